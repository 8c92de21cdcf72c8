"""A clean pair passes every stage; the report renders; parity.json follows the documented schema;
the bounds table in docs/parity.md is the one the harness uses."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
from parity_helpers import PROMPTS, tiny_draft

from dflash_llama import schema as L
from dflash_llama.parity import bounds as B, report as R
from dflash_llama.parity.graph import DSPARK_NAMES, SELECTOR_NAMES, first_reader, graph_order
from dflash_llama.parity.stages import ParityConfig, layer_check, run_parity

DOCS = Path(__file__).resolve().parents[1] / "docs" / "parity.md"


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_target_hf, tiny_target_gguf):
    hf, gguf = tiny_draft(tmp_path_factory, tiny_target_hf, tiny_target_gguf, name="clean")
    cfg = ParityConfig(target=tiny_target_gguf, draft=gguf, draft_hf=hf, prompts=PROMPTS, name="clean",
                       n_predict=10, graph_prompts=2, agreement_steps=3)
    report = run_parity(cfg, progress_bar=False)
    out = tmp_path_factory.mktemp("report")
    return report, R.write(report, out)


def test_clean_pair_passes_every_stage(clean):
    r, _ = clean
    assert r["passed"] and r["first_divergence"] is None
    assert {k: s["status"] for k, s in r["stages"].items()} == {
        "converter": "pass", "capture": "pass", "graph": "pass", "end_to_end": "pass"}
    assert r["types"] == {"draft": "f32", "target": "f32", "head": "f32", "head_category": "f32"}
    assert r["inputs"]["reference_weights"] == "hf"
    g = r["stages"]["graph"]
    assert g["names"] == graph_order(2) and not g["missing"]
    assert max(g["errors"]["reference/runtime"].values()) < 1e-5
    assert max(g["errors"]["runtime/native"].values()) < 1e-5
    cap = r["stages"]["capture"]
    assert cap["reference"] == "gguf" and [row["tap"] for row in cap["layers"]] == [False, True, True, False]
    assert max(row["error"] for row in cap["layers"]) < 1e-5
    e = r["stages"]["end_to_end"]
    assert e["greedy_exact"] == {"reference": True, "runtime": True, "native": True}
    assert set(e["tau"]) == {"reference", "runtime", "native"} and all(t >= 1.0 for t in e["tau"].values())
    assert e["draft_agreement"]["runtime/native"] == 1.0
    assert e["draft_agreement"]["reference/runtime"] == 1.0
    assert [row["prompt"] for row in e["prompts"]] == ["fib", "stack"]
    assert all(row["runtime"]["n_tokens"] == 10 for row in e["prompts"])


def test_report_files_and_schema(clean):
    r, paths = clean
    data = json.loads(paths["json"].read_text())
    R.validate(data)
    md = paths["md"].read_text()
    assert "Result: PASS" in md and "First divergence: none" in md
    assert "| `blk.1.ffn_down.weight` | f32 | 0.0e+00 | 0.0e+00 | 1.0e-07 | yes |" in md
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    broken = copy.deepcopy(data)
    broken["stages"]["graph"]["status"] = "ok"
    with pytest.raises(jsonschema.ValidationError):
        R.validate(broken)
    broken = copy.deepcopy(data)
    broken["stages"]["graph"]["errors"]["reference/runtime"]["fc_out"] = -1.0
    with pytest.raises(jsonschema.ValidationError):
        R.validate(broken)
    del data["first_divergence"]
    with pytest.raises(jsonschema.ValidationError, match="'first_divergence' is a required property"):
        R.validate(data)


@pytest.fixture(scope="module")
def dflash2_report(tmp_path_factory, tiny_target_hf, tiny_target_gguf) -> dict:
    """parity.json of a DFlash 2 draft (block 4, top-K 3): the graph stage on one prompt."""
    from dflash_llama import fixtures

    cfg = fixtures.TinyDraftConfig(variant="dflash2", layers=1, heads=4, kv_heads=2, target_layer_ids=[1, 2],
                                   block_size=4, seed=33, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                   selector_top_k=3)
    hf, gguf = tiny_draft(tmp_path_factory, tiny_target_hf, tiny_target_gguf, cfg, name="dflash2")
    pc = ParityConfig(target=tiny_target_gguf, draft=gguf, draft_hf=hf, prompts=PROMPTS[:1], name="dflash2",
                      graph_prompts=1, end_to_end=False)
    paths = R.write(run_parity(pc, progress_bar=False), tmp_path_factory.mktemp("dflash2-report"))
    return json.loads(paths["json"].read_text())


def test_dflash2_report_and_its_selector_follow_the_schema(clean, dflash2_report):
    """The graph stage's `selector` (DFlash 2; null for DFlash 1) is described by the schema."""
    assert json.loads(clean[1]["json"].read_text())["stages"]["graph"]["selector"] is None
    R.validate(dflash2_report)
    graph = dflash2_report["stages"]["graph"]
    sel = graph["selector"]
    assert graph["status"] == "pass" and sel["failures"] == []
    # slot 1: the anchor's row of 3 scores; slots 2 and 3: 3 x 3 each
    assert {pair: (p["entries"], p["only_one_side"], p["same_path"]) for pair, p in sel["pairs"].items()} == {
        pair: (3 + 2 * 9, 0, True) for pair in ("reference/runtime", "reference/native", "runtime/native")}
    (row,) = sel["inputs"]
    assert row["prompt"] == "fib" and len(row["reference/native"]["path_a"]) == 3
    for path, value, message in [(("pairs", "reference/runtime", "entries"), -1, "-1 is less than the minimum of 0"),
                                 (("inputs", 0, "reference/native", "path_b"), [1.5], "1.5 is not of type 'integer'"),
                                 (("failures",), [{"name": "x"}], "is not of type 'string'")]:
        broken = copy.deepcopy(dflash2_report)
        node = broken["stages"]["graph"]["selector"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError, match=re.escape(message)):
            R.validate(broken)
    broken = copy.deepcopy(dflash2_report)
    broken["stages"]["graph"]["selector"]["pairs"]["reference/other"] = broken["stages"]["graph"]["selector"][
        "pairs"].pop("runtime/native")
    with pytest.raises(jsonschema.ValidationError, match="'reference/other' is not one of"):
        R.validate(broken)


def test_docs_table_is_the_bounds_table():
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\| `(\w+)`[^|]*\|((?: *[0-9.e+-]+ *\|){6})", line)
        if m:
            rows[m.group(1)] = [float(x) for x in m.group(2).strip(" |").split("|")]
    assert set(rows) == set(B.BOUNDS)
    for cat, b in B.BOUNDS.items():
        assert rows[cat] == [b.weights, b.capture, b.capture_hf, b.graph, b.graph_same, b.head], cat


def test_capture_bound_allows_for_the_gelu_table_of_gemma3_only():
    assert B.capture_bound("f32", "qwen3", hf=False) == 1e-4
    assert B.capture_bound("f32", "gemma3", hf=False) == B.GELU_TABLE_CAPTURE == 2e-3
    assert B.capture_bound("q4", "gemma3", hf=True) == 0.5  # the type's bound, when it is wider
    assert "capture bound of 2e-3 at f32\n(`bounds.GELU_TABLE_CAPTURE`" in DOCS.read_text()


def test_categories():
    assert [B.category(t) for t in ("F32", "f16", "bf16", "q8_0", "q4_0", "q4_K", "q6_K", "iq4_nl")] == \
        ["f32", "f16", "bf16", "q8_0", "q4", "q4", "q4", "q4"]
    with pytest.raises(ValueError, match="no parity bound for tensor type 'i32'"):
        B.category("i32")
    smollm2 = {"token_embd.weight": "q8_0", "blk.0.attn_q.weight": "q4_1", "blk.0.attn_norm.weight": "f32"}
    assert B.file_category(smollm2) == "q4"
    assert B.file_category({"fc.weight": "f16", "output_norm.weight": "f32", "token_embd.weight": "q4_0"},
                           skip=("token_embd.weight",)) == "f16"


def test_layer_check_messages():
    assert layer_check([1, 8], [1, 8])["status"] == "pass"
    assert layer_check([1, 8], None)["status"] == "skipped"
    minus = layer_check([0, 7], [1, 8])
    assert (minus["status"], minus["shift"]) == ("fail", -1) and "without the + 1" in minus["message"]
    plus = layer_check([2, 9], [1, 8])
    assert plus["shift"] == 1 and "applied twice" in plus["message"]
    other = layer_check([1, 5], [1, 8])
    assert other["message"].startswith("target layers differ") and "shift" not in other


def test_first_reader_covers_every_tensor():
    for spec in L.TENSORS:
        name = spec.gguf.format(bid=3)
        reader = first_reader(name)
        assert reader is not None, name
        variant = next(v for v in L.VARIANTS.values() if not spec.head or v.has(spec.head))
        computed = graph_order(4, variant) + list(SELECTOR_NAMES) + list(DSPARK_NAMES)  # heads: per slot, no layer
        assert reader in computed, (name, reader, variant.name)
    assert first_reader("blk.1.attn_k.weight") == "Kcur_injected-1"
    assert first_reader("blk.0.ffn_norm.weight") == "ffn_norm-0"


def test_first_divergence_order_and_messages():
    from dflash_llama.parity.stages import first_divergence

    names = graph_order(1)
    errors = {"reference/runtime": {n: 1e-7 for n in names}}
    bounds = {"reference/runtime": {n: 1e-4 for n in names}}
    errors["reference/runtime"]["ffn_out-0"] = 0.5
    graph = {"names": names, "errors": errors, "bounds": bounds, "missing": {},
             "failures": [{"name": "ffn_out-0", "pair": "reference/runtime", "error": 0.5, "bound": 1e-4}]}
    bad_q = {"name": "blk.0.attn_q.weight", "passed": False, "error": 0.3, "requant_error": 0.3, "bound": 1e-7}
    ok_cap = {"bound": 1e-4, "own_bound": 1e-4, "layers": [{"layer": 0, "error": 1e-3, "own_error": 1e-6}],
              "layer_check": {"status": "pass"}}  # a compounded error over the old bound is not a failure
    report = {"stages": {"capture": ok_cap, "converter": {"tensors": [bad_q]}, "graph": graph, "end_to_end": {}}}
    fd = first_divergence(report)  # Qcur-0 (the reader of attn_q) comes before ffn_out-0
    assert (fd["stage"], fd["name"], fd["tensor"]) == ("converter", "Qcur-0", "blk.0.attn_q.weight")
    report["stages"]["converter"]["tensors"] = []
    fd = first_divergence(report)
    assert fd["name"] == "ffn_out-0" and fd["message"].startswith(
        "ffn_out-0 (draft layer 0): reference/runtime relative error 5.0e-01 > bound 1.0e-04")
    report["stages"]["capture"]["layers"][0]["own_error"] = 1.0
    fd = first_divergence(report)
    assert fd["name"] == "target_feat-0" and fd["message"] == (
        "target_feat-0: target layer 0's own error (reading our runtime's input, relative to what the layer adds) "
        "1.0e+00 > bound 1.0e-04; compounded from layer 0: 1.0e-03")
    e2e = {"greedy_exact": {"runtime": True, "native": False},
           "prompts": [{"prompt": "p0", "runtime": {"greedy_exact": True},
                        "native": {"greedy_exact": False, "error": "exited with code -6:\nGGML_ASSERT(x) failed"}}]}
    clean = {"stages": {"capture": {"bound": 1, "own_bound": 1, "layers": [], "layer_check": {"status": "pass"}},
                        "converter": {"tensors": []}, "graph": {"names": names, "failures": [], "errors": {},
                                                                 "bounds": {}, "missing": {}},
                        "end_to_end": e2e}}
    assert first_divergence(clean)["message"] == "native: the speculative loop failed on p0 (GGML_ASSERT(x) failed)"
