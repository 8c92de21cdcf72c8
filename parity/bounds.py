"""Error bounds per weight type: the one table the harness checks against (docs/parity.md shows it).

Errors are relative: ||got - want|| / ||want|| over a whole tensor. Each stage keys its bound by
the type that limits its precision:

- weights (stage 1): a GGUF tensor against the Hugging Face tensor, by the GGUF tensor's type.
  Also exact: a tensor whose type gguf-py can quantise must equal the HF tensor re-quantised
  (REQUANT_BOUND), which catches faults far below the quantisation error.
- capture (stage 2): our runtime's target features against transformers' hidden states, by the
  target's weight type; `capture` when transformers runs the same (dequantised) GGUF weights,
  `capture_hf` when it runs the original Hugging Face weights (--target-hf). These errors compound
  with depth; the stage's check is each layer's own error (LAYER_BOUNDS below), and these bounds
  apply to it only where the reference cannot round as ggml does.
- graph (stage 3): each ggml implementation against the reference, by the draft's weight type
  (`graph`), and our runtime against llama.cpp's graph, which share weights (`graph_same`).
- head: `result_output` goes through the target's output head, whose type adds its own rounding
  (`head`); that intermediate's bound is the larger of the draft's and the head's.

Values were set from measured errors on the tiny fixtures and a SmolLM2-shaped random draft
(docs/parity.md lists them) with a margin of 3x or more.
"""

from __future__ import annotations

from dataclasses import dataclass

REQUANT_BOUND = 1e-6  # HF tensor re-quantised to the GGUF tensor's type vs the GGUF tensor


@dataclass(frozen=True)
class Bound:
    weights: float
    capture: float
    capture_hf: float
    graph: float
    graph_same: float
    head: float
    reason: str


BOUNDS: dict[str, Bound] = {
    "f32": Bound(
        weights=1e-7, capture=1e-4, capture_hf=1e-4, graph=1e-4, graph_same=1e-5, head=1e-4,
        reason="bf16/f16/f32 sources widen to f32 exactly; ggml and PyTorch differ only in "
               "summation order (measured <= 1.0e-6 in the draft, 1.0e-6 in captures)"),
    "f16": Bound(
        weights=1e-3, capture=1e-2, capture_hf=1e-2, graph=5e-3, graph_same=5e-3, head=5e-3,
        reason="f16 keeps 11 significant bits (half-ulp 2^-11 = 4.9e-4); ggml also rounds each "
               "matmul's input to f16 (measured 1.2e-3 vs reference, 2e-4 runtime vs native)"),
    "bf16": Bound(
        weights=5e-3, capture=3e-2, capture_hf=5e-2, graph=3e-2, graph_same=1e-2, head=3e-2,
        reason="bf16 keeps 8 significant bits (half-ulp 2^-9 = 2.0e-3); ggml rounds each matmul's "
               "input to bf16 as well (measured 7.9e-3 vs reference)"),
    "q8_0": Bound(
        weights=1.5e-2, capture=5e-2, capture_hf=0.1, graph=0.15, graph_same=2e-2, head=2e-2,
        reason="8-bit blocks of 32 with an f16 scale: ~5.4e-3 per weight tensor; ggml quantises "
               "each matmul's input to q8_0 too, and errors compound through the layers "
               "(measured 5.4e-2 on a 2-layer draft with large random weights)"),
    "q4": Bound(
        weights=0.15, capture=0.1, capture_hf=0.5, graph=0.8, graph_same=2e-2, head=2e-2,
        reason="4-bit blocks (q4_0, q4_1, q4_K, and q5/q6 types, which get this bound too): "
               "~8.6e-2 per Gaussian weight tensor, compounding to 0.4 in a 2-layer draft: at 4 "
               "bits the graph check only catches gross faults; the exact re-quantisation check "
               "of stage 1 is the precise one. A q4_1 target's captures: measured <= 3.0e-2"),
}

# Target architectures whose FFN activation ggml-cpu computes through an f16 table
# (GGML_GELU_FP16, ggml-cpu/vec.h: f16(gelu(f16(x))), a relative rounding of up to 2^-11 per
# activation), measured: the tiny gemma3 target's captures 2.0e-4 .. 5.0e-4 from transformers',
# 3.7e-6 .. 7.2e-5 with the table emulated in transformers (docs/families.md). At f32 their
# capture bound is GELU_TABLE_CAPTURE (4x the largest measured) instead of the type's.
GELU_TABLE_ARCHS = frozenset({"gemma3"})
GELU_TABLE_CAPTURE = 2e-3


# The capture stage's check at depth: each target layer's OWN error. The reference layer reads our
# runtime's captured input of that layer (so errors do not compound from layer to layer), rounds the
# input of each matmul as ggml-cpu does (to the weight type's vec_dot_type) and, against HF weights,
# rounds those to the GGUF's type as gguf-py quantises them; what is left is summation order and the
# rare activation rounding that lands the other way. The error is relative to what the layer adds
# to the residual stream: ||ref_L - ours_L|| / ||ours_L - ours_{L-1}||. Keyed by vec_dot_type;
# measured max over 24 layers of a random qwen3 (hidden 128, std 0.05; k-quants: 8 layers, hidden
# 256) on a HumanEval prompt: f32 9.4e-7, f16 7.3e-5, bf16 6.3e-4, q8_0 (q8_0, q4_0, q5_0
# weights) 7.1e-4, q8_K (q2_K .. q6_K) 1.3e-3, q8_1 (q4_1, q5_1: their min term uses a rounded
# block sum that rounding the input cannot reproduce) 1.2e-2. A weight scaled by 1.05 in one layer
# (attn_v) showed 4.3e-2 there. Bounds: the measured maximum x 5 or more.
LAYER_BOUNDS = {"f32": 1e-4, "f16": 1e-3, "bf16": 5e-3, "q8_0": 5e-3, "q8_k": 1e-2, "q8_1": 3e-2}


def layer_bound(vec_dot_types, covered: bool, target_cat: str, target_arch: str, hf: bool) -> float:
    """Bound of the capture stage's per-layer (own) errors: by the least precise vec_dot_type of the
    target's matrices when the reference emulates every one of them (covered), else the type's
    capture bound (`capture_bound`: nothing emulated, the weight and activation roundings stay)."""
    if not covered:
        return capture_bound(target_cat, target_arch, hf)
    types = [t or "f32" for t in vec_dot_types] or ["f32"]
    bound = max(LAYER_BOUNDS[t] for t in types)
    if target_arch in GELU_TABLE_ARCHS:
        bound = max(bound, GELU_TABLE_CAPTURE)
    return bound


def capture_bound(target_cat: str, target_arch: str, hf: bool) -> float:
    """The capture stage's bound for a target of bound category `target_cat` and GGUF architecture
    `target_arch`, against transformers on the dequantised GGUF (hf False) or the HF weights."""
    b = BOUNDS[target_cat]
    bound = b.capture_hf if hf else b.capture
    if target_arch in GELU_TABLE_ARCHS:
        bound = max(bound, GELU_TABLE_CAPTURE)
    return bound


# precision order, best first: a file's category is its least precise matrix type
ORDER = ("f32", "f16", "bf16", "q8_0", "q4")


def category(ggml_type: str) -> str:
    """The bound category of a ggml type name ("f32", "q4_k", "q8_0", ...)."""
    t = ggml_type.lower()
    if t in ("f32", "f16", "bf16", "q8_0"):
        return t
    if t.startswith(("q4", "q5", "q6", "iq4", "q3", "q2", "iq3", "iq2", "iq1", "tq")):
        return "q4"
    raise ValueError(f"no parity bound for tensor type {ggml_type!r}")


def worst(categories) -> str:
    """The least precise of some categories."""
    cats = list(categories)
    return max(cats, key=ORDER.index) if cats else "f32"


def file_category(tensor_types: dict[str, str], skip: tuple[str, ...] = ()) -> str:
    """Category of a GGUF from {tensor name: ggml type}: its least precise matrix (names in `skip`
    ignored; norms are f32 in every file and do not count)."""
    return worst(category(t) for name, t in tensor_types.items()
                 if name not in skip and not name.endswith("norm.weight"))
