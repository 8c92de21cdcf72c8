"""Reading a published DFlash draft directory: config.json and its safetensors, checked on the way in.

No torch and no safetensors library: the header is parsed here, so a truncated or foreign file is
reported by name before a single byte is converted.
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


# safetensors dtype -> (bytes per element, how to read it as float32)
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}


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
        if self.dtype == "F32":
            data = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        elif self.dtype == "F16":
            data = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        else:  # BF16: the top half of a float32
            data = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        return data.reshape(self.shape)


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
        if end - begin != math.prod(shape) * _DTYPES[dtype]:
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


# --- config.json -> draft hyper-parameters ----------------------------------------------------

DFLASH_ARCHITECTURE = "DFlashDraftModel"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published rule when a checkpoint has no `target_layer_ids`."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 3) - 1
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DraftConfig:
    """What config.json says, with the defaults of Qwen3Config (the class published drafts load with)."""

    hidden: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    context_length: int
    rope_theta: float
    rope_linear_factor: float | None
    partial_rotary_factor: float | None
    rope_is_neox: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int] | None  # None: not in the config, the default rule applies
    num_target_layers: int | None
    vocab_size: int | None
    output_multiplier: float | None
    final_logit_softcapping: float | None
    input_embedding_scale: float | None
    attention_value_scale: float | None
    causal: bool | None
    causal_from_is_causal_false: bool  # `is_causal: false` at the top level: the key goes early (pinned order)
    sliding_window: int | None  # set only when the config enables sliding attention
    sliding_window_pattern: list[bool] | None


def parse_config(config: dict, where: str) -> DraftConfig:
    """Check config.json of a DFlash 1 draft and read its hyper-parameters; `where` names the file."""
    archs = config.get("architectures") or []
    dflash = config.get("dflash_config")
    if "DFlash2DraftModel" in archs or (isinstance(dflash, dict) and "conv_kernel_size" in dflash):
        raise ConversionError(f"{where}: DFlash2 drafts are not supported yet (architectures {archs})")
    if archs and DFLASH_ARCHITECTURE not in archs:
        raise ConversionError(
            f"{where}: unsupported architecture {archs}: expected [\"{DFLASH_ARCHITECTURE}\"]")
    if not isinstance(dflash, dict):
        raise ConversionError(f"{where}: no 'dflash_config': this is not a DFlash draft checkpoint")

    def value(name: str, default=None):
        """dflash_config first, then the top level (the published reference's lookup order)."""
        return dflash.get(name, config.get(name, default))

    def integer(name: str, v, minimum: int = 1) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConversionError(f"{where}: {name} must be an integer >= {minimum}, got {v!r}")
        return v

    def number(name: str, v) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConversionError(f"{where}: {name} must be a number, got {v!r}")
        return float(v)

    def required(name: str) -> int:
        if name not in config:
            raise ConversionError(f"{where}: missing {name}")
        return integer(name, config[name])

    mask = value("mask_token_id")
    if mask is None:
        raise ConversionError(f"{where}: no mask token id (dflash_config.mask_token_id)")
    mask = integer("mask_token_id", mask, minimum=0)

    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConversionError(f"{where}: hidden_act {hidden_act!r} is not supported (DFlash 1 drafts use silu)")

    n_layer = required("num_hidden_layers")
    n_head = required("num_attention_heads")
    n_head_kv = integer("num_key_value_heads", config.get("num_key_value_heads") or n_head)

    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConversionError(f"{where}: rope_parameters must be an object, got {rope!r}")
    rope = rope.get("full_attention", rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ConversionError(f"{where}: rope_type {rope_type!r} is not supported (only default and linear)")
    rope_theta = number("rope_theta", rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    linear = number("rope factor", rope["factor"]) if rope_type == "linear" and "factor" in rope else None
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))

    ids = value("target_layer_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in ids):
            raise ConversionError(f"{where}: target_layer_ids must be a non-empty list of integers, got {ids!r}")
    num_target_layers = config.get("num_target_layers")
    if num_target_layers is not None:
        num_target_layers = integer("num_target_layers", num_target_layers)

    # Sliding attention, read the way the pinned converter reads it (Qwen3Config nulls
    # sliding_window unless use_sliding_window; layer_types defaults to full attention below
    # max_window_layers).
    use_swa = bool(config.get("use_sliding_window", False) or dflash.get("use_swa", False))
    window = dflash.get("swa_window_size") or config.get("sliding_window")
    window_pattern = None
    if use_swa and window:
        window = integer("sliding_window", window)
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
            for i in range(n_layer)]
        if len(layer_types) != n_layer:
            raise ConversionError(f"{where}: layer_types has {len(layer_types)} entries for {n_layer} layers")
        window_pattern = ([True] * n_layer if dflash.get("use_swa", False)
                          else [t == "sliding_attention" for t in layer_types])
    else:
        window = None

    causal = config.get("is_causal")
    if causal is None:
        causal = dflash.get("causal")

    def optional_number(name: str) -> float | None:
        v = value(name)
        return None if v is None else number(name, v)

    softcap = optional_number("final_logit_softcapping")
    vocab = config.get("vocab_size")
    return DraftConfig(
        hidden=required("hidden_size"),
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=integer("head_dim", config.get("head_dim", 128)),
        n_ff=required("intermediate_size"),
        rms_eps=number("rms_norm_eps", config.get("rms_norm_eps", 1e-6)),
        context_length=integer("max_position_embeddings", config.get("max_position_embeddings", 32768)),
        rope_theta=rope_theta,
        rope_linear_factor=linear,
        partial_rotary_factor=None if partial is None else number("partial_rotary_factor", partial),
        rope_is_neox=bool(config.get("rope_is_neox_style", True)),
        block_size=integer("block_size", value("block_size", 16)),
        mask_token_id=mask,
        target_layer_ids=ids,
        num_target_layers=num_target_layers,
        vocab_size=None if vocab is None else integer("vocab_size", vocab),
        output_multiplier=optional_number("output_multiplier"),
        final_logit_softcapping=softcap if softcap is not None and softcap > 0 else None,
        input_embedding_scale=optional_number("input_embedding_scale"),
        attention_value_scale=(None if dflash.get("attention_value_scale") is None
                               else number("attention_value_scale", dflash["attention_value_scale"])),
        causal=None if causal is None else bool(causal),
        causal_from_is_causal_false=config.get("is_causal") is False,
        sliding_window=window,
        sliding_window_pattern=window_pattern,
    )
