"""GGUF header inspection, read by ggml's own gguf parser (C++, dflash_llama._core)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is ne0, the fastest-moving dimension
    type: str  # ggml type name: "f32", "f16", "bf16", "q8_0", "q4_1", ...
    offset: int  # byte offset inside the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFInfo:
    path: str
    architecture: str
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any] = field(repr=False)
    tensors: list[TensorInfo] = field(repr=False)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value; `key` may omit the `<architecture>.` prefix."""
        if key in self.metadata:
            return self.metadata[key]
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def block_count(self) -> int | None:
        return self.get("block_count")

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"{self.path}: no tensor named {name!r}")


def gguf_info(path: str | os.PathLike) -> GGUFInfo:
    """Architecture, every key-value and every tensor's name, shape and type of a GGUF file.

    Raises ValueError naming the path and the reason for a missing, foreign or truncated file.
    """
    from . import _core

    raw = _core.gguf_info(os.fspath(path))
    return GGUFInfo(
        path=raw["path"],
        architecture=raw["architecture"],
        version=raw["version"],
        alignment=raw["alignment"],
        data_offset=raw["data_offset"],
        metadata=dict(raw["metadata"]),
        tensors=[TensorInfo(n, tuple(s), t, o, b) for n, s, t, o, b in raw["tensors"]],
    )
