"""The draft graph three ways: the PyTorch reference, our runtime and llama.cpp's `dflash` graph.

All three get the same context features and block and name their intermediates in the shared
vocabulary of intermediates (listed in docs/parity.md); this module lines them up in graph order
and measures relative errors between every pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dflash_llama import schema as L

IMPLEMENTATIONS = ("reference", "runtime", "native")
# (a, b): error of b measured against a
PAIRS = (("reference", "runtime"), ("reference", "native"), ("runtime", "native"))

# The injection graph (context) first, then the block graph, as the loop runs them.
INJECT_NAMES = ("fc_out", "inp_g_embeddings")
INJECT_LAYER_NAMES = ("Kcur_injected", "Vcur_injected")
BLOCK_LAYER_NAMES = ("noise_norm", "Qcur", "Kcur", "Vcur", "ffn_inp", "ffn_norm", "ffn_out", "l_out")
# DFlash 2: a convolution's dynamic taps (`*_dyn`, not named in llama.cpp's graph), its input side (`*_in`:
# what attention / the MLP read) and its output side (`*_out`, before the residual)
DFLASH2_BLOCK_LAYER_NAMES = ("noise_norm", "attn_conv_dyn", "attn_conv_in", "Qcur", "Kcur", "Vcur", "attn_conv_out",
                             "ffn_inp", "ffn_norm", "ffn_conv_dyn", "ffn_conv_in", "ffn_out", "ffn_conv_out", "l_out")
FINAL_NAMES = ("result_norm", "result_output")
# DFlash 2's candidate selector, per draft slot (compared apart: see `lattice`); llama.cpp packs the
# candidates and the scores into one tensor, `dflash2_lattice`
SELECTOR_NAMES = ("selector_unary", "selector_candidates", "selector_gate", "selector_scores", "selector_path")
LLAMA_LATTICE = "dflash2_lattice"
# intermediates llama.cpp's graph computes without naming them (the convolutions' dynamic taps): the
# native peer cannot trace them, so they are compared between the reference and our runtime only
UNNAMED_IN_LLAMA = ("attn_conv_dyn", "ffn_conv_dyn")
# DSpark heads, per drafted slot (slots 0.. anchor-first, 1.. in DFlash's layout), after the head
# output: the token each slot's Markov bias reads (a token id, compared exactly), the bias, the
# biased logits and, with a confidence head, the confidence. llama.cpp's graph names none of them:
# its peer reads the biased logits and the confidences as draft-dspark reads them and the bias and
# its token from the graph's products with markov_w2 and markov_w1 (runtime/native_draft.h)
DSPARK_NAMES = ("markov_prev", "markov_bias", "biased_logits", "confidence")
EXACT_NAMES = ("markov_prev",)  # token ids: equal or not (bound 0)

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
    "blk.{i}.attn_conv_proj.weight": "attn_conv_dyn-{i}",
    "blk.{i}.attn_conv_base": "attn_conv_in-{i}",
    "blk.{i}.ffn_conv_proj.weight": "ffn_conv_dyn-{i}",
    "blk.{i}.ffn_conv_base": "ffn_conv_in-{i}",
    "selector_hidden.weight": "selector_gate",
    "selector_predecessor.weight": "selector_scores",
    "selector_successor.weight": "selector_scores",
    # DSpark
    "markov_w1.weight": "markov_bias",
    "markov_w2.weight": "markov_bias",
    "markov_w2.scale": "markov_bias",
    "conf_proj.weight": "confidence",
    "conf_proj.bias": "confidence",
}


def graph_order(n_layers: int, variant: L.Variant = L.DFLASH1, heads: Sequence[str] | None = None) -> list[str]:
    """Every intermediate name of an n_layers draft of `variant` with `heads` (default: all of the
    variant's; a DSpark draft without a confidence head lacks one), in the order the graphs compute
    them (the selector's, which are compared as a lattice, not included)."""
    heads = variant.heads if heads is None else heads
    names = list(INJECT_NAMES)
    for il in range(n_layers):
        names += [f"{n}-{il}" for n in INJECT_LAYER_NAMES]
    names.append("inp_noise_embd")
    block_names = DFLASH2_BLOCK_LAYER_NAMES if variant.has(L.CONV) else BLOCK_LAYER_NAMES
    for il in range(n_layers):
        names += [f"{n}-{il}" for n in block_names]
    names += FINAL_NAMES
    if L.MARKOV in heads:
        names += [n for n in DSPARK_NAMES if n != "confidence" or L.CONFIDENCE in heads]
    return names


def chain_draft(cfg) -> bool:
    """Whether a draft drafts as a chain over its slots (DSpark's Markov head, or an anchor-first
    block: DeepSpec's "DFlash"), whose drafted tokens the graph stage compares (`compare_drafts`)."""
    return L.MARKOV in cfg.heads or bool(cfg.sample_from_anchor)


def unnamed_in_llama(name: str) -> bool:
    """Whether llama.cpp's graph computes `name` without naming it (`attn_conv_dyn-0`: yes)."""
    return name.rpartition("-")[0] in UNNAMED_IN_LLAMA


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
    """The PyTorch reference draft's intermediates on the same inputs (context at positions 0..);
    a DFlash 2 draft's greedy selector walk too (`SELECTOR_NAMES`), a chain draft's (`chain_draft`)
    greedy chain (`DSPARK_NAMES`; `markov_prev` and `biased_logits`, unbiased, without a Markov head)."""
    import torch

    trace: dict = {}
    if draft.candidate_selector is not None:
        run = draft.propose
    elif chain_draft(draft.config):
        run = draft.draft_chain
    else:
        run = draft
    with torch.no_grad():
        run(torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)), list(block),
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
            lacking = [n for n in self.names if n not in trace and not (impl == "native" and unnamed_in_llama(n))]
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


def drafted_tokens(trace: dict[str, np.ndarray], n_vocab: int, top_k: int = 0, first: int = 1) -> list[int]:
    """Greedy draft of a trace: a DFlash 2 selector's walked path (ours, or llama.cpp's lattice
    walked as its loop walks it; `top_k`: the draft's selector_top_k), a chain's (DSpark's) argmax of
    each drafted slot's biased logits, else the argmax of the raw head output at block positions
    `first`.. (1: DFlash's layout and llama.cpp's draft-dflash; 0: an anchor-first draft) (a positive
    logit scale and a soft-cap keep the argmax, so raw logits suffice)."""
    if "selector_path" in trace:
        return [int(t) for t in np.asarray(trace["selector_path"]).ravel()]
    if LLAMA_LATTICE in trace:
        return walk_llama_lattice(trace[LLAMA_LATTICE], top_k)
    if "biased_logits" in trace:
        return [int(i) for i in np.asarray(trace["biased_logits"]).reshape(-1, n_vocab).argmax(-1)]
    logits = np.asarray(trace["result_output"]).reshape(-1, n_vocab)
    return [int(i) for i in logits[first:].argmax(-1)]


def compare_drafts(drafted: dict[str, list[int]]) -> dict[str, dict]:
    """A chain draft's drafted tokens of each implementation (llama.cpp's read as its loop reads its
    outputs), pair by pair: "a/b" -> {"same", "drafts_a", "drafts_b"}."""
    return {f"{a}/{b}": {"same": drafted[a] == drafted[b], "drafts_a": drafted[a], "drafts_b": drafted[b]}
            for a, b in PAIRS if a in drafted and b in drafted}


# --- DFlash 2: the selector's lattice ---------------------------------------------------------------

Lattice = dict  # (slot, predecessor token, candidate token) -> score; slots 1.. of the block


def lattice(trace: dict[str, np.ndarray], anchor: int, top_k: int) -> Lattice:
    """Every score a DFlash 2 selector computed, keyed by tokens rather than by candidate order, so
    an implementation whose top-K comes unordered (llama.cpp's ggml_top_k) lines up with ours.

    From our traces: `selector_candidates` [n, K] and `selector_scores` [n, K, K] (slot 1's row 0, the
    anchor, repeated). From llama.cpp's: `dflash2_lattice` [B, n_embd] (row 0 zeros; row p: K candidate
    ids as floats, then K x K scores, index pred * K + cand)."""
    if LLAMA_LATTICE in trace:
        packed = np.asarray(trace[LLAMA_LATTICE], dtype=np.float64)
        return _lattice_from_packed(packed[1:], anchor, top_k)
    cands = np.asarray(trace["selector_candidates"]).astype(np.int64)
    scores = np.asarray(trace["selector_scores"], dtype=np.float64)
    return _lattice_from_rows(cands, scores, anchor)


def _lattice_from_packed(rows: np.ndarray, anchor: int, k: int) -> Lattice:
    cands = np.rint(rows[:, :k]).astype(np.int64)
    scores = rows[:, k:k + k * k].reshape(-1, k, k)  # [slot, pred, cand]
    return _lattice_from_rows(cands, scores, anchor)


def _lattice_from_rows(cands: np.ndarray, scores: np.ndarray, anchor: int) -> Lattice:
    out: Lattice = {}
    for s in range(cands.shape[0]):
        preds = [anchor] if s == 0 else [int(t) for t in cands[s - 1]]
        for p, pred in enumerate(preds):
            for c, cand in enumerate(cands[s]):
                out[(s + 1, pred, int(cand))] = float(scores[s, p, c])
    return out


def compare_lattices(a: Lattice, b: Lattice) -> dict:
    """Relative error of b's scores against a's on the entries both have, and how many entries
    only one has (a different candidate set: a top-K that differs)."""
    common = sorted(set(a) & set(b))
    va = np.array([a[k] for k in common])
    vb = np.array([b[k] for k in common])
    return {"error": rel_err(va, vb) if common else float("inf"), "entries": len(common),
            "only_a": len(set(a) - set(b)), "only_b": len(set(b) - set(a))}


def compare_selectors(traces: dict[str, dict[str, np.ndarray]], anchor: int, top_k: int) -> dict[str, dict]:
    """Every pair's lattices compared (`compare_lattices`) and whether their drafted tokens (the
    walked paths) are equal; pair "a/b" -> {"error", "entries", "only_a", "only_b", "same_path"}."""
    lattices = {impl: lattice(t, anchor, top_k) for impl, t in traces.items()}
    paths = {impl: drafted_tokens(t, 0, top_k) for impl, t in traces.items()}
    return {f"{a}/{b}": {**compare_lattices(lattices[a], lattices[b]), "same_path": paths[a] == paths[b],
                         "path_a": paths[a], "path_b": paths[b]}
            for a, b in PAIRS if a in traces and b in traces}


def walk_llama_lattice(packed: np.ndarray, k: int) -> list[int]:
    """The greedy walk llama.cpp's draft-dflash loop does over its packed lattice (first maximum)."""
    return [token for token, _ in llama_walk_steps(packed, k)]


def llama_walk_steps(packed: np.ndarray, k: int) -> list[tuple[int, np.ndarray]]:
    """Each step of that walk: the token it takes and the K scores it chose from (the row of the
    previous pick, the anchor's for the first slot)."""
    rows = np.asarray(packed, dtype=np.float64)[1:]
    steps, pred = [], 0
    for row in rows:
        scores = row[k + pred * k:k + (pred + 1) * k]
        pred = int(np.argmax(scores))
        steps.append((int(round(row[pred])), scores))
    return steps
