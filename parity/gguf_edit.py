"""Copy a GGUF with changes: replaced key-values, transformed tensors. Used to plant faults that the
parity harness must catch, and by tests that need a deliberately wrong file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Collection

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

# name -> new value, or None to drop the key; values keep the type of the key they replace
KVEdits = dict[str, Any]
# (name, f32 array in NumPy order) -> new f32 array, or None to keep the tensor as it is
TensorEdit = Callable[[str, np.ndarray], np.ndarray | None]


def _field_value(field) -> Any:
    return field.contents()


def copy_gguf(src: str | os.PathLike, dst: str | os.PathLike, kv: KVEdits | None = None,
              tensors: TensorEdit | None = None, widen: Collection[str] = ()) -> Path:
    """Write `dst` = `src` with key-values replaced per `kv` and tensors passed through `tensors`.

    An edited quantized tensor is re-quantized to its original type; a tensor named in `widen` is
    written as float32, dequantised (the same values in a wider type).
    """
    kv = dict(kv or {})
    reader = GGUFReader(str(src))
    arch = _field_value(reader.fields["general.architecture"])
    writer = GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = kv.pop(name) if name in kv else _field_value(field)
        if value is None:
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(name, list(value), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, vtype)
    for name, value in kv.items():  # new keys
        if value is not None:
            _add_new(writer, name, value)

    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        data = np.asarray(t.data)
        new = None
        if t.name in widen:
            shape = tuple(reversed([int(x) for x in t.shape]))
            writer.add_tensor(t.name, dequantize(data, qtype).reshape(shape).astype(np.float32))
            continue
        if tensors is not None:
            f32 = dequantize(data, qtype).reshape(tuple(reversed([int(x) for x in t.shape])))
            new = tensors(t.name, f32.astype(np.float32))
        if new is None:
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
        elif qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(t.name, new.astype(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16))
        else:
            q = quantize(np.ascontiguousarray(new, dtype=np.float32), qtype)
            writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def _add_new(writer: GGUFWriter, name: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(name, value)
    elif isinstance(value, int):
        writer.add_uint32(name, value)
    elif isinstance(value, float):
        writer.add_float32(name, value)
    elif isinstance(value, str):
        writer.add_string(name, value)
    else:
        writer.add_array(name, list(value))
