"""The one draft schema (dflash_llama/schema.py): the C++ runtime spells only its keys, the runtime
and the reference refuse the same things, config.json and GGUF metadata round-trip."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

import dflash_llama
from dflash_llama import schema as S
from dflash_llama.parity.gguf_edit import copy_gguf

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
KEY_LITERAL = re.compile(r'"(dflash\.[A-Za-z0-9_.]+)"')

# one planted value per refused key, one planted tensor per refused tensor ("{bid}" -> 0)
PLANTED_KEYS = {
    S.HIDDEN_ACTIVATION: "gelu", S.ATTENTION_SCALE: 0.5, S.VALUE_SCALE: 0.5,
    S.ROPE_DIMENSION_SECTIONS: [4, 2, 2, 0], S.ROPE_SCALING_TYPE: "yarn", S.VALUE_LENGTH: 8,
    S.ROPE_DIMENSION_COUNT: 8, S.HYPER_CONNECTION_COUNT: 4,
}
# a variant's keys come all together: one alone is refused (the others named), as is a non-positive one
PLANTED_VARIANT_KEYS = {k: 4 for k in S.DFLASH2_KEYS}
PLANTED_TENSORS = [r.name.format(bid=0) for r in S.REFUSALS if r.tensor]


def unknown_keys(cpp: str) -> list[str]:
    """`dflash.*` string literals in C++ source that are not keys of the schema table."""
    return sorted({k for k in KEY_LITERAL.findall(cpp) if k not in S.KEY})


def test_every_cpp_key_literal_is_in_the_schema():
    sources = sorted(RUNTIME.glob("*.cpp"))
    assert sources
    found = {k for p in sources for k in KEY_LITERAL.findall(p.read_text())}
    assert len(found) >= 20  # the checker sees the runtime's keys
    assert {p.name: unknown_keys(p.read_text()) for p in sources} == {p.name: [] for p in sources}


def test_the_key_checker_reports_a_planted_key():
    cpp = 'hp.n_embd = kv.u32("dflash.embedding_length");\nkv.f32_or("dflash.attention.bogus_scale", 1.0f);'
    assert unknown_keys(cpp) == ["dflash.attention.bogus_scale"]


def test_every_refusal_is_planted():
    keys = {r.name for r in S.REFUSALS if not r.tensor}
    assert keys == set(PLANTED_KEYS)
    assert keys <= set(S.KEY)


def _with_tensor(src: Path, dst: Path, name: str, data: np.ndarray | None = None) -> Path:
    """`src` with one more f32 tensor called `name` (`data`, else four zeros)."""
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, list(f.contents()), f.types[0], sub_type=f.types[-1])
        else:
            writer.add_key_value(key, f.contents(), f.types[0])
    for t in reader.tensors:
        values = np.asarray(t.data)
        writer.add_tensor(t.name, values, raw_shape=values.shape, raw_dtype=GGMLQuantizationType(t.tensor_type))
    writer.add_tensor(name, np.zeros(4, dtype=np.float32) if data is None else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _both_refuse(target: Path, draft: Path, name: str) -> None:
    """Both refuse `name`; a pending one (DSpark's) only the runtime, and the reference's refusals
    do not name it."""
    from dflash_llama.reference import load_draft

    with pytest.raises((ValueError, RuntimeError), match=re.escape(f"'{name}'")):
        dflash_llama.Runtime(target, draft, n_threads=1, n_ctx=64)
    pending = next((r.why for r in S.REFUSALS if r.pending and r.name == name), None)
    if pending is not None:  # the reference may refuse it for another reason (a head's tensor alone)
        reader = GGUFReader(str(draft))
        kv = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        names = [t.name for t in reader.tensors]
        assert not any(pending in line for line in S.refusals(kv, names, runtime=False))
        assert any(f"'{name}'" in line and pending in line for line in S.refusals(kv, names))
        return
    with pytest.raises(ValueError, match=re.escape(f"'{name}'")):
        load_draft(draft)


def test_the_unplanted_draft_loads_in_both(tiny_draft_gguf, tiny_target_gguf):
    from dflash_llama.reference import load_draft

    dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=1, n_ctx=64)
    assert load_draft(tiny_draft_gguf).config.head_dim == 16


@pytest.mark.parametrize("key", sorted(PLANTED_KEYS))
def test_runtime_and_reference_refuse_the_same_key(key, tiny_draft_gguf, tiny_target_gguf, tmp_path):
    planted = copy_gguf(tiny_draft_gguf, tmp_path / "planted.gguf", kv={key: PLANTED_KEYS[key]})
    assert S.refusals(GGUFReaderKV(planted)) != []
    _both_refuse(tiny_target_gguf, planted, key)


@pytest.mark.parametrize("key", sorted(PLANTED_VARIANT_KEYS))
def test_a_variant_key_alone_is_refused_by_both(key, tiny_draft_gguf, tiny_target_gguf, tmp_path):
    planted = copy_gguf(tiny_draft_gguf, tmp_path / "planted.gguf", kv={key: PLANTED_VARIANT_KEYS[key]})
    missing = [k for k in S.DFLASH2_KEYS if k != key]
    assert S.refusals(GGUFReaderKV(planted)) == [
        f"'{k}' missing: a DFlash 2 draft needs {', '.join(S.DFLASH2_KEYS)}" for k in missing]
    _both_refuse(tiny_target_gguf, planted, missing[0])


def test_variant_keys_and_tensors_must_agree():
    kv = {k: 4 for k in S.DFLASH2_KEYS}
    assert S.variant_of_gguf(kv) is S.DFLASH2 and S.variant_of_gguf({}) is S.DFLASH1
    assert S.refusals({**kv, S.SELECTOR_RANK: 0}) == [f"'{S.SELECTOR_RANK}' = 0: expected a positive integer"]
    assert S.refusals({}, ["selector_hidden.weight", "blk.0.attn_conv_base"]) == [
        f"tensor '{name}': a DFlash 2 tensor in a DFlash 1 draft (no {' / '.join(S.DFLASH2_KEYS)})"
        for name in ("selector_hidden.weight", "blk.0.attn_conv_base")]
    assert S.refusals(kv, ["selector_hidden.weight", "blk.0.attn_conv_base", "blk.0.ffn_conv_proj.weight"]) == []


@pytest.mark.parametrize("name", PLANTED_TENSORS)
def test_runtime_and_reference_refuse_the_same_tensor(name, tiny_draft_gguf, tiny_target_gguf, tmp_path):
    planted = _with_tensor(tiny_draft_gguf, tmp_path / "planted.gguf", name)
    _both_refuse(tiny_target_gguf, planted, name)


@pytest.mark.parametrize("name", ["token_embd.weight", "output.weight"])
def test_a_draft_with_its_own_embeddings_or_head_is_refused(name, tiny_draft_gguf, tiny_target_gguf, tmp_path):
    """llama.cpp would use a draft's own token_embd / output; the runtime's graph uses the target's,
    so the runtime refuses such a file rather than answer with other weights. The reference refuses
    the embeddings and reads an own head, as llama.cpp does (a DSpark converter keeps one)."""
    from dflash_llama.reference import load_draft

    vocab, hidden = reversed(dflash_llama.gguf_info(tiny_target_gguf).tensor("token_embd.weight").shape)
    planted = _with_tensor(tiny_draft_gguf, tmp_path / "own.gguf", name, np.ones((vocab, hidden), np.float32))
    message = (f"{planted}: tensor '{name}': the runtime uses the target's embeddings and head; "
               "a draft with its own is not supported by this runtime"
               + (" (an own head needs a d2t: a reduced vocabulary)" if name == "output.weight" else ""))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dflash_llama.Runtime(tiny_target_gguf, planted, n_threads=1, n_ctx=64)
    assert S.refusals({}, [name]) == [message.removeprefix(f"{planted}: ")]
    if name == "output.weight":
        assert S.refusals({}, [name], runtime=False) == []
        draft = load_draft(planted)
        assert draft._own["lm_head"] and torch.equal(draft.lm_head, torch.ones(draft.lm_head.shape))
        return
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_draft(planted)


def GGUFReaderKV(path: Path) -> dict:  # noqa: N802  (reads like a constructor)
    return {k: f.contents() for k, f in GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}


# --- head_dim: the default of Qwen3Config, the class published drafts load with ----------------

BASE = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "num_target_layers": 12, "dflash_config": {"mask_token_id": 5}}


def test_head_dim_default_is_the_published_one(tmp_path):
    """Without `head_dim`, the published model (Qwen3Config) uses 128, not hidden // heads = 16;
    the reference used to read 16, so its q/k shapes disagreed with the converter's and llama.cpp's."""
    transformers = pytest.importorskip("transformers")
    published = transformers.Qwen3Config(**BASE).head_dim
    assert published == 128
    assert S.DraftHParams.from_hf_config(BASE).head_dim == published
    import json

    from dflash_llama.reference import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert read_hf_config(tmp_path).head_dim == published


# --- round trips ----------------------------------------------------------------------------------

VARIANTS = [
    S.DraftHParams(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, mask_token_id=5,
                   target_layer_ids=None, n_vocab=100, n_layer_target=12, n_ctx_train=32768),
    S.DraftHParams(n_embd=64, n_layer=3, n_head=8, n_head_kv=2, head_dim=8, n_ff=96, mask_token_id=0,
                   target_layer_ids=[1, 2, 3], n_vocab=49152, block_size=5, n_ctx_train=4096, rms_eps=1e-5,
                   rope_freq_base=1e6, rope_linear_factor=4.0, causal=False, sliding_window=3,
                   swa_layers=[True, False, True], embedding_scale=1.5, logit_scale=0.75, logit_softcap=4.0),
    S.DraftHParams(n_embd=32, n_layer=1, n_head=2, n_head_kv=1, head_dim=16, n_ff=64, mask_token_id=3,
                   target_layer_ids=[0], n_ctx_train=2048, causal=True, swa_layers=[True], rope_neox=False, n_rot=8,
                   value_scale=0.5),
]


@pytest.mark.parametrize("hp", VARIANTS)
def test_hf_config_round_trip(hp):
    assert S.DraftHParams.from_hf_config(hp.to_hf_config()) == hp


def _gguf_kv(hp: S.DraftHParams) -> dict:
    return dict(hp.to_gguf_kv(file_type=0)) | {S.MASK_TOKEN_ID: hp.mask_token_id, "tokenizer.ggml.tokens": ["a"] * 7}


@pytest.mark.parametrize("hp", [dataclasses.replace(VARIANTS[0], target_layer_ids=[2, 5]), VARIANTS[1]])
def test_gguf_round_trip(hp):
    # a GGUF has no num_target_layers and takes its vocabulary size from its tokenizer
    assert S.DraftHParams.from_gguf(_gguf_kv(hp)) == dataclasses.replace(hp, n_layer_target=None, n_vocab=7)


def test_gguf_writer_writes_what_the_reader_refuses():
    """The converter writes what the pinned llama.cpp reads (a value scale, partial RoPE); the
    runtime and the reference refuse it, naming the first key."""
    with pytest.raises(ValueError, match=re.escape(f"draft.gguf: '{S.VALUE_SCALE}' = 0.5")):
        S.DraftHParams.from_gguf(_gguf_kv(VARIANTS[2]))
    kv = _gguf_kv(dataclasses.replace(VARIANTS[2], value_scale=None))
    with pytest.raises(ValueError, match=re.escape(f"'{S.ROPE_DIMENSION_COUNT}' = 8")):
        S.DraftHParams.from_gguf(kv)


def test_rope_permutation_is_the_converters():
    rows = np.arange(2 * 8 * 3).reshape(16, 3)  # two heads of head_dim 8
    order = S.rope_halves_order(16, 8)
    assert order.tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    assert np.array_equal(rows[order], rows.reshape(-1, 4, 2, 3).swapaxes(1, 2).reshape(16, 3))
