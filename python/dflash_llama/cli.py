"""The `dflash-llama` command: one entry point, one subcommand per job.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`;
this file only routes to them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module implementing it, one-line help)
SUBCOMMANDS = {
    "convert": ("dflash_llama.converter.cli", "convert a Hugging Face DFlash draft to GGUF"),
    "generate": ("dflash_llama.generate_cli", "generate text with DFlash speculative decoding"),
    "parity": ("dflash_llama.parity.cli", "compare reference, runtime and llama.cpp layer by layer"),
    "bench": ("dflash_llama.bench.cli", "measure acceptance and speed against baselines"),
    "train": ("dflash_llama.train.cli", "train a small DFlash draft for a target"),
    "run": ("dflash_llama.run_cli", "the main job: speculative decoding on the embedded default pair"),
}


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            return None  # not written yet
        raise


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    ap = argparse.ArgumentParser(prog="dflash-llama",
                                 description="DFlash speculative decoding on GGUF models.")
    ap.add_argument("--version", action="store_true", help="print versions and exit")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = _load(module_name)
        if module is not None:
            module.add_arguments(p)
        modules[name] = module
    return ap, modules


def main(argv: list[str] | None = None) -> int:
    ap, modules = build_parser()
    args, extra = ap.parse_known_args(argv)
    if args.version:
        import dflash_llama

        print(f"dflash-llama {dflash_llama.__version__} "
              f"(llama.cpp {dflash_llama.llama_cpp_commit()})")
        return 0
    if args.command is None:
        ap.print_help()
        return 2
    module = modules[args.command]
    if module is None:
        print(f"dflash-llama {args.command}: not implemented yet", file=sys.stderr)
        return 2
    if extra:
        ap.parse_args(argv)  # let argparse report the unknown arguments, exit 2
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
