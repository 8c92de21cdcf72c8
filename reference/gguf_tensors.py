"""Tensors read from GGUF files into PyTorch, dequantised to f32 by gguf-py.

`read_tensor` reads one tensor of any GGUF; `target_weights_from_gguf` the frozen pieces of a
target (token embeddings, LM head, shapes) that a draft uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch


def read_tensor(path: Path, data_offset: int, t) -> torch.Tensor:
    """One tensor, dequantised by gguf-py to f32, in torch order (ggml shape reversed)."""
    import gguf
    import numpy as np

    try:
        qtype = gguf.GGMLQuantizationType[t.type.upper()]
    except KeyError as e:
        raise ValueError(f"{path}: tensor {t.name} has type {t.type}, unknown to gguf-py") from e
    rows = int(np.prod(t.shape[1:], dtype=np.int64))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=data_offset + t.offset,
                    shape=(t.nbytes,)).reshape(*reversed(t.shape[1:]), t.nbytes // max(rows, 1))
    try:
        data = gguf.quants.dequantize(raw, qtype)
    except NotImplementedError as e:
        raise ValueError(f"{path}: tensor {t.name}: gguf-py cannot dequantise {t.type}") from e
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(tuple(reversed(t.shape)))


@dataclass
class TargetWeights:
    embed_tokens: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float
    rms_eps: float


def target_weights_from_gguf(path: str | os.PathLike) -> TargetWeights:
    """The frozen pieces of a GGUF target the draft uses, dequantised to f32."""
    from dflash_llama import gguf_info

    info = gguf_info(path)
    embed = read_tensor(Path(path), info.data_offset, info.tensor("token_embd.weight"))
    names = {t.name for t in info.tensors}
    head = (read_tensor(Path(path), info.data_offset, info.tensor("output.weight"))
            if "output.weight" in names else embed)
    n_embd, n_head = int(info.get("embedding_length")), int(info.get("attention.head_count"))
    return TargetWeights(
        embed_tokens=embed, lm_head=head, n_layers=int(info.block_count), n_heads=n_head,
        n_kv_heads=int(info.get("attention.head_count_kv", n_head)),
        head_dim=int(info.get("attention.key_length", n_embd // n_head)),
        ffn=_ffn_length(info, path), rope_theta=float(info.get("rope.freq_base", 10000.0)),
        rms_eps=float(info.get("attention.layer_norm_rms_epsilon", 1e-6)))


def _ffn_length(info, path) -> int:
    """The target's FFN width (the default of a draft's): `feed_forward_length` (its largest entry
    when given per layer); a MoE target without one (Qwen3.5 MoE): its shared expert's, else one
    expert's."""
    for key in ("feed_forward_length", "expert_shared_feed_forward_length", "expert_feed_forward_length"):
        value = info.get(key)
        if isinstance(value, (list, tuple)):
            value = max(value, default=0)
        if value:
            return int(value)
    raise ValueError(f"{path}: the target has no feed_forward_length (nor an expert's)")
