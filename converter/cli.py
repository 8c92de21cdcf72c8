"""`dflash-llama convert DRAFT_DIR -m TARGET -o OUT.gguf [--outtype TYPE]`.

As llama.cpp's convert_hf_to_gguf.py, the checkpoint to convert is the positional argument; the
target it is converted for is `-m` (alias `--target`), as on every other subcommand.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from dflash_llama.cli_args import add_model_args

from .conversion import NATIVE_OUTTYPES, OUTTYPES, convert


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("draft", metavar="DRAFT_DIR", help="DFlash draft checkpoint (config.json + safetensors)")
    add_model_args(p, target_required=True,
                   target_help="the target model: its GGUF file or its Hugging Face directory "
                               "(tokenizer and shape checks come from it)")
    p.add_argument("-o", "--outfile", required=True, metavar="OUT.gguf", help="output GGUF path")
    p.add_argument("--outtype", default="auto", choices=OUTTYPES, metavar="TYPE",
                   help=f"{', '.join(NATIVE_OUTTYPES)} (written directly), other llama-quantize types "
                        f"({', '.join(t for t in OUTTYPES if t not in NATIVE_OUTTYPES and t != 'auto')}) "
                        "via an f32 conversion; auto (default): the draft's own 16-bit type")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="K",
                   help="a reduced draft vocabulary: the head keeps K target tokens (the end-of-generation "
                        "tokens, then the tokenizer's most likely), a d2t as the pinned llama.cpp reads it; "
                        "0 (default): the target's whole head")


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    warnings = logging.StreamHandler(sys.stderr)
    warnings.setFormatter(logging.Formatter("dflash-llama convert: warning: %(message)s"))
    log = logging.getLogger("dflash_llama.converter")
    log.addHandler(warnings)
    log.propagate = False
    try:
        out = convert(args.draft, args.target, args.outfile, args.outtype, args.draft_vocab)  # ConversionError: exit 2
    finally:
        log.removeHandler(warnings)
        log.propagate = True
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    return 0
