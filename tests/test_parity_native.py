"""llama.cpp's own DFlash graph as a traced peer (runtime/native_draft.h) and its speculative loop
as parity runs it (dflash_llama.peers with parity's flash-attention setting)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity_helpers import PROMPTS, tiny_draft

import dflash_llama
from dflash_llama import fixtures, peers
from dflash_llama.parity.graph import graph_order, reference_trace, rel_err
from dflash_llama.parity.native import FLASH_ATTN, NativeDraft
from dflash_llama.reference.checkpoint import load_draft
from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_target_hf, tiny_target_gguf):
    return tiny_draft(tmp_path_factory, tiny_target_hf, tiny_target_gguf)


@pytest.fixture(scope="module")
def tw(tiny_target_gguf):
    return target_weights_from_gguf(tiny_target_gguf)


def three_traces(target_gguf, draft_gguf, draft_hf, tw, prompt=PROMPTS[0].text):
    rt = dflash_llama.Runtime(target_gguf, draft_gguf, n_threads=1, n_ctx=256, kv_f32=True)
    native = NativeDraft(rt, draft_gguf, n_ctx=256, n_threads=1)
    tokens = rt.tokenize(prompt)
    feats = rt.capture(tokens[:-1])
    block = [tokens[-1]] + [rt.mask_token_id] * (rt.block_size - 1)
    ref = reference_trace(load_draft(draft_hf, tw.embed_tokens, tw.lm_head), feats, block)
    return ref, rt.trace_draft(feats, block), native.trace(feats, block), native


def test_native_trace_has_every_name_and_matches(pair, tiny_target_gguf, tw):
    hf, gguf = pair
    ref, ours, native, _ = three_traces(tiny_target_gguf, gguf, hf, tw)
    names = graph_order(2)
    assert sorted(native) == sorted(names) == sorted(ours) == sorted(ref)
    for name in names:
        assert native[name].size == ref[name].size, name
        assert native[name].reshape(ref[name].shape).shape == ours[name].shape
        assert rel_err(ours[name], native[name]) <= 1e-5, name  # same weights, same ggml kernels
        assert rel_err(ref[name], native[name]) <= 1e-4, name
    # the injection graph is the same computation in both: bit for bit
    for name in ("fc_out", "inp_g_embeddings", "Kcur_injected-1", "Vcur_injected-1", "inp_noise_embd"):
        assert np.array_equal(ours[name], native[name].reshape(ours[name].shape)), name
    assert native["result_output"].shape == (6, 49152)  # raw head output of every block position


def test_native_reads_what_draft_dflash_reads(pair, tiny_target_gguf, tw):
    _, _, _, native = three_traces(tiny_target_gguf, pair[1], pair[0], tw)
    assert native.target_layers == [2, 3]  # HF ids [1, 2] + 1: llama.cpp captures layer inputs
    assert native.mask_token_id == 0
    assert native.block_size == 6
    assert native.causal is False


def test_native_bad_input(pair, tiny_target_gguf):
    rt = dflash_llama.Runtime(tiny_target_gguf, pair[1], n_threads=1, n_ctx=128, kv_f32=True)
    native = NativeDraft(rt, pair[1], n_ctx=128, n_threads=1)
    with pytest.raises(ValueError, match=r"features must be \[3, 128\] \(2 taps\), got 192 values"):
        native.trace(np.zeros((3, 64), np.float32), [1, 0, 0])
    with pytest.raises(ValueError, match="block token 49152 is outside the vocabulary"):
        native.trace(np.zeros((3, 128), np.float32), [49152, 0])
    with pytest.raises(ValueError,
                       match=r"features \(125\) \+ block \(8\) exceed the native draft context of 128 positions"):
        native.trace(np.zeros((125, 128), np.float32), [1] * 8)
    with pytest.raises(ValueError, match="architecture is 'qwen3', not a DFlash draft"):
        NativeDraft(rt, tiny_target_gguf)
    with pytest.raises(ValueError, match="no such file"):
        NativeDraft(rt, "/nonexistent/draft.gguf")


def test_sliding_layers_diverge_in_llama_cpp(tmp_path_factory, tiny_target_hf, tiny_target_gguf, tw):
    """Finding U3 (docs/upstream_status.md): the published model makes sliding-window layers causal;
    llama.cpp's draft-dflash runs every layer non-causally. Our runtime follows the reference."""
    cfg = fixtures.TinyDraftConfig(layers=2, heads=4, kv_heads=1, target_layer_ids=[0, 2], block_size=8, seed=32,
                                   layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    hf, gguf = tiny_draft(tmp_path_factory, tiny_target_hf, tiny_target_gguf, cfg, name="sliding")
    ref, ours, native, _ = three_traces(tiny_target_gguf, gguf, hf, tw)
    assert rel_err(ref["l_out-0"], native["l_out-0"]) <= 1e-4  # the full-attention layer agrees
    assert rel_err(ref["ffn_inp-1"], ours["ffn_inp-1"]) <= 1e-4
    assert rel_err(ref["ffn_inp-1"], native["ffn_inp-1"]) > 3e-2  # first intermediate after its attention


def test_causal_draft_agrees(tmp_path_factory, tiny_target_hf, tiny_target_gguf, tw):
    """dflash.attention.causal = true: draft-dflash switches the context to causal attention."""
    cfg = fixtures.TinyDraftConfig(layers=1, target_layer_ids=[1], block_size=8, seed=33,
                                   extra_config={"is_causal": True})
    hf, gguf = tiny_draft(tmp_path_factory, tiny_target_hf, tiny_target_gguf, cfg, name="causal")
    ref, _, native, nd = three_traces(tiny_target_gguf, gguf, hf, tw)
    assert nd.causal is True
    assert max(rel_err(ref[n], native[n]) for n in graph_order(1)) <= 1e-4


def native_speculative(target, draft, prompt: str, n_predict: int, n_max: int) -> peers.PeerResult:
    return peers.speculative(target, prompt, n_predict, "draft-dflash", draft=draft, n_max=n_max, threads=1,
                             n_ctx=256, flash_attn=FLASH_ATTN)


def test_speculative_simple_is_lossless_and_parsed(pair, tiny_target_gguf):
    rt = dflash_llama.Runtime(tiny_target_gguf, pair[1], n_threads=1, n_ctx=256)
    text = PROMPTS[1].text
    spec = native_speculative(tiny_target_gguf, pair[1], text, 12, 5)
    plain = native_speculative(tiny_target_gguf, pair[1], text, 12, 0)
    assert "-fa" in spec.command and spec.command[spec.command.index("-fa") + 1] == "auto"
    assert spec.n_tokens >= 12 and spec.n_drafted > 0
    assert spec.n_drafted % 5 == 0  # every step drafts block_size - 1 tokens
    assert spec.tau == pytest.approx(spec.n_tokens / (spec.n_tokens - spec.n_accept))
    assert plain.n_drafted == 0
    assert spec.text and spec.text == plain.text  # greedy: drafts never change the output
    ar = rt.autoregressive(rt.tokenize(text), 12, stop_at_eog=False)
    assert spec.text.startswith(rt.detokenize(ar.tokens)[:8])


def test_speculative_simple_aborts_on_last_layer_tap(tmp_path_factory, tiny_target_hf, tiny_target_gguf):
    """Finding U2: a tap on the target's last layer aborts llama.cpp's draft-dflash."""
    cfg = fixtures.TinyDraftConfig(layers=1, target_layer_ids=[3], block_size=4, seed=34)
    _, gguf = tiny_draft(tmp_path_factory, tiny_target_hf, tiny_target_gguf, cfg, name="lasttap")
    with pytest.raises(peers.PeerError, match=r"(?s)llama-speculative-simple exited with .*layer input tensor is null"):
        native_speculative(tiny_target_gguf, gguf, PROMPTS[0].text, 8, 3)
