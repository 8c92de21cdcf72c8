"""The `dflash-llama` command: one entry point, one subcommand per job.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`;
this file routes to them and turns every error a subcommand raises into one line and an exit code
(cli_args: 2 for usage and input errors, 1 for runtime failures, 3 for an exactness failure).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .cli_args import EXIT_CODES, INPUT_ERRORS, RUNTIME_ERRORS, report_error

# name -> (module implementing it, one-line help)
SUBCOMMANDS = {
    "convert": ("dflash_llama.converter.cli", "convert a Hugging Face DFlash draft to GGUF"),
    "generate": ("dflash_llama.generate_cli", "generate text with DFlash speculative decoding"),
    "parity": ("dflash_llama.parity.cli", "compare reference, runtime and llama.cpp layer by layer"),
    "bench": ("dflash_llama.bench.cli", "measure acceptance and speed against baselines"),
    "train": ("dflash_llama.train.cli", "train a small DFlash draft for a target"),
    "run": ("dflash_llama.run_cli", "the main job: speculative decoding on the embedded default pair"),
    "fetch": ("dflash_llama.fetch_cli", "download a real target GGUF on demand (cached), print its path"),
}


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: `dflash-llama run: error: ... (see --help)`, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    ap = Parser(prog="dflash-llama", description="DFlash speculative decoding on GGUF models.")
    ap.add_argument("--version", action="store_true", help="print versions and exit")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EXIT_CODES)
        modules[name] = importlib.import_module(module_name)
        modules[name].add_arguments(p)
    ap.subcommands = dict(sub.choices)  # name -> its parser
    return ap, modules


def main(argv: list[str] | None = None) -> int:
    ap, modules = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra:  # named by the subcommand that does not know them
        ap.subcommands.get(args.command, ap).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.version:
        import dflash_llama

        print(f"dflash-llama {dflash_llama.__version__} "
              f"(llama.cpp {dflash_llama.llama_cpp_commit()})")
        return 0
    if args.command is None:
        ap.print_help()
        return 2
    try:
        return int(modules[args.command].main(args) or 0)
    except INPUT_ERRORS + RUNTIME_ERRORS as e:
        return report_error(args.command, e)
    except Exception as e:  # a defect of ours: still one line (DFLASH_LLAMA_TRACEBACK=1 shows where)
        if os.environ.get("DFLASH_LLAMA_TRACEBACK"):
            raise
        return report_error(args.command, e)
    except KeyboardInterrupt:
        print(f"dflash-llama {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
