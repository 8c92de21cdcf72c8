"""Threads, side by side (`dflash-llama bench --thread-study`): each tool at its default thread count
and at every fixed count, on a quiet machine and with cores kept busy by other processes.

On a small CPU, ggml's threads wait for each other at every node: when another process holds a
core, two threads decode slower than one. Our runtime measures its thread count when -t is not
given (runtime/engine.h); this phase checks that choice against every fixed count, and shows
llama.cpp's tools at theirs:

- `ours-default`: our default loop (`--draft-max auto`, no -t), a new Runtime in each condition, as
  a new run would be: it measures its threads before its first generation, under that condition;
- `ours-t{N}`: the same loop with -t N;
- `llama-default`, `llama-t{N}`: llama-completion (plain decoding) with no -t (llama.cpp's default)
  and with -t N.

A busy core is a process spinning in a loop (`busy_cores`). Methods rotate per prompt as in the main
loop, and with `--repeat N` each runs N times per prompt, the fastest counting (runner.fastest_run).
Every row is checked against the main loop's reference for its prompt: our tokens against our plain
decoding's, llama-completion's text against llama-completion's at the run's -t (with repeats: every
run).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

from dflash_llama import peers
from dflash_llama.prompts import Prompt

SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[list[subprocess.Popen]]:
    """`n` processes that each keep a core busy until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def thread_counts(n_cpus: int | None = None) -> list[int]:
    """The fixed counts to compare: 1, 2 and all CPUs (as the runtime measures), without repeats."""
    n = n_cpus or os.cpu_count() or 1
    return sorted({c for c in (1, 2, n) if c <= n})


@dataclass(frozen=True)
class Arm:
    tool: str  # "dflash-llama" (our default loop) or "llama.cpp" (llama-completion)
    threads: int | None  # None: the tool's default

    @property
    def key(self) -> str:
        who = "ours" if self.tool == "dflash-llama" else "llama"
        return f"{who}-{'default' if self.threads is None else f't{self.threads}'}"

    @property
    def label(self) -> str:
        who = "dflash-llama default loop" if self.tool == "dflash-llama" else "llama-completion"
        return f"{who}, {'no -t (default)' if self.threads is None else f'-t {self.threads}'}"


def plan(counts: list[int]) -> list[Arm]:
    return [Arm(tool, t) for tool in ("dflash-llama", "llama.cpp") for t in [None, *counts]]


def creation_order(arms: list[Arm], condition: int) -> list[Arm]:
    """The order in which one condition creates our Runtimes: rotated by one per condition, so that no
    arm is always the first-created (whose memory the process takes first)."""
    k = condition % len(arms) if arms else 0
    return arms[k:] + arms[:k]


def _speed(rows: list[dict]) -> float | None:
    ms = sum(r["decode_ms"] for r in rows)
    return 1000.0 * sum(r["decode_tokens"] for r in rows) / ms if ms > 0 else None


def summarise(rows: list[dict], arms: list[Arm]) -> dict:
    """Per arm: speed over all tokens and exactness; per tool: its best fixed count, and its default
    against it (over all tokens and the median of per-prompt ratios), with the count the default used;
    with repeats, how far one arm's runs on one prompt spread (the median of (fastest - slowest) /
    fastest): a default that chose the best fixed count is that setting, and its ratio to it is noise
    of about that size."""
    by = {a.key: [r for r in rows if r["arm"] == a.key] for a in arms}
    arms_out = {a.key: {"label": a.label, "tool": a.tool, "threads": a.threads, "prompts": len(by[a.key]),
                        "exact": sum(r["exact"] for r in by[a.key]), "tokens_per_second": _speed(by[a.key]),
                        "threads_used": sorted({r["threads_used"] for r in by[a.key] if r["threads_used"]})}
                for a in arms}
    tools = {}
    for tool in ("dflash-llama", "llama.cpp"):
        fixed = [a for a in arms if a.tool == tool and a.threads is not None and arms_out[a.key]["tokens_per_second"]]
        default = next(a for a in arms if a.tool == tool and a.threads is None)
        if not fixed or not arms_out[default.key]["tokens_per_second"]:
            continue
        best = max(fixed, key=lambda a: arms_out[a.key]["tokens_per_second"])
        d = {r["prompt"]: r for r in by[default.key]}
        per = [d[r["prompt"]]["tokens_per_second"] / r["tokens_per_second"] for r in by[best.key]
               if r["prompt"] in d and r["tokens_per_second"] and d[r["prompt"]]["tokens_per_second"]]
        used = arms_out[default.key]["threads_used"]
        tools[tool] = {"default": default.key, "best_fixed": best.key,
                       "default_threads": used, "same_count_as_best_fixed": used == [best.threads],
                       "default_vs_best_fixed": arms_out[default.key]["tokens_per_second"]
                       / arms_out[best.key]["tokens_per_second"],
                       "median_prompt_default_vs_best_fixed": statistics.median(per) if per else None}
    spreads = [(max(v) - min(v)) / max(v) for r in rows if len(v := r.get("repeat_tokens_per_second") or []) > 1
               and min(v) > 0]
    return {"arms": arms_out, "tools": tools,
            "repeat_spread": statistics.median(spreads) if spreads else None}


class ThreadStudy:
    """Runs the study on `prompts` against the main loop's references: `ref_tokens[prompt id]` (our plain
    decoding) and `ref_texts[prompt id]` = (llama-completion's text, whether it stopped)."""

    def __init__(self, s, prompts: list[Prompt], tokens: dict[str, list[int]], ref_tokens: dict[str, list[int]],
                 ref_texts: dict[str, tuple[str, bool]], busy: int,
                 progress: Callable[[int, str], None] = lambda n, what: None):
        self.s, self.prompts, self.tokens = s, prompts, tokens
        self.ref_tokens, self.ref_texts = ref_tokens, ref_texts
        self.conditions = sorted({0, busy})
        self.repeat = s.repeat  # runs of each arm on each prompt; the fastest counts
        self.arms = plan(thread_counts())
        self.progress = progress

    def count_runs(self) -> int:
        return len(self.conditions) * len(self.prompts) * len(self.arms) * self.repeat

    def estimate_s(self, seconds_per_run: float) -> float:
        """Expected length, from what one generation cost in the main loop (a busy core halves a
        -t 2 run's speed: counted as twice)."""
        return seconds_per_run * self.count_runs() * (1.5 if len(self.conditions) > 1 else 1.0)

    def _ours(self, rt, p: Prompt) -> dict:
        from .runner import Method, runtime_row

        g = rt.generate(self.tokens[p.id], self.s.n_predict, draft_max="auto")
        row = runtime_row(Method("runtime-auto", "dflash-llama", "autoregressive"), g)
        return {k: row[k] for k in ("decode_tokens", "decode_ms", "tokens_per_second")} | {
            "exact": g.tokens == self.ref_tokens[p.id], "threads_used": g.threads.n_threads if g.threads else None,
            "threads": g.threads.line() if g.threads else None}

    def _llama(self, arm: Arm, p: Prompt) -> dict:
        from .runner import text_matches

        r = peers.completion(self.s.target, p.text, self.s.n_predict, threads=arm.threads, n_ctx=self.s.n_ctx,
                             n_gpu_layers=self.s.n_gpu_layers)
        return {"decode_tokens": r.n_tokens, "decode_ms": r.decode_ms, "tokens_per_second": r.tokens_per_second,
                "exact": text_matches(r.text, *self.ref_texts[p.id])[0], "threads_used": r.n_threads, "threads": None}

    def run(self) -> dict:
        from dflash_llama import Runtime

        from .runner import fastest_run, rounds

        s = self.s
        out = []
        for c, busy in enumerate(self.conditions):
            with busy_cores(busy):
                ours = creation_order([a for a in self.arms if a.tool == "dflash-llama"], c)
                rts = {a.key: Runtime(s.target, s.draft, n_threads=a.threads, n_ctx=s.n_ctx,
                                      n_gpu_layers=s.n_gpu_layers) for a in ours}
                rows = []
                for i, p in enumerate(self.prompts):
                    runs: dict[str, list[dict]] = {a.key: [] for a in self.arms}
                    for _, order in rounds(self.arms, i, self.repeat):
                        for a in order:
                            runs[a.key].append(self._ours(rts[a.key], p) if a.tool == "dflash-llama"
                                               else self._llama(a, p))
                            self.progress(1, f"threads, {busy} busy: {p.id} {a.key}")
                    for a in self.arms:
                        best = fastest_run(runs[a.key])
                        best["exact"] = all(r["exact"] for r in runs[a.key])
                        rows.append({"prompt": p.id, "arm": a.key, **best})
                del rts  # each condition's runtimes measure their threads anew
            out.append({"busy_cores": busy, "created": [a.key for a in ours], "rows": rows,
                        **summarise(rows, self.arms)})
        return {"prompts": [p.id for p in self.prompts], "thread_counts": thread_counts(),
                "n_predict": s.n_predict, "repeat": self.repeat, "conditions": out}
