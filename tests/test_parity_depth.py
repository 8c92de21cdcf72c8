"""Parity at depth: each target layer's own error is the capture check (a correct deep q8_0 target
passes, a weight scaled in one layer fails there), and the metrics users of llama.cpp read: NMSE per
intermediate, KL divergence and same-top-1 of the logits, the first-divergence table."""

from __future__ import annotations

import numpy as np
import pytest
from parity_helpers import PROMPTS

from dflash_llama import fixtures
from dflash_llama.converter import convert
from dflash_llama.parity import faults
from dflash_llama.parity.stages import ParityConfig, logit_metrics, nmse, run_parity

DEEP = fixtures.TinyTargetConfig(layers=16, hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=384, init_std=0.05,
                                 seed=5)
FAULT_LAYER = 9


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 16-layer qwen3 target (HF and q8_0 GGUF), a q8_0 draft for it tapping layers 1, 8, 14, and
    the target with blk.9.attn_v scaled by 1.05."""
    root = tmp_path_factory.mktemp("deep")
    hf = fixtures.tiny_target_hf(root / "target-hf", DEEP)
    target = fixtures.tiny_target_gguf(hf, root / "target-q8_0.gguf", outtype="q8_0")
    draft_hf = fixtures.tiny_draft_hf(root / "draft-hf", hf, fixtures.TinyDraftConfig(
        layers=1, heads=4, kv_heads=2, head_dim=32, ffn=256, block_size=8, target_layer_ids=[1, 8, 14], seed=6))
    draft = convert(draft_hf, target, root / "draft-q8_0.gguf", outtype="q8_0")
    faulty = faults.scale_tensor(target, root / "target-v9.gguf", f"blk.{FAULT_LAYER}.attn_v.weight", 1.05)
    return {"hf": hf, "target": target, "draft_hf": draft_hf, "draft": draft, "faulty": faulty, "root": root}


def _run(deep, target, **kw) -> dict:
    cfg = ParityConfig(target=target, draft=deep["draft"], draft_hf=deep["draft_hf"], target_hf=deep["hf"],
                       prompts=PROMPTS[:1], name="deep", graph_prompts=1, n_threads=2, **kw)
    return run_parity(cfg, progress_bar=False)


def test_deep_q8_0_target_passes_and_a_scaled_layer_fails_there(deep):
    clean = _run(deep, deep["target"], end_to_end=False)
    cap = clean["stages"]["capture"]
    assert cap["status"] == "pass" and clean["first_divergence"] is None, clean["first_divergence"]
    assert cap["rounding"] == {"covered": True, "uncovered": [], "weights": "rounded to the GGUF's types"}
    assert cap["own_bound"] == 5e-3  # q8_0 weights: ggml's q8_0 activations, emulated
    own = [row["own_error"] for row in cap["layers"]]
    assert max(own) < 2e-3
    compounded = [row["error"] for row in cap["layers"]]
    assert compounded[-2] > 1e-2 > max(own)  # against the HF weights the free-running error compounds
    assert all(row["nmse"] == pytest.approx(row["error"] ** 2) for row in cap["layers"])
    assert cap["logits"]["n"] == cap["n_tokens"] and cap["logits"]["same_top1"] > 0.9

    bad = _run(deep, deep["faulty"], end_to_end=False)
    cap = bad["stages"]["capture"]
    assert not bad["passed"] and cap["status"] == "fail"
    fd = bad["first_divergence"]
    assert (fd["stage"], fd["name"], fd["layer"]) == ("capture", f"target_feat-{FAULT_LAYER}", FAULT_LAYER)
    own = [row["own_error"] for row in cap["layers"]]
    assert own[FAULT_LAYER] > 5 * cap["own_bound"]  # measured 4.3e-2
    assert [i for i, e in enumerate(own) if e > cap["own_bound"]] == [FAULT_LAYER]
    assert fd["message"].startswith(f"target_feat-{FAULT_LAYER}: target layer {FAULT_LAYER}'s own error")
    assert cap["logits"]["kl_mean"] > clean["stages"]["capture"]["logits"]["kl_mean"]


def test_draft_taps_off_by_one_are_named(deep):
    shifted = faults.shift_target_layers(deep["draft"], deep["root"] / "draft-shift.gguf", -1)
    cfg = ParityConfig(target=deep["target"], draft=shifted, draft_hf=deep["draft_hf"], prompts=PROMPTS[:1],
                       name="shift", graph_prompts=1, n_threads=2, end_to_end=False, native=False)
    r = run_parity(cfg, progress_bar=False)
    check = r["stages"]["capture"]["layer_check"]
    assert (check["status"], check["shift"], check["gguf_ids"], check["hf_ids"]) == ("fail", -1, [0, 7, 13], [1, 8, 14])
    assert r["first_divergence"]["name"] == "target layers"
    assert r["stages"]["capture"]["status"] == "fail"


def test_end_to_end_metrics_and_divergence_table(deep):
    r = _run(deep, deep["target"], n_predict=8, agreement_steps=2, divergence_lengths=[4, 8], verify_widths=[1, 7])
    e = r["stages"]["end_to_end"]
    assert e["status"] == "pass" and e["reference_mode"] == "loop"
    cells = {(d["impl"], d["width"], d["length"]): d["first_divergence"] for d in e["divergence"]}
    assert set(cells) == {(i, w, n) for i in ("runtime", "native") for w in (1, 7) for n in (4, 8)}
    assert all(v is None for (impl, _, _), v in cells.items() if impl == "runtime")
    v = e["verify_logits"]
    assert v["n"] == 8 and 0 <= v["kl_mean"] <= v["kl_p99"] <= v["kl_max"] and v["same_top1"] > 0.5
    assert [p["phase"] for p in r["resources"]["phases"]] == [
        "converter", "runtime and llama.cpp (capture, graph, end to end)", "reference target (capture)",
        "reference draft (graph)", "reference target and draft (end to end)"]
    assert all(p["peak_rss_bytes"] > 100 << 20 for p in r["resources"]["phases"])
    g = r["stages"]["graph"]
    assert all(g["nmse"][pair][n] == pytest.approx(err ** 2) for pair, errs in g["errors"].items()
               for n, err in errs.items())


def test_logit_metrics_and_nmse_values():
    want = np.log(np.array([[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]]))
    got = np.log(np.array([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]]))  # row 1: a planted change of its top token
    m = logit_metrics(want, got)
    kl1 = 0.25 * np.log(0.5) + 0.5 * np.log(2.0)
    assert m["n"] == 2 and m["same_top1"] == 0.5
    assert m["kl_mean"] == pytest.approx(kl1 / 2) and m["kl_max"] == pytest.approx(kl1)
    assert m["kl_p99"] == pytest.approx(np.percentile([0.0, kl1], 99))
    assert nmse(np.array([3.0, 4.0]), np.array([3.0, 4.5])) == pytest.approx(0.25 / 25)
    with pytest.raises(ValueError, match=r"^cannot compare logits of shapes \(2, 3\) and \(1, 3\)$"):
        logit_metrics(want, got[:1])


def test_a_runtime_divergence_is_tabled_and_named():
    """A runtime whose speculative output departs from plain decoding at one verify width (planted)."""
    from types import SimpleNamespace

    from dflash_llama.parity.stages import _generations, first_divergence

    plain = [5, 6, 7, 8, 9, 10, 11, 12]

    class Planted:
        block_size, mask_token_id = 4, 0

        def tokenize(self, text):
            return [1, 2, 3]

        def detokenize(self, tokens):
            return "x"

        def autoregressive(self, tokens, n, stop_at_eog):
            return SimpleNamespace(tokens=plain[:n])

        def generate(self, tokens, n, draft_max, stop_at_eog):
            out = list(plain[:n])
            if draft_max == 1 and n > 2:
                out[2] = 99  # the planted fault: width 1 from its third token
            return SimpleNamespace(tokens=out, tau=1.0, steps=[])

        def target_logits(self, tokens):
            return np.zeros((len(tokens), 4), np.float32)

    cfg = ParityConfig(target="t", draft="d", prompts=PROMPTS[:1], n_predict=8, native=False)
    item = _generations(cfg, Planted(), PROMPTS[0], 512)
    table = {(d["width"], d["length"]): d["first_divergence"] for d in item["row"]["divergence"]}
    assert table == {(1, 4): 2, (1, 8): 2, (3, 4): None, (3, 8): None}  # lengths n/2, n; widths 1, B-1
    e2e = {"divergence": item["row"]["divergence"], "greedy_exact": {"runtime": True}, "prompts": []}
    report = {"stages": {"capture": {"own_bound": 1, "layers": [], "layer_check": {"status": "pass"}},
                         "converter": {"tensors": []}, "graph": {"names": [], "failures": []}, "end_to_end": e2e}}
    assert first_divergence(report)["message"] == (
        "runtime: greedy speculative output at verify width 1, 4 tokens, differs from greedy target output at token 2")
