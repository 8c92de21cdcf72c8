"""Planted faults are caught, and the report names the first intermediate they affect."""

from __future__ import annotations

import pytest
from parity_helpers import PROMPTS, tiny_draft

from dflash_llama.parity import faults
from dflash_llama.parity.stages import ParityConfig, run_parity


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_target_hf, tiny_target_gguf):
    return tiny_draft(tmp_path_factory, tiny_target_hf, tiny_target_gguf, name="faults")


def check(draft, pair, tiny_target_gguf, tiny_target_hf) -> dict:
    cfg = ParityConfig(target=tiny_target_gguf, draft=draft, draft_hf=pair[0], target_hf=tiny_target_hf,
                       prompts=PROMPTS[:1], name="fault", graph_prompts=1, end_to_end=False)
    return run_parity(cfg, progress_bar=False)


def test_scaled_attn_k_is_caught_at_the_first_reader(pair, tiny_target_gguf, tiny_target_hf, tmp_path):
    bad = faults.scale_tensor(pair[1], tmp_path / "k.gguf", "blk.1.attn_k.weight", 1.01)
    r = check(bad, pair, tiny_target_gguf, tiny_target_hf)
    assert not r["passed"]
    assert r["stages"]["converter"]["status"] == "fail"
    failed = [t for t in r["stages"]["converter"]["tensors"] if not t["passed"]]
    assert [t["name"] for t in failed] == ["blk.1.attn_k.weight"]
    assert failed[0]["error"] == pytest.approx(0.01, rel=1e-3)
    fd = r["first_divergence"]
    assert (fd["stage"], fd["name"], fd["layer"], fd["tensor"]) == ("converter", "Kcur_injected-1", 1,
                                                                     "blk.1.attn_k.weight")
    assert "first intermediate reading blk.1.attn_k.weight" in fd["message"]
    # the per-head k_norm cancels a uniform scale of k_proj: the graph itself stays within bounds
    assert r["stages"]["graph"]["status"] == "pass"
    assert r["stages"]["graph"]["errors"]["reference/runtime"]["Kcur_injected-1"] < 1e-5


def test_swapped_norms_fail_at_the_right_layer(pair, tiny_target_gguf, tiny_target_hf, tmp_path):
    bad = faults.swap_tensors(pair[1], tmp_path / "swap.gguf", "blk.1.attn_norm.weight", "blk.1.ffn_norm.weight")
    r = check(bad, pair, tiny_target_gguf, tiny_target_hf)
    assert not r["passed"]
    g = r["stages"]["graph"]
    assert g["status"] == "fail"
    fd = r["first_divergence"]
    assert (fd["stage"], fd["name"], fd["layer"], fd["pair"]) == ("graph", "noise_norm-1", 1, "reference/runtime")
    assert fd["error"] > 0.1
    assert g["errors"]["runtime/native"]["noise_norm-1"] < 1e-5  # same (wrong) weights in both ggml graphs
    assert all(g["errors"]["reference/runtime"][n] < 1e-4 for n in g["names"][:g["names"].index("noise_norm-1")])
    assert "runtime and llama.cpp agree" in fd["message"]
    assert "blk.1.attn_norm.weight" in fd["message"]  # stage 1 names the tensor


def test_target_layers_off_by_one(pair, tiny_target_gguf, tiny_target_hf, tmp_path):
    bad = faults.shift_target_layers(pair[1], tmp_path / "shift.gguf", -1)
    r = check(bad, pair, tiny_target_gguf, tiny_target_hf)
    assert not r["passed"]
    check_ = r["stages"]["capture"]["layer_check"]
    assert (check_["status"], check_["shift"], check_["gguf_ids"], check_["hf_ids"]) == ("fail", -1, [0, 1], [1, 2])
    fd = r["first_divergence"]
    assert fd["stage"] == "capture"
    assert fd["message"].startswith("target layers off by one: dflash.target_layers = [1, 2] reads as target "
                                    "layer ids [0, 1], but the HF config's target_layer_ids are [1, 2]")
    assert "without the + 1" in fd["message"]
    assert all(t["error"] > 0.1 for t in check_["tap_errors"])  # the features read are another layer's


def test_shift_refuses_below_one(pair, tmp_path):
    with pytest.raises(ValueError, match=r"shifting dflash.target_layers by -2 gives \[0, 1\]: below 1"):
        faults.shift_target_layers(pair[1], tmp_path / "x.gguf", -2)
