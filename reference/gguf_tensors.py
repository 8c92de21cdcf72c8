"""Tensors read from GGUF files into PyTorch, dequantised to f32 by gguf-py.

`read_tensor` reads one tensor of any GGUF; `target_weights_from_gguf` the frozen pieces of a
target (token embeddings, LM head, shapes) that a draft uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def read_tensor(info, name: str) -> torch.Tensor:
    """One tensor of a `dflash_llama.GGUFInfo`, dequantised to f32 (ids as they are), in torch order."""
    return torch.from_numpy(info.read(name))


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
    embed = read_tensor(info, "token_embd.weight")
    names = {t.name for t in info.tensors}
    head = read_tensor(info, "output.weight") if "output.weight" in names else embed
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
