"""Reading a published DFlash draft directory: config.json and its safetensors, checked on the way in.

No torch and no safetensors library: the header is parsed here, as strictly as that library reads
it (its `SafeTensors::read_metadata` and `Metadata::validate`), so a truncated, foreign or doctored
file is reported by name before a single byte is converted. What config.json means is
`dflash_llama.schema.DraftHParams.from_hf_config`.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class ConversionError(ValueError):
    """Bad input to the converter: the message says what is wrong and, where it can, what to do."""


# safetensors dtype -> (bytes per element, NumPy type of its bytes): the ones a draft may have
_DTYPES = {"F32": (4, "<f4"), "F16": (2, "<f2"), "BF16": (2, "<u2"), "I64": (8, "<i8"), "BOOL": (1, "|u1")}
# the vocabulary maps of a reduced vocabulary, and their one dtype each
INDEX_DTYPES = {"d2t": "I64", "t2d": "BOOL"}
# every other dtype the safetensors library knows (refused as unsupported, not as corrupt)
_OTHER_DTYPES = {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "I32", "U32", "F64",
                 "I64", "U64", "C64", "F4", "F6_E2M3", "F6_E3M2"}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's MAX_HEADER_SIZE
MAX_JSON_BYTES = 64 << 20  # config.json / the index: published ones are < 10 MB (index of a 600B model)
MAX_JSON_DEPTH = 64  # published configs nest 3 deep, safetensors headers 2; serde_json allows 128


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: str  # "F32", "F16" or "BF16" (INDEX_DTYPES: "I64" for a d2t, "BOOL" for a t2d)
    shape: tuple[int, ...]  # PyTorch order
    path: Path
    start: int  # absolute byte offset in `path`
    nbytes: int

    def load_ints(self) -> np.ndarray:
        """An I64 or BOOL tensor's values (int64)."""
        with open(self.path, "rb") as f:
            f.seek(self.start)
            raw = f.read(self.nbytes)
        if len(raw) != self.nbytes:
            raise ConversionError(f"{self.path}: truncated while reading tensor {self.name!r}")
        return np.frombuffer(raw, dtype=_DTYPES[self.dtype][1]).astype(np.int64).reshape(self.shape)

    def load_f32(self) -> np.ndarray:
        """The values as float32 (exact: every float source dtype widens losslessly)."""
        if self.dtype in INDEX_DTYPES.values():
            raise ConversionError(f"{self.path}: tensor {self.name!r} holds integers, not weights")
        with open(self.path, "rb") as f:
            f.seek(self.start)
            raw = f.read(self.nbytes)
        if len(raw) != self.nbytes:
            raise ConversionError(f"{self.path}: truncated while reading tensor {self.name!r}")
        data = np.frombuffer(raw, dtype=_DTYPES[self.dtype][1])
        if self.dtype == "BF16":  # the top half of a float32
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32).reshape(self.shape)


# --- JSON -----------------------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.S)  # an unterminated string runs to the end: linear time
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep [ and { nest outside strings (stops counting past `limit`): checked before json.loads,
    which recurses once per level."""
    marks = np.frombuffer(_NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii"), np.uint8)
    depth = deepest = 0
    for i in range(0, len(marks), 1 << 20):
        chunk = marks[i:i + (1 << 20)]
        run = depth + np.cumsum(np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1))
        deepest, depth = max(deepest, int(run.max())), int(run[-1])
        if deepest > limit:
            break
    return deepest


def _strict_float(s: str) -> float:
    x = float(s)
    if not math.isfinite(x):
        raise ValueError(f"number {s[:40]} is out of range")
    return x


def _no_constant(s: str):
    raise ValueError(f"{s} is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key[:60]!r} appears twice")
        out[key] = value
    return out


def parse_json(data: bytes, where: str) -> Any:
    """Strict JSON (UTF-8, finite numbers, no NaN, no duplicate keys), at most MAX_JSON_DEPTH deep;
    anything else is a ConversionError naming `where`."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConversionError(f"{where}: not valid JSON (not UTF-8: {e.reason} at byte {e.start})") from e
    if (depth := json_depth(text)) > MAX_JSON_DEPTH:
        raise ConversionError(f"{where}: not valid JSON here: nested more than {MAX_JSON_DEPTH} levels deep "
                              f"(at least {depth})")
    try:
        return json.loads(text, parse_float=_strict_float, parse_constant=_no_constant,
                          object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    except (ValueError, RecursionError) as e:  # a hook's refusal; an integer of over 4300 digits
        raise ConversionError(f"{where}: not valid JSON ({e})") from e


def read_json(path: Path) -> Any:
    """A JSON file of at most MAX_JSON_BYTES, parsed by `parse_json`."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise ConversionError(f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} a JSON file here may have")
        data = path.read_bytes()
    except OSError as e:
        raise ConversionError(f"{path}: cannot read: {e.strerror or e}") from e
    return parse_json(data, str(path))


# --- safetensors ----------------------------------------------------------------------------------

def read_safetensors_header(path: Path) -> list[SourceTensor]:
    """Tensors of one safetensors file, sorted by name (the order the pinned converter uses).

    The rules of the safetensors library: a header of at most 100 MB inside the file, a JSON object
    {name: {dtype, shape, data_offsets}} (and an optional __metadata__ of strings), each tensor's
    bytes = prod(shape) * dtype size, and the tensors, sorted by offset, tiling the data section
    exactly: no gap, no overlap, nothing after the last one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConversionError(f"{path}: not a safetensors file (only {size} bytes)")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, MAX_HEADER_BYTES):
                limit = f" (at most {MAX_HEADER_BYTES} allowed)" if n > MAX_HEADER_BYTES else ""
                raise ConversionError(f"{path}: truncated or not a safetensors file: the header claims {n} bytes "
                                      f"but the file has {size}{limit}")
            header_bytes = f.read(n)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read: {e.strerror or e}") from e
    if not header_bytes.startswith(b"{"):
        raise ConversionError(f"{path}: corrupt safetensors header (does not start with '{{')")
    header = parse_json(header_bytes, f"{path}: corrupt safetensors header")
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ConversionError(f"{path}: corrupt safetensors header (__metadata__ must map strings to strings)")

    data_start = 8 + n
    tensors = [_tensor_entry(path, name, entry, data_start) for name, entry in header.items()]
    end = 0  # the tiling: each tensor starts where the one before it ended
    for t in sorted(tensors, key=lambda t: (t.start, t.nbytes)):
        if t.start - data_start != end:
            raise ConversionError(
                f"{path}: corrupt safetensors header: tensor {t.name!r} starts at data offset "
                f"{t.start - data_start}, expected {end} (tensors must tile the data: no gap, no overlap)")
        if t.start + t.nbytes > size:
            raise ConversionError(
                f"{path}: truncated: tensor {t.name!r} needs bytes up to {t.start + t.nbytes} "
                f"but the file has {size}")
        end += t.nbytes
    if data_start + end != size:
        raise ConversionError(f"{path}: corrupt safetensors file: its tensors cover {end} bytes of data, the "
                              f"file has {size - data_start} after its {n}-byte header")
    return sorted(tensors, key=lambda t: t.name)


def _tensor_entry(path: Path, name: str, entry: Any, data_start: int) -> SourceTensor:
    """One header entry, checked: a dtype we read, a shape of non-negative ints, two offsets that fit it."""
    def corrupt(why: str) -> ConversionError:
        return ConversionError(f"{path}: corrupt safetensors entry for {name[:80]!r} ({why})")

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise corrupt("expected an object with dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES.keys() | _OTHER_DTYPES:
        raise corrupt(f"dtype {str(dtype)[:20]!r} is not a safetensors dtype")
    index = INDEX_DTYPES.get(name.removeprefix("model."))
    if dtype not in _DTYPES or dtype != (index or dtype) or (index is None and dtype in INDEX_DTYPES.values()):
        maps = " (and an I64 d2t, a BOOL t2d)" if index or dtype in INDEX_DTYPES.values() else ""
        raise ConversionError(f"{path}: tensor {name!r} has dtype {dtype}; only F32, F16 and BF16 drafts are "
                              f"supported{maps}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise corrupt("shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
        raise corrupt("data_offsets must be two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise corrupt(f"data_offsets [{begin}, {end}] end before they begin")
    if end - begin != math.prod(shape) * _DTYPES[dtype][0]:
        raise corrupt("size does not match shape")
    return SourceTensor(name, dtype, tuple(shape), path, data_start + begin, end - begin)


def safetensors_parts(draft_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The checkpoint's safetensors files and its weight map: from model.safetensors.index.json, else
    model*.safetensors (no map)."""
    index = draft_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{index}: unreadable safetensors index (no 'weight_map' object)")
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or Path(v).name != v
                    or v in ("", ".", "..")), None)
        if bad is not None:
            raise ConversionError(f"{index}: weight_map[{bad[0][:80]!r}] = {str(bad[1])[:80]!r}: expected "
                                  "the name of a safetensors file in this directory")
        parts = sorted(set(weight_map.values()))
        missing = [p for p in parts if not (draft_dir / p).is_file()]
        if missing:
            raise ConversionError(f"{index}: lists {', '.join(missing)} which is missing")
        return [draft_dir / p for p in parts], weight_map
    parts = sorted(p for p in os.listdir(draft_dir)
                   if p.startswith("model") and p.endswith(".safetensors"))
    if not parts:
        raise ConversionError(f"{draft_dir}: no model*.safetensors file (only safetensors drafts are supported)")
    return [draft_dir / p for p in parts], None


def read_tensors(draft_dir: Path) -> dict[str, SourceTensor]:
    """Every tensor of the checkpoint by name, in the pinned converter's order (parts, then names);
    a tensor in two parts, or not where the index says, is an error."""
    parts, weight_map = safetensors_parts(draft_dir)
    tensors: dict[str, SourceTensor] = {}
    for part in parts:
        for t in read_safetensors_header(part):
            if t.name in tensors:
                raise ConversionError(f"{draft_dir}: tensor {t.name!r} is in both {tensors[t.name].path.name} "
                                      f"and {part.name}")
            tensors[t.name] = t
    for name, part in (weight_map or {}).items():
        if name not in tensors or tensors[name].path.name != part:
            raise ConversionError(f"{draft_dir / 'model.safetensors.index.json'}: tensor {name[:80]!r} is not "
                                  f"in {part}, where the index says it is")
    return tensors


def read_config(draft_dir: Path) -> dict:
    path = draft_dir / "config.json"
    if not draft_dir.is_dir():
        raise ConversionError(f"{draft_dir}: not a directory (expected a DFlash draft checkpoint)")
    if not path.is_file():
        raise ConversionError(f"{path}: not found (expected a DFlash draft checkpoint directory)")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: not a JSON object")
    return config
