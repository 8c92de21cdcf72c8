"""The target's last decoder layers in PyTorch, read from its GGUF: its logits from a captured feature.

A dataset stores the target's hidden states at the draft's target layers. When the deepest of them
is layer i, running the target's layers i+1 .. N-1, its output norm and head on that hidden state
gives back the target's own logits at every position: the full next-token distribution, which
training can distil into the draft (far more signal per token than the one greedy token). A tap
on the last layer is already after the output norm (as Hugging Face reports it): only the head
remains.

Llama and Qwen3 targets are supported (RoPE attention with GQA, SiLU gated MLP, RMS norms, no
biases; Qwen3 adds per-head q/k norms). A llama GGUF's q/k rows are in llama.cpp's permuted
(interleaved RoPE) order and are put back to rotate-half order; Qwen3's are stored as they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .model import apply_rope, interleaved_to_halves, rope_cos_sin

ARCHS = ("llama", "qwen3")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_norm: torch.Tensor | None = None  # [head_dim], Qwen3
    k_norm: torch.Tensor | None = None


class TargetTail:
    """Layers first..N-1 of a GGUF target, its output norm and head, in f32."""

    def __init__(self, path: str | os.PathLike, first: int, lm_head: torch.Tensor):
        from dflash_llama import gguf_info

        from .gguf_tensors import read_tensor

        info = gguf_info(path)
        if info.architecture not in ARCHS:
            raise ValueError(f"{path}: distillation runs the target's last layers in PyTorch, which is "
                             f"implemented for {', '.join(ARCHS)} targets, not {info.architecture}")
        permuted = info.architecture == "llama"
        get = lambda name: read_tensor(info, name)  # noqa: E731
        self.n_layers = int(info.block_count)
        if not 0 < first <= self.n_layers:
            raise ValueError(f"no target layers after layer {first - 1} of {self.n_layers}")
        self.n_head = int(info.get("attention.head_count"))
        self.n_kv = int(info.get("attention.head_count_kv", self.n_head))
        n_embd = int(info.get("embedding_length"))
        self.head_dim = int(info.get("attention.key_length", n_embd // self.n_head))
        self.theta = float(info.get("rope.freq_base", 10000.0))
        self.eps = float(info.get("attention.layer_norm_rms_epsilon", 1e-5))
        self.layers = []
        names = {t.name for t in info.tensors}
        for il in range(first, self.n_layers):
            b = f"blk.{il}."
            wq, wk = get(b + "attn_q.weight"), get(b + "attn_k.weight")
            if permuted:
                wq, wk = interleaved_to_halves(wq, self.head_dim), interleaved_to_halves(wk, self.head_dim)
            qk_norm = b + "attn_q_norm.weight" in names
            self.layers.append(_Layer(
                attn_norm=get(b + "attn_norm.weight"), wq=wq, wk=wk, wv=get(b + "attn_v.weight"),
                wo=get(b + "attn_output.weight"), ffn_norm=get(b + "ffn_norm.weight"),
                gate=get(b + "ffn_gate.weight"), up=get(b + "ffn_up.weight"), down=get(b + "ffn_down.weight"),
                q_norm=get(b + "attn_q_norm.weight") if qk_norm else None,
                k_norm=get(b + "attn_k_norm.weight") if qk_norm else None))
        self.output_norm = get("output_norm.weight")
        self.lm_head = lm_head

    @torch.no_grad()
    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Output-normed final hidden states [L, H] of one sequence from its hidden states [L, H]
        at the input of the first tail layer (positions 0..L-1, causal)."""
        h = h.float()
        if not self.layers:
            return h  # the captured last layer is the output-normed state already
        n = h.shape[0]
        cos, sin = rope_cos_sin(torch.arange(n), self.head_dim, self.theta, torch.float32)
        for ly in self.layers:
            x = _rms(h, ly.attn_norm, self.eps)
            q = (x @ ly.wq.T).view(n, self.n_head, self.head_dim)
            k = (x @ ly.wk.T).view(n, self.n_kv, self.head_dim)
            if ly.q_norm is not None:
                q, k = _rms(q, ly.q_norm, self.eps), _rms(k, ly.k_norm, self.eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = (x @ ly.wv.T).view(n, self.n_kv, self.head_dim)
            rep = self.n_head // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True).transpose(0, 1).reshape(n, -1)
            h = h + a @ ly.wo.T
            x = _rms(h, ly.ffn_norm, self.eps)
            h = h + (F.silu(x @ ly.gate.T) * (x @ ly.up.T)) @ ly.down.T
        return _rms(h, self.output_norm, self.eps)
