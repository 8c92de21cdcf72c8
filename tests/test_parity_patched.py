"""The patch series under patches/, applied in order to a copy of the pinned tree, removes each
finding's divergence where users run llama.cpp (its tools), and the pinned tree stays untouched."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from dflash_llama.parity import findings, patched


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("DFLASH_LLAMA_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def _touched_hashes() -> dict[str, str]:
    tree = patched.ROOT / "third_party" / "llama.cpp"
    files = sorted({f for p in patched.series() for f in patched.touched_files(p)})
    return {f: hashlib.sha256((tree / f).read_bytes()).hexdigest() for f in files}


@pytest.fixture(scope="module")
def build():
    before = _touched_hashes()
    log: list[str] = []
    b = patched.patched_build(log=log.append)
    assert _touched_hashes() == before  # the pinned tree is never written
    return b, log


def test_series_names_every_patch_in_order():
    names = [p.name for p in patched.series()]
    assert names == ["u1-dflash-default-target-layers.patch", "u2-dflash-last-layer-tap.patch",
                     "u3-dflash-causal-sliding-layers.patch", "u4-dflash1-logit-scale.patch",
                     "u5-dflash-full-block.patch", "u7-gemma3-layer-inputs.patch",
                     "u9-dflash-speculators-format.patch", "u10-dflash2-full-block.patch",
                     "u11-recurrent-snapshots-follow-moved-cells.patch", "u18-speculative-simple-spent-budget.patch",
                     "u19-dflash-blocks-fit-the-ubatch.patch"]
    assert sorted(names + list(patched.PROPOSED)) == sorted(p.name for p in patched.PATCHES.glob("*.patch"))
    assert {f for fs in patched.PROPOSED.values() for f in fs} <= set(patched.UNPATCHED)
    assert {f: patch for f, (patch, _) in patched.SHOW.items()} == {
        "U" + n[1:].split("-")[0]: n for n in names}  # one patch per finding
    # every finding of findings.py patched, or listed as not patched yet with its reason
    assert set(patched.SHOW) | set(patched.UNPATCHED) == set(findings.FINDINGS)
    assert not set(patched.SHOW) & set(patched.UNPATCHED)


def test_series_builds_only_the_touched_units_then_comes_from_the_cache(build):
    build, first_log = build
    assert sorted(m for m in first_log if m.startswith("compiling")) == [
        "compiling patched common/speculative.cpp",
        "compiling patched examples/speculative-simple/speculative-simple.cpp", "compiling patched src/llama-graph.cpp",
        "compiling patched src/llama-kv-cache.cpp", "compiling patched src/llama-memory-recurrent.cpp",
        "compiling patched src/llama-model.cpp",
        "compiling patched src/models/dflash.cpp", "compiling patched src/models/gemma3.cpp"]
    again: list[str] = []
    assert patched.patched_build(log=again.append) == build and again == []
    # one patch less (the converter's U9): a new build, every object reused (incremental over the series)
    fewer: list[str] = []
    other = patched.patched_build([p for p in patched.series() if not p.name.startswith("u9-")], log=fewer.append)
    assert other.tree != build.tree
    assert fewer == ["linking patched llama-speculative-simple", "linking patched llama-server"]
    r = subprocess.run([str(build.tool("llama-server")), "--version"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_u1_converter_writes_the_default_taps(build):
    build, _ = build
    u1 = patched.show_u1(build)
    assert u1["pinned"]["target_layers"] is None and u1["pinned"]["exit"] == 1
    assert "DFlash model requires 'target_layers' in GGUF metadata" in u1["pinned"]["error"]
    assert u1["patched"] == {"exit": 0, "exact": True, "target_layers": [2, 2]}  # HF ids [1, 1] + 1
    assert u1["fixed"]


def test_u9_converter_reads_speculators_drafts(build):
    """The patched converter writes, from speculators' format (DFlash 2 as saved, DFlash 1 with the
    verifier's copies), the bytes of the z-lab copy's conversion; the pinned one fails on both."""
    build, _ = build
    u9 = patched.show_u9(build)
    assert u9["pinned"] == {
        "dflash2": "failed: KeyError: \"could not find any of: ['n_layers', 'num_hidden_layers', 'n_layer', "
                   "'num_layers']\"",
        "dflash": "failed: ERROR:hf-to-gguf:Model DFlashSpeculator is not supported"}
    assert u9["patched"] == {v: "same bytes as the z-lab copy's conversion" for v in ("dflash2", "dflash")}
    assert u9["fixed"]


@pytest.mark.parametrize("show", [patched.show_u2, patched.show_u7], ids=["U2", "U7"])
def test_capture_findings_run_exact_and_draft_as_our_runtime(build, show):
    build, _ = build
    r = show(build)
    assert r["pinned"]["exit"] == -6 and "layer input tensor is null" in r["pinned"]["error"]
    assert r["patched"] == {"exit": 0, "exact": True}
    assert r["drafts"]["tool"] == r["drafts"]["runtime"] and len(r["drafts"]["tool"]) >= 3
    assert r["fixed"]


def test_u4_and_u5_gone(build):
    build, _ = build
    u5 = patched.show_u5(build)
    assert u5["pinned"] == {"n_max_7_first_3": [799, 799, 799], "n_max_3": [8856, 8856, 31886], "agree": False}
    assert u5["patched"] == {"n_max_7_first_3": [799, 799, 799], "n_max_3": [799, 799, 799], "agree": True}
    u4 = patched.show_u4(build)
    assert (u4["published"], u4["raw"], u4["pinned"], u4["patched"]) == (0.114, 0.249, 0.249, 0.114)
    assert u4["fixed"] and u5["fixed"]


def test_u10_dflash2_drafts_from_its_trained_block(build):
    """At --spec-draft-n-max 3 and 7, the patched tool's DFlash 2 drafts are the first n_max of the
    reference's walk over the trained block (8, 16) at every step; the pinned block of n_max + 1 walks
    other tokens unless it is the trained block (n_max 7, block 8); every run exact."""
    build, _ = build
    u10 = patched.show_u10(build)
    steps = {p: {b: {n: (u10[p][b][n]["same_as_reference"], u10[p][b][n]["steps"], u10[p][b][n]["exact"])
                     for n in (3, 7)} for b in ("pinned", "patched")} for p in patched.U10_PAIRS}
    # -n 8, every draft rejected: 9 verifies, the last two with the budget spent (U18's patch: no draft)
    assert steps == {"tiny-dflash2-f32": {"pinned": {3: (0, 7, True), 7: (7, 7, True)},
                                          "patched": {3: (7, 7, True), 7: (7, 7, True)}},
                     "tiny-dflash2-llama-f32": {"pinned": {3: (0, 7, True), 7: (0, 7, True)},
                                                "patched": {3: (7, 7, True), 7: (7, 7, True)}}}
    assert u10["fixed"]
    assert ("patched  tiny-dflash2-llama-f32 (trained block 16) --spec-draft-n-max 3, a block of 16: drafts equal "
            "the reference's trained-block walk at 7/7 steps; the tool's greedy text exact") in u10["lines"]


def test_u18_speculative_simple_stops_at_n_predict(build):
    """A tool's own source (the example's main file) is patched too, and linked into that tool only."""
    build, _ = build
    out = patched.show_u18(build)
    # -n 20, drafts of 16 always accepted: 17, 20, then the last step drafts 16 more on the pinned tool
    assert (out["pinned"], out["patched"], out["fixed"]) == (37, 21, True)


def test_u19_blocks_longer_than_the_ubatch_no_longer_abort(build):
    build, _ = build
    out = patched.show_u19(build)
    assert out["fixed"], out["lines"]
    pinned = out["pinned"]["tool"]
    assert pinned["exit"] == -6 and "non-causal attention requires n_ubatch" in pinned["said"]
    assert out["patched"]["tool"]["said"] == "a draft block of 8 tokens does not fit the ubatch of 7 (-ub): no drafts"
    assert (out["pinned"]["server_exact"], out["patched"]["server_exact"]) == (None, 16)


def test_u3_sliding_layers_draft_as_our_runtime(build):
    build, _ = build
    u3 = patched.show_u3(build)
    assert u3["pinned"]["tool"] != u3["pinned"]["runtime"]  # the sliding layer ran non-causally
    assert u3["patched"]["tool"] == u3["patched"]["runtime"] and len(u3["patched"]["tool"]) == 7
    assert u3["patched"]["exact"] and u3["fixed"]


def test_every_fixture_pair_is_exact_through_the_patched_tool(build):
    """llama-speculative-simple of the series, greedy, -fa off, the draft's whole block: the same
    text as drafting nothing on a tiny target of every family, the SWA draft and the last-layer tap."""
    from dflash_llama import families

    build, _ = build
    result = patched.fixtures_exact(build)
    assert {r["family"] for r in result.values()} == set(families.NAMES)
    assert {"tiny-sliding", "tiny-last-layer-tap", "tiny-gemma3-f32"} <= set(result)
    assert {name: (r["exact"], r["errors"]) for name, r in result.items()} == {name: (3, []) for name in result}


def test_findings_patched_counts_what_is_not_fixed(build, capsys, monkeypatch):
    assert findings.main(["--patched", "U3", "U7"]) == 0
    out = capsys.readouterr().out
    assert "U3: reproduced on the pinned build, fixed on the patched build" in out
    assert "U7: reproduced on the pinned build, fixed on the patched build" in out
    # a finding whose patch is not in the series is run on the pinned build, and counts
    without_u3 = [p for p in patched.series() if not p.name.startswith("u3-")]
    monkeypatch.setattr(patched, "series", lambda: without_u3)
    assert findings.main(["--patched", "U3", "U7"]) == 1
    out = capsys.readouterr().out
    assert "U3: no patch in patches/series; on the pinned build: REPRODUCED" in out


def test_parity_all_patched_passes_the_expected_fail_pairs(build, tmp_path):
    """The registry's expected-fail pairs (U3, U2, U7) pass three-way parity on the patched build:
    the in-process llama.cpp graph and llama-speculative-simple both from the series."""
    names = ["tiny-sliding", "tiny-last-layer-tap", "tiny-gemma3-f32"]
    r = subprocess.run([sys.executable, "-m", "dflash_llama.cli", "parity", "--all", "--patched", "--quiet",
                        "--limit", "1", "-n", "16", "--only", ",".join(names), "--out", str(tmp_path)],
                       capture_output=True, text=True, env=os.environ)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["pair"]: row["result"] for row in json.loads((tmp_path / "summary.json").read_text())}
    assert rows == {"tiny-sliding": "pass (fixed by u3-dflash-causal-sliding-layers.patch)",
                    "tiny-last-layer-tap": "pass (fixed by u2-dflash-last-layer-tap.patch)",
                    "tiny-gemma3-f32": "pass (fixed by u7-gemma3-layer-inputs.patch)"}
    report = json.loads((tmp_path / "tiny-sliding" / "parity.json").read_text())
    assert report["inputs"]["native_build"].startswith("patched (u1-dflash-default-target-layers.patch, ")
    graph = report["stages"]["graph"]
    assert graph["status"] == "pass" and graph["errors"]["reference/native"]["ffn_inp-1"] < 1e-5
    e2e = report["stages"]["end_to_end"]["prompts"][0]["native"]
    assert e2e["greedy_exact"] and "error" not in e2e


def test_bench_patched_serves_the_pair_with_the_patched_server(build, tiny_target_gguf, tiny_draft_hf, tmp_path):
    from dflash_llama import cli

    out = tmp_path / "bench"
    assert cli.main(["bench", "--target", str(tiny_target_gguf), "--draft", str(tiny_draft_hf), "--limit", "2",
                     "-n", "12", "-t", "1", "--block-sizes", "4", "--ngram-types", "none", "--no-native",
                     "--pilot-prompts", "2", "--calibration-tokens", "6", "--server-concurrency", "1",
                     "--patched", "--out", str(out)]) == 0
    res = json.loads((out / "bench.json").read_text())
    srv = res["server"]
    assert srv["build"] == "patched" and srv["patches"] == [p.name for p in patched.series()]
    assert srv["command"][0].endswith("/bin/llama-server") and "/patched/" in srv["command"][0]
    assert [(lv["concurrency"], lv["requests"], lv["exact"]) for lv in srv["levels"]] == [(1, 2, 2)]
    assert "--patched" in res["command"] and res["settings"]["patched_server"] is True
    md = (out / "bench.md").read_text()
    assert "## Serving: llama-server with native DFlash, patched build" in md
    assert "`u3-dflash-causal-sliding-layers.patch`" in md


def test_patched_server_drafts_alike_at_every_concurrency(build):
    """U5 runs the whole block with logits on the drafted positions only: with two sequences in one
    draft batch, each must read its own rows (the acceptance of the same requests does not depend
    on how many run at once, as with the pinned server)."""
    from dflash_llama import fixtures, prompts
    from dflash_llama.bench import server
    from dflash_llama.bench.cli import draft_and_name

    build, _ = build
    target = str(fixtures.smollm2_gguf())
    draft, _ = draft_and_name(None, target)
    requests = [(p.id, p.text) for p in prompts.spread(prompts.load("humaneval"), 4)]
    rates = {}
    with server.LlamaServer(target, draft, threads=2, n_ctx=1024, n_parallel=2, n_max=3,
                            exe=build.tool("llama-server")) as srv:
        for c in (1, 2):
            rates[c] = server.load_test(srv.url, requests, 32, c).summary()["acceptance_rate"]
    assert rates[1] == rates[2] and rates[1] > 0.2, rates


def test_the_patched_module_cannot_replace_a_loaded_one(build):
    import dflash_llama

    dflash_llama.llama_cpp_commit()  # the pinned module is loaded in this process
    core = patched.patched_build(tools=("llama-speculative-simple", "_core"), log=lambda m: None)
    with pytest.raises(RuntimeError, match="dflash_llama._core is already loaded from .*: the patched build's module"):
        patched.use_core(core)


def test_patch_that_does_not_apply(tmp_path):
    bad = tmp_path / "bad.patch"
    bad.write_text("--- a/common/speculative.cpp\n+++ b/common/speculative.cpp\n@@ -1,1 +1,1 @@\n-no such line\n+x\n")
    with pytest.raises(RuntimeError, match="bad.patch does not apply to the pinned tree"):
        patched.patched_build([bad])


def test_series_naming_a_missing_patch(tmp_path):
    (tmp_path / "series").write_text("# order\nu9-nothing.patch\n")
    with pytest.raises(FileNotFoundError, match="no such patch: u9-nothing.patch"):
        patched.series(tmp_path / "series")
