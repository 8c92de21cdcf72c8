"""Our converter against the pinned llama.cpp converter (`convert_hf_to_gguf.py --target-model-dir`).

Where the draft states its target_layer_ids the two files must be byte-identical: same keys in the
same order, same tensors, same bytes (f32, f16, bf16 and q8_0). The one intended difference is a
draft without target_layer_ids: the pinned converter then writes no `dflash.target_layers` (and
llama.cpp refuses the file), we write the published default rule.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_llama import fixtures, gguf_info, schema as L
from dflash_llama.converter import convert

GQA = fixtures.TinyDraftConfig(layers=2, heads=8, kv_heads=2, target_layer_ids=[0, 2, 3], seed=2)
# every optional key the pinned converter knows for DFlash 1, interleaved RoPE, a q8_0 fallback
# (rows of 48 are not a multiple of 32: ffn_down falls back to f16)
EXTRAS = fixtures.TinyDraftConfig(
    layers=2, heads=4, kv_heads=1, ffn=48, block_size=4, target_layer_ids=[1, 2],
    layer_types=["sliding_attention", "full_attention"], sliding_window=4, seed=3,
    extra_config={"is_causal": False, "output_multiplier": 0.5, "final_logit_softcapping": 30.0,
                  "input_embedding_scale": 2.0, "rope_is_neox_style": False})


@pytest.fixture(scope="module")
def gqa_draft(tiny_target_hf, tmp_path_factory):
    return fixtures.tiny_draft_hf(tmp_path_factory.mktemp("gqa") / "gqa-draft", tiny_target_hf, GQA)


@pytest.fixture(scope="module")
def extras_draft(tiny_target_hf, tmp_path_factory):
    return fixtures.tiny_draft_hf(tmp_path_factory.mktemp("extras") / "extras-draft", tiny_target_hf, EXTRAS)


def pinned(draft, target_hf, out, outtype):
    fixtures.run_pinned_converter([str(draft), "--target-model-dir", str(target_hf),
                                   "--outtype", outtype, "--outfile", str(out)])
    return out


def data_section(path) -> bytes:
    return path.read_bytes()[gguf_info(path).data_offset:]


def f32_values(path, name) -> np.ndarray:
    """An f32 tensor of a GGUF in PyTorch order."""
    info = gguf_info(path)
    t = info.tensor(name)
    assert t.type == "f32"
    with open(path, "rb") as f:
        f.seek(info.data_offset + t.offset)
        return np.frombuffer(f.read(t.nbytes), dtype="<f4").reshape(tuple(reversed(t.shape)))


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_gqa_draft_is_byte_identical_to_pinned(gqa_draft, tiny_target_hf, tiny_target_gguf, tmp_path,
                                               outtype):
    from safetensors.torch import load_file

    ref = pinned(gqa_draft, tiny_target_hf, tmp_path / "pinned.gguf", outtype)
    ours = convert(gqa_draft, tiny_target_gguf, tmp_path / "ours.gguf", outtype)
    assert ours.read_bytes() == ref.read_bytes()
    info = gguf_info(ours)
    assert info.get(L.TARGET_LAYERS) == [1, 3, 4]
    assert (info.get(L.HEAD_COUNT), info.get(L.HEAD_COUNT_KV)) == (8, 2)
    assert info.tensor("blk.1.attn_q.weight").type == info.tensor("fc.weight").type == outtype
    assert info.tensor("blk.1.attn_q_norm.weight").type == info.tensor("enc.output_norm.weight").type == "f32"
    if outtype == "f32":  # independent of the pinned converter: the bf16 checkpoint, widened
        src = load_file(gqa_draft / "model.safetensors")
        assert len(info.tensors) == len(src) == 3 + 2 * 11
        for hf_name, value in src.items():
            name, _ = L.gguf_tensor_name(hf_name)
            np.testing.assert_array_equal(f32_values(ours, name), value.float().numpy())


def test_gqa_draft_bf16_with_hf_target_is_byte_identical(gqa_draft, tiny_target_hf, tmp_path):
    # the HF target route: the tokenizer comes from the pinned converter's own vocab code
    ref = pinned(gqa_draft, tiny_target_hf, tmp_path / "pinned.gguf", "bf16")
    ours = convert(gqa_draft, tiny_target_hf, tmp_path / "ours.gguf", "bf16")
    assert ours.read_bytes() == ref.read_bytes()
    assert gguf_info(ours).tensor("blk.0.ffn_up.weight").type == "bf16"


def test_extras_draft_is_byte_identical_to_pinned(extras_draft, tiny_target_hf, tiny_target_gguf, tmp_path):
    ref = pinned(extras_draft, tiny_target_hf, tmp_path / "pinned.gguf", "q8_0")
    ours = convert(extras_draft, tiny_target_gguf, tmp_path / "ours.gguf", "q8_0")
    assert ours.read_bytes() == ref.read_bytes()
    info = gguf_info(ours)
    assert info.get(L.SLIDING_WINDOW) == 4
    assert info.get(L.SLIDING_WINDOW_PATTERN) == [True, False]
    assert info.get(L.CAUSAL) is False
    assert info.get(L.LOGIT_SCALE) == 0.5
    assert info.get(L.FINAL_LOGIT_SOFTCAPPING) == 30.0
    assert info.get(L.EMBEDDING_SCALE) == 2.0
    assert info.get(L.BLOCK_SIZE) == 4
    assert info.tensor("blk.0.ffn_down.weight").type == "f16"  # 48-wide rows: no q8_0
    assert info.tensor("blk.0.ffn_up.weight").type == "q8_0"
    # rope_is_neox_style: false -> per head, even dims first, then odd (llama.cpp ropes NeoX-style)
    from safetensors.torch import load_file

    src = load_file(extras_draft / "model.safetensors")
    k_norm = src["layers.1.self_attn.k_norm.weight"].float().numpy()
    np.testing.assert_array_equal(f32_values(ours, "blk.1.attn_k_norm.weight"),
                                  np.concatenate([k_norm[0::2], k_norm[1::2]]))
    ffn_norm = src["layers.1.post_attention_layernorm.weight"].float().numpy()  # not roped: as is
    np.testing.assert_array_equal(f32_values(ours, "blk.1.ffn_norm.weight"), ffn_norm)


def test_default_target_layers_written_where_pinned_omits_them(tiny_draft_hf, tiny_target_hf,
                                                               tiny_target_gguf, tmp_path):
    ref = pinned(tiny_draft_hf, tiny_target_hf, tmp_path / "pinned.gguf", "f32")
    ours = convert(tiny_draft_hf, tiny_target_gguf, tmp_path / "ours.gguf", "f32")
    ref_info, our_info = gguf_info(ref), gguf_info(ours)
    ref_kv, our_kv = dict(ref_info.metadata), dict(our_info.metadata)
    # 1 draft layer, 4 target layers: default ids [4 // 2] = [2], stored +1
    assert our_kv.pop(L.TARGET_LAYERS) == [3]
    assert L.TARGET_LAYERS not in ref_kv
    assert list(our_kv) == list(ref_kv) and our_kv == ref_kv
    assert our_info.tensors == ref_info.tensors  # names, order, shapes, types, offsets
    assert data_section(ours) == data_section(ref)
