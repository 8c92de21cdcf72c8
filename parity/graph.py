"""The draft graph three ways: the PyTorch reference, our runtime and llama.cpp's `dflash` graph.

All three get the same context features and block and name their intermediates in the shared
vocabulary of intermediates (listed in docs/parity.md); this module lines them up in graph order
and measures relative errors between every pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

IMPLEMENTATIONS = ("reference", "runtime", "native")
# (a, b): error of b measured against a
PAIRS = (("reference", "runtime"), ("reference", "native"), ("runtime", "native"))

# The injection graph (context) first, then the block graph, as the loop runs them.
INJECT_NAMES = ("fc_out", "inp_g_embeddings")
INJECT_LAYER_NAMES = ("Kcur_injected", "Vcur_injected")
BLOCK_LAYER_NAMES = ("noise_norm", "Qcur", "Kcur", "Vcur", "ffn_inp", "ffn_norm", "ffn_out", "l_out")
FINAL_NAMES = ("result_norm", "result_output")

# which GGUF tensor each intermediate reads first (a weight fault shows there first)
FIRST_READER = {
    "fc.weight": "fc_out",
    "enc.output_norm.weight": "inp_g_embeddings",
    "blk.{i}.attn_k.weight": "Kcur_injected-{i}",
    "blk.{i}.attn_k_norm.weight": "Kcur_injected-{i}",
    "blk.{i}.attn_v.weight": "Vcur_injected-{i}",
    "blk.{i}.attn_norm.weight": "noise_norm-{i}",
    "blk.{i}.attn_q.weight": "Qcur-{i}",
    "blk.{i}.attn_q_norm.weight": "Qcur-{i}",
    "blk.{i}.attn_output.weight": "ffn_inp-{i}",
    "blk.{i}.ffn_norm.weight": "ffn_norm-{i}",
    "blk.{i}.ffn_gate.weight": "ffn_out-{i}",
    "blk.{i}.ffn_up.weight": "ffn_out-{i}",
    "blk.{i}.ffn_down.weight": "ffn_out-{i}",
    "output_norm.weight": "result_norm",
    "token_embd.weight": "inp_noise_embd",
    "output.weight": "result_output",
}


def graph_order(n_layers: int) -> list[str]:
    """Every intermediate name of an n_layers draft, in the order the graphs compute them."""
    names = list(INJECT_NAMES)
    for il in range(n_layers):
        names += [f"{n}-{il}" for n in INJECT_LAYER_NAMES]
    names.append("inp_noise_embd")
    for il in range(n_layers):
        names += [f"{n}-{il}" for n in BLOCK_LAYER_NAMES]
    return names + list(FINAL_NAMES)


def layer_of(name: str) -> int | None:
    """Draft layer of an intermediate (`Qcur-3` -> 3), None for the layer-less ones."""
    head, _, tail = name.rpartition("-")
    return int(tail) if head and tail.isdigit() else None


def first_reader(tensor_name: str) -> str | None:
    """The first intermediate computed from GGUF tensor `tensor_name`."""
    parts = tensor_name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        key = ".".join(["blk", "{i}", *parts[2:]])
        reader = FIRST_READER.get(key)
        return reader.format(i=int(parts[1])) if reader else None
    return FIRST_READER.get(tensor_name)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """||b - a|| / ||a|| over the whole tensor, in f64 (a is the side measured against).

    -inf entries (a reduced vocabulary's logits outside its rows) must sit in the same places on
    both sides, and are left out; anywhere else they make the error infinite."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"cannot compare tensors of {a.size} and {b.size} values")
    masked = np.isneginf(a)
    if masked.any() or np.isneginf(b).any():
        if not np.array_equal(masked, np.isneginf(b)):
            return float("inf")
        a, b = a[~masked], b[~masked]
    denom = np.linalg.norm(a)
    diff = np.linalg.norm(b - a)
    if denom == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return float(diff / denom)


def reference_trace(draft, features: np.ndarray, block: Sequence[int]) -> dict[str, np.ndarray]:
    """The PyTorch reference draft's intermediates on the same inputs (context at positions 0..)."""
    import torch

    trace: dict = {}
    with torch.no_grad():
        draft(torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)), list(block),
              start=features.shape[0], cache=None, trace=trace)
    return {k: v.float().numpy() for k, v in trace.items()}


@dataclass
class GraphComparison:
    """Relative errors of every intermediate for every pair, maxed over the inputs compared."""
    names: list[str]  # graph order
    errors: dict[str, dict[str, float]] = field(default_factory=dict)  # "a/b" -> name -> error
    missing: dict[str, list[str]] = field(default_factory=dict)  # implementation -> names it lacks
    shapes: dict[str, list[int]] = field(default_factory=dict)  # name -> reference shape

    def add(self, traces: dict[str, dict[str, np.ndarray]]) -> None:
        """Fold in one set of traces (implementation -> name -> array), keeping the max error."""
        for impl, trace in traces.items():
            lacking = [n for n in self.names if n not in trace]
            if lacking:
                self.missing[impl] = sorted(set(self.missing.get(impl, [])) | set(lacking),
                                            key=self.names.index)
        for a, b in PAIRS:
            if a not in traces or b not in traces:
                continue
            key = f"{a}/{b}"
            errs = self.errors.setdefault(key, {})
            for name in self.names:
                if name not in traces[a] or name not in traces[b]:
                    continue
                ta, tb = traces[a][name], traces[b][name]
                if ta.size != tb.size:
                    raise ValueError(f"{name}: {a} has shape {ta.shape}, {b} has {tb.shape}")
                self.shapes.setdefault(name, list(traces["reference"][name].shape)
                                       if "reference" in traces and name in traces["reference"]
                                       else list(ta.shape))
                errs[name] = max(errs.get(name, 0.0), rel_err(ta, tb))


def drafted_tokens(trace: dict[str, np.ndarray], n_vocab: int) -> list[int]:
    """Greedy draft of a trace: argmax of the raw head output at block positions 1.. (a positive
    logit scale and a soft-cap keep the argmax, so raw logits suffice)."""
    logits = np.asarray(trace["result_output"]).reshape(-1, n_vocab)
    return [int(i) for i in logits[1:].argmax(-1)]
