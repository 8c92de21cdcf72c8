"""llama.cpp's native DFlash in three builds of the pin: exact, and how fast.

    python -m dflash_llama.bench.stock_builds [-m TARGET] [-md DRAFT.gguf] [--limit 6] [-n 128]
                                               [--block-sizes 2,4,8] [-t 0]

Builds compared, each `llama-speculative-simple` (`dflash_llama.toolbuild`):

- ours: llamafile's sgemm left out (how our build compiles the pin);
- stock: sgemm on, as llama.cpp builds by default; sgemm serves matmuls of two rows or more, so a
  verify sums in another order than the one-token decode it must reproduce;
- stock, one-row sgemm: sgemm on and serving one-row matmuls too, so a verify and a decode take
  the same kernels.

On each prompt, each build decodes plainly (the tool without drafts: the text its speculative runs
must reproduce) and with DFlash at every block size B (`--draft-max B-1`), the builds in rotating
order. Prints, per build and B, the decode speed over all prompts and on how many prompts the
speculative text is the build's own plain text.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from dflash_llama import fixtures, peers, prompts, toolbuild
from dflash_llama.argtypes import int_list
from dflash_llama.bench.runner import text_matches
from dflash_llama.converter.pair import DECODE_DRAFT_TYPE, DECODE_DRAFT_VOCAB, DEFAULT_DRAFT, resolve_draft

BUILDS = ("ours", "stock", "stock, one-row sgemm")


def tools() -> dict[str, Path | None]:
    """Each build's llama-speculative-simple (None: our build's own)."""
    return {"ours": None, "stock": toolbuild.stock_tool(),
            "stock, one-row sgemm": toolbuild.stock_tool(one_row_sgemm=True)}


def measure(target, draft, texts: list[str], n_predict: int, block_sizes: list[int], threads: int,
            exes: dict[str, Path | None]) -> dict[tuple[str, int], dict]:
    """Per (build, B; B = 0: plain): tokens, decode ms and exact prompts, summed over the prompts."""
    out = {(b, k): {"tokens": 0, "ms": 0.0, "exact": 0} for b in exes for k in [0, *block_sizes]}
    names = list(exes)
    for i, text in enumerate(texts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            exe = exes[name]
            plain = peers.speculative_plain(target, text, n_predict, threads=threads, n_ctx=4096, exe=exe)
            runs = [(0, plain)] + [(b, peers.speculative(target, text, n_predict, "draft-dflash", threads=threads,
                                                         n_ctx=4096, draft=draft, n_max=b - 1, exe=exe))
                                   for b in block_sizes]
            for b, r in runs:
                row = out[name, b]
                row["tokens"] += r.n_tokens
                row["ms"] += r.decode_ms
                row["exact"] += text_matches(r.text, plain.text, plain.stopped)[0]
        print(f"  prompt {i + 1}/{len(texts)} done", file=sys.stderr, flush=True)
    return out


def arm_ratios(runs: dict, arms: tuple[str, str], modes) -> dict[str, tuple[float, float]]:
    """Per mode: arm 0 / arm 1 of `runs` ({(arm, mode): {"tokens": [...], "tokens_per_second": [...]}},
    one entry per prompt), over all tokens and as the median of per-prompt ratios."""
    def total(r: dict) -> float:
        return sum(r["tokens"]) / sum(n / s for n, s in zip(r["tokens"], r["tokens_per_second"]))

    out = {}
    for mode in modes:
        a, b = runs[arms[0], mode], runs[arms[1], mode]
        per = [x / y for x, y in zip(a["tokens_per_second"], b["tokens_per_second"]) if y > 0]
        out[mode] = (total(a) / total(b), statistics.median(per))
    return out


def add_pair_args(p: argparse.ArgumentParser) -> None:
    """-m, -md, --limit and -n, as the side-by-side benches of this folder take them."""
    p.add_argument("-m", "--model", dest="target", help="target GGUF (default: the shipped SmolLM2)")
    p.add_argument("-md", "--model-draft", dest="draft",
                   help="DFlash draft GGUF (default: the shipped draft, converted as `dflash-llama run` does)")
    p.add_argument("--limit", type=int, default=6, help="HumanEval prompts, spread over the set (default 6)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens per generation (default 128)")


def pair_inputs(args: argparse.Namespace) -> tuple[Path, Path, list[str]]:
    """The target, the draft and the HumanEval prompt texts that add_pair_args' flags name."""
    target = args.target or fixtures.smollm2_gguf()
    draft = args.draft or resolve_draft(DEFAULT_DRAFT, target, DECODE_DRAFT_TYPE, DECODE_DRAFT_VOCAB)
    return target, draft, [q.text for q in prompts.spread(prompts.humaneval(), args.limit)]


def two_arm_main(argv: list[str] | None, prog: str, doc: str, measure, arms: tuple[str, str], modes,
                 heading: tuple[str, str, str], exact_what: str, extra=None) -> int:
    """The command line of a bench of two arms side by side (huge_pages, dot_cols): the pair's flags,
    -t and --repeat; `measure(target, draft, texts, n_predict, threads, repeat)` returns {"runs":
    {(arm, mode): ...}, "exact": bool}; prints `extra(res)` if given, then per mode both arms' median
    speeds and arm 0 / arm 1 (`heading`: the two arms' column names and the ratio's), and whether
    every run was exact (`exact_what`: what that means)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
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
        target, draft, texts = pair_inputs(args)
        res = measure(target, draft, texts, args.n_predict, args.threads, args.repeat)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1
    if extra is not None:
        print(extra(res))
    print(f"| mode | {heading[0]} tok/s (median prompt) | {heading[1]} tok/s (median prompt) | {heading[2]}, "
          "all tokens | median per prompt |")
    print("|---|---:|---:|---:|---:|")
    for mode, (total, median) in arm_ratios(res["runs"], arms, modes).items():
        speed = [statistics.median(res["runs"][arm, mode]["tokens_per_second"]) for arm in arms]
        print(f"| {mode} | {speed[0]:.1f} | {speed[1]:.1f} | {total:.3f} | {median:.3f} |")
    print(f"exact: {'yes' if res['exact'] else 'NO'} ({exact_what})")
    return 0 if res["exact"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_llama.bench.stock_builds", description=__doc__.split("\n")[0])
    add_pair_args(p)
    p.add_argument("--block-sizes", default="2,4,8", type=lambda t: int_list(t, "--block-sizes", 2),
                   help="DFlash block sizes (default 2,4,8)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default 0: all)")
    args = p.parse_args(argv)
    block_sizes = args.block_sizes
    if args.limit < 1 or args.n_predict < 2:
        p.error("--limit must be at least 1 and -n at least 2")
    if args.draft and not Path(args.draft).is_file():
        p.error(f"-md {args.draft}: no such file")
    try:
        target, draft, texts = pair_inputs(args)
        res = measure(target, draft, texts, args.n_predict, block_sizes, args.threads, tools())
    except (OSError, ValueError, RuntimeError, peers.PeerError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1
    print("| build | plain tok/s | " + " | ".join(f"B={b} tok/s | exact" for b in block_sizes) + " |")
    print("|---|---:|" + "---:|---:|" * len(block_sizes))
    for name in BUILDS:
        cells = [f"{1000 * res[name, 0]['tokens'] / res[name, 0]['ms']:.1f}"]
        for b in block_sizes:
            r = res[name, b]
            cells += [f"{1000 * r['tokens'] / r['ms']:.1f}", f"{r['exact']}/{len(texts)}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
