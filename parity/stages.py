"""The four parity stages. Each returns a JSON-ready dict with a `status` ("pass", "fail" or
"skipped") and its numbers; `run_parity` runs them and finds the first divergence.

1. converter: every GGUF tensor against the Hugging Face safetensors (needs --draft-hf);
2. capture: our runtime's target features against the reference target's hidden states (each
   layer's own error is the check, so it holds at any depth), the draft's target layers against
   its HF config, and the KL divergence of the prompt's logits;
3. graph: every named draft intermediate, reference vs runtime vs llama.cpp's `dflash` graph, on
   the same features and block (a DSpark draft's Markov chain and confidences too, and the tokens
   a chain draft drafts, llama.cpp's as its loop reads them);
4. end to end: drafted-token agreement, greedy speculative output == target greedy output over
   generation lengths and verify widths, the acceptance length (tau) of the three implementations
   on the same prompts, and the KL divergence of the verify logits.

Memory: everything our runtime and llama.cpp compute is gathered first (`gather_runtime`), and
their models are released before the reference target and draft load, so the target GGUF (mapped
by llama.cpp) and the reference's float32 weights are never resident together; the reference
target is layer-streamed when large (reference/target.py).
"""

from __future__ import annotations

import datetime as _dt
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_llama import schema as L
from dflash_llama.paths import display_path
from dflash_llama.results import first_mismatch

from . import bounds as B
from .graph import (
    EXACT_NAMES,
    PAIRS,
    GraphComparison,
    chain_draft,
    compare_drafts,
    compare_selectors,
    drafted_tokens,
    first_reader,
    graph_order,
    layer_of,
    reference_trace,
    rel_err,
    unnamed_in_llama,
)

SCHEMA_VERSION = 1
DEFAULT_PROMPTS = "humaneval"


@dataclass
class ParityConfig:
    target: Path
    draft: Path
    draft_hf: Path | None = None
    target_hf: Path | None = None
    prompts: list = field(default_factory=list)  # bench.prompts.Prompt
    name: str = "parity"
    n_predict: int = 32  # tokens per end-to-end generation
    graph_prompts: int = 2  # prompts whose features feed the graph stage
    agreement_steps: int = 8  # speculative steps replayed per prompt for drafted-token agreement
    max_context: int = 192  # prompt tokens kept (longer prompts are cut from the left)
    n_threads: int = 1  # one: on a loaded machine ggml's spinning threads cost more than they give
    native: bool = True  # run llama.cpp's peer (graph and end to end)
    native_tool: Path | None = None  # another build's llama-speculative-simple (a patched one)
    native_build: str = "pinned"  # the llama.cpp this process and native_tool run, for the report
    end_to_end: bool = True
    reference_dtype: str = "float32"  # the reference target's weights and activations (reference.target.DTYPES)
    reference_device: str = "cpu"
    divergence_lengths: list[int] | None = None  # generation lengths of the first-divergence table (None: n/2, n)
    verify_widths: list[int] | None = None  # ... and verify widths (None: 1 and B-1)


class Progress:
    """A tqdm bar over the stages' units of work; silent when tqdm is off."""

    def __init__(self, total: int, enabled: bool = True):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="parity", unit="step", leave=True)

    def step(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------- helpers

def tensor_types(path: Path) -> dict[str, str]:
    """GGUF tensor name -> its type name (f32, q8_0, ...)."""
    from dflash_llama import gguf_info

    return types_of(gguf_info(path))


def types_of(info) -> dict[str, str]:
    return {t.name: t.type for t in info.tensors}


def head_type(target_types: dict[str, str]) -> str:
    """The type of the target's output head (the tied embedding when it has no output.weight)."""
    return target_types.get("output.weight", target_types.get("token_embd.weight", "f32"))


def keep_last(tokens: list[int], n: int) -> list[int]:
    """A prompt's last `n` tokens (longer prompts are cut from the left)."""
    return tokens[-n:] if len(tokens) > n else tokens


def _fmt(x: float) -> str:
    return f"{x:.1e}"


# ---------------------------------------------------------------- stage 1: converter

def stage_converter(cfg: ParityConfig) -> dict:
    """Every tensor of the draft GGUF against the HF checkpoint (published names, dequantised)."""
    if cfg.draft_hf is None:
        return {"status": "skipped", "reason": "no --draft-hf: nothing to compare the GGUF's tensors with",
                "tensors": []}
    import gguf
    import gguf.quants

    from dflash_llama.reference.checkpoint import load_draft, read_draft_gguf

    _, gguf_tensors, vocabulary = read_draft_gguf(Path(cfg.draft))
    hf_draft = load_draft(cfg.draft_hf)
    if vocabulary is not None:  # made at conversion: the HF weights over the GGUF's d2t (a DSpark draft's W2 rows)
        hf_draft.set_vocabulary(*vocabulary)
    hf = {n: p.detach().float().numpy() for n, p in hf_draft.named_parameters()}
    types = tensor_types(Path(cfg.draft))
    rows = []
    for hf_name, got in gguf_tensors.items():
        gguf_name = L.gguf_tensor_name(hf_name)[0]
        qtype = types[gguf_name]
        want = hf.get(hf_name)
        row = {"name": gguf_name, "hf_name": hf_name, "type": qtype}
        if want is None:
            row.update(error=None, requant_error=None, bound=None, passed=False,
                       detail="not in the HF checkpoint")
            rows.append(row)
            continue
        got = got.numpy()
        if got.shape != want.shape:
            row.update(error=None, requant_error=None, bound=None, passed=False,
                       detail=f"shape {list(got.shape)} vs HF {list(want.shape)}")
            rows.append(row)
            continue
        bound = B.BOUNDS[B.category(qtype)].weights
        err = rel_err(want, got)
        requant = None
        gtype = gguf.GGMLQuantizationType[qtype.upper()]
        if gtype != gguf.GGMLQuantizationType.F32:
            try:
                again = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(want), gtype), gtype)
                requant = rel_err(again.reshape(want.shape), got)
            except (NotImplementedError, gguf.quants.QuantError):
                requant = None  # gguf-py cannot quantise this type: the bound alone decides
        else:
            requant = err
        passed = err <= bound and (requant is None or requant <= B.REQUANT_BOUND)
        row.update(error=err, requant_error=requant, bound=bound, passed=passed)
        rows.append(row)
    missing = sorted(set(hf) - set(gguf_tensors))
    for hf_name in missing:
        rows.append({"name": L.gguf_tensor_name(hf_name)[0], "hf_name": hf_name, "type": None,
                     "error": None, "requant_error": None, "bound": None, "passed": False,
                     "detail": "in the HF checkpoint, not in the GGUF"})
    order = {n: i for i, n in enumerate(hf)}
    rows.sort(key=lambda r: order.get(r["hf_name"], len(order)))
    status = "pass" if all(r["passed"] for r in rows) else "fail"
    return {"status": status, "requant_bound": B.REQUANT_BOUND, "tensors": rows}


# ---------------------------------------------------------------- metrics

def nmse(want: np.ndarray, got: np.ndarray) -> float:
    """Normalised mean squared error ||got - want||^2 / ||want||^2 (llama.cpp's model-conversion check:
    below 1e-2 passes, below 1e-6 is "identical")."""
    e = rel_err(want, got)
    return e * e


def logit_metrics(want: np.ndarray, got: np.ndarray, chunk: int = 32) -> dict:
    """KL divergence KL(P_want || P_got) per position (natural log, in float64) as mean, 99th
    percentile and maximum, and the share of positions whose top token agrees (llama-perplexity
    --kl-divergence's numbers), over the rows of two [n, V] logit arrays."""
    want, got = np.asarray(want), np.asarray(got)
    if want.shape != got.shape:
        raise ValueError(f"cannot compare logits of shapes {want.shape} and {got.shape}")
    kl, same = [], 0
    for i in range(0, want.shape[0], chunk):
        a, b = want[i:i + chunk].astype(np.float64), got[i:i + chunk].astype(np.float64)
        la = a - a.max(-1, keepdims=True)
        la -= np.log(np.exp(la).sum(-1, keepdims=True))
        lb = b - b.max(-1, keepdims=True)
        lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
        kl += np.maximum((np.exp(la) * (la - lb)).sum(-1), 0.0).tolist()
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
    kl = np.asarray(kl)
    return {"n": int(kl.size), "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
            "kl_max": float(kl.max()), "same_top1": same / kl.size}


class Meter:
    """Wall time and peak resident memory of each phase of a run (Linux: the peak is reset at the
    start of a phase through /proc/self/clear_refs; child processes: their largest peak so far)."""

    def __init__(self):
        self.phases: list[dict] = []

    @staticmethod
    def _status_kb(key: str) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    @staticmethod
    def _children_peak() -> int:
        import resource

        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024

    def phase(self, name: str):
        meter = self

        class _Phase:
            def __enter__(self):
                try:
                    Path("/proc/self/clear_refs").write_text("5")
                except OSError:
                    pass
                self.children, self.t0 = meter._children_peak(), time.perf_counter()

            def __exit__(self, *exc):
                peak = meter._status_kb("VmHWM")
                children = meter._children_peak()
                meter.phases.append({"phase": name, "seconds": round(time.perf_counter() - self.t0, 1),
                                     "peak_rss_bytes": None if peak is None else peak * 1024,
                                     "children_peak_rss_bytes": children if children > self.children else None})
                return False

        return _Phase()

    def summary(self) -> dict:
        peaks = [p["peak_rss_bytes"] for p in self.phases if p["peak_rss_bytes"] is not None]
        children = [p["children_peak_rss_bytes"] for p in self.phases if p["children_peak_rss_bytes"]]
        return {"phases": self.phases, "seconds": round(sum(p["seconds"] for p in self.phases), 1),
                "peak_rss_bytes": max(peaks) if peaks else None,
                "children_peak_rss_bytes": max(children) if children else None}


# ---------------------------------------------------------------- our runtime and llama.cpp, first

@dataclass
class RuntimeSide:
    """What our runtime and llama.cpp computed, gathered before any reference model is loaded (the
    target GGUF's pages and the reference's weights are then never resident together)."""
    target_layer_ids: list[int]
    n_layer: int
    n_vocab: int
    block_size: int
    mask_token_id: int
    capture: dict = field(default_factory=dict)  # tokens, features [n, n_layer, H], logits [n, V]
    graph: list = field(default_factory=list)  # per input: prompt, n_context, features, block, traces
    end_to_end: list = field(default_factory=list)  # per prompt: its rows and what the replay needs


def runtime(cfg: ParityConfig, n_ctx: int, parity: bool):
    """Our runtime on the pair: parity's (f32 KV cache, the target's own head for the draft) or the
    generation's (llama.cpp's default f16 KV, as the native tool runs)."""
    from dflash_llama import Runtime

    if parity:
        return Runtime(cfg.target, cfg.draft, n_threads=cfg.n_threads, n_ctx=n_ctx, kv_f32=True,
                       compact_draft_head=False)
    return Runtime(cfg.target, cfg.draft, n_threads=cfg.n_threads, n_ctx=n_ctx)


def grid(cfg: ParityConfig, block: int) -> tuple[list[int], list[int]]:
    """Generation lengths and verify widths of the first-divergence table."""
    n = cfg.n_predict
    lengths = cfg.divergence_lengths or sorted({max(1, n // 2), n})
    widths = cfg.verify_widths or sorted({1, block - 1})
    return [min(x, n) for x in lengths], [min(w, block - 1) for w in widths]


def gather_runtime(cfg: ParityConfig, n_ctx: int, progress) -> RuntimeSide:
    """Every number of our runtime and of llama.cpp's graph and loop the stages compare."""
    import gc

    from .native import NativeDraft

    side = None
    if cfg.end_to_end:
        rt_e2e = runtime(cfg, n_ctx, parity=False)
        side = _side(rt_e2e)
        for prompt in cfg.prompts:
            side.end_to_end.append(_generations(cfg, rt_e2e, prompt, n_ctx))
            progress.step("end to end (runtime, llama.cpp)")
        del rt_e2e
        gc.collect()
    rt = runtime(cfg, n_ctx, parity=True)
    side = side or _side(rt)
    native = NativeDraft(rt, cfg.draft, n_ctx=n_ctx, n_threads=cfg.n_threads) if cfg.native else None
    tokens = keep_last(rt.tokenize(cfg.prompts[0].text), cfg.max_context)
    side.capture = {"tokens": tokens,
                    "features": rt.capture(tokens, list(range(rt.n_layer))).reshape(len(tokens), rt.n_layer, -1),
                    "logits": rt.target_logits(tokens)}
    progress.step("capture (runtime)")
    side.graph = graph_inputs(cfg, rt, native, progress)
    for row in side.end_to_end:  # drafted-token agreement: the runtime's first steps replayed
        replay = row["replay"]
        replay["features"] = rt.capture(replay["full"])
        for step in replay["steps"]:
            feats, blk = replay["features"][:step["start"]], step["block"]
            step["drafted"] = {"runtime": drafted_tokens(rt.trace_draft(feats, blk), rt.n_vocab,
                                                         first=first_draft_slot(rt))}
            if native is not None:
                step["drafted"]["native"] = drafted_tokens(native.trace(feats, blk), rt.n_vocab,
                                                           native.selector_top_k)
    del native, rt
    gc.collect()
    return side


def first_draft_slot(rt) -> int:
    """The first block position our runtime drafts from: 0 anchor-first, else 1."""
    return 0 if rt.sample_from_anchor else 1


def graph_inputs(cfg: ParityConfig, rt, native, progress=None) -> list[dict]:
    """The graph stage's inputs (features of a prompt but its last token, the block of that token
    and MASKs) with our runtime's and llama.cpp's traces on them, and the tokens each drafts there
    (llama.cpp's as its loop reads its graph's outputs: draft-dflash from block position 1,
    draft-dspark from its first draft slot)."""
    out = []
    for prompt in cfg.prompts[:cfg.graph_prompts]:
        tokens = keep_last(rt.tokenize(prompt.text), cfg.max_context)
        features = rt.capture(tokens[:-1])
        block = [tokens[-1]] + [rt.mask_token_id] * (rt.block_size - 1)
        traces = {"runtime": rt.trace_draft(features, block)}
        drafted = {"runtime": drafted_tokens(traces["runtime"], rt.n_vocab, first=first_draft_slot(rt))}
        if native is not None:
            traces["native"] = native.trace(features, block)
            drafted["native"] = drafted_tokens(traces["native"], rt.n_vocab, native.selector_top_k)
        out.append({"prompt": prompt.id, "n_context": len(tokens) - 1, "features": features,
                    "block": block, "traces": traces, "drafted": drafted})
        if progress is not None:
            progress.step("graph (runtime, llama.cpp)")
    return out


def _side(rt) -> RuntimeSide:
    return RuntimeSide(target_layer_ids=rt.target_layer_ids, n_layer=rt.n_layer, n_vocab=rt.n_vocab,
                       block_size=rt.block_size, mask_token_id=rt.mask_token_id)


def _generations(cfg: ParityConfig, rt, prompt, n_ctx: int) -> dict:
    """One prompt through our runtime and llama.cpp's loop: greedy speculative against plain
    decoding at the trained block and over the divergence grid, and the target's verify logits."""
    n, block = cfg.n_predict, rt.block_size
    tokens = keep_last(rt.tokenize(prompt.text), cfg.max_context)
    text = rt.detokenize(tokens)  # the exact text the native tool tokenizes (after a cut)
    row = {"prompt": prompt.id, "n_prompt": len(tokens)}
    ar = rt.autoregressive(tokens, n, stop_at_eog=False)
    spec = rt.generate(tokens, n, draft_max=None, stop_at_eog=False)  # the whole block, as the reference
    row["runtime"] = {"tau": spec.tau, "greedy_exact": spec.tokens == ar.tokens, "n_tokens": len(spec.tokens),
                      "first_mismatch": first_mismatch(spec.tokens, ar.tokens)}
    lengths, widths = grid(cfg, block)
    table = []
    for width in widths:
        for length in lengths:
            gen = spec if (width, length) == (block - 1, n) else \
                rt.generate(tokens, length, draft_max=width, stop_at_eog=False)
            table.append({"impl": "runtime", "width": width, "length": length, "unit": "token",
                          "first_divergence": first_mismatch(gen.tokens, ar.tokens[:length])})
    full = tokens + ar.tokens
    verify = rt.target_logits(full)[len(tokens) - 1:len(full) - 1]  # one batched decode, as a verify
    if cfg.native:
        n_ctx_native = max(512, len(tokens) + n + 2 * block)
        row["native"], native_table = native_row(cfg, text, n, block, n_ctx_native, rt.detokenize(ar.tokens),
                                                 lengths, widths, rt.max_draft)
        table += native_table
    row["divergence"] = table
    steps, produced = [], 1
    for step in spec.steps[:cfg.agreement_steps]:
        start = len(tokens) + produced - 1  # position of the step's anchor token
        full_spec = tokens + spec.tokens
        steps.append({"start": start, "block": [full_spec[start]] + [rt.mask_token_id] * (block - 1)})
        produced += step.produced
    return {"row": row, "tokens": tokens, "ar_tokens": ar.tokens, "verify_logits": verify,
            "replay": {"full": tokens + spec.tokens, "steps": steps}}


def native_spec_type(draft) -> str:
    """The speculative type llama.cpp's tool picks for a draft GGUF by default: draft-dspark for one
    with a Markov head (its `markov_w1.weight`), else draft-dflash."""
    return "draft-dspark" if L.DSPARK.marker in tensor_types(Path(draft)) else "draft-dflash"


def native_row(cfg: ParityConfig, text: str, n: int, block: int, n_ctx: int, ar_text: str,
               lengths: list[int] = (), widths: list[int] = (),
               max_draft: int | None = None) -> tuple[dict, list[dict]]:
    """llama.cpp's loop on one prompt (the speculative type its tool picks for the draft,
    `native_spec_type`), against the same tool drafting nothing (one token per target decode): its
    prompt handling (the last prompt token decoded with the first block) is its own, and CPU flash
    attention is not batch-invariant, so its greedy text is the fair baseline; agreement with our
    runtime's text (`ar_text`) is reported apart. Then the divergence grid: the first differing
    character of each (width, length) run from that baseline. max_draft: the tokens a full block
    drafts (B anchor-first: draft-dspark's whole block; default and for draft-dflash B - 1)."""
    from dflash_llama import peers

    from .native import FLASH_ATTN

    spec_type = native_spec_type(cfg.draft)
    full = max_draft if spec_type == "draft-dspark" and max_draft else block - 1

    def run(length, n_max):
        return peers.speculative(cfg.target, text, length, spec_type, draft=cfg.draft, n_max=n_max,
                                 threads=cfg.n_threads, n_ctx=n_ctx, flash_attn=FLASH_ATTN, exe=cfg.native_tool)

    try:
        ns, plain = run(n, full), run(n, 0)
    except peers.PeerError as e:
        return {"tau": None, "greedy_exact": False, "spec_type": spec_type, "error": str(e)}, []
    k = min(len(ns.text), len(plain.text))
    m = min(len(ns.text), len(ar_text))
    row = {"tau": ns.tau, "greedy_exact": k > 0 and ns.text[:k] == plain.text[:k], "n_tokens": ns.n_tokens,
           "spec_type": spec_type,
           "n_drafted": ns.n_drafted, "n_accept": ns.n_accept, "compared_chars": k,
           "same_text_as_runtime": ns.text[:m] == ar_text[:m]}
    table = []
    for width in widths:
        for length in lengths:
            try:
                got = ns if (width, length) == (full, n) else run(length, width)
            except peers.PeerError as e:
                table.append({"impl": "native", "width": width, "length": length, "unit": "char",
                              "first_divergence": None, "error": str(e).strip().splitlines()[-1]})
                continue
            k = min(len(got.text), len(plain.text))
            table.append({"impl": "native", "width": width, "length": length, "unit": "char",
                          "first_divergence": first_mismatch(got.text[:k], plain.text[:k])})
    return row, table


# ---------------------------------------------------------------- stage 2: capture + layers

def layer_check(gguf_ids: list[int], hf_ids: list[int] | None) -> dict:
    """The draft's target layers as the GGUF states them against the HF config's."""
    stored = L.target_layers_from_ids(gguf_ids)  # what the file holds (ids + 1)
    if hf_ids is None:
        return {"status": "skipped", "gguf_target_layers": stored, "gguf_ids": gguf_ids, "hf_ids": None,
                "message": "no --draft-hf: the target layers cannot be checked against the checkpoint"}
    out = {"gguf_target_layers": stored, "gguf_ids": gguf_ids, "hf_ids": list(hf_ids)}
    if list(gguf_ids) == list(hf_ids):
        return {**out, "status": "pass", "message": "dflash.target_layers = target_layer_ids + 1"}
    if len(gguf_ids) == len(hf_ids):
        shifts = {g - h for g, h in zip(gguf_ids, hf_ids)}
        if shifts in ({-1}, {1}):
            shift = shifts.pop()
            why = ("the file holds the ids without the + 1 (llama.cpp captures layer inputs)"
                   if shift == -1 else "the + 1 was applied twice")
            return {**out, "status": "fail", "shift": shift,
                    "message": f"target layers off by one: dflash.target_layers = {stored} reads as target "
                               f"layer ids {gguf_ids}, but the HF config's target_layer_ids are {list(hf_ids)} "
                               f"(expected dflash.target_layers = {L.target_layers_from_ids(list(hf_ids))}): {why}"}
    return {**out, "status": "fail",
            "message": f"target layers differ: dflash.target_layers = {stored} reads as ids {gguf_ids}, "
                       f"the HF config's target_layer_ids are {list(hf_ids)}"}



def stage_capture(cfg: ParityConfig, side: RuntimeSide, reference, target_types: dict[str, str],
                  target_cat: str, target_arch: str, hf_ids: list[int] | None, progress) -> dict:
    """Runtime features of every target layer against the reference target's hidden states: each
    layer's own error (the check, at any depth) and the compounded error of the free-running
    reference (as before, reported), with NMSE, and KL divergence of the prompt's logits."""
    from dflash_llama.reference.target import VEC_DOT_TYPES

    check = layer_check(side.target_layer_ids, hf_ids)
    source = cfg.target_hf or cfg.target
    hf = cfg.target_hf is not None
    tokens, ours = side.capture["tokens"], side.capture["features"]
    n_layer = side.n_layer
    out = reference.forward(tokens, 0, reference.new_cache(), feature_layers=list(range(n_layer)))
    theirs = out.features.float().numpy().reshape(len(tokens), n_layer, -1)
    own, rounding = own_errors(reference, tokens, ours, target_types, requantise=hf)
    vec_dot = {VEC_DOT_TYPES.get(t.lower(), "?") for n, t in target_types.items() if not n.endswith("norm.weight")}
    layer_bound = B.layer_bound(vec_dot - {"?"}, rounding.covered, target_cat, target_arch, hf=hf)
    taps = set(side.target_layer_ids)
    layers = [{"layer": i, "tap": i in taps, "error": rel_err(theirs[:, i], ours[:, i]),
               "nmse": nmse(theirs[:, i], ours[:, i]), "own_error": own[i]} for i in range(n_layer)]
    if hf_ids is not None and check["status"] == "fail" and len(hf_ids) == len(side.target_layer_ids):
        # what the draft reads against what it was trained on, layer by layer
        check["tap_errors"] = [{"gguf_id": g, "hf_id": h, "error": rel_err(theirs[:, h], ours[:, g])}
                               for g, h in zip(side.target_layer_ids, hf_ids)]
    ref_logits = out.logits.numpy()
    del out
    progress.step("capture (reference)")
    failing = [r for r in layers if not r["own_error"] <= layer_bound]
    status = "fail" if failing or check["status"] == "fail" else "pass"
    return {"status": status, "reference": "hf" if hf else "gguf", "reference_path": display_path(source),
            "target_type": target_cat, "target_arch": target_arch,
            "bound": B.capture_bound(target_cat, target_arch, hf=hf), "own_bound": layer_bound,
            "rounding": {"covered": rounding.covered, "uncovered": rounding.uncovered[:8],
                         "weights": "rounded to the GGUF's types" if hf else "the GGUF's, dequantised"},
            "n_tokens": len(tokens), "layers": layers, "logits": logit_metrics(ref_logits, side.capture["logits"]),
            "layer_check": check}


def own_errors(reference, tokens: list[int], ours: np.ndarray, target_types: dict[str, str],
               requantise: bool) -> tuple[list[float], object]:
    """Each target layer's own error: the reference layer reads our runtime's output of the layer
    before (layer 0: its own embedding of the tokens) and rounds as ggml's matmuls do; the error of
    its output is measured relative to what the layer adds, ||ref_L - ours_L|| / ||ours_L - ours_{L-1}||.
    The last layer's outputs are after the final norm (as transformers and the capture report
    them): there, what it adds is measured after the norm too."""
    import torch

    n, n_layer = len(tokens), ours.shape[1]
    inputs = {k: torch.from_numpy(np.ascontiguousarray(ours[:, k - 1])) for k in range(1, n_layer)}
    with reference.rounding_as_ggml(target_types, requantise=requantise) as rounding:
        out = reference.forward(tokens, 0, reference.new_cache(), feature_layers=list(range(n_layer)),
                                layer_inputs=inputs)
        embed = reference.embed(tokens)
    own = out.features.float().numpy().reshape(n, n_layer, -1)
    errors = []
    for k in range(n_layer):
        before = embed if k == 0 else ours[:, k - 1]
        if k == n_layer - 1 and k > 0:
            before = reference.final_norm(ours[:, k - 1])
        added = np.linalg.norm((ours[:, k] - before).astype(np.float64))
        diff = np.linalg.norm((own[:, k] - ours[:, k]).astype(np.float64))
        errors.append(float(diff / added) if added > 0 else (0.0 if diff == 0 else float("inf")))
    return errors, rounding


# ---------------------------------------------------------------- stage 3: graph

def graph_bounds(names: list[str], draft_cat: str, head_cat: str) -> dict[str, dict[str, float]]:
    """pair -> name -> bound."""
    out = {}
    for a, b in PAIRS:
        base = B.BOUNDS[draft_cat].graph_same if a != "reference" else B.BOUNDS[draft_cat].graph
        per = {n: base for n in names}
        per["result_output"] = max(base, B.BOUNDS[head_cat].head)
        if "biased_logits" in per:  # the head's logits plus the Markov bias
            per["biased_logits"] = per["result_output"]
        for name in EXACT_NAMES:
            if name in per:
                per[name] = 0.0
        out[f"{a}/{b}"] = per
    return out


def stage_graph(cfg: ParityConfig, inputs_: list[dict], ref_draft, draft_cat: str, head_cat: str, progress,
                fill_rows=None) -> dict:
    """Every named intermediate of the reference draft against those our runtime and llama.cpp
    computed on the same features and block. fill_rows(ids): reads the target embedding's rows
    the reference draft needs (a lazily read table)."""
    variant, top_k = ref_draft.config.variant, ref_draft.config.selector_top_k
    names = graph_order(ref_draft.config.n_layer, variant, ref_draft.config.heads)
    comparison = GraphComparison(names)
    chain = chain_draft(ref_draft.config)
    inputs, selectors, drafts = [], [], []
    native = False
    for item in inputs_:
        if fill_rows is not None:
            fill_rows(item["block"])
        traces = {"reference": reference_trace(ref_draft, item["features"], item["block"]), **item["traces"]}
        native = native or "native" in traces
        comparison.add(traces)
        inputs.append({"prompt": item["prompt"], "n_context": item["n_context"], "block": item["block"]})
        if variant.has(L.SELECTOR):
            selectors.append({"prompt": item["prompt"], **compare_selectors(traces, item["block"][0], top_k)})
        if chain:
            drafted = {"reference": drafted_tokens(traces["reference"], ref_draft.config.n_vocab),
                       **item.get("drafted", {})}
            drafts.append({"prompt": item["prompt"], **compare_drafts(drafted)})
        progress.step("graph (reference)")
    bounds = graph_bounds(names, draft_cat, head_cat)
    failures = []
    for name in names:
        for pair, errs in comparison.errors.items():
            if name in errs and errs[name] > bounds[pair][name]:
                failures.append({"name": name, "pair": pair, "error": errs[name], "bound": bounds[pair][name]})
    missing = {k: v for k, v in comparison.missing.items() if v}
    selector = selector_summary(selectors, bounds) if variant.has(L.SELECTOR) else None
    chain_summary = drafts_summary(drafts) if chain else None
    notes = []
    if native:
        notes.append("native fc_out is read from llama.cpp's DFlash encoder graph (llama_process ENCODE); "
                     "the draft-dflash loop runs only the decoder graph, which names the normed "
                     "projection inp_g_embeddings and has no fc_out")
    else:
        notes.append("llama.cpp's graph was not run (--no-native)")
    if native and any(unnamed_in_llama(n) for n in names):
        notes.append("llama.cpp's graph does not name the convolutions' dynamic taps (attn_conv_dyn, "
                     "ffn_conv_dyn): they are compared between the reference and our runtime only; the "
                     "selector is compared as lattices keyed by (slot, predecessor token, candidate token), "
                     "llama.cpp's read from its nextn rows as draft-dflash reads them")
    if native and L.MARKOV in ref_draft.config.heads:
        notes.append("llama.cpp's graph names none of DSpark's intermediates: its biased_logits are the logits "
                     "and its confidences the nextn rows (first column) of the drafted slots, as draft-dspark reads "
                     "them; its markov_bias is the graph's product with markov_w2.weight (times markov_w2.scale, "
                     "scattered through d2t, where the draft has them) and its markov_prev the "
                     "row its get_rows reads from markov_w1.weight, read as the graph computes them; markov_prev "
                     "(token ids) must be equal")
    if native and chain:
        notes.append("drafted tokens: llama.cpp's as its loop reads its outputs (draft-dspark from the first draft "
                     "slot, for a draft with markov_w1.weight; draft-dflash, for one without, from block position 1 "
                     "whatever dflash.sample_from_anchor says)")
    nmses = {pair: {n: e * e if e is not None else None for n, e in errs.items()}
             for pair, errs in comparison.errors.items()}
    failed = failures or missing or (selector is not None and selector["failures"]) or \
        (chain_summary is not None and chain_summary["failures"])
    return {"status": "fail" if failed else "pass", "draft_type": draft_cat, "head_type": head_cat,
            "inputs": inputs, "names": names, "errors": comparison.errors, "nmse": nmses, "bounds": bounds,
            "shapes": comparison.shapes, "missing": missing, "failures": failures, "selector": selector,
            "drafts": chain_summary, "notes": notes}


def drafts_summary(per_input: list[dict]) -> dict:
    """A chain draft (DSpark, or anchor-first): per pair, whether the drafted tokens were equal on
    every input; `failures` lists the first input where they were not."""
    pairs, failures = {}, []
    for a, b in PAIRS:
        pair = f"{a}/{b}"
        rows = [r for r in per_input if pair in r]
        if not rows:
            continue
        pairs[pair] = {"same": all(r[pair]["same"] for r in rows)}
        bad = next((r for r in rows if not r[pair]["same"]), None)
        if bad is not None:
            failures.append(f"{pair}: drafted tokens differ on {bad['prompt']}: {bad[pair]['drafts_a']} vs "
                            f"{bad[pair]['drafts_b']}")
    return {"pairs": pairs, "inputs": per_input, "failures": failures}


def selector_summary(per_input: list[dict], bounds: dict[str, dict[str, float]]) -> dict:
    """DFlash 2: per pair, the largest lattice error over the inputs (bound: result_output's, whose
    logits the scores add to), candidates only one side proposed, and whether the walked paths (the
    drafted tokens) were equal on every input; `failures` lists what broke."""
    pairs, failures = {}, []
    for pair in bounds:
        rows = [r[pair] for r in per_input if pair in r]
        if not rows:
            continue
        bound = bounds[pair]["result_output"]
        out = {"error": max(r["error"] for r in rows), "bound": bound,
               "only_one_side": sum(r["only_a"] + r["only_b"] for r in rows),
               "entries": sum(r["entries"] for r in rows), "same_path": all(r["same_path"] for r in rows)}
        pairs[pair] = out
        if not out["error"] <= bound:
            failures.append(f"{pair}: lattice relative error {_fmt(out['error'])} > bound {_fmt(bound)}")
        if out["only_one_side"]:
            failures.append(f"{pair}: {out['only_one_side']} lattice entries on one side only (other top-K candidates)")
        if not out["same_path"]:
            bad = next(r for r in per_input if pair in r and not r[pair]["same_path"])
            failures.append(f"{pair}: drafted tokens differ on {bad['prompt']}: {bad[pair]['path_a']} vs "
                            f"{bad[pair]['path_b']}")
    return {"pairs": pairs, "inputs": per_input, "failures": failures}


# ---------------------------------------------------------------- stage 4: end to end

def stage_end_to_end(cfg: ParityConfig, side: RuntimeSide, reference_target, ref_draft, progress,
                     fill_rows=None) -> dict:
    """Per prompt: greedy speculative vs greedy target for the three implementations, their tau, the
    first divergence over generation lengths and verify widths, KL divergence of the runtime's
    verify logits from the reference target's, and drafted-token agreement on replayed steps (all
    three drafts on identical inputs).

    The reference runs its own loop (generate_speculative against generate_autoregressive) on a
    target loaded whole; on a layer-streamed target, where each forward reads every layer again,
    it is replayed instead: one forward over the prompt and our runtime's greedy tokens gives the
    reference target's own next tokens (compared with ours), its verify logits and its features,
    on which the reference draft's blocks are accepted as its loop would accept them."""
    import torch

    from dflash_llama.reference import generate_autoregressive, generate_speculative

    if reference_target.vocab_size != side.n_vocab:
        raise ValueError(f"the reference target has {reference_target.vocab_size} tokens, the GGUF {side.n_vocab}")
    n, block = cfg.n_predict, side.block_size
    loop = not reference_target.streamed
    taps = ref_draft.target_layer_ids
    rows = []
    agree = {f"{a}/{b}": [0, 0] for a, b in PAIRS}
    verify_metrics = []
    for item in side.end_to_end:
        row, tokens, ar_tokens = item["row"], item["tokens"], item["ar_tokens"]
        full = tokens + ar_tokens
        with torch.no_grad():
            forced = reference_target.forward(full, 0, reference_target.new_cache(),
                                              feature_layers=None if loop else taps)
        ref_logits = forced.logits.numpy()[len(tokens) - 1:len(full) - 1]
        row["verify_logits"] = logit_metrics(ref_logits, item["verify_logits"])
        verify_metrics.append((ref_logits, item["verify_logits"]))
        ref_next = [int(t) for t in ref_logits.argmax(-1)]
        if loop:
            with torch.no_grad():
                r_ar = generate_autoregressive(reference_target, tokens, n)
                r_spec = generate_speculative(reference_target, ref_draft, tokens, n)
            row["reference"] = {"tau": r_spec.tau, "greedy_exact": r_spec.tokens == r_ar.tokens,
                                "n_tokens": len(r_spec.tokens),
                                "first_mismatch": first_mismatch(r_spec.tokens, r_ar.tokens),
                                "same_tokens_as_runtime": r_ar.tokens == ar_tokens}
        else:
            tau, n_steps = replayed_tau(ref_draft, forced.features, tokens, ar_tokens, block, side.mask_token_id,
                                        side.n_vocab, fill_rows)
            row["reference"] = {"tau": tau, "greedy_exact": None, "n_tokens": len(ar_tokens), "steps": n_steps,
                                "same_tokens_as_runtime": ref_next == ar_tokens,
                                "first_mismatch_vs_runtime": first_mismatch(ar_tokens, ref_next)}
        for step in item["replay"]["steps"]:
            feats, blk = item["replay"]["features"][:step["start"]], step["block"]
            if fill_rows is not None:
                fill_rows(blk)
            drafts = {"reference": drafted_tokens(reference_trace(ref_draft, feats, blk), side.n_vocab),
                      **step["drafted"]}
            for a, b in PAIRS:
                if a in drafts and b in drafts:
                    agree[f"{a}/{b}"][0] += sum(x == y for x, y in zip(drafts[a], drafts[b]))
                    agree[f"{a}/{b}"][1] += len(drafts[a])
        rows.append(row)
        progress.step("end to end (reference)")

    impls = ["reference", "runtime"] + (["native"] if cfg.native else [])
    tau, exact = {}, {}
    for impl in impls:
        vals = [r[impl]["tau"] for r in rows if r.get(impl, {}).get("tau") is not None]
        tau[impl] = float(np.mean(vals)) if vals else None
        if impl == "reference" and not loop:
            continue  # replayed: its loop did not run
        exact[impl] = all(r[impl]["greedy_exact"] for r in rows)
    divergences = [d for r in rows for d in r["divergence"]]
    runtime_diverged = [d for d in divergences if d["impl"] == "runtime" and d["first_divergence"] is not None]
    agreement = {k: (v[0] / v[1] if v[1] else None) for k, v in agree.items() if v[1]}
    errors = [r["native"]["error"] for r in rows if "error" in r.get("native", {})]
    status = "pass" if all(exact.values()) and not runtime_diverged else "fail"
    want = np.concatenate([a for a, _ in verify_metrics]) if verify_metrics else None
    got = np.concatenate([b for _, b in verify_metrics]) if verify_metrics else None
    notes = ["runtime and native run llama.cpp's default KV cache (f16); native runs llama.cpp's "
             "default flash-attention setting (auto), our runtime runs without; the reference runs "
             "transformers in f32 on its own target, so its tokens may differ",
             "native tau = n_predict / (n_predict - n_accept) from llama-speculative-simple's log; "
             "its first block is anchored on the last prompt token (the published loop samples "
             "the first token from the prefill)",
             "native greedy_exact compares llama-speculative-simple's text with the same tool's "
             "text at --spec-draft-n-max 0 (no drafts, one token per target decode), over the "
             "shorter of the two; same_text_as_runtime tells whether it also equals our runtime's "
             "autoregressive text (it need not: the tool decodes the last prompt token together "
             "with the first block, and CPU flash attention is not batch-invariant)",
             "divergence: the first index at which a greedy speculative run of that verify width and "
             "length differs from plain decoding (tokens for our runtime, which must never differ; "
             "characters of llama.cpp's text against its own plain run, reported)",
             "verify logits: our runtime's target logits of prompt + its greedy tokens in one batched "
             "decode (as a verify computes them) against the reference target's, at the generated "
             "positions: KL(reference || runtime)"]
    if not loop:
        notes.append("reference: replayed, not run (the target is layer-streamed, so each of its forwards "
                     "reads every layer again): one forward over the prompt and our runtime's greedy "
                     "tokens; its tau accepts each reference block against those tokens as its loop would "
                     "against its own, which are the same where same_tokens_as_runtime holds")
    return {"status": status, "n_predict": n, "block_size": block, "reference_mode": "loop" if loop else "replay",
            "prompts": rows, "tau": tau, "greedy_exact": exact, "draft_agreement": agreement,
            "verify_logits": logit_metrics(want, got) if want is not None else None,
            "divergence": divergences, "native_error": errors[0] if errors else None, "notes": notes}


def replayed_tau(ref_draft, features, tokens: list[int], target_tokens: list[int], block: int, mask: int,
                 n_vocab: int, fill_rows=None) -> tuple[float, int]:
    """The reference loop's tau, replayed: the greedy loop over `target_tokens` (the first from the
    prefill), each step drafting [last, MASK...] on the features before it and accepting the longest
    prefix that matches the next target tokens, plus one."""
    n = len(target_tokens)
    full = tokens + target_tokens
    feats = features.float().numpy()
    produced, steps, start = 1, 0, len(tokens)
    while produced < n:
        size = min(block, n - produced + 1)
        blk = [full[start]] + [mask] * (size - 1)
        if fill_rows is not None:
            fill_rows(blk)
        drafted = drafted_tokens(reference_trace(ref_draft, feats[:start], blk), n_vocab) if size > 1 else []
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == full[start + 1 + accepted]:
            accepted += 1
        new = min(accepted + 1, n - produced)
        produced, start, steps = produced + new, start + new, steps + 1
    return ((n - 1) / steps if steps else 0.0), steps


# ---------------------------------------------------------------- first divergence

def first_divergence(report: dict) -> dict | None:
    """The first thing over its bound, in data-flow order: the target layers, the captured
    features, then draft intermediates in graph order (a GGUF tensor over its bound counts at the
    first intermediate that reads it), then the end-to-end checks."""
    st = report["stages"]
    cap = st.get("capture", {})
    check = cap.get("layer_check", {})
    if check.get("status") == "fail":
        return {"stage": "capture", "name": "target layers", "layer": None, "message": check["message"]}
    bad = [r for r in cap.get("layers", []) if not r["own_error"] <= cap["own_bound"]]
    if bad:
        r = bad[0]
        return {"stage": "capture", "name": f"target_feat-{r['layer']}", "layer": r["layer"],
                "error": r["own_error"], "bound": cap["own_bound"],
                "message": f"target_feat-{r['layer']}: target layer {r['layer']}'s own error (reading our runtime's "
                           f"input, relative to what the layer adds) {_fmt(r['own_error'])} > bound "
                           f"{_fmt(cap['own_bound'])}; compounded from layer 0: {_fmt(r['error'])}"}

    graph = st.get("graph", {})
    names = graph.get("names") or []
    position = {n: i for i, n in enumerate(names)}
    candidates = []  # (graph position, priority, entry)
    for f in graph.get("failures", []):
        candidates.append((position[f["name"]], 0, ("graph", f)))
    for t in st.get("converter", {}).get("tensors", []):
        if not t["passed"]:
            reader = first_reader(t["name"])
            candidates.append((position.get(reader, -1), 1, ("converter", {**t, "reader": reader})))
    for impl, lacking in (graph.get("missing") or {}).items():
        for name in lacking:
            candidates.append((position[name], 2, ("missing", {"name": name, "impl": impl})))
    if candidates:
        pos, _, (kind, entry) = min(candidates, key=lambda c: (c[0], c[1]))
        name = names[pos] if pos >= 0 else None
        errs = {pair: graph["errors"][pair].get(name) for pair in graph.get("errors", {}) if name}
        bounds = {pair: graph["bounds"][pair].get(name) for pair in graph.get("bounds", {}) if name}
        out = {"stage": "graph" if kind != "converter" else "converter", "name": name,
               "layer": layer_of(name) if name else None, "errors": errs, "bounds": bounds}
        weights = [t for t in st.get("converter", {}).get("tensors", []) if not t["passed"]
                   and first_reader(t["name"]) == name]
        if kind == "graph":
            out.update(pair=entry["pair"], error=entry["error"], bound=entry["bound"])
            others = [f"{p} {_fmt(e)}" for p, e in errs.items() if e is not None and p != entry["pair"]]
            msg = (f"{name} (draft layer {layer_of(name)})" if layer_of(name) is not None else name) + \
                f": {entry['pair']} relative error {_fmt(entry['error'])} > bound {_fmt(entry['bound'])}" + \
                (f"; {', '.join(others)}" if others else "")
            same = errs.get("runtime/native")
            if same is not None and same <= bounds.get("runtime/native", 0) and entry["pair"] != "runtime/native":
                msg += " (runtime and llama.cpp agree: the draft's weights or settings differ from the reference's)"
            elif entry["pair"] != "reference/runtime" and (errs.get("reference/runtime") or 0) <= \
                    bounds.get("reference/runtime", 0):
                msg += " (our runtime agrees with the reference: llama.cpp's graph diverges)"
        elif kind == "converter":
            out.update(error=entry.get("error"), bound=entry.get("bound"), tensor=entry["name"])
            msg = (f"{name}: first intermediate reading {entry['name']}, which differs from the HF tensor "
                   "(relative error "
                   + (_fmt(entry["error"]) if entry.get("error") is not None else str(entry.get("detail")))
                   + (f", re-quantised {_fmt(entry['requant_error'])}"
                      if entry.get("requant_error") is not None else "")
                   + f", bound {_fmt(entry['bound']) if entry.get('bound') is not None else '-'})")
            effect = [e for e in errs.values() if e is not None]
            if effect and name in names:
                msg += (f"; in the graph it shows as {_fmt(max(effect))} there, within the graph bound"
                        if not any(f["name"] == name for f in graph.get("failures", [])) else "")
        else:
            msg = f"{name}: {entry['impl']} does not compute it"
        if weights and kind == "graph":
            msg += "; stage 1: " + ", ".join(f"{t['name']} {_fmt(t['error'])}" for t in weights
                                             if t.get("error") is not None)
        out["message"] = msg
        return out

    selector = graph.get("selector") or {}
    if selector.get("failures"):  # DFlash 2: after every named intermediate, the selector's lattice
        return {"stage": "graph", "name": "selector", "layer": None,
                "message": "selector: " + "; ".join(selector["failures"])}
    drafts = graph.get("drafts") or {}
    if drafts.get("failures"):  # a chain draft: after every named intermediate, the tokens drafted
        return {"stage": "graph", "name": "drafted tokens", "layer": None,
                "message": "drafted tokens: " + "; ".join(drafts["failures"])}

    e2e = st.get("end_to_end", {})
    for d in e2e.get("divergence", []):
        if d["impl"] == "runtime" and d["first_divergence"] is not None:
            return {"stage": "end_to_end", "name": "runtime greedy output", "layer": None,
                    "message": f"runtime: greedy speculative output at verify width {d['width']}, "
                               f"{d['length']} tokens, differs from greedy target output at token "
                               f"{d['first_divergence']}"}
    for impl, ok in (e2e.get("greedy_exact") or {}).items():
        if not ok:
            bad = next(r for r in e2e["prompts"] if not r[impl]["greedy_exact"])
            if bad[impl].get("error"):
                message = (f"{impl}: the speculative loop failed on {bad['prompt']} "
                           f"({bad[impl]['error'].strip().splitlines()[-1]})")
            else:
                message = (f"{impl}: greedy speculative output differs from greedy target output on "
                           f"{bad['prompt']} (first differing token at {bad[impl].get('first_mismatch')})")
            return {"stage": "end_to_end", "name": f"{impl} greedy output", "layer": None, "message": message}
    return None


# ---------------------------------------------------------------- all stages

def load_reference_target(path, quiet: bool = False, dtype: str = "float32", device: str = "cpu"):
    """The reference target (layer-streamed when large), with transformers' notices off, and its
    progress bars too when quiet (its GGUF loader draws one of tqdm's own, which transformers'
    switch does not reach)."""
    import contextlib
    import io

    import transformers

    from dflash_llama.reference import Target
    from dflash_llama.reference.target import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"reference dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
        return Target.load(path, dtype=DTYPES[dtype], device=device, progress=not quiet)


def run_parity(cfg: ParityConfig, progress_bar: bool = True) -> dict:
    """Run every stage on one target/draft pair; the report dict (parity.json's content)."""
    import gc

    import torch

    import dflash_llama
    from dflash_llama.reference.checkpoint import load_draft, read_draft_gguf, read_hf_config
    from dflash_llama.reference.target import DTYPES, check_device, gguf_vocab_tables

    torch.set_num_threads(max(1, cfg.n_threads))
    if not cfg.prompts:
        raise ValueError("no prompts")
    check_device(cfg.reference_device)  # before an hour of runtime work, not after
    if cfg.reference_dtype not in DTYPES:
        raise ValueError(f"reference dtype {cfg.reference_dtype!r}: choose one of {', '.join(DTYPES)}")
    for path, what in ((cfg.target, "--target"), (cfg.draft, "--draft")):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{what} {path}: no such file")
    for path, what in ((cfg.draft_hf, "--draft-hf"), (cfg.target_hf, "--target-hf")):
        if path is not None and not Path(path).is_dir():
            raise FileNotFoundError(f"{what} {path}: not a directory")

    n_graph = min(cfg.graph_prompts, len(cfg.prompts))
    n_e2e = len(cfg.prompts) if cfg.end_to_end else 0
    progress = Progress(1 + 2 * (1 + n_graph + n_e2e), progress_bar)
    meter = Meter()
    try:
        from dflash_llama import gguf_info

        target_info = gguf_info(cfg.target)
        target_types = types_of(target_info)
        draft_types = tensor_types(Path(cfg.draft))
        target_cat = B.file_category(target_types)
        # a reduced vocabulary (d2t) multiplies by the draft's own head rows, else by the target's head
        head = draft_types["output.weight"] if L.D2T in draft_types else head_type(target_types)
        draft_cat = B.file_category(draft_types, skip=("token_embd.weight", "output.weight", L.D2T))
        n_ctx = max(512, cfg.max_context + cfg.n_predict + 64)
        hf_ids = read_hf_config(Path(cfg.draft_hf)).target_layer_ids if cfg.draft_hf else None

        report = {
            "schema_version": SCHEMA_VERSION,
            "name": cfg.name,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": {"dflash_llama": dflash_llama.__version__, "llama_cpp": dflash_llama.llama_cpp_commit()},
            "inputs": {"target": display_path(cfg.target), "draft": display_path(cfg.draft),
                       "draft_hf": display_path(cfg.draft_hf) if cfg.draft_hf else None,
                       "target_hf": display_path(cfg.target_hf) if cfg.target_hf else None,
                       "prompts": [p.id for p in cfg.prompts], "n_predict": cfg.n_predict,
                       "reference_weights": "hf" if cfg.draft_hf else "gguf",
                       "native_build": cfg.native_build, "reference_dtype": cfg.reference_dtype,
                       "reference_device": cfg.reference_device},
            "types": {"draft": draft_cat, "target": target_cat, "head": head,
                      "head_category": B.category(head)},
            "stages": {},
        }
        with meter.phase("converter"):
            report["stages"]["converter"] = stage_converter(cfg)
            gc.collect()
        progress.step("converter")
        with meter.phase("runtime and llama.cpp (capture, graph, end to end)"):
            side = gather_runtime(cfg, n_ctx, progress)
        with meter.phase("reference target (capture)"):
            reference_target = load_reference_target(cfg.target_hf or cfg.target, quiet=not progress_bar,
                                                      dtype=cfg.reference_dtype, device=cfg.reference_device)
            report["stages"]["capture"] = stage_capture(cfg, side, reference_target, target_types, target_cat,
                                                        target_info.architecture, hf_ids, progress)
        with meter.phase("reference draft (graph)"):
            # the target's embedding and head as the draft reads them: from the GGUF, by gguf-py; a
            # streamed target's embedding rows read as blocks need them, its head shared when the same
            embed, lm_head, rows = gguf_vocab_tables(
                cfg.target, lazy=reference_target.streamed,
                head_in_memory=reference_target.lm_head if reference_target.streamed else None)
            fill_rows = rows.fill if rows is not None else None
            ref_draft = load_draft(cfg.draft_hf or cfg.draft, embed, lm_head)
            if cfg.draft_hf:  # a reduced vocabulary is made at conversion: the HF weights, the GGUF's d2t
                _, _, vocabulary = read_draft_gguf(Path(cfg.draft))
                if vocabulary is not None:
                    ref_draft.set_vocabulary(*vocabulary)
            if ref_draft.config.n_taps != len(side.target_layer_ids):
                raise ValueError(f"the HF draft has {ref_draft.config.n_taps} target layers, the GGUF "
                                 f"{len(side.target_layer_ids)}: not the same draft")
            report["stages"]["graph"] = stage_graph(cfg, side.graph, ref_draft, draft_cat, B.category(head),
                                                    progress, fill_rows)
        if cfg.end_to_end:
            with meter.phase("reference target and draft (end to end)"):
                report["stages"]["end_to_end"] = stage_end_to_end(cfg, side, reference_target, ref_draft,
                                                                  progress, fill_rows)
        else:
            report["stages"]["end_to_end"] = {"status": "skipped", "reason": "--no-end-to-end"}
    finally:
        progress.close()
    report["resources"] = meter.summary()
    report["first_divergence"] = first_divergence(report)
    report["passed"] = all(s["status"] != "fail" for s in report["stages"].values())
    return report
