"""ggml's matmul with our multi-column dot products against vec_dot per column: side by side, exact.

    python -m dflash_llama.bench.dot_cols [-m TARGET] [-md DRAFT.gguf] [--limit 6] [-n 128] [-t N]
                                          [--repeat 3]

The build's ggml-cpu takes a verify's columns up to four at a time through runtime/cpu_dot_cols.h,
each column's result bit for bit the vec_dot ggml computes for it alone. Two Runtimes of one pair in
one process, one per arm; before each of its generations the kernels are switched on
(`multi-column`) or off (`vec_dot`, the arithmetic and speed of ggml as pinned) for the process. On
each prompt both decode plainly, with a fixed draft of 7 (a verify of 8 every step) and with the
default loop, `--repeat` times each in alternating order, the fastest run counting. Prints, per
mode, the speed of each arm, multi-column / vec_dot over all tokens and as the median of per-prompt
ratios, and whether every run of both arms decoded the tokens of plain decoding.
"""

from __future__ import annotations

import sys

from dflash_llama.bench.stock_builds import two_arm_main

ARMS = ("multi-column", "vec_dot")
MODES = {"plain": None, "draft of 7": 7, "default loop": "auto"}


def measure(target, draft, texts: list[str], n_predict: int, threads: int | None, repeat: int) -> dict:
    """{"runs": {(arm, mode): {"tokens_per_second": [fastest per prompt], "tokens": [per prompt]}},
    "exact": every run of both arms decoded plain decoding's tokens}."""
    from dflash_llama import Runtime, _core

    was = _core.dot_cols()
    try:
        rts = {}
        for arm in ARMS:
            _core.set_dot_cols(arm == ARMS[0])
            rts[arm] = Runtime(target, draft, n_threads=threads)
        out = {(arm, mode): {"tokens_per_second": [], "tokens": []} for arm in ARMS for mode in MODES}
        same = True
        for i, text in enumerate(texts):
            best: dict = {}
            ref = None
            for rep in range(repeat):
                for arm in ARMS if (i + rep) % 2 == 0 else ARMS[::-1]:
                    _core.set_dot_cols(arm == ARMS[0])
                    for mode, draft_max in MODES.items():
                        rt = rts[arm]
                        g = rt.autoregressive(text, n_predict) if draft_max is None else \
                            rt.generate(text, n_predict, draft_max=draft_max)
                        ref = g.tokens if ref is None else ref
                        same = same and g.tokens == ref
                        ms = g.stats.t_total_ms - g.stats.t_prefill_ms
                        tps = 1000.0 * (g.stats.n_generated - 1) / ms if ms > 0 else 0.0
                        if (arm, mode) not in best or tps > best[arm, mode][0]:
                            best[arm, mode] = (tps, len(g.tokens))
            for key, (tps, n) in best.items():
                out[key]["tokens_per_second"].append(tps)
                out[key]["tokens"].append(n)
    finally:
        _core.set_dot_cols(was)
    return {"runs": out, "exact": same}


def main(argv: list[str] | None = None) -> int:
    return two_arm_main(argv, "python -m dflash_llama.bench.dot_cols", __doc__, measure, ARMS, MODES,
                        ("multi-column", "vec_dot", "multi-column / vec_dot"),
                        "every run of both arms: the tokens of plain decoding")


if __name__ == "__main__":
    sys.exit(main())
