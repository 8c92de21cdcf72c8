"""DSpark drafts in the parity harness: the Markov head's intermediates (the token each slot's bias
reads, the bias, the biased logits, the confidence) three ways, llama.cpp's peer driven and read as
its draft-dspark loop drives it, and the tokens a chain draft drafts, where llama.cpp's draft-dflash
reads DeepSpec's anchor-first "DFlash" drafts one slot late (U14). One draft per target family: the
registry's `tiny-dspark-*` pairs (`dflash-llama parity --all`) cover the rest."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from parity_helpers import PROMPTS, tiny_draft

import dflash_llama
from dflash_llama import cli, fixtures
from dflash_llama.parity import graph as G, registry, report as R, stages
from dflash_llama.parity.native import NativeDraft
from dflash_llama.reference.checkpoint import load_draft
from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

torch.set_num_threads(1)

DS = dict(variant="dspark", dtype="float32", layers=2, heads=4, kv_heads=2, target_layer_ids=[1, 2])
PAIRS = ("reference/runtime", "reference/native", "runtime/native")


class _Silent:
    def step(self, what):
        pass


def three(tmp_path_factory, target_hf, target_gguf, cfg, name):
    """(draft HF dir, GGUF, our runtime, llama.cpp's peer, the reference draft) of one DSpark draft."""
    hf, gguf = tiny_draft(tmp_path_factory, target_hf, target_gguf, cfg, name=name)
    rt = dflash_llama.Runtime(target_gguf, gguf, n_threads=1, n_ctx=256, kv_f32=True, compact_draft_head=False)
    native = NativeDraft(rt, gguf, n_ctx=256, n_threads=1)
    tw = target_weights_from_gguf(target_gguf)
    return hf, gguf, rt, native, load_draft(hf, tw.embed_tokens, tw.lm_head)


def graph_stage(rt, native, ref, gguf) -> tuple[list[dict], dict]:
    """The graph stage on the first prompt: its input (with our runtime's and llama.cpp's traces and
    drafts) and its result."""
    cfg = stages.ParityConfig(target=gguf, draft=gguf, prompts=PROMPTS[:1], graph_prompts=1)
    inputs = stages.graph_inputs(cfg, rt, native)
    return inputs, stages.stage_graph(cfg, inputs, ref, "f32", "f32", _Silent())


def shipped_draft(name: str) -> fixtures.TinyDraftConfig:
    pair = next(p for p in registry.load()[0] if p.name == name)
    return fixtures.TinyDraftConfig(**pair.draft_cfg)


@pytest.fixture(scope="module")
def anchor_first(tmp_path_factory, tiny_target_hf, tiny_target_gguf):
    """The registry's tiny-dspark-f32 draft (anchor-first, rank 16, a confidence head, block 8) on the
    qwen3 tiny target, the one the registry builds."""
    return three(tmp_path_factory, tiny_target_hf, tiny_target_gguf, shipped_draft("tiny-dspark-f32"), "dspark")


def test_markov_head_three_ways(anchor_first):
    _, gguf, rt, native, ref = anchor_first
    assert (native.dspark, native.sample_from_anchor, native.block_size) == (True, True, 8)
    assert stages.native_spec_type(gguf) == "draft-dspark"
    inputs, out = graph_stage(rt, native, ref, gguf)
    assert out["status"] == "pass" and out["failures"] == [] and out["missing"] == {}
    assert out["names"][-6:] == ["result_norm", "result_output", *G.DSPARK_NAMES]
    for pair in PAIRS:  # all four read from llama.cpp's graph, the token ids equal
        assert set(G.DSPARK_NAMES) <= set(out["errors"][pair]) and out["errors"][pair]["markov_prev"] == 0.0
    assert max(out["errors"][pair][name] for pair in PAIRS for name in G.DSPARK_NAMES) <= 1e-5
    assert out["shapes"]["markov_bias"] == [8, rt.n_vocab] and out["shapes"]["confidence"] == [8]
    traces = inputs[0]["traces"]
    native_trace = traces["native"]
    # llama.cpp's chain: each slot's bias reads the token its slot before drafted, the anchor first
    drafted = inputs[0]["drafted"]["native"]
    anchor = inputs[0]["block"][0]
    assert len(drafted) == 8 and native_trace["markov_prev"].astype(int).tolist() == [anchor, *drafted[:7]]
    unbiased = native_trace["result_output"].argmax(-1).tolist()
    assert unbiased != drafted  # the Markov bias changes what llama.cpp drafts
    assert np.all((native_trace["confidence"] > 0) & (native_trace["confidence"] < 1))
    assert out["drafts"]["failures"] == [] and all(out["drafts"]["pairs"][p]["same"] for p in PAIRS)
    assert out["drafts"]["inputs"][0]["reference/native"]["drafts_a"] == drafted
    # llama.cpp conditioning slot 3 on another token: markov_prev is the first divergence, exactly
    traces["native"] = bad = dict(native_trace)
    bad["markov_prev"] = native_trace["markov_prev"].copy()
    bad["markov_prev"][3] += 1
    out = stages.stage_graph(None, inputs, ref, "f32", "f32", _Silent())
    fd = stages.first_divergence({"stages": {"graph": out}})
    assert (fd["name"], fd["pair"], fd["bound"]) == ("markov_prev", "reference/native", 0.0)
    assert fd["message"].startswith("markov_prev: reference/native relative error ")


def test_parity_passes_on_the_anchor_first_draft(anchor_first, tiny_target_gguf, tmp_path, capsys):
    """`dflash-llama parity` on it, end to end included: PASS, llama.cpp's loop run as draft-dspark
    drafting the whole block, and the report holds the Markov head's intermediates."""
    hf, gguf = anchor_first[:2]
    out = tmp_path / "report"
    rc = cli.main(["parity", "--target", str(tiny_target_gguf), "--draft", str(gguf), "--draft-hf", str(hf),
                   "--limit", "1", "--graph-prompts", "1", "-n", "8", "-t", "1", "--quiet", "--out", str(out)])
    assert rc == 0 and "parity report: PASS" in capsys.readouterr().out
    report = json.loads((out / "parity.json").read_text())
    R.validate(report)  # parity/schema.json, the chain's drafts included
    assert report["passed"] and report["first_divergence"] is None
    graph, e2e = report["stages"]["graph"], report["stages"]["end_to_end"]
    assert set(G.DSPARK_NAMES) <= set(graph["errors"]["reference/native"])
    assert all(graph["drafts"]["pairs"][p]["same"] for p in PAIRS)
    row = e2e["prompts"][0]
    assert row["runtime"]["greedy_exact"] and row["native"]["greedy_exact"] and row["reference"]["greedy_exact"]
    assert row["native"]["spec_type"] == "draft-dspark" and row["native"]["n_drafted"] > 0
    assert e2e["draft_agreement"]["reference/runtime"] == 1.0
    md = (out / "parity.md").read_text()
    assert "| `biased_logits` |" in md and "Drafted tokens of the chain" in md


def test_dflash_layout_on_llama(family_targets, tmp_path_factory):
    """DFlash's layout (sample_from_anchor false), no confidence head, a llama target: slot 0 is not
    drafted, so every head covers the block's 5 drafted slots of 6, in llama.cpp's graph as in ours."""
    hf_t, gguf_t = family_targets["llama"]
    cfg = fixtures.TinyDraftConfig(**DS, block_size=6, markov_rank=8, confidence_head=False, sample_from_anchor=False,
                                   seed=63)
    _, gguf, rt, native, ref = three(tmp_path_factory, hf_t, gguf_t, cfg, "dspark_llama")
    assert (native.dspark, native.sample_from_anchor) == (True, False)
    inputs, out = graph_stage(rt, native, ref, gguf)
    assert out["status"] == "pass" and out["names"][-3:] == ["markov_prev", "markov_bias", "biased_logits"]
    assert out["shapes"]["result_output"] == [6, rt.n_vocab] and out["shapes"]["biased_logits"] == [5, rt.n_vocab]
    assert "confidence" not in inputs[0]["traces"]["native"] and "confidence" not in out["names"]
    assert max(out["errors"][pair][name] for pair in PAIRS for name in out["names"][-3:]) <= 1e-5
    assert [len(v) for v in inputs[0]["drafted"].values()] == [5, 5]
    assert inputs[0]["traces"]["native"]["markov_prev"][0] == inputs[0]["block"][0]  # slot 1 reads the anchor


def test_gemma3_graph_three_ways(family_targets, tmp_path_factory):
    """On a gemma3 target llama.cpp's loop aborts (U7: the registry's gemma3 DSpark pairs expect it),
    but its graph, fed our runtime's features, runs: the three agree there."""
    hf_t, gguf_t = family_targets["gemma3"]
    _, gguf, rt, native, ref = three(tmp_path_factory, hf_t, gguf_t, shipped_draft("tiny-dspark-gemma3-f32"),
                                     "dspark_gemma3")
    _, out = graph_stage(rt, native, ref, gguf)
    assert out["status"] == "pass" and set(G.DSPARK_NAMES) <= set(out["names"])
    assert max(out["errors"][pair][name] for pair in PAIRS for name in G.DSPARK_NAMES) <= 1e-5
    assert all(out["drafts"]["pairs"][p]["same"] for p in PAIRS)


def test_deepspec_dflash_is_drafted_one_slot_late(tmp_path_factory, tiny_target_hf, tiny_target_gguf):
    """U14: DeepSpec's anchor-first "DFlash" draft (markov_rank 0) has no markov_w1, so llama.cpp's tool
    runs it as draft-dflash, which reads block positions 1..: its graph agrees with ours, its drafts
    are the reference's from the second on, and the graph stage fails on them."""
    cfg = dataclasses.replace(shipped_draft("tiny-deepspec-dflash"), layers=1, block_size=6)
    _, gguf, rt, native, ref = three(tmp_path_factory, tiny_target_hf, tiny_target_gguf, cfg, "deepspec")
    assert not native.dspark and stages.native_spec_type(gguf) == "draft-dflash"
    inputs, out = graph_stage(rt, native, ref, gguf)
    assert out["failures"] == [] and not set(G.DSPARK_NAMES) & set(out["names"])  # every intermediate agrees
    drafted = out["drafts"]["inputs"][0]
    ours = drafted["reference/runtime"]
    assert ours["same"] and len(ours["drafts_a"]) == 6
    assert inputs[0]["drafted"]["native"] == ours["drafts_a"][1:]
    assert out["status"] == "fail"
    fd = stages.first_divergence({"stages": {"graph": out}})
    assert fd["name"] == "drafted tokens" and fd["message"].startswith(
        "drafted tokens: reference/native: drafted tokens differ on fib: ")
