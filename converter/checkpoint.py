"""Reading a published DFlash draft directory: config.json and its safetensors, checked on the way in.

No torch and no safetensors library: the header is parsed here, so a truncated or foreign file is
reported by name before a single byte is converted. What config.json means is
`dflash_llama.schema.DraftHParams.from_hf_config`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class ConversionError(ValueError):
    """Bad input to the converter: the message says what is wrong and, where it can, what to do."""


# safetensors dtype -> (bytes per element, NumPy type of its bytes)
_DTYPES = {"F32": (4, "<f4"), "F16": (2, "<f2"), "BF16": (2, "<u2")}


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: str  # "F32", "F16" or "BF16"
    shape: tuple[int, ...]  # PyTorch order
    path: Path
    start: int  # absolute byte offset in `path`
    nbytes: int

    def load_f32(self) -> np.ndarray:
        """The values as float32 (exact: every source dtype widens losslessly)."""
        with open(self.path, "rb") as f:
            f.seek(self.start)
            raw = f.read(self.nbytes)
        if len(raw) != self.nbytes:
            raise ConversionError(f"{self.path}: truncated while reading tensor {self.name!r}")
        data = np.frombuffer(raw, dtype=_DTYPES[self.dtype][1])
        if self.dtype == "BF16":  # the top half of a float32
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32).reshape(self.shape)


def read_safetensors_header(path: Path) -> list[SourceTensor]:
    """Tensors of one safetensors file, sorted by name (the order the pinned converter uses)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConversionError(f"{path}: not a safetensors file (only {size} bytes)")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise ConversionError(
                    f"{path}: truncated or not a safetensors file: the header claims {n} bytes "
                    f"but the file has {size}")
            header_bytes = f.read(n)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: corrupt safetensors header (not a JSON object)")

    data_start = 8 + n
    tensors = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ConversionError(f"{path}: corrupt safetensors entry for {name!r}") from e
        if dtype not in _DTYPES:
            raise ConversionError(
                f"{path}: tensor {name!r} has dtype {dtype}; only F32, F16 and BF16 drafts are supported")
        if end - begin != math.prod(shape) * _DTYPES[dtype][0]:
            raise ConversionError(f"{path}: corrupt safetensors entry for {name!r} (size does not match shape)")
        if data_start + end > size:
            raise ConversionError(
                f"{path}: truncated: tensor {name!r} needs bytes up to {data_start + end} "
                f"but the file has {size}")
        tensors.append(SourceTensor(name, dtype, shape, path, data_start + begin, end - begin))
    return sorted(tensors, key=lambda t: t.name)


def safetensors_parts(draft_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: from model.safetensors.index.json, else model*.safetensors."""
    index = draft_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            parts = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(f"{index}: unreadable safetensors index ({e})") from e
        missing = [p for p in parts if not (draft_dir / p).is_file()]
        if missing:
            raise ConversionError(f"{index}: lists {', '.join(missing)} which is missing")
        return [draft_dir / p for p in parts]
    parts = sorted(p for p in os.listdir(draft_dir)
                   if p.startswith("model") and p.endswith(".safetensors"))
    if not parts:
        raise ConversionError(f"{draft_dir}: no model*.safetensors file (only safetensors drafts are supported)")
    return [draft_dir / p for p in parts]


def read_tensors(draft_dir: Path) -> dict[str, SourceTensor]:
    """Every tensor of the checkpoint by name, in the pinned converter's order (parts, then names)."""
    tensors: dict[str, SourceTensor] = {}
    for part in safetensors_parts(draft_dir):
        for t in read_safetensors_header(part):
            tensors[t.name] = t
    return tensors


def read_config(draft_dir: Path) -> dict:
    path = draft_dir / "config.json"
    if not draft_dir.is_dir():
        raise ConversionError(f"{draft_dir}: not a directory (expected a DFlash draft checkpoint)")
    if not path.is_file():
        raise ConversionError(f"{path}: not found (expected a DFlash draft checkpoint directory)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: cannot read: {e}") from e
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: not a JSON object")
    return config
