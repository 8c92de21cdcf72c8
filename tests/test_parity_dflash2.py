"""DFlash 2 drafts in the parity harness: every intermediate three ways (the convolutions included),
the candidate selector compared as lattices keyed by tokens and by its walked path, and llama.cpp's
peer driven as draft-dflash drives a DFlash 2 draft."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity_helpers import PROMPTS, tiny_draft

import dflash_llama
from dflash_llama import fixtures, schema as L
from dflash_llama.parity import graph as G, stages
from dflash_llama.parity.native import NativeDraft
from dflash_llama.reference.checkpoint import load_draft
from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

torch.set_num_threads(1)

DRAFT = fixtures.TinyDraftConfig(variant="dflash2", layers=2, target_layer_ids=[1, 2], block_size=8, seed=61,
                                 conv_kernel_size=3, conv_group_size=16, selector_rank=16, selector_top_k=4)


@pytest.fixture(scope="module")
def three(tmp_path_factory, tiny_target_hf, tiny_target_gguf):
    """The reference draft, our runtime and llama.cpp's peer on one DFlash 2 draft, and one graph input."""
    hf, gguf = tiny_draft(tmp_path_factory, tiny_target_hf, tiny_target_gguf, DRAFT, name="dflash2")
    rt = dflash_llama.Runtime(tiny_target_gguf, gguf, n_threads=1, n_ctx=256, kv_f32=True, compact_draft_head=False)
    native = NativeDraft(rt, gguf, n_ctx=256, n_threads=1)
    tw = target_weights_from_gguf(tiny_target_gguf)
    ref = load_draft(hf, tw.embed_tokens, tw.lm_head)
    tokens = rt.tokenize(PROMPTS[0].text)
    feats = rt.capture(tokens[:-1])
    block = [tokens[-1]] + [rt.mask_token_id] * (rt.block_size - 1)
    return rt, native, ref, feats, block


class _Silent:
    def step(self, what):
        pass


def test_graph_stage_compares_dflash2_three_ways(three):
    rt, native, ref, feats, block = three
    assert native.selector_top_k == 4 and native.block_size == 8 and native.causal is False
    traces = {"runtime": rt.trace_draft(feats, block), "native": native.trace(feats, block)}
    lattice = traces["native"][G.LLAMA_LATTICE]
    assert lattice.shape == (8, 64) and not lattice[0].any()  # [B, n_embd], row 0 (the anchor) zeros
    item = {"prompt": "fib", "n_context": len(feats), "features": feats, "block": block, "traces": traces}
    out = stages.stage_graph(None, [item], ref, "f32", "f32", _Silent())
    names = G.graph_order(2, L.DFLASH2)
    assert out["status"] == "pass" and out["names"] == names and out["failures"] == [] and out["missing"] == {}
    # llama.cpp names every intermediate but the convolutions' dynamic taps, compared ours vs the reference
    native_names = [n for n in names if not G.unnamed_in_llama(n)]
    assert [n for n in names if n not in native_names] == ["attn_conv_dyn-0", "ffn_conv_dyn-0", "attn_conv_dyn-1",
                                                            "ffn_conv_dyn-1"]
    assert sorted(out["errors"]["reference/native"]) == sorted(native_names)
    assert max(out["errors"]["reference/runtime"].values()) <= 1e-4
    assert max(out["errors"]["reference/native"].values()) <= 1e-4
    assert max(out["errors"]["runtime/native"].values()) <= 1e-5  # same weights, same ggml kernels
    # the selector: 4 + 6 * 16 scores keyed by (slot, predecessor, candidate), the same tokens walked
    sel = out["selector"]
    assert sel["failures"] == []
    for pair in ("reference/runtime", "reference/native", "runtime/native"):
        assert sel["pairs"][pair]["entries"] == 4 + 6 * 16 and sel["pairs"][pair]["only_one_side"] == 0
        assert sel["pairs"][pair]["error"] <= 1e-5 and sel["pairs"][pair]["same_path"]
    path = sel["inputs"][0]["reference/native"]["path_a"]
    assert len(path) == 7 and path == G.walk_llama_lattice(lattice, 4)
    # a planted fault in llama.cpp's lattice (another candidate at slot 3) is the first divergence
    traces["native"][G.LLAMA_LATTICE] = bad = lattice.copy()
    bad[3, :4] = bad[3, [1, 0, 2, 3]]  # candidates swapped under their scores
    out = stages.stage_graph(None, [item], ref, "f32", "f32", _Silent())
    fd = stages.first_divergence({"stages": {"graph": out}})
    assert out["status"] == "fail" and fd["name"] == "selector" and fd["stage"] == "graph"
    assert fd["message"].startswith("selector: reference/native: lattice relative error ")


def test_native_block_lengths(three):
    """draft-dflash's block is n_max + 1 (U10): a non-causal DFlash 2 block of 4 walks other tokens than
    the trained block of 8; past the trained block llama.cpp's lattice has no rows, a one-line error."""
    rt, native, _, feats, block = three
    full = G.drafted_tokens(native.trace(feats, block), rt.n_vocab, 4)
    short = G.drafted_tokens(native.trace(feats, block[:4]), rt.n_vocab, 4)
    assert len(short) == 3 and short != full[:3]
    with pytest.raises(ValueError, match=r"^a DFlash 2 block of 9 tokens exceeds the trained block of 8 "
                                         r"\(llama.cpp's selector lattice holds 8 rows\)$"):
        native.trace(feats, block + [rt.mask_token_id])
    assert np.array_equal(G.drafted_tokens(native.trace(feats, block), rt.n_vocab, 4), full)  # still usable
