"""The target's weights in huge pages against llama.cpp's mmap of the file: side by side, exact.

    python -m dflash_llama.bench.huge_pages [-m TARGET] [-md DRAFT.gguf] [--limit 6] [-n 128] [-t N]
                                             [--repeat 3]

Two Runtimes of one pair in one process: `Runtime(huge_pages=True)` (the default: the weights read
into memory and collapsed to huge pages, runtime/huge_pages.h) and `huge_pages=False` (the file
mapped, as llama.cpp's tools load it). On each prompt both decode plainly and with the default loop,
`--repeat` times each in alternating order, the fastest run counting (the machine is shared: another
process only ever slows a run down). Prints, per mode, the speed over all prompts, the median of the
per-prompt ratios, and whether both Runtimes decoded the same tokens on every prompt and run.
"""

from __future__ import annotations

import sys

from dflash_llama.bench.stock_builds import two_arm_main

ARMS = ("huge pages", "mapped")
MODES = ("plain", "default loop")


def measure(target, draft, texts: list[str], n_predict: int, threads: int | None, repeat: int) -> dict:
    """{(arm, mode): {"tokens_per_second": [fastest per prompt], "tokens": [per prompt]}}, the huge
    page bytes of each arm, and whether every run of both arms decoded the same tokens."""
    from dflash_llama import Runtime

    rts = {arm: Runtime(target, draft, n_threads=threads, huge_pages=arm == ARMS[0]) for arm in ARMS}
    out = {(arm, mode): {"tokens_per_second": [], "tokens": []} for arm in ARMS for mode in MODES}
    same = True
    for i, text in enumerate(texts):
        best: dict = {}
        for rep in range(repeat):
            for arm in ARMS if (i + rep) % 2 == 0 else ARMS[::-1]:
                for mode in MODES:
                    rt = rts[arm]
                    g = rt.autoregressive(text, n_predict) if mode == "plain" else rt.generate(text, n_predict)
                    ms = g.stats.t_total_ms - g.stats.t_prefill_ms
                    tps = 1000.0 * (g.stats.n_generated - 1) / ms if ms > 0 else 0.0
                    prev = best.get((arm, mode))
                    if prev is not None and prev[1] != g.tokens:
                        same = False
                    if prev is None or tps > prev[0]:
                        best[(arm, mode)] = (tps, g.tokens)
        ref = best[(ARMS[1], "plain")][1]
        same = same and all(tokens == ref for _, tokens in best.values())
        for key, (tps, tokens) in best.items():
            out[key]["tokens_per_second"].append(tps)
            out[key]["tokens"].append(len(tokens))
    return {"runs": out, "huge_page_bytes": {arm: rts[arm].huge_page_bytes for arm in ARMS}, "exact": same}


def main(argv: list[str] | None = None) -> int:
    def pages(res: dict) -> str:
        mib = {arm: res["huge_page_bytes"][arm] / 2**20 for arm in ARMS}
        return f"weights in huge pages: {mib[ARMS[0]]:.0f} MiB (huge pages), {mib[ARMS[1]]:.0f} MiB (mapped)"

    return two_arm_main(argv, "python -m dflash_llama.bench.huge_pages", __doc__, measure, ARMS, MODES,
                        ("huge pages", "mapped", "huge / mapped"),
                        "every run of both Runtimes: the same tokens as plain decoding", extra=pages)


if __name__ == "__main__":
    sys.exit(main())
