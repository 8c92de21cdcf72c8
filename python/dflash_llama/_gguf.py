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

    def read(self, name: str, rows=None):
        """Tensor `name` as a NumPy array in PyTorch order (the ggml shape reversed): i32 / i64 as
        they are, every other type dequantised to float32 by gguf-py. `rows`: of a 2-D tensor, only
        these rows (ne1 indices), read and dequantised alone."""
        import gguf
        import numpy as np

        t = self.tensor(name)
        if t.type in ("i32", "i64"):
            return np.array(np.memmap(self.path, dtype={"i32": "<i4", "i64": "<i8"}[t.type], mode="r",
                                      offset=self.data_offset + t.offset, shape=tuple(reversed(t.shape))))
        try:
            qtype = gguf.GGMLQuantizationType[t.type.upper()]
        except KeyError as e:
            raise ValueError(f"{self.path}: tensor {name} has type {t.type}, unknown to gguf-py") from e
        n_rows = int(np.prod(t.shape[1:], dtype=np.int64))
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_offset + t.offset,
                        shape=(t.nbytes,)).reshape(n_rows, t.nbytes // max(n_rows, 1))
        if rows is not None:
            if len(t.shape) != 2:
                raise ValueError(f"{self.path}: rows of tensor {name} with {len(t.shape)} dimensions")
            raw = raw[np.asarray(rows, dtype=np.int64)]
        try:
            data = gguf.quants.dequantize(raw, qtype)
        except NotImplementedError as e:
            raise ValueError(f"{self.path}: tensor {name}: gguf-py cannot dequantise {t.type}") from e
        shape = (raw.shape[0], t.shape[0]) if rows is not None else tuple(reversed(t.shape))
        return np.array(data, dtype=np.float32).reshape(shape)


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
