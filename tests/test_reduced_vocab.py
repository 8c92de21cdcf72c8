"""A reduced draft vocabulary (`convert --draft-vocab K`: `d2t` + the draft's own head rows): which
tokens the converter keeps, the runtime's greedy output unchanged, its logits in the target's
vocabulary, and the reference and llama.cpp's own graph computing the same."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from parity_helpers import PROMPTS

import dflash_llama
from dflash_llama import gguf_info, schema as L
from dflash_llama.converter import ConversionError, convert
from dflash_llama.converter.vocabulary import choose_tokens
from dflash_llama.parity.graph import graph_order, reference_trace, rel_err
from dflash_llama.parity.native import NativeDraft
from dflash_llama.reference.checkpoint import load_draft
from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

K = 512
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def reduced(tiny_draft_hf, tiny_target_gguf, tmp_path_factory) -> Path:
    return convert(tiny_draft_hf, tiny_target_gguf, tmp_path_factory.mktemp("d2t") / "d2t-f32.gguf", "f32",
                   draft_vocab=K)


@pytest.fixture(scope="module")
def tw(tiny_target_gguf):
    return target_weights_from_gguf(tiny_target_gguf)


# --- the converter --------------------------------------------------------------------------------

def test_the_file_holds_d2t_and_the_targets_head_rows(reduced, tiny_target_gguf, tw):
    info = gguf_info(reduced)
    assert info.tensor(L.D2T).type == "i64" and info.tensor(L.D2T).shape == (K,)
    assert info.tensor("output.weight").shape == (tw.lm_head.shape[1], K)
    d2t = info.read(L.D2T)
    assert (np.diff(d2t) > 0).all() and d2t[0] >= 0 and d2t[-1] < tw.lm_head.shape[0]
    target = gguf_info(tiny_target_gguf).metadata
    eog = {target[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in target}
    assert eog and eog <= set(d2t.tolist())  # the draft can propose the stop
    np.testing.assert_array_equal(info.read("output.weight"), tw.lm_head[torch.from_numpy(d2t)].numpy())


@dataclass
class FakeTarget:
    fields: list
    vocab: int = 10
    path: str = "t.gguf"

    def tokenizer_fields(self):
        return self.fields


@dataclass
class Field:
    key: str
    value: object


def test_tokens_kept_by_score_else_by_id_and_never_control():
    types = [3, 1, 1, 1, 6, 1, 1, 3, 1, 5]  # 0, 7 control; 9 unused; 4 a byte
    base = [Field("tokenizer.ggml.token_type", types), Field("tokenizer.ggml.eos_token_id", 7)]
    assert choose_tokens(FakeTarget(base), 4).tolist() == [1, 2, 3, 7]  # by id (BPE merge order) + EOS
    scores = [0, -5, -1, -9, -2, -3, -4, 0, -0.5, 0]
    assert choose_tokens(FakeTarget(base + [Field("tokenizer.ggml.scores", scores)]), 4).tolist() == [2, 4, 7, 8]
    with pytest.raises(ConversionError, match=r"^--draft-vocab 10: expected 1 to 9 \(the target t.gguf has 10 "):
        choose_tokens(FakeTarget(base), 10)
    with pytest.raises(ConversionError, match="has 1 end-of-generation tokens, which the draft keeps; ask for more"):
        choose_tokens(FakeTarget(base), 1)


def test_the_cli_refuses_a_negative_size(tiny_draft_hf, tiny_target_gguf, tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "dflash_llama.cli", "convert", str(tiny_draft_hf), "-m",
                          str(tiny_target_gguf), "-o", str(tmp_path / "x.gguf"), "--draft-vocab", "-3"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (f"dflash-llama convert: error: --draft-vocab -3: expected 1 to "
                                                   f"49151 (the target {tiny_target_gguf} has 49152 tokens; 0 keeps "
                                                   "the whole vocabulary)")
    assert not any(tmp_path.iterdir())


def test_schema_refusals_know_the_pair():
    names = ["fc.weight", "output.weight", L.D2T]
    assert L.refusals({}, names) == []
    assert L.refusals({}, ["fc.weight", L.D2T]) == [
        "tensor 'd2t': a reduced vocabulary needs the draft's own 'output.weight' over its rows"]
    assert L.refusals({}, ["fc.weight", "output.weight"])[0].startswith(
        "tensor 'output.weight': the runtime uses the target's embeddings and head")


# --- the runtime ----------------------------------------------------------------------------------

@pytest.mark.parametrize("draft_max", [None, "auto"])
def test_greedy_output_is_the_targets_at_every_block_size(reduced, tiny_target_gguf, draft_max):
    d2t = set(gguf_info(reduced).read(L.D2T).tolist())
    rt = dflash_llama.Runtime(tiny_target_gguf, reduced, n_threads=1, n_ctx=256)
    for block in (2, 4, 8, 16):
        for p in PROMPTS:
            want = rt.autoregressive(p.text, 24)
            # the n-gram source proposes from the text, not from the draft's rows: off here
            got = rt.generate(p.text, 24, block_size=block, draft_max=draft_max, ngram=False)
            assert got.tokens == want.tokens, f"block {block}, {p.id}"
            assert {t for s in got.steps for t in s.drafted} <= d2t  # proposals come from the kept rows


def test_a_constant_draft_is_accepted_through_d2t(smollm2_constant_draft_hf, smollm2_gguf, tmp_path):
    """The " ha" draft's head rows reduced to 64 tokens: row r proposes token d2t[r], so " ha" is
    still what it drafts and the target still accepts it."""
    import gguf

    ha = gguf.GGUFReader(smollm2_gguf).get_field("tokenizer.ggml.tokens").contents().index("Ġha")
    draft = convert(smollm2_constant_draft_hf, smollm2_gguf, tmp_path / "ha.gguf", "f16", draft_vocab=ha + 1)
    rows = gguf_info(draft).read(L.D2T)
    assert ha in rows.tolist() and len(rows) == ha + 1
    rt = dflash_llama.Runtime(smollm2_gguf, draft, n_threads=2, n_ctx=256)
    plain = rt.autoregressive("ha ha ha ha ha ha", 32)
    got = rt.generate("ha ha ha ha ha ha", 32, draft_max=None)
    assert got.tokens == plain.tokens
    drafted = [t for s in got.steps for t in s.drafted]
    assert set(drafted) == {ha} and sum(s.accepted for s in got.steps) >= len(drafted) // 2


def test_sampled_proposals_come_from_the_kept_rows(reduced, tiny_target_gguf):
    d2t = set(gguf_info(reduced).read(L.D2T).tolist())
    rt = dflash_llama.Runtime(tiny_target_gguf, reduced, n_threads=1, n_ctx=256)
    for seed in range(4):
        g = rt.generate(PROMPTS[0].text, 16, temperature=1.0, seed=seed, draft_max=None)
        drafted = [t for s in g.steps for t in s.drafted]
        assert drafted and set(drafted) <= d2t
        assert g.tokens == rt.generate(PROMPTS[0].text, 16, temperature=1.0, seed=seed, draft_max=None).tokens


# --- three implementations ------------------------------------------------------------------------

def test_runtime_reference_and_native_agree(reduced, tiny_target_gguf, tw):
    rt = dflash_llama.Runtime(tiny_target_gguf, reduced, n_threads=1, n_ctx=256, kv_f32=True)
    native = NativeDraft(rt, reduced, n_ctx=256, n_threads=1)
    tokens = rt.tokenize(PROMPTS[0].text)
    feats = rt.capture(tokens[:-1])
    block = [tokens[-1]] + [rt.mask_token_id] * (rt.block_size - 1)
    ref_draft = load_draft(reduced, tw.embed_tokens, tw.lm_head)
    ref = reference_trace(ref_draft, feats, block)
    traces = {"runtime": rt.trace_draft(feats, block), "native": native.trace(feats, block)}
    d2t = gguf_info(reduced).read(L.D2T)
    want = ref["result_output"].reshape(len(block), -1)
    assert want.shape[1] == tw.lm_head.shape[0]
    outside = np.ones(want.shape[1], bool)
    outside[d2t] = False
    assert np.isneginf(want[:, outside]).all() and np.isfinite(want[:, d2t]).all()
    for name, trace in traces.items():
        got = np.asarray(trace["result_output"]).reshape(want.shape)
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), name
        assert rel_err(want, got) < 1e-4, name
        compared = [key for key in graph_order(ref_draft.config.n_layer) if key in trace and key in ref]
        assert len(compared) >= 12, f"{name}: only {compared}"
        for key in compared:
            assert rel_err(ref[key], np.asarray(trace[key]).reshape(ref[key].shape)) < 1e-4, f"{name} {key}"
    assert rel_err(want, want + np.where(np.isneginf(want), 0, 1)) > 0  # the bound can fail


def test_the_reference_loop_is_exact_with_a_reduced_vocabulary(reduced, reference_target, tiny_target_gguf, tw):
    from dflash_llama.reference import generate_autoregressive, generate_speculative

    draft = load_draft(reduced, tw.embed_tokens, tw.lm_head)
    assert draft.d2t is not None and tuple(draft.lm_head.shape) == (K, tw.lm_head.shape[1])
    ids = dflash_llama.Runtime(tiny_target_gguf, n_threads=1, n_ctx=64).tokenize(PROMPTS[1].text)
    want = generate_autoregressive(reference_target, ids, 16)
    got = generate_speculative(reference_target, draft, ids, 16)
    assert got.tokens == want.tokens
    assert {t for s in got.steps for t in s.drafted} <= set(draft.d2t.tolist())
