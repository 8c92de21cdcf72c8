"""`dflash-llama bench --target-types` on the tiny f32 fixtures: the requantized targets and their
cache, the JSON of the sweep, exactness of every DFlash row, the report and the plot, the flags."""

from __future__ import annotations

import json
import math
import os

import gguf
import pytest

from dflash_llama import Runtime, cli, peers, prompts
from dflash_llama.bench import target_types
from dflash_llama.paths import cache_dir

pytestmark = pytest.mark.peer

TYPES = ["Q8_0", "F16"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the requantized targets are cached: keep them out of the home folder
        path = tmp_path_factory.mktemp("cache")
        mp.setenv("DFLASH_LLAMA_CACHE", str(path))
        yield path


def _bench(target, draft, out, *extra) -> int:
    return cli.main(["bench", "-m", str(target), "-md", str(draft), "--limit", "2", "-n", "12", "-t", "1",
                     "--pilot-prompts", "1", "--calibration-tokens", "6", *extra, "--out", str(out)])


@pytest.fixture(scope="module")
def sweep_run(cache, tiny_target_gguf, tiny_draft_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "tiny"
    rc = _bench(tiny_target_gguf, tiny_draft_gguf, out, "--target-types", ",".join(TYPES))
    return rc, out, json.loads((out / "bench.json").read_text())


def test_requantized_targets_have_the_requested_types(sweep_run, cache, tiny_target_gguf):
    _, _, res = sweep_run
    sweep = res["target_types"]
    assert sweep["source_type"] == "F32" == target_types.file_type(tiny_target_gguf)
    for t, qtype in zip(sweep["by_type"], TYPES):
        path = cache / "targets" / f"{tiny_target_gguf.stem}-{target_types.cache_key(tiny_target_gguf)}-{qtype}.gguf"
        assert t["type"] == qtype and t["requantized"] is True and t["target"] == str(path)
        assert target_types.file_type(path) == qtype
        tensors = gguf.GGUFReader(path).tensors
        # every matrix in the requested type, the norms in f32 (llama.cpp's rule), nothing else
        assert {x.tensor_type for x in tensors if len(x.shape) == 2} == {gguf.GGMLQuantizationType[qtype]}
        assert {x.tensor_type for x in tensors if len(x.shape) == 1} == {gguf.GGMLQuantizationType.F32}
        assert t["tensor_types"] == {"F32": 17, qtype: 30} and sum(t["tensor_types"].values()) == len(tensors)


def test_the_cache_is_reused_and_the_input_type_is_not_requantized(sweep_run, cache, tiny_target_gguf, monkeypatch):
    _, _, res = sweep_run
    made = {t["type"]: t["target"] for t in res["target_types"]["by_type"]}
    before = {q: (p, os.stat(p).st_mtime_ns) for q, p in made.items()}

    def no_quantize(*args, **kwargs):
        raise AssertionError("llama-quantize ran again")

    monkeypatch.setattr(peers, "quantize", no_quantize)
    for qtype in TYPES:
        path, requantized = target_types.typed_target(tiny_target_gguf, qtype)
        assert (str(path), path.stat().st_mtime_ns) == before[qtype] and requantized is True
        assert path.parent == cache_dir() / "targets"
    assert target_types.typed_target(tiny_target_gguf, "F32") == (tiny_target_gguf, False)
    assert sorted(p.name for p in (cache / "targets").iterdir()) == sorted(
        f"{tiny_target_gguf.stem}-{target_types.cache_key(tiny_target_gguf)}-{q}.gguf" for q in TYPES)


def test_the_json_has_every_types_rows(sweep_run):
    rc, _, res = sweep_run
    assert rc == 0
    assert set(res) == {"schema", "meta", "settings", "target_types", "command"}  # only the sweep ran
    assert res["schema"] == "dflash-llama-bench/1"
    sweep = res["target_types"]
    assert sweep["schema"] == "dflash-llama-bench-target-types/2" and sweep["types"] == TYPES
    assert sweep["prompts"] == ["HumanEval/0", "HumanEval/163"] and sweep["stopped_by_budget"] is False
    assert sweep["block_size"] == 8 and [t["type"] for t in sweep["by_type"]] == TYPES
    rows = sweep["rows"]
    # prompts outer, types inner (rotated per prompt), the three methods in their fixed order
    assert [(r["prompt"], r["type"], r["method"]) for r in rows] == [
        (p, q, m) for p, types in (("HumanEval/0", TYPES), ("HumanEval/163", TYPES[::-1])) for q in types
        for m in ("runtime-ar", "dflash-auto", "dflash-pick")]
    for t in sweep["by_type"]:
        cm = t["cost_model"]
        assert t["pick"] == cm["pick"]["n_draft"] and 1 <= t["pick"] <= 7
        assert sorted(map(int, t["verify_cost"])) == list(range(2, 9))  # k = 2..B from N = 1..B-1
        costs = {c["n_draft"] + 1: c["verify_ms"] for c in cm["costs"]}
        for k, v in t["verify_cost"].items():
            assert v == pytest.approx(costs[int(k)] / cm["autoregressive_step_ms"]) and v > 0
        assert t["decode_tokens_per_second"] == pytest.approx(1000 / cm["autoregressive_step_ms"])
        lb = t["llama_bench_verify_cost"]  # the pinned llama-bench on the same file
        # measured speeds on a shared machine: shape and sign only, never a timing bound (the ratios go to reports)
        assert list(lb) == ["2", "4", "8"] and all(v > 0 and math.isfinite(v) for v in lb.values())
        mine = [r for r in rows if r["type"] == t["type"]]

        def speed(m, mine=mine):
            rs = [r for r in mine if r["method"] == m]
            return 1000 * sum(r["decode_tokens"] for r in rs) / sum(r["decode_ms"] for r in rs)

        for m in ("dflash-auto", "dflash-pick"):
            it = t["methods"][m]
            assert it["prompts"] == 2 and it["tokens_per_second"] == pytest.approx(speed(m))
            assert it["ratio_vs_runtime_ar"] == pytest.approx(speed(m) / speed("runtime-ar"))


def test_the_ceilings_bound_every_n(sweep_run):
    """The ceiling of a type is the best E[tokens](N) / step cost over N, from its own cost model: with
    the verify alone (a free draft) and with the whole measured step."""
    _, _, res = sweep_run
    for t in res["target_types"]["by_type"]:
        cm, c = t["cost_model"], t["ceiling"]
        step = {x["n_draft"]: x for x in cm["costs"]}
        free = {p["n_draft"]: p["expected_tokens"] * cm["autoregressive_step_ms"] / step[p["n_draft"]]["verify_ms"]
                for p in cm["predictions"]}
        whole = {p["n_draft"]: p["expected_tokens"] * cm["autoregressive_step_ms"] / step[p["n_draft"]]["step_ms"]
                 for p in cm["predictions"]}
        assert sorted(free) == list(range(1, 8))
        assert c["free_draft"] == pytest.approx(max(free.values())) == pytest.approx(free[c["free_draft_n"]])
        assert c["measured_draft"] == pytest.approx(max(whole.values())) == pytest.approx(whole[c["measured_draft_n"]])
        assert c["measured_draft"] < c["free_draft"]  # a draft step costs something
        # the pick maximises the same prediction
        assert whole[t["pick"]] == pytest.approx(c["measured_draft"])


def test_every_dflash_row_is_exact(sweep_run):
    _, _, res = sweep_run
    sweep = res["target_types"]
    for r in sweep["rows"]:
        assert r["tokens_per_second"] > 0 and (r["n_tokens"] == 12 or r["stop_reason"] == "stop_token")
        if r["method"] != "runtime-ar":
            assert r["exact"] is True and r["first_difference"] is None, r
            assert r["steps"] > 0 and r["tau"] >= 1.0
    for t in sweep["by_type"]:
        assert t["methods"]["dflash-auto"]["exact"] == t["methods"]["dflash-pick"]["exact"] == 2
    assert target_types.inexact_rows(sweep) == []


def test_the_auto_row_runs_what_the_json_says(sweep_run, tiny_draft_gguf):
    """The `dflash-auto` rows ran Runtime.generate with `auto_request`, the adaptive loop (whose choices
    follow its timings, so only the tokens are compared)."""
    _, _, res = sweep_run
    sweep = res["target_types"]
    t = sweep["by_type"][0]
    rt = Runtime(t["target"], str(tiny_draft_gguf), n_threads=1, n_ctx=res["settings"]["n_ctx"])
    row = next(r for r in sweep["rows"] if r["type"] == t["type"] and r["method"] == "dflash-auto")
    text = next(p.text for p in prompts.load("humaneval") if p.id == row["prompt"])
    assert sweep["auto_request"] == {"draft_max": "auto"}
    g = rt.generate(rt.tokenize(text), 12, block_size=8, **sweep["auto_request"])
    assert g.tokens == rt.autoregressive(rt.tokenize(text), 12).tokens and len(g.tokens) == row["n_tokens"]
    assert row["policy"]["plain_steps"] + row["policy"]["draft_steps"] == row["steps"]


def test_report_and_plot(sweep_run):
    _, out, res = sweep_run
    assert {p.name for p in out.iterdir()} == {"bench.json", "bench.md", "target_types.png"}
    assert (out / "target_types.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    cmd = res["command"]
    assert f"```\n{cmd}\n```" in md and "![target_types.png](target_types.png)" in md
    assert cmd.startswith("dflash-llama bench -m ") and "--limit 2 -n 12 --target-types Q8_0,F16 -t 1" in cmd
    for absent in ("--server", "--ngram-types", "--native", "--block-sizes"):  # the sweep alone
        assert absent not in cmd
    assert "## Target weight types (`--target-types`)" in md and "**no**" not in md
    for t in res["target_types"]["by_type"]:
        assert f"| {t['type']} | requantized | " in md
        c = t["ceiling"]
        assert (f"| {c['free_draft']:.2f}x (N={c['free_draft_n']}) | "
                f"{c['measured_draft']:.2f}x (N={c['measured_draft_n']}) |") in md
    by = res["target_types"]["by_type"]
    assert "The pinned `llama-bench -p 1,2,4,8 -n 0 -fa 0` on the same targets" in md
    assert "; ".join(f"{t['type']} " + " / ".join(f"{v:.2f}" for v in t["llama_bench_verify_cost"].values())
                     for t in by) + " (k = 2 / 4 / 8)." in md
    top = max(by, key=lambda t: t["ceiling"]["free_draft"])
    assert (f"the highest ceiling is {top['ceiling']['free_draft']:.2f}x with a free draft ({top['type']}, "
            f"N={top['ceiling']['free_draft_n']})") in md


def test_an_inexact_row_exits_3(cache, tiny_target_gguf, tiny_draft_gguf, tmp_path, monkeypatch, capsys):
    """A DFlash generation whose tokens differ from plain decoding makes the sweep exit 3, naming the row."""
    real = Runtime.generate

    def wrong_last_token(self, *args, **kwargs):
        g = real(self, *args, **kwargs)
        g.tokens[-1] = (g.tokens[-1] + 1) % self.n_vocab
        return g

    monkeypatch.setattr(Runtime, "generate", wrong_last_token)
    rc = _bench(tiny_target_gguf, tiny_draft_gguf, tmp_path / "bad", "--target-types", "Q8_0", "--limit", "1")
    assert rc == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dflash-llama bench: error: 2 speculative rows of our runtime differ from plain greedy "
                          "decoding (first: dflash-auto on target type Q8_0 on HumanEval/0, at token 11)")
    res = json.loads((tmp_path / "bad" / "bench.json").read_text())
    assert [r["exact"] for r in res["target_types"]["rows"] if r["method"] != "runtime-ar"] == [False, False]
    assert "**no**" in (tmp_path / "bad" / "bench.md").read_text()


def test_bad_type_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--target-types", "Q8_0,Q9_9"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dflash-llama bench: error: argument --target-types: "
                                                   "unknown target type 'Q9_9'; choose from F32,F16,BF16,Q8_0,")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--target-types", ","])
    assert e.value.code == 2 and "unknown target type ','" in capsys.readouterr().err


def test_parse_types():
    assert target_types.parse_types("q4_1, Q8_0,f16,Q8_0") == ["Q4_1", "Q8_0", "F16"]


def test_asking_for_more_runs_the_benchmark_too(cache, tiny_target_gguf, tiny_draft_gguf, tmp_path):
    """--target-types with --ngram-types: the benchmark (n-gram asked, native and server not) and the sweep."""
    out = tmp_path / "both"
    # two pilot prompts: the cost model's plot needs an acceptance curve over the whole block
    rc = _bench(tiny_target_gguf, tiny_draft_gguf, out, "--target-types", "F32", "--ngram-types", "ngram-simple",
                "--block-sizes", "2", "--pilot-prompts", "2")
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    assert {"summary", "rows", "cost_model", "target_types"} <= set(res) and res["server"] is None
    assert [m["key"] for m in res["methods"]] == ["runtime-ar", "llama-completion", "llama-spec-ar", "runtime-b2",
                                                  "runtime-auto", "runtime-auto-no-ngram",
                                                  f"runtime-b8-n{res['cost_model']['pick']['n_draft']}",
                                                  "ngram-simple"]
    t = res["target_types"]["by_type"][0]
    assert t["type"] == "F32" and t["requantized"] is False and t["target"] == str(tiny_target_gguf)
    assert "--no-native" in res["command"] and "--no-server" in res["command"]
    md = (out / "bench.md").read_text()
    assert "## Summary (all prompts)" in md and "## Target weight types (`--target-types`)" in md
    assert "target_types.png" in {p.name for p in out.iterdir()} and "![cost_model.png](cost_model.png)" in md


def test_prompt_speeds_of_a_file_that_is_no_model_is_a_peer_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(peers.PeerError, match=r"^llama-bench exited with 1:"):
        peers.prompt_speeds(bad, (1, 2), threads=1)
