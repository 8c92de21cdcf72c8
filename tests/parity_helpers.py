"""Shared by the tests/test_parity_*.py files: a tiny draft for the tiny target, short prompts."""

from __future__ import annotations

from pathlib import Path

from dflash_llama import fixtures
from dflash_llama.converter import convert
from dflash_llama.prompts import Prompt

PROMPTS = [Prompt("fib", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
           Prompt("stack", "class Stack:\n    def push(self, item):\n        ")]

# two layers, GQA 4:2, taps in the middle of the 4-layer tiny target
PAIR_DRAFT = fixtures.TinyDraftConfig(layers=2, heads=4, kv_heads=2, target_layer_ids=[1, 2], block_size=6, seed=31)


def tiny_draft(tmp_path_factory, target_hf: Path, target_gguf: Path, cfg=PAIR_DRAFT,
               outtype: str = "f32", name: str = "draft") -> tuple[Path, Path]:
    """(HF dir, GGUF) of a random draft for the tiny target."""
    root = tmp_path_factory.mktemp(name)
    hf = fixtures.tiny_draft_hf(root / "hf", target_hf, cfg)
    return hf, convert(hf, target_gguf, root / f"{name}-{outtype}.gguf", outtype=outtype)
