"""What a draft step costs by the draft's weight type, in units of one plain decode.

    python -m dflash_llama.bench.draft_types [-m TARGET] [-md DRAFT_DIR] [--types f16,q8_0,q4_0]
                                              [--draft-vocabs 0,8192] [--limit 3] [-n 96] [-t 0]

Converts the draft (a Hugging Face checkpoint folder; default: the shipped SmolLM2 draft) once per
type and reduced vocabulary with our converter (cached), then on each prompt decodes plainly and
with DFlash at N = 1 drafted token in a block of 2 positions (as the adaptive loop drafts it) and in
the draft's whole block (as a fixed --draft-max 1 does), and at N = B - 1, checks every DFlash output
against the plain one token for token, and prints per type, vocabulary and N the median draft time per step (block
forward and feature injection), the median verify time per step and the plain decode time they
compare with. Ratios only: every number of a row comes from the same prompts in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from dflash_llama import fixtures, prompts
from dflash_llama.converter.conversion import OUTTYPES
from dflash_llama.converter.pair import DEFAULT_DRAFT, resolve_draft
from dflash_llama.results import first_mismatch
from dflash_llama.runtime import Runtime


class Inexact(RuntimeError):
    """A DFlash output that is not the plain greedy one (exit 3, as the CLIs)."""


def shapes(block_size: int) -> list[tuple[int, int]]:
    """(N, block) pairs measured: N = 1 in a block of 2 positions, as the adaptive loop drafts it
    (its block holds only the positions it verifies), and in the draft's whole block, as a fixed
    draft_max drafts it; N = B - 1 in the whole block."""
    return list(dict.fromkeys([(1, 2), (1, block_size), (block_size - 1, block_size)]))


def measure(rt: Runtime, texts: list[str], n_predict: int,
            n_drafts: list[tuple[int, int]]) -> dict[tuple[int, int], dict]:
    """Per (N, block): median draft ms and verify ms per step, median plain ms per token, mean tau."""
    rows: dict[tuple[int, int], list[tuple[float, float, float, float]]] = {nb: [] for nb in n_drafts}
    for text in texts:
        plain = rt.autoregressive(text, n_predict)
        plain_ms = 1000.0 / plain.stats.tokens_per_second  # decode only, prefill excluded, as everywhere
        for n, block in n_drafts:
            g = rt.generate(text, n_predict, draft_max=n, block_size=block)
            if g.tokens != plain.tokens:
                raise Inexact(f"DFlash at N={n} (block {block}) differs from plain decoding at token "
                              f"{first_mismatch(plain.tokens, g.tokens)} on {text[:40]!r}")
            steps = max(1, len(g.steps))
            rows[n, block].append((g.stats.t_draft_ms / steps, g.stats.t_verify_ms / steps, plain_ms, g.tau))
    return {nb: {"draft_ms": statistics.median(r[0] for r in rs), "verify_ms": statistics.median(r[1] for r in rs),
                 "plain_ms": statistics.median(r[2] for r in rs), "tau": statistics.mean(r[3] for r in rs)}
            for nb, rs in rows.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_llama.bench.draft_types", description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", dest="target", help="target GGUF (default: the shipped SmolLM2)")
    p.add_argument("-md", "--model-draft", dest="draft", help="draft folder (default: the shipped SmolLM2 draft)")
    p.add_argument("--types", default="f16,q8_0,q4_0", help="draft weight types (default f16,q8_0,q4_0)")
    p.add_argument("--draft-vocabs", default="0", metavar="K,...",
                   help="reduced draft vocabularies to convert each type with (convert --draft-vocab; "
                        "0: the whole vocabulary; default 0)")
    p.add_argument("--limit", type=int, default=3, help="HumanEval prompts, spread over the set (default 3)")
    p.add_argument("-n", "--n-predict", type=int, default=96, help="tokens per generation (default 96)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default 0: all)")
    args = p.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in OUTTYPES]
    if unknown or not types:
        p.error(f"--types {args.types!r}: choose from {', '.join(OUTTYPES)}")
    try:
        vocabs = [int(v) for v in args.draft_vocabs.split(",")]
    except ValueError:
        vocabs = [-1]
    if any(v < 0 for v in vocabs):
        p.error(f"--draft-vocabs {args.draft_vocabs!r}: expected sizes >= 0, comma-separated")
    if args.limit < 1 or args.n_predict < 2:
        p.error("--limit must be at least 1 and -n at least 2")
    if args.draft and not Path(args.draft).is_dir():
        p.error(f"-md {args.draft}: expected a draft checkpoint folder (each type is converted from it)")
    try:
        return run(args, types, vocabs)
    except (OSError, ValueError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 3 if isinstance(e, Inexact) else 1


def run(args: argparse.Namespace, types: list[str], vocabs: list[int]) -> int:
    target = args.target or fixtures.smollm2_gguf()
    texts = [q.text for q in prompts.spread(prompts.humaneval(), args.limit)]
    print("| draft type | draft vocabulary | N | block | draft ms | draft / plain decode | verify ms | plain decode ms "
          "| tau | exact |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for outtype in types:
        for vocab in vocabs:
            draft = resolve_draft(args.draft or DEFAULT_DRAFT, target, outtype, draft_vocab=vocab)
            rt = Runtime(target, draft, n_threads=args.threads)
            for (n, block), m in measure(rt, texts, args.n_predict, shapes(rt.block_size)).items():
                share = m["draft_ms"] / m["plain_ms"]
                print(f"| {outtype} | {vocab or 'all'} | {n} | {block} | {m['draft_ms']:.1f} | {share:.2f} | "
                      f"{m['verify_ms']:.1f} | {m['plain_ms']:.1f} | {m['tau']:.2f} | {len(texts)}/{len(texts)} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
