"""Planted faults: copies of a good draft GGUF with one deliberate error each, which the harness
must catch and locate (tests/test_parity_faults.py, docs/parity.md)."""

from __future__ import annotations

import os
from pathlib import Path

from dflash_llama import schema as L

from .gguf_edit import copy_gguf


def scale_tensor(src: str | os.PathLike, dst: str | os.PathLike, name: str, factor: float) -> Path:
    """`name` multiplied by `factor` (re-quantised to its type)."""
    _require(src, [name])
    return copy_gguf(src, dst, tensors=lambda n, x: x * factor if n == name else None)


def swap_tensors(src: str | os.PathLike, dst: str | os.PathLike, a: str, b: str) -> Path:
    """Tensors `a` and `b` exchanged (they must have the same shape), e.g. two norms of a layer."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    _require(src, [a, b])
    values = {}
    for t in GGUFReader(str(src)).tensors:
        if t.name in (a, b):
            shape = tuple(reversed([int(x) for x in t.shape]))
            values[t.name] = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
    if values[a].shape != values[b].shape:
        raise ValueError(f"cannot swap {a} {values[a].shape} and {b} {values[b].shape}: shapes differ")
    return copy_gguf(src, dst, tensors=lambda n, x: values[b] if n == a else values[a] if n == b else None)


def shift_target_layers(src: str | os.PathLike, dst: str | os.PathLike, shift: int = -1) -> Path:
    """dflash.target_layers moved by `shift` (-1: the ids written without llama.cpp's + 1)."""
    from dflash_llama import gguf_info

    layers = [int(x) + shift for x in gguf_info(src).metadata[L.TARGET_LAYERS]]
    if min(layers) < 1:
        raise ValueError(f"shifting dflash.target_layers by {shift} gives {layers}: below 1")
    return copy_gguf(src, dst, kv={L.TARGET_LAYERS: layers})


def _require(src, names: list[str]) -> None:
    from dflash_llama import gguf_info

    have = {t.name for t in gguf_info(src).tensors}
    for n in names:
        if n not in have:
            raise ValueError(f"{src} has no tensor {n!r}")
