"""The flags every `dflash-llama` subcommand shares, spelled as llama.cpp spells them, with one default each.

    -m/--model (alias --target)        the target GGUF
    -md/--model-draft (alias --draft)  the DFlash draft: a GGUF, or a Hugging Face folder (converted once, cached)
    -p/--prompt, -n/--n-predict, -t/--threads, -c/--ctx-size, -s/--seed, --temp, --block-size

Exit codes: 0 success, 1 a runtime failure, 2 a usage or input error (bad flag value, missing or wrong
file), 3 an exactness failure (speculative output differs from plain greedy decoding).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

N_PREDICT = 128  # tokens to generate, as llama-dflash-cli
THREADS = 0  # CPU threads; 0 = all (the runtime's own decoding: unset, the fastest count, measured)
CTX_SIZE = 4096  # context size per sequence, as llama-dflash-cli
SEED = 0
TEMP = 0.0  # greedy

EXIT_RUNTIME, EXIT_USAGE, EXIT_INEXACT = 1, 2, 3
EXIT_CODES = ("exit status: 0 done, 1 runtime failure, 2 usage or input error (bad value, missing or wrong "
              "file), 3 exactness failure (output differs from plain greedy decoding)")
# errors a user causes (a bad value, a missing or wrong file); the runtime's std::invalid_argument
# arrives as ValueError
INPUT_ERRORS = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError)
RUNTIME_ERRORS = (RuntimeError, OSError, subprocess.SubprocessError)


def add_model_args(p: argparse.ArgumentParser, *, target_help: str, draft_help: str | None = None,
                   target_required: bool = False) -> None:
    """-m/--model (alias --target) and, when draft_help is given, -md/--model-draft (alias --draft)."""
    p.add_argument("-m", "--model", "--target", dest="target", metavar="TARGET", required=target_required,
                   help=target_help)
    if draft_help is not None:
        p.add_argument("-md", "--model-draft", "--draft", dest="draft", metavar="DRAFT", help=draft_help)


def add_generation_args(p: argparse.ArgumentParser, *, prompt: str | None = None, ctx: bool = True,
                        measured_threads: bool = False) -> None:
    """-n/--n-predict, -t/--threads and (ctx) -c/--ctx-size, with the shared defaults; -p/--prompt
    when `prompt` is its default (pass "" for no default). measured_threads: -t 0 is the runtime's
    measured thread count when -t is not given (else 0: all CPUs)."""
    if prompt is not None:
        p.add_argument("-p", "--prompt", default=prompt or None,
                       help="prompt" + (" (default: a small coding task)" if prompt else ""))
    p.add_argument("-n", "--n-predict", type=int, default=N_PREDICT,
                   help=f"tokens to generate (default {N_PREDICT})")
    add_threads_arg(p, measured=measured_threads)
    if ctx:
        p.add_argument("-c", "--ctx-size", type=int, default=CTX_SIZE,
                       help=f"context size per sequence (default {CTX_SIZE})")


def add_threads_arg(p: argparse.ArgumentParser, *, measured: bool = False) -> None:
    """-t/--threads (0: all CPUs; measured: unset by default, the runtime measures the fastest count) and -ngl."""
    p.add_argument("-t", "--threads", type=int, default=None if measured else THREADS,
                   help="CPU threads (0 or -1: all; default: measured, the fastest of 1, 2 and all for a plain "
                        "decode and a verify, and again when decoding slows down)" if measured
                   else "CPU threads (default 0: all)")
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=int, default=0, metavar="N",
                   help="target layers on the GPU (default 0; -1: all; a GPU build only); the draft runs "
                        "on the GPU when the target's output layer does")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=TEMP, help="temperature, 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0 = off)")
    add_seed_arg(p, "sampling seed")


def add_seed_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("-s", "--seed", type=int, default=SEED, help=f"{what} (default {SEED})")


def add_block_size_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, help="draft block size (default: the draft's)")


def parse_draft_max(text: str) -> str | int:
    """argparse type of `--draft-max`: 'auto' or an integer >= 1."""
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--draft-max must be 'auto' or an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--draft-max must be at least 1, got {n}")
    return n


def parse_on_off(text: str) -> bool:
    """argparse type of an on|off flag (`--ngram`)."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def add_draft_max_arg(p: argparse.ArgumentParser) -> None:
    """--draft-max auto|N and the adaptive loop's --ngram on|off."""
    p.add_argument("--draft-max", type=parse_draft_max, default="auto", metavar="auto|N",
                   help="what each step verifies: auto (default) chooses, for the highest expected speed on this "
                        "machine, nothing (a plain decode), N drafted tokens, or an n-gram continuation (--ngram); "
                        "N: at most N drafted tokens every step")
    p.add_argument("--ngram", type=parse_on_off, metavar="on|off",
                   help="with --draft-max auto, also verify continuations of the text so far found by n-gram "
                        "lookup, with no draft forward (default: on)")


def add_draft_p_min_arg(p: argparse.ArgumentParser) -> None:
    """A DSpark draft's confidence head: --draft-p-min P, a threshold (llama.cpp's --spec-draft-p-min), and
    --draft-confidence on|off, the adaptive loop's gate."""
    p.add_argument("--draft-p-min", type=finite_float, default=0.0, metavar="P",
                   help="a draft with a confidence head (DSpark): each draft stops before its first slot whose "
                        "confidence is below P (default: 0 = never)")
    p.add_argument("--draft-confidence", type=parse_on_off, metavar="on|off",
                   help="with --draft-max auto and a confidence head (DSpark): cut each draft where its "
                        "calibrated confidences stop paying, before the verify (default: on)")


def finite_float(text: str) -> float:
    """argparse type for a number that must be finite: nan or inf would be silently misread downstream."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def threads(n: int) -> int:
    """A concrete thread count for --threads (0 = all CPUs), for tools that need one."""
    return n if n > 0 else os.cpu_count() or 1


def report_error(command: str, e: BaseException) -> int:
    """Print `dflash-llama <command>: error: ...` on one line and return the exit code for `e`."""
    message = " ".join(str(e).split()) or type(e).__name__
    if not isinstance(e, INPUT_ERRORS + RUNTIME_ERRORS):  # unexpected: the type says what went wrong
        message = f"{type(e).__name__}: {message}"
    print(f"dflash-llama {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE if isinstance(e, INPUT_ERRORS) else EXIT_RUNTIME
