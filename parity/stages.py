"""The four parity stages. Each returns a JSON-ready dict with a `status` ("pass", "fail" or
"skipped") and its numbers; `run_parity` runs them in order and finds the first divergence.

1. converter: every GGUF tensor against the Hugging Face safetensors (needs --draft-hf);
2. capture: our runtime's target features against the reference target's hidden states, and the
   draft's target layers against its HF config;
3. graph: every named draft intermediate, reference vs runtime vs llama.cpp's `dflash` graph, on
   the same features and block;
4. end to end: drafted-token agreement, greedy speculative output == target greedy output, and the
   acceptance length (tau) of the three implementations on the same prompts.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_llama import schema as L
from dflash_llama.paths import display_path
from dflash_llama.results import first_mismatch

from . import bounds as B
from .graph import PAIRS, GraphComparison, drafted_tokens, first_reader, graph_order, layer_of, reference_trace, rel_err

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

    _, gguf_tensors, _ = read_draft_gguf(Path(cfg.draft))
    hf = {n: p.detach().float().numpy() for n, p in load_draft(cfg.draft_hf).named_parameters()}
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


def stage_capture(cfg: ParityConfig, rt, reference, target_cat: str, target_arch: str,
                  hf_ids: list[int] | None, progress) -> dict:
    """Runtime features of every target layer against the reference target's hidden states."""
    check = layer_check(rt.target_layer_ids, hf_ids)
    source = cfg.target_hf or cfg.target
    bound = B.capture_bound(target_cat, target_arch, hf=cfg.target_hf is not None)
    tokens = keep_last(rt.tokenize(cfg.prompts[0].text), cfg.max_context)
    n_layer = rt.n_layer
    ours = rt.capture(tokens, list(range(n_layer))).reshape(len(tokens), n_layer, -1)
    out = reference.forward(tokens, 0, reference.new_cache(), feature_layers=list(range(n_layer)))
    theirs = out.features.float().numpy().reshape(len(tokens), n_layer, -1)
    taps = set(rt.target_layer_ids)
    layers = [{"layer": i, "tap": i in taps, "error": rel_err(theirs[:, i], ours[:, i])} for i in range(n_layer)]
    if hf_ids is not None and check["status"] == "fail" and len(hf_ids) == len(rt.target_layer_ids):
        # what the draft reads against what it was trained on, layer by layer
        check["tap_errors"] = [{"gguf_id": g, "hf_id": h, "error": rel_err(theirs[:, h], ours[:, g])}
                               for g, h in zip(rt.target_layer_ids, hf_ids)]
    progress.step("capture")
    failing = [r for r in layers if r["error"] > bound]
    status = "fail" if failing or check["status"] == "fail" else "pass"
    return {"status": status, "reference": "hf" if cfg.target_hf else "gguf", "reference_path": display_path(source),
            "target_type": target_cat, "target_arch": target_arch, "bound": bound, "n_tokens": len(tokens),
            "layers": layers, "layer_check": check}


# ---------------------------------------------------------------- stage 3: graph

def graph_bounds(names: list[str], draft_cat: str, head_cat: str) -> dict[str, dict[str, float]]:
    """pair -> name -> bound."""
    out = {}
    for a, b in PAIRS:
        base = B.BOUNDS[draft_cat].graph_same if a != "reference" else B.BOUNDS[draft_cat].graph
        per = {n: base for n in names}
        per["result_output"] = max(base, B.BOUNDS[head_cat].head)
        out[f"{a}/{b}"] = per
    return out


def stage_graph(cfg: ParityConfig, rt, native, ref_draft, draft_cat: str, head_cat: str, progress) -> dict:
    names = graph_order(ref_draft.config.n_layer)
    comparison = GraphComparison(names)
    inputs = []
    for prompt in cfg.prompts[:cfg.graph_prompts]:
        tokens = keep_last(rt.tokenize(prompt.text), cfg.max_context)
        features = rt.capture(tokens[:-1])
        block = [tokens[-1]] + [rt.mask_token_id] * (rt.block_size - 1)
        traces = {"reference": reference_trace(ref_draft, features, block), "runtime": rt.trace_draft(features, block)}
        if native is not None:
            traces["native"] = native.trace(features, block)
        comparison.add(traces)
        inputs.append({"prompt": prompt.id, "n_context": len(tokens) - 1, "block": block})
        progress.step("graph")
    bounds = graph_bounds(names, draft_cat, head_cat)
    failures = []
    for name in names:
        for pair, errs in comparison.errors.items():
            if name in errs and errs[name] > bounds[pair][name]:
                failures.append({"name": name, "pair": pair, "error": errs[name], "bound": bounds[pair][name]})
    missing = {k: v for k, v in comparison.missing.items() if v}
    notes = []
    if native is not None:
        notes.append("native fc_out is read from llama.cpp's DFlash encoder graph (llama_process ENCODE); "
                     "the draft-dflash loop runs only the decoder graph, which names the normed "
                     "projection inp_g_embeddings and has no fc_out")
    else:
        notes.append("llama.cpp's graph was not run (--no-native)")
    return {"status": "fail" if failures or missing else "pass", "draft_type": draft_cat, "head_type": head_cat,
            "inputs": inputs, "names": names, "errors": comparison.errors, "bounds": bounds,
            "shapes": comparison.shapes, "missing": missing, "failures": failures, "notes": notes}


# ---------------------------------------------------------------- stage 4: end to end

def stage_end_to_end(cfg: ParityConfig, rt_e2e, rt, native, reference_target, ref_draft, progress) -> dict:
    """Per prompt: greedy speculative vs greedy target for the three implementations, their tau,
    and drafted-token agreement on replayed steps (all three drafts on identical inputs)."""
    import torch

    from dflash_llama.reference import generate_autoregressive, generate_speculative

    if reference_target.vocab_size != rt.n_vocab:
        raise ValueError(f"the reference target has {reference_target.vocab_size} tokens, the GGUF {rt.n_vocab}")
    n = cfg.n_predict
    block = rt.block_size
    rows = []
    agree = {f"{a}/{b}": [0, 0] for a, b in PAIRS}
    for prompt in cfg.prompts:
        tokens = keep_last(rt.tokenize(prompt.text), cfg.max_context)
        text = rt.detokenize(tokens)  # the exact text the native tool tokenizes (after a cut)
        row = {"prompt": prompt.id, "n_prompt": len(tokens)}

        # our runtime (llama.cpp's default f16 KV, as the native tool runs)
        ar = rt_e2e.autoregressive(tokens, n, stop_at_eog=False)
        spec = rt_e2e.generate(tokens, n, draft_max=None, stop_at_eog=False)  # the whole block, as the reference
        row["runtime"] = {"tau": spec.tau, "greedy_exact": spec.tokens == ar.tokens, "n_tokens": len(spec.tokens),
                          "first_mismatch": first_mismatch(spec.tokens, ar.tokens)}

        # the reference, on its own (transformers) target
        with torch.no_grad():
            r_ar = generate_autoregressive(reference_target, tokens, n)
            r_spec = generate_speculative(reference_target, ref_draft, tokens, n)
        row["reference"] = {"tau": r_spec.tau, "greedy_exact": r_spec.tokens == r_ar.tokens,
                            "n_tokens": len(r_spec.tokens),
                            "first_mismatch": first_mismatch(r_spec.tokens, r_ar.tokens),
                            "same_tokens_as_runtime": r_ar.tokens == ar.tokens}

        if native is not None:
            n_ctx = max(512, len(tokens) + n + 2 * block)
            row["native"] = native_row(cfg, text, n, block, n_ctx, rt_e2e.detokenize(ar.tokens))

        # drafted-token agreement: replay the runtime's first steps through all three drafts
        full = tokens + spec.tokens
        feats = rt.capture(full)
        produced = 1
        for step in spec.steps[:cfg.agreement_steps]:
            start = len(tokens) + produced - 1  # position of the step's anchor token
            blk = [full[start]] + [rt.mask_token_id] * (block - 1)
            drafts = {"reference": drafted_tokens(reference_trace(ref_draft, feats[:start], blk), rt.n_vocab),
                      "runtime": drafted_tokens(rt.trace_draft(feats[:start], blk), rt.n_vocab)}
            if native is not None:
                drafts["native"] = drafted_tokens(native.trace(feats[:start], blk), rt.n_vocab)
            for a, b in PAIRS:
                if a in drafts and b in drafts:
                    agree[f"{a}/{b}"][0] += sum(x == y for x, y in zip(drafts[a], drafts[b]))
                    agree[f"{a}/{b}"][1] += len(drafts[a])
            produced += step.produced
        rows.append(row)
        progress.step("end to end")

    impls = ["reference", "runtime"] + (["native"] if native is not None else [])
    tau = {}
    exact = {}
    for impl in impls:
        vals = [r[impl]["tau"] for r in rows if r.get(impl, {}).get("tau") is not None]
        tau[impl] = float(np.mean(vals)) if vals else None
        exact[impl] = all(r[impl]["greedy_exact"] for r in rows)
    agreement = {k: (v[0] / v[1] if v[1] else None) for k, v in agree.items() if v[1]}
    errors = [r["native"]["error"] for r in rows if "error" in r.get("native", {})]
    status = "pass" if all(exact.values()) else "fail"
    return {"status": status, "n_predict": n, "block_size": block, "prompts": rows, "tau": tau,
            "greedy_exact": exact, "draft_agreement": agreement,
            "native_error": errors[0] if errors else None,
            "notes": ["runtime and native run llama.cpp's default KV cache (f16); native runs llama.cpp's "
                      "default flash-attention setting (auto), our runtime runs without; the reference runs "
                      "transformers in f32 on its own target, so its tokens may differ",
                      "native tau = n_predict / (n_predict - n_accept) from llama-speculative-simple's log; "
                      "its first block is anchored on the last prompt token (the published loop samples "
                      "the first token from the prefill)",
                      "native greedy_exact compares llama-speculative-simple's text with the same tool's "
                      "text at --spec-draft-n-max 0 (no drafts, one token per target decode), over the "
                      "shorter of the two; same_text_as_runtime tells whether it also equals our runtime's "
                      "autoregressive text (it need not: the tool decodes the last prompt token together "
                      "with the first block, and CPU flash attention is not batch-invariant)"]}


def native_row(cfg: ParityConfig, text: str, n: int, block: int, n_ctx: int, ar_text: str) -> dict:
    """llama.cpp's draft-dflash loop on one prompt, against the same tool drafting nothing (one
    token per target decode): its prompt handling (the last prompt token decoded with the first
    block) is its own, and CPU flash attention is not batch-invariant, so its greedy text is the
    fair baseline; agreement with our runtime's text (`ar_text`) is reported apart."""
    from dflash_llama import peers

    from .native import FLASH_ATTN

    try:
        runs = [peers.speculative(cfg.target, text, n, "draft-dflash", draft=cfg.draft, n_max=n_max,
                                  threads=cfg.n_threads, n_ctx=n_ctx, flash_attn=FLASH_ATTN, exe=cfg.native_tool)
                for n_max in (block - 1, 0)]
    except peers.PeerError as e:
        return {"tau": None, "greedy_exact": False, "error": str(e)}
    ns, plain = runs
    k = min(len(ns.text), len(plain.text))
    m = min(len(ns.text), len(ar_text))
    return {"tau": ns.tau, "greedy_exact": k > 0 and ns.text[:k] == plain.text[:k], "n_tokens": ns.n_tokens,
            "n_drafted": ns.n_drafted, "n_accept": ns.n_accept, "compared_chars": k,
            "same_text_as_runtime": ns.text[:m] == ar_text[:m]}


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
    bad = [r for r in cap.get("layers", []) if r["error"] > cap["bound"]]
    if bad:
        r = bad[0]
        return {"stage": "capture", "name": f"target_feat-{r['layer']}", "layer": r["layer"],
                "error": r["error"], "bound": cap["bound"],
                "message": f"target_feat-{r['layer']}: runtime capture vs reference hidden state "
                           f"{_fmt(r['error'])} > bound {_fmt(cap['bound'])}"}

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

    e2e = st.get("end_to_end", {})
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

def load_reference_target(path, quiet: bool = False):
    """The reference target, with transformers' notices off, and its progress bars too when quiet
    (its GGUF loader draws one of tqdm's own, which transformers' switch does not reach)."""
    import contextlib
    import io

    import transformers

    from dflash_llama.reference import Target

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
        return Target.load(path)


def run_parity(cfg: ParityConfig, progress_bar: bool = True) -> dict:
    """Run every stage on one target/draft pair; the report dict (parity.json's content)."""
    import torch

    import dflash_llama
    from dflash_llama import Runtime
    from dflash_llama.reference.checkpoint import load_draft, read_draft_gguf, read_hf_config
    from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

    from .native import NativeDraft

    torch.set_num_threads(max(1, cfg.n_threads))
    if not cfg.prompts:
        raise ValueError("no prompts")
    for path, what in ((cfg.target, "--target"), (cfg.draft, "--draft")):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{what} {path}: no such file")
    for path, what in ((cfg.draft_hf, "--draft-hf"), (cfg.target_hf, "--target-hf")):
        if path is not None and not Path(path).is_dir():
            raise FileNotFoundError(f"{what} {path}: not a directory")

    n_graph = min(cfg.graph_prompts, len(cfg.prompts))
    progress = Progress(1 + 1 + n_graph + (len(cfg.prompts) if cfg.end_to_end else 0), progress_bar)
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
        rt = Runtime(cfg.target, cfg.draft, n_threads=cfg.n_threads, n_ctx=n_ctx, kv_f32=True, compact_draft_head=False)
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
                       "native_build": cfg.native_build},
            "types": {"draft": draft_cat, "target": target_cat, "head": head,
                      "head_category": B.category(head)},
            "stages": {},
        }
        report["stages"]["converter"] = stage_converter(cfg)
        progress.step("converter")
        reference_target = load_reference_target(cfg.target_hf or cfg.target, quiet=not progress_bar)
        report["stages"]["capture"] = stage_capture(cfg, rt, reference_target, target_cat,
                                                    target_info.architecture, hf_ids, progress)

        tw = target_weights_from_gguf(cfg.target)
        ref_draft = load_draft(cfg.draft_hf or cfg.draft, tw.embed_tokens, tw.lm_head)
        if cfg.draft_hf:  # a reduced vocabulary is made at conversion: the HF weights, the GGUF's d2t
            _, _, vocabulary = read_draft_gguf(Path(cfg.draft))
            if vocabulary is not None:
                ref_draft.set_vocabulary(*vocabulary)
        if ref_draft.config.n_taps != len(rt.target_layer_ids):
            raise ValueError(f"the HF draft has {ref_draft.config.n_taps} target layers, the GGUF "
                             f"{len(rt.target_layer_ids)}: not the same draft")
        native = NativeDraft(rt, cfg.draft, n_ctx=n_ctx, n_threads=cfg.n_threads) if cfg.native else None
        report["stages"]["graph"] = stage_graph(cfg, rt, native, ref_draft, draft_cat,
                                                B.category(head), progress)
        if cfg.end_to_end:
            rt_e2e = Runtime(cfg.target, cfg.draft, n_threads=cfg.n_threads, n_ctx=n_ctx)
            report["stages"]["end_to_end"] = stage_end_to_end(cfg, rt_e2e, rt, native, reference_target,
                                                              ref_draft, progress)
        else:
            report["stages"]["end_to_end"] = {"status": "skipped", "reason": "--no-end-to-end"}
    finally:
        progress.close()
    report["first_divergence"] = first_divergence(report)
    report["passed"] = all(s["status"] != "fail" for s in report["stages"].values())
    return report
