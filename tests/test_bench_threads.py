"""`dflash-llama bench --thread-study`: each tool at its default thread count and at every fixed one,
quiet and with a core kept busy; its summary from scripted rows; the busy processes end with it."""

from __future__ import annotations

import json
import os

import pytest

from dflash_llama import cli, peers
from dflash_llama.bench import thread_study as ts


def _row(arm: str, prompt: str, tps: float, exact: bool = True, used: int | None = 1) -> dict:
    return {"arm": arm, "prompt": prompt, "decode_tokens": int(tps), "decode_ms": 1000.0, "tokens_per_second": tps,
            "exact": exact, "threads_used": used, "threads": None}


def test_summary_compares_each_default_with_its_best_fixed_count():
    arms = ts.plan([1, 2])
    assert [a.key for a in arms] == ["ours-default", "ours-t1", "ours-t2", "llama-default", "llama-t1", "llama-t2"]
    speeds = {"ours-default": (150, 160), "ours-t1": (150, 150), "ours-t2": (60, 70),
              "llama-default": (70, 80), "llama-t1": (140, 160), "llama-t2": (70, 80)}
    rows = [_row(k, p, v[i], exact=(k, p) != ("llama-t2", "b"), used=2 if k.endswith("t2") or k == "llama-default"
                 else 1) for k, v in speeds.items() for i, p in enumerate("ab")]
    out = ts.summarise(rows, arms)
    assert out["tools"]["dflash-llama"]["default_threads"] == [1]
    assert out["tools"]["llama.cpp"]["default_threads"] == [2]
    assert out["tools"]["dflash-llama"]["same_count_as_best_fixed"] is True
    assert out["tools"]["llama.cpp"]["same_count_as_best_fixed"] is False and out["repeat_spread"] is None
    rows[0]["repeat_tokens_per_second"], rows[1]["repeat_tokens_per_second"] = [100.0, 90.0], [150.0, 120.0, 140.0]
    assert ts.summarise(rows, arms)["repeat_spread"] == pytest.approx((0.1 + 0.2) / 2)
    assert out["arms"]["ours-t2"]["tokens_per_second"] == pytest.approx(65.0)
    assert out["arms"]["llama-t2"]["exact"] == 1 and out["arms"]["ours-t1"]["exact"] == 2
    ours, llama = out["tools"]["dflash-llama"], out["tools"]["llama.cpp"]
    assert ours["best_fixed"] == "ours-t1" and ours["default_vs_best_fixed"] == pytest.approx(155 / 150)
    assert ours["median_prompt_default_vs_best_fixed"] == pytest.approx((1.0 + 160 / 150) / 2)
    assert llama["best_fixed"] == "llama-t1" and llama["default_vs_best_fixed"] == pytest.approx(75 / 150)


def test_the_fastest_of_repeated_runs_counts_and_differing_outputs_are_kept():
    from dflash_llama.bench.runner import fastest_run

    runs = [{"tokens_per_second": 140.0, "_tokens": [1, 2]}, {"tokens_per_second": 151.5, "_tokens": [1, 2]},
            {"tokens_per_second": 150.0, "_tokens": [1, 2]}]
    best = fastest_run(runs)
    assert best["tokens_per_second"] == 151.5 and best["repeat_tokens_per_second"] == [140.0, 151.5, 150.0]
    assert "_repeats_differ" not in best and "repeat_tokens_per_second" not in runs[1]
    assert fastest_run(runs[:1]) is runs[0]
    differ = fastest_run([{"tokens_per_second": 10.0, "_text": "a"}, {"tokens_per_second": 9.0, "_text": "b"}])
    assert differ["_repeats_differ"] is True and differ["_text"] == "a"


def test_thread_counts_and_busy_cores_end_with_the_block():
    assert ts.thread_counts(1) == [1] and ts.thread_counts(2) == [1, 2] and ts.thread_counts(8) == [1, 2, 8]
    ours = [a for a in ts.plan([1, 2]) if a.tool == "dflash-llama"]
    assert [[a.key for a in ts.creation_order(ours, c)] for c in (0, 1, 3)] == [
        ["ours-default", "ours-t1", "ours-t2"], ["ours-t1", "ours-t2", "ours-default"],
        ["ours-default", "ours-t1", "ours-t2"]]
    with ts.busy_cores(1) as procs:
        assert len(procs) == 1 and procs[0].poll() is None  # spinning
    assert procs[0].poll() is not None


def test_peers_without_a_thread_count_leave_it_to_the_tool(tiny_target_gguf):
    cmd = peers.speculative_command(tiny_target_gguf, "x", 4, "ngram-mod", threads=None, n_ctx=64)
    assert "-t" not in cmd and "-tb" not in cmd and "-td" not in cmd
    cmd = peers.speculative_command(tiny_target_gguf, "x", 4, "ngram-mod", threads=3, n_ctx=64)
    assert cmd[cmd.index("-t") + 1] == "3" and cmd[cmd.index("-tb") + 1] == "3"


@pytest.mark.peer
def test_bench_runs_each_tool_at_its_default_and_every_fixed_count(tiny_target_gguf, tiny_draft_gguf, tmp_path):
    """With --repeat 2: every row of the main loop and of the study is the faster of its two runs."""
    out = tmp_path / "threads"
    rc = cli.main(["bench", "--target", str(tiny_target_gguf), "--draft", str(tiny_draft_gguf), "--limit", "1",
                   "-n", "6", "-t", "1", "--block-sizes", "2", "--ngram-types", "none", "--no-native", "--no-server",
                   "--pilot-prompts", "1", "--calibration-tokens", "4", "--thread-study", "--thread-prompts", "1",
                   "--repeat", "2", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    assert res["settings"]["repeat"] == 2 and "--repeat 2" in res["command"]
    for r in res["rows"] + [r for c in res["threads"]["conditions"] for r in c["rows"]]:
        assert len(r["repeat_tokens_per_second"]) == 2 and r["tokens_per_second"] == max(r["repeat_tokens_per_second"])
        assert r["exact"] and "repeats_differ" not in r
    study = res["threads"]
    counts = ts.thread_counts()
    assert study["prompts"] == ["HumanEval/0"] and study["thread_counts"] == counts
    assert [c["busy_cores"] for c in study["conditions"]] == [0, 1]
    ours = [a for a in ts.plan(counts) if a.tool == "dflash-llama"]
    for i, c in enumerate(study["conditions"]):
        assert c["created"] == [a.key for a in ts.creation_order(ours, i)]
        assert {r["arm"] for r in c["rows"]} == {a.key for a in ts.plan(counts)}
        assert len(c["rows"]) == 2 * (1 + len(counts))
        assert all(r["exact"] for r in c["rows"])
        arms = c["arms"]
        assert arms["ours-default"]["threads_used"][0] in counts  # measured
        assert arms["llama-default"]["threads_used"] == [os.cpu_count()]  # llama.cpp's default: every CPU
        assert all(arms[f"ours-t{n}"]["threads_used"] == [n] for n in counts)
        assert set(c["tools"]) == {"dflash-llama", "llama.cpp"}
    assert "--thread-study --busy-cores 1 --thread-prompts 1" in res["command"]
    md = (out / "bench.md").read_text()
    assert "## Threads: each tool at its default and at every fixed -t" in md
    assert "| 1 | llama-completion, no -t (default) |" in md and "1 busy: `" in md
    assert "each method ran 2 times on each prompt (in rotating order), the fastest run counting" in md
    assert ", each run 2 times per prompt, the fastest counting." in md
    assert "Runs of one method on one prompt spread by " in md


def test_a_thread_study_needs_the_benchmark(capsys, tiny_target_gguf):
    assert cli.main(["bench", "--target", str(tiny_target_gguf), "--target-types", "Q8_0", "--thread-study"]) == 2
    assert "--thread-study runs on the benchmark's prompts after its main loop" in capsys.readouterr().err
