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

import argparse
import statistics
import sys
from pathlib import Path

from dflash_llama import fixtures, prompts
from dflash_llama.bench.stock_builds import add_pair_args, arm_ratios
from dflash_llama.converter.pair import DECODE_DRAFT_TYPE, DECODE_DRAFT_VOCAB, DEFAULT_DRAFT, resolve_draft

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
    p = argparse.ArgumentParser(prog="python -m dflash_llama.bench.dot_cols", description=__doc__.split("\n")[0])
    add_pair_args(p)
    p.add_argument("-t", "--threads", type=int, help="CPU threads (default: measured, as the runtime does)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each arm and mode per prompt, the fastest counts "
                                                         "(default 3)")
    args = p.parse_args(argv)
    if args.limit < 1 or args.n_predict < 2 or args.repeat < 1:
        p.error("--limit and --repeat must be at least 1 and -n at least 2")
    if args.draft and not Path(args.draft).is_file():
        p.error(f"-md {args.draft}: no such file")
    try:
        target = args.target or fixtures.smollm2_gguf()
        draft = args.draft or resolve_draft(DEFAULT_DRAFT, target, DECODE_DRAFT_TYPE, DECODE_DRAFT_VOCAB)
        texts = [q.text for q in prompts.spread(prompts.humaneval(), args.limit)]
        res = measure(target, draft, texts, args.n_predict, args.threads, args.repeat)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1
    print("| mode | multi-column tok/s (median prompt) | vec_dot tok/s (median prompt) | multi-column / vec_dot, "
          "all tokens | median per prompt |")
    print("|---|---:|---:|---:|---:|")
    for mode, (total, median) in arm_ratios(res["runs"], ARMS, MODES).items():
        speed = [statistics.median(res["runs"][arm, mode]["tokens_per_second"]) for arm in ARMS]
        print(f"| {mode} | {speed[0]:.1f} | {speed[1]:.1f} | {total:.3f} | {median:.3f} |")
    print(f"exact: {'yes' if res['exact'] else 'NO'} (every run of both arms: the tokens of plain decoding)")
    return 0 if res["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
