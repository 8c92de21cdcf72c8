"""Where the pinned llama.cpp's DFlash path disagrees with the published model: one small,
runnable reproduction per finding of docs/upstream_status.md.

    python -m dflash_llama.parity.findings            # all
    python -m dflash_llama.parity.findings U3 U5      # some
    python -m dflash_llama.parity.findings --patched  # each on the pinned build and on patches/series
    python -m dflash_llama.parity.findings --dflash2-study [PAIR [N]]  # DFlash 2 drafts at each n_max
    python -m dflash_llama.parity.findings --refuted  # suspected divergences a run refuted, checked again

Each prints what it measured and whether the divergence is present; the exit status is the number
of findings reproduced (0 once llama.cpp has fixed them all). With `--patched`, each finding the
series patches runs on both builds, and the exit status is the number not shown fixed (a finding
with no patch counts when it reproduces). Tiny fixtures are built on demand into the parity cache
folder (`$DFLASH_LLAMA_CACHE`).
"""

from __future__ import annotations

import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def tiny_fixture(name: str, **draft):
    """(target HF dir, target GGUF, draft HF dir, draft GGUF f32) for a tiny draft config."""
    from dflash_llama import fixtures
    from dflash_llama.converter import convert

    from . import registry

    cache = registry.cache_dir()
    target_hf, target = registry.tiny_target(cache)
    hf = cache / f"finding-{name}-hf"
    if not (hf / "model.safetensors").exists():
        fixtures.tiny_draft_hf(hf, target_hf, fixtures.TinyDraftConfig(**draft))
    gguf = cache / f"finding-{name}-f32.gguf"
    if not gguf.exists():
        convert(hf, target, gguf, outtype="f32")
    return target_hf, target, hf, gguf


def registry_fixture(name: str) -> tuple[Path, Path]:
    """(target GGUF, draft GGUF) of a fixture pair of parity/registry.toml, built on demand."""
    from . import registry

    pairs, defaults = registry.load()
    pair = next((p for p in pairs if p.name == name), None)
    if pair is None:
        raise ValueError(f"no pair {name} in {registry.REGISTRY_PATH}")
    r = registry.resolve(pair, defaults)
    return r.target, r.draft


def gemma3_fixture() -> tuple[Path, Path]:
    return registry_fixture("tiny-gemma3-f32")


def _traces(target, gguf, hf, block_len=None):
    import torch

    import dflash_llama
    from dflash_llama.reference.checkpoint import load_draft
    from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

    from .graph import reference_trace
    from .native import NativeDraft

    torch.set_num_threads(1)
    rt = dflash_llama.Runtime(target, gguf, n_threads=1, n_ctx=256, kv_f32=True, compact_draft_head=False)
    native = NativeDraft(rt, gguf, n_ctx=256, n_threads=1)
    tokens = rt.tokenize(PROMPT)
    feats = rt.capture(tokens[:-1])
    block = [tokens[-1]] + [rt.mask_token_id] * ((block_len or rt.block_size) - 1)
    tw = target_weights_from_gguf(target)
    ref = reference_trace(load_draft(hf, tw.embed_tokens, tw.lm_head), feats, block)
    return rt, native, feats, block, ref, rt.trace_draft(feats, block), native.trace(feats, block)


def u1_converter_default_layers() -> bool:
    """U1: the pinned converter writes no dflash.target_layers for a draft whose config relies on
    the default taps, and llama.cpp then refuses the file."""
    from dflash_llama import fixtures, gguf_info

    target_hf, target, hf, _ = tiny_fixture("u1", layers=2, block_size=8, seed=41)  # no target_layer_ids
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pinned.gguf"
        fixtures.run_pinned_converter([str(hf), "--target-model-dir", str(target_hf), "--outfile", str(out),
                                       "--outtype", "f32"])
        has = "dflash.target_layers" in gguf_info(out).metadata
        r = _speculative_simple(target, out)
    print(f"U1: pinned convert_hf_to_gguf.py wrote dflash.target_layers: {has}; llama-speculative-simple "
          f"exit code {r.returncode}: {_last(r, 'target_layers')}")
    return not has and r.returncode != 0


def u2_last_layer_tap() -> bool:
    """U2: a tap on the target's last layer aborts draft-dflash (no input tensor for layer n_layer)."""
    _, target, _, gguf = tiny_fixture("u2", layers=1, target_layer_ids=[3], block_size=4, seed=42)
    r = _speculative_simple(target, gguf)
    print(f"U2: tap on target layer 3 of 4: llama-speculative-simple exit code {r.returncode}: "
          f"{_last(r, 'GGML_ASSERT')}")
    return r.returncode != 0 and "layer input tensor is null" in r.stderr


def u3_fixture():
    """A 2-layer draft whose layer 1 is a sliding-window layer (window 4, block 8)."""
    return tiny_fixture("u3", layers=2, heads=4, kv_heads=1, target_layer_ids=[0, 2], block_size=8, seed=43,
                        layer_types=["full_attention", "sliding_attention"], sliding_window=4)


def u3_sliding_layers_non_causal() -> bool:
    """U3: sliding-window draft layers are causal in the published model, not in llama.cpp."""
    from .graph import rel_err

    _, target, hf, gguf = u3_fixture()
    *_, ref, ours, native = _traces(target, gguf, hf)
    e_rt, e_nat = rel_err(ref["ffn_inp-1"], ours["ffn_inp-1"]), rel_err(ref["ffn_inp-1"], native["ffn_inp-1"])
    print(f"U3: sliding layer 1, ffn_inp-1 vs reference: runtime {e_rt:.1e}, llama.cpp {e_nat:.1e}")
    return e_nat > 1e-2 and e_rt < 1e-4


def u4_probabilities() -> tuple[np.ndarray, np.ndarray]:
    """Top-token probabilities (top-10 softmax) at block positions 1.. of the U4 fixture: from the
    raw head output llama.cpp's draft-dflash uses, and from the published (scaled, capped) logits."""
    import torch

    from dflash_llama.reference.checkpoint import load_draft

    _, target, hf, gguf = tiny_fixture("u4", layers=1, target_layer_ids=[1], block_size=8, seed=44,
                                extra_config={"output_multiplier": 0.25, "final_logit_softcapping": 2.0})
    rt, native, feats, block, ref, ours, nat = _traces(target, gguf, hf)
    raw = nat["result_output"].reshape(len(block), -1)[1:]
    published = load_draft(gguf).finish_logits(torch.from_numpy(raw)).numpy()
    return _top_p(raw), _top_p(published)


def u4_logit_scale_ignored() -> bool:
    """U4: dflash.logit_scale and dflash.final_logit_softcapping are not applied to DFlash 1 drafts
    anywhere (graph or sampler): draft-dflash's --spec-draft-p-min sees raw probabilities."""
    p_raw, p_pub = u4_probabilities()
    print(f"U4: logit_scale 0.25, softcap 2.0: top-token probability (top-10 softmax, what "
          f"--spec-draft-p-min compares) draft-dflash {p_raw.mean():.3f}, published logits {p_pub.mean():.3f} "
          f"(mean over the block)")
    return bool(np.abs(p_raw - p_pub).max() > 1e-2)


def u5_block_length() -> bool:
    """U5: draft-dflash runs a block of --spec-draft-n-max + 1 tokens, not the trained block size; with
    non-causal attention over the block, a shorter block drafts other tokens."""
    from .graph import drafted_tokens

    _, target, hf, gguf = tiny_fixture("u5", layers=2, target_layer_ids=[1, 2], block_size=8, seed=45)
    rt, native, feats, block, *_ = _traces(target, gguf, hf)
    full = drafted_tokens(native.trace(feats, block), rt.n_vocab)[:3]
    short = drafted_tokens(native.trace(feats, block[:4]), rt.n_vocab)[:3]
    n_full = native.trace(feats, block)["l_out-1"].reshape(len(block), -1)[1:4]
    n_short = native.trace(feats, block[:4])["l_out-1"].reshape(4, -1)[1:4]
    diff = float(np.linalg.norm(n_full - n_short) / np.linalg.norm(n_full))
    print(f"U5: first 3 drafted tokens with the trained block of 8: {full}; with --spec-draft-n-max 3 "
          f"(block of 4): {short}; l_out-1 at those positions differs by {diff:.1e}")
    return diff > 1e-3


def u7_gemma3_no_layer_inputs() -> bool:
    """U7: the gemma3 graph sets no layer inputs, so draft-dflash's capture aborts."""
    target, draft = gemma3_fixture()
    r = _speculative_simple(target, draft)
    print(f"U7: gemma3 target: llama-speculative-simple exit code {r.returncode}: {_last(r, 'GGML_ASSERT')}")
    return r.returncode != 0 and "layer input tensor is null" in r.stderr


def u9_speculators_dflash2() -> bool:
    """U9: the pinned converter cannot read a DFlash 2 draft in vLLM speculators' format: `DFlashModel`
    reads the Qwen3 settings at the top level, where speculators nests them (`transformer_layer_config`).
    Ours writes the bytes of the same weights converted from z-lab's format."""
    from dflash_llama import fixtures
    from dflash_llama.converter import convert

    target_hf, target, hf, gguf = tiny_fixture("u9", variant="dflash2", layers=1, target_layer_ids=[1], seed=49)
    with tempfile.TemporaryDirectory() as tmp:
        spec = fixtures.speculators_draft_hf(Path(tmp) / hf.name, hf)  # the same name: the same general.name
        try:
            fixtures.run_pinned_converter([str(spec), "--target-model-dir", str(target_hf), "--outfile",
                                           str(Path(tmp) / "pinned.gguf"), "--outtype", "f32"])
            error = None
        except RuntimeError as e:
            error = str(e).strip().splitlines()[-1]
        same = convert(spec, target, Path(tmp) / "ours.gguf", "f32").read_bytes() == gguf.read_bytes()
    print(f"U9: speculators-format DFlash 2 draft: pinned convert_hf_to_gguf.py "
          f"{'failed: ' + error if error else 'wrote a file'}; ours gave the z-lab conversion's bytes: {same}")
    return error is not None


# --- DFlash 2 in llama.cpp: what lowers acceptance (docs/upstream_status.md, "DFlash 2") -----------

DFLASH2_STUDY_PAIR = "tiny-dflash2-f32"  # registry pair: block 8, top-K 4, non-causal


def dflash2_contexts(rt, n_contexts: int, prompt: str = PROMPT) -> tuple[np.ndarray, list[int], list[int]]:
    """Features of the prompt and the target's greedy continuation, and the positions whose
    anchors the study drafts from (the last prompt token, then each generated one)."""
    tokens = rt.tokenize(prompt)
    ar = rt.autoregressive(tokens, n_contexts, stop_at_eog=False)
    full = tokens + ar.tokens
    return rt.capture(full), full, list(range(len(tokens) - 1, len(tokens) - 1 + n_contexts))


def prefix_match(a: list[int], b: list[int]) -> int:
    """How many leading tokens of a equal b's: what a verify would accept of `a` were `b` the target's."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def lattice_confidence(packed: np.ndarray, k: int) -> list[float]:
    """The softmax probability of each step of llama.cpp's walk at its argmax, as draft-dflash
    compares it with --spec-draft-p-min (1 / sum(exp(s - s_max)))."""
    from .graph import llama_walk_steps

    return [float(1.0 / np.exp(scores - scores.max()).sum()) for _, scores in llama_walk_steps(packed, k)]


def registry_sides(pair: str, n_ctx: int = 512):
    """A registry pair's three sides: (the resolved pair, our runtime, llama.cpp's graph on the same
    target, the reference draft), single-threaded, f32 KV caches."""
    import torch

    import dflash_llama
    from dflash_llama.reference.checkpoint import load_draft
    from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

    from . import registry
    from .native import NativeDraft

    pairs, defaults = registry.load()
    r = registry.resolve(next(p for p in pairs if p.name == pair), defaults)
    torch.set_num_threads(1)
    rt = dflash_llama.Runtime(r.target, r.draft, n_threads=1, n_ctx=n_ctx, kv_f32=True, compact_draft_head=False)
    tw = target_weights_from_gguf(r.target)
    return r, rt, NativeDraft(rt, r.draft, n_ctx=n_ctx, n_threads=1), load_draft(r.draft_hf, tw.embed_tokens,
                                                                               tw.lm_head)


def dflash2_acceptance_study(pair: str = DFLASH2_STUDY_PAIR, n_contexts: int = 24,
                             n_max: tuple[int, ...] = (1, 3, 7), p_min: tuple[float, ...] = (0.5, 0.75, 0.9)) -> dict:
    """llama.cpp's DFlash 2 drafts against the reference's at the trained block B, on the same
    contexts: for each --spec-draft-n-max (a block of n_max + 1; B - 1 added), per-position
    agreement with the reference's walked path and the mean accepted length were the reference's drafts
    the target's (1 + matching prefix: the tau that block could reach where the trained block reaches
    B); then --spec-draft-p-min's truncation of the full-block walk, and exact ties in the walks."""
    from .graph import LLAMA_LATTICE, drafted_tokens, llama_walk_steps, reference_trace

    _, rt, native, ref_draft = registry_sides(pair)
    B, k, mask = rt.block_size, native.selector_top_k, rt.mask_token_id
    feats, full, starts = dflash2_contexts(rt, n_contexts)
    widths = sorted({*(n for n in n_max if n < B - 1), B - 1})  # draft-dflash clamps n_max to B - 1
    agree = {n: np.zeros(min(n, B - 1)) for n in widths}
    accepted = {n: 0.0 for n in widths}
    conf, ties, ref_ties = [], 0, 0
    for t in starts:
        ctx = feats[:t]
        block = [full[t]] + [mask] * (B - 1)
        ref = reference_trace(ref_draft, ctx, block)
        want = drafted_tokens(ref, rt.n_vocab)
        scores = np.asarray(ref["selector_scores"])
        index = 0  # ties in the reference's walk: a row whose maximum is not unique
        for slot, tok in enumerate(want):
            row = scores[slot, index]
            ref_ties += int((row == row.max()).sum() > 1)
            index = int(np.flatnonzero(np.asarray(ref["selector_candidates"])[slot] == tok)[0])
        for n in widths:
            trace = native.trace(ctx, [full[t]] + [mask] * n)
            got = drafted_tokens(trace, rt.n_vocab, k)[:n]
            m = min(n, B - 1)
            agree[n] += np.array([a == b for a, b in zip(got[:m], want[:m])], dtype=float)
            accepted[n] += 1 + prefix_match(got, want)
            if n == B - 1:
                conf.append(lattice_confidence(trace[LLAMA_LATTICE], k))
                ties += sum(int((s == s.max()).sum() > 1) for _, s in llama_walk_steps(trace[LLAMA_LATTICE], k))
    n_ctx = len(starts)
    conf_arr = np.array(conf)  # [contexts, B - 1]
    truncated = {p: float(np.mean([next((i for i, c in enumerate(row) if c < p), len(row)) for row in conf_arr]))
                 for p in p_min}
    return {"pair": pair, "block_size": B, "top_k": k, "contexts": n_ctx,
            "rows": [{"n_max": n, "block": n + 1, "agreement": (agree[n] / n_ctx).tolist(),
                      "mean_agreement": float(agree[n].sum() / (n_ctx * len(agree[n]))),
                      "tau_if_reference_exact": accepted[n] / n_ctx, "tau_cap": n + 1} for n in widths],
            "p_min_mean_drafted": truncated, "mean_walk_confidence": float(conf_arr.mean()),
            "ties": {"native": ties, "reference": ref_ties, "steps": n_ctx * (B - 1)}}


def u10_dflash2_default_block() -> bool:
    """U10: DFlash 2 drafts in llama.cpp run U5's block of --spec-draft-n-max + 1 (default n_max 3: a
    block of 4) instead of the trained block: the non-causal block and its convolutions see other
    MASK positions, the selector walks other candidates, and tau is capped at 4."""
    out = dflash2_acceptance_study(n_contexts=8, n_max=(3,))
    rows = {r["n_max"]: r for r in out["rows"]}
    B = out["block_size"]
    short, full = rows[3], rows[B - 1]
    print(f"U10: {out['pair']} (B = {B}, top-K {out['top_k']}), {out['contexts']} contexts: llama.cpp's drafts "
          f"against the reference's at B: n_max {B - 1} agrees at {full['mean_agreement']:.0%} of positions, "
          f"n_max 3 (default) at {short['mean_agreement']:.0%} (per position {_pct(short['agreement'])}); "
          f"tau were the reference's drafts the target's: {full['tau_if_reference_exact']:.2f} vs "
          f"{short['tau_if_reference_exact']:.2f} (cap {short['tau_cap']})")
    return short["mean_agreement"] < 1.0 or short["tau_cap"] < full["tau_cap"]


def dflash2_study_table(out: dict) -> str:
    """The study as markdown: one row per --spec-draft-n-max, then p-min and ties."""
    lines = [f"{out['pair']}: B = {out['block_size']}, top-K {out['top_k']}, {out['contexts']} contexts", "",
             "| n_max | block | agreement with the reference at B | per position | tau were the reference's drafts "
             "the target's | tau cap |", "|---:|---:|---:|---|---:|---:|"]
    for r in out["rows"]:
        lines.append(f"| {r['n_max']} | {r['block']} | {r['mean_agreement']:.1%} | {_pct(r['agreement'])} | "
                     f"{r['tau_if_reference_exact']:.2f} | {r['tau_cap']} |")
    lines += ["", f"mean walk confidence (softmax at the argmax) {out['mean_walk_confidence']:.3f}; mean drafted "
              "length under --spec-draft-p-min: " + ", ".join(f"{p} -> {n:.2f}" for p, n in
                                                            out["p_min_mean_drafted"].items())
              + f" (of {out['block_size'] - 1}); exact ties in the walks: llama.cpp {out['ties']['native']}, "
              f"reference {out['ties']['reference']} of {out['ties']['steps']} steps"]
    return "\n".join(lines)


def _pct(xs) -> str:
    return "/".join(f"{x:.0%}" for x in xs)


FINDINGS = {"U1": u1_converter_default_layers, "U2": u2_last_layer_tap, "U3": u3_sliding_layers_non_causal,
            "U4": u4_logit_scale_ignored, "U5": u5_block_length, "U7": u7_gemma3_no_layer_inputs,
            "U9": u9_speculators_dflash2, "U10": u10_dflash2_default_block}


def _top_p(logits: np.ndarray, k: int = 10) -> np.ndarray:
    """Probability of the top token among the top k, as draft-dflash's top-k 10 sampler computes it."""
    top = np.sort(logits, axis=-1)[:, -k:]
    z = np.exp(top - top[:, -1:])
    return z[:, -1] / z.sum(-1)


def _speculative_simple(target, draft):
    """llama-speculative-simple's draft-dflash loop on the finding's prompt, whatever its exit status."""
    from dflash_llama import peers

    from .native import FLASH_ATTN

    return peers.run_tool(peers.speculative_command(target, PROMPT, 8, "draft-dflash", draft=draft, n_max=3,
                                                    threads=1, n_ctx=256, flash_attn=FLASH_ATTN))


def _last(r, key: str) -> str:
    lines = [ln.strip() for ln in r.stderr.splitlines() if key in ln]
    return lines[-1] if lines else (r.stderr.strip().splitlines() or ["ok"])[-1]


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[:1] == ["--dflash2-study"]:  # [PAIR [N_CONTEXTS]]: the acceptance study's table
        pair = argv[1] if len(argv) > 1 else DFLASH2_STUDY_PAIR
        print(dflash2_study_table(dflash2_acceptance_study(pair, int(argv[2]) if len(argv) > 2 else 24)))
        return 0
    if argv[:1] == ["--refuted"]:  # suspected divergences a run refuted: exit status = how many diverge now
        diverging = 0
        for name, check in REFUTED.items():
            present = check()
            print(f"{name}: {'DIVERGES' if present else 'refuted (no divergence)'}")
            diverging += present
        return diverging
    on_patched = "--patched" in argv
    names = [a for a in argv if a != "--patched"] or list(FINDINGS)
    unknown = [n for n in names if n not in FINDINGS]
    if unknown:
        print(f"unknown finding(s) {', '.join(unknown)}; known: {', '.join(FINDINGS)}", file=sys.stderr)
        return 255
    if on_patched:
        return _main_patched(names)
    reproduced = 0
    for name in names:
        present = FINDINGS[name]()
        print(f"{name}: {'REPRODUCED' if present else 'not reproduced (fixed?)'}")
        reproduced += present
    return reproduced


def _main_patched(names: list[str]) -> int:
    from . import patched

    patches = patched.series()
    in_series = {p.name for p in patches}
    with_patch = [n for n in names if n in patched.SHOW and patched.SHOW[n][0] in in_series]
    count = patched.show(with_patch, patched.patched_build(patches)) if with_patch else 0
    for name in names:
        if name not in with_patch:
            present = FINDINGS[name]()
            print(f"{name}: no patch in patches/series; on the pinned build: "
                  f"{'REPRODUCED' if present else 'not reproduced'}")
            count += present
    return count


def u11_hybrid_rollback_across_requests() -> bool:
    """U11: llama-server with a DFlash draft on a hybrid (recurrent) target: with several requests in
    flight, a verify rolled back through the recurrent memory's per-token snapshots sometimes leaves a
    request's text other than the plain target's greedy text (never with one request, never without a
    draft, never on a dense target). Runs the serving check's rollback check, which owns the server."""
    import json
    import subprocess

    from . import registry

    out = registry.cache_dir() / "finding-u11"
    r = subprocess.run([sys.executable, "-m", "dflash_llama.bench.serving_check", "--out", str(out),
                        "--rollback-check", "6", "--n-max", "7"], capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"the serving check exited with {r.returncode}:\n{r.stderr.strip()[-1500:]}")
    runs = json.loads((out / "rollback_check.json").read_text())
    one, eight = (sum(map(bool, runs[f"np{n}"])) for n in (1, 8))
    print(f"U11: tiny qwen35 target, random draft (every verify rolls back 7), 16 prompts, {runs['runs']} runs "
          f"each: texts not the plain target's in {one} runs at -np 1, {eight} at -np 8")
    return one == 0 and eight > 0


FINDINGS["U11"] = u11_hybrid_rollback_across_requests


# --- DSpark drafts in llama.cpp (docs/variants.md, "The pinned llama.cpp's converter and loop") -----

# a tiny DeepSpec-format DSpark draft (own copies of the target's embeddings and head, as published);
# taps 0 and 2 (a tap on the last of the 4 target layers would hit U2)
DSPARK_DRAFT = dict(variant="dspark", target_layer_ids=[0, 2], block_size=6, markov_rank=8, dtype="float32")
# Qwen3Config's defaults that speculators' config diff omits (the tiny draft's values are these)
SPECULATORS_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0}
_DRAFT_CANDIDATE = re.compile(r"draft candidate\s+0, pos\s+\d+:\s+(\d+) ")
_ACCEPTED = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((\d+)\)")


@dataclass
class ToolSteps:
    """llama-speculative-simple's steps, read from its debug log: per verify the drafted tokens, how
    many the target accepted and its own next token; and the tool's totals."""
    drafts: list[list[int]]
    accepted: list[int]
    last: list[int]
    n_drafted: int
    n_accept: int
    log: str

    def sequence(self, prompt: list[int]) -> tuple[list[int], list[int]]:
        """The tokens the run decoded (prompt first) and each step's anchor position: the tool's first
        step drafts from the prompt's last token, every later one from the token the step before added."""
        seq, anchors = list(prompt), []
        for drafted, n, last in zip(self.drafts, self.accepted, self.last):
            anchors.append(len(seq) - 1)
            seq += drafted[:n] + [last]
        return seq, anchors


def tool_steps(target, draft, spec_type: str | None = "draft-dspark", n_predict: int = 12,
               n_max: int | None = DSPARK_DRAFT["block_size"], extra: Sequence[str] = ()) -> ToolSteps:
    """Run llama-speculative-simple (greedy, -fa off, -lv 5) and read every step's drafted tokens.
    spec_type None: no --spec-type, so the tool picks one from the draft file as it does by default.
    n_max: the trained block by default (the tool clamps it to what its layout drafts): its default 3
    would run a shorter block than the published model's (U5)."""
    from dflash_llama import peers

    cmd = peers.speculative_command(target, PROMPT, n_predict, spec_type or "draft-dflash", draft=draft, n_max=n_max,
                                    threads=1, n_ctx=256, extra_args=["-lv", "5", *extra])
    if spec_type is None:
        i = cmd.index("--spec-type")
        del cmd[i:i + 2]
    r = peers.run_tool(cmd)
    if r.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple exited with {r.returncode}: {_last(r, 'error')}")
    drafts, accepted, last, current = [], [], [], []
    for line in r.stderr.splitlines():
        if m := _DRAFT_CANDIDATE.search(line):
            current.append(int(m.group(1)))
        elif m := _ACCEPTED.search(line):
            n, n_sent, tok = (int(g) for g in m.groups())
            drafts.append(current[:n_sent])  # near -n the tool truncates the draft it sends
            accepted.append(n)
            last.append(tok)
            current = []
    res = peers.parse_speculative(r.stdout, r.stderr, PROMPT, n_predict)
    return ToolSteps(drafts, accepted, last, res.n_drafted, res.n_accept, r.stderr)


def reference_drafts(target, draft_hf, steps: ToolSteps, markov: bool = True) -> list[list[int]]:
    """What the published model (our PyTorch reference on the checkpoint) drafts at each of the tool's
    steps: the same anchors, the context's target features captured by llama.cpp (our runtime's
    capture, no draft), its whole trained block, greedy Markov chain (markov False: without the Markov
    bias, what a graph that skips it drafts)."""
    import torch

    import dflash_llama
    from dflash_llama.reference.checkpoint import load_draft
    from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

    torch.set_num_threads(1)
    tw = target_weights_from_gguf(target)
    ref = load_draft(draft_hf, tw.embed_tokens, tw.lm_head)
    if not markov:
        ref.markov_head = ref.confidence_head = None
    rt = dflash_llama.Runtime(target, None, n_threads=1, n_ctx=256)
    seq, anchors = steps.sequence(rt.tokenize(PROMPT))
    feats = torch.from_numpy(rt.capture(seq, ref.target_layer_ids))
    block = [ref.mask_token_id] * ref.block_size
    with torch.inference_mode():
        return [ref.draft_chain(feats[:t], [seq[t]] + block[1:], t).tokens.tolist() for t in anchors]


def agreement(got: list[list[int]], want: list[list[int]], shift: int = 0) -> tuple[int, int]:
    """(positions where got[s][i] == want[s][i + shift], positions compared) over all steps."""
    pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w[shift:])]
    return sum(a == b for a, b in pairs), len(pairs)


def tau_if_reference_exact(got: list[list[int]], want: list[list[int]]) -> float:
    """Mean tokens per verify were the reference's drafts the target's text: 1 + the prefix of `got`
    that the reference drafted (as U10 measures it)."""
    return sum(1 + prefix_match(g, w) for g, w in zip(got, want)) / len(got)


def dspark_fixture(name: str, **draft) -> tuple[Path, Path, Path, Path]:
    """(target HF dir, target GGUF, DeepSpec-format draft dir, our converter's f32 GGUF)."""
    return tiny_fixture(name, **{**DSPARK_DRAFT, **draft})


def pinned_conversion(draft_dir: Path, target_hf: Path, out: Path) -> Path:
    from dflash_llama import fixtures

    fixtures.run_pinned_converter([str(draft_dir), "--target-model-dir", str(target_hf), "--outfile", str(out),
                                   "--outtype", "f32"])
    return out


def u12_dspark_own_head_dropped() -> bool:
    """U12: the pinned converter drops a DeepSpec DSpark draft's lm_head (full vocabulary) and keeps its
    embeddings as token_embd, which the loader then takes for the head: for an untied target (Qwen3-8B,
    14B) the draft proposes from the wrong matrix."""
    from dflash_llama import gguf_info

    target_hf, target, hf, ours = dspark_fixture("u12", seed=61)
    with tempfile.TemporaryDirectory() as tmp:
        pinned = pinned_conversion(hf, target_hf, Path(tmp) / "pinned.gguf")
        names = {t.name for t in gguf_info(pinned).tensors}
        on_pinned = tool_steps(target, pinned)
    on_ours = tool_steps(target, ours)
    want = reference_drafts(target, hf, on_ours)
    a_pin = agreement(on_pinned.drafts, reference_drafts(target, hf, on_pinned))
    a_ours = agreement(on_ours.drafts, want)
    print(f"U12: DeepSpec DSpark draft, untied tiny target: pinned convert_hf_to_gguf.py wrote token_embd.weight "
          f"{'token_embd.weight' in names}, output.weight {'output.weight' in names}; draft-dspark drafts equal to "
          f"the reference's: pinned GGUF {a_pin[0]}/{a_pin[1]}, ours {a_ours[0]}/{a_ours[1]}")
    return "output.weight" not in names and "token_embd.weight" in names and a_pin[0] < a_pin[1] and \
        a_ours[0] == a_ours[1]


def u13_speculators_layout_guessed() -> bool:
    """U13: a speculators DSpark checkpoint without sample_from_anchor (speculators' default: true,
    anchor-first) gets dflash.sample_from_anchor = false from the pinned converter, which guesses the
    layout from the config's shape: llama.cpp then drafts in DFlash's layout, one slot later."""
    import json

    from dflash_llama import fixtures, gguf_info
    from dflash_llama.converter import convert

    target_hf, target, hf, _ = dspark_fixture("u13", seed=62)
    with tempfile.TemporaryDirectory() as tmp:
        spec = fixtures.dspark_draft_as(Path(tmp) / "spec", hf, "speculators")
        config = json.loads((spec / "config.json").read_text())
        del config["sample_from_anchor"]
        # the two defaults speculators' diff leaves out and the pinned converter then never writes (U17)
        config["transformer_layer_config"].update(SPECULATORS_DEFAULTS)
        (spec / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        pinned = pinned_conversion(spec, target_hf, Path(tmp) / "pinned.gguf")
        ours = convert(spec, target, Path(tmp) / "ours.gguf", "f32")
        keys = [gguf_info(p).get("dflash.sample_from_anchor") for p in (pinned, ours)]
        on_pinned, on_ours = tool_steps(target, pinned), tool_steps(target, ours)
    want_p, want_o = reference_drafts(target, hf, on_pinned), reference_drafts(target, hf, on_ours)
    a_pin, a_ours = agreement(on_pinned.drafts, want_p), agreement(on_ours.drafts, want_o)
    print(f"U13: speculators DSpark draft without sample_from_anchor: dflash.sample_from_anchor pinned {keys[0]}, "
          f"ours {keys[1]}; draft-dspark drafts equal to the anchor-first reference's: pinned GGUF {a_pin[0]}/"
          f"{a_pin[1]} ({max(map(len, on_pinned.drafts))} a step), ours {a_ours[0]}/{a_ours[1]} "
          f"({max(map(len, on_ours.drafts))} a step); tau were the reference's drafts the target's: "
          f"{tau_if_reference_exact(on_pinned.drafts, want_p):.2f} vs "
          f"{tau_if_reference_exact(on_ours.drafts, want_o):.2f}")
    return keys[0] is False and a_pin[0] < a_pin[1]


def u14_anchor_first_dflash_as_draft_dflash() -> bool:
    """U14: DeepSpec's anchor-first "DFlash" drafts (Qwen3DSparkModel, markov_rank 0) carry no markov_w1,
    so llama.cpp picks draft-dflash for them, which ignores dflash.sample_from_anchor: it reads block
    positions 1.. as the drafts for anchor + 1.., each one slot later than the draft was trained for."""
    from dflash_llama import gguf_info

    target_hf, target, hf, ours = dspark_fixture("u14", markov_rank=0, seed=63)
    with tempfile.TemporaryDirectory() as tmp:
        pinned = gguf_info(pinned_conversion(hf, target_hf, Path(tmp) / "pinned.gguf"))
    key, markov = pinned.get("dflash.sample_from_anchor"), "markov_w1.weight" in {t.name for t in pinned.tensors}
    auto = tool_steps(target, ours, spec_type=None)  # our GGUF: the same keys, the target's head (not U12's)
    detected = "auto-detected speculative type 'draft-dflash'" in auto.log
    dspark = tool_steps(target, ours, spec_type="draft-dspark")
    want_a, want_d = reference_drafts(target, hf, auto), reference_drafts(target, hf, dspark)
    same, shifted, explicit = agreement(auto.drafts, want_a), agreement(auto.drafts, want_a, 1), \
        agreement(dspark.drafts, want_d)
    print(f"U14: DeepSpec anchor-first DFlash draft (block {DSPARK_DRAFT['block_size']}): pinned converter wrote "
          f"sample_from_anchor {key}, markov_w1 {markov}; with no --spec-type the tool auto-detects draft-dflash: "
          f"{detected}; its drafts equal the reference's at the same slot {same[0]}/{same[1]}, at the next slot "
          f"{shifted[0]}/{shifted[1]}; --spec-type draft-dspark: {explicit[0]}/{explicit[1]}; tau were the "
          f"reference's drafts the target's: {tau_if_reference_exact(auto.drafts, want_a):.2f} (draft-dflash) vs "
          f"{tau_if_reference_exact(dspark.drafts, want_d):.2f} (draft-dspark)")
    return key is True and not markov and detected and same[0] < same[1] and shifted[0] == shifted[1]


def u15_specforge_markov_type_unread() -> bool:
    """U15: the pinned converter checks markov_head_type at the top level of config.json only; SpecForge
    writes it in dflash_config, so a SpecForge draft with a gated Markov head is not refused as one."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from dflash_llama import fixtures

    target_hf, _, hf, _ = dspark_fixture("u15", seed=64)
    with tempfile.TemporaryDirectory() as tmp:
        sf = fixtures.dspark_draft_as(Path(tmp) / "specforge", hf, "specforge")
        config = json.loads((sf / "config.json").read_text())
        config["dflash_config"]["markov_head_type"] = "gated"
        (sf / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        errors = {}
        for what in ("config", "tensors"):
            if what == "tensors":  # a gated head's gate over [hidden ; markov_w1 row] (speculators' names)
                tensors = load_file(sf / "model.safetensors")
                r, h = tensors["markov_head.markov_w1.weight"].shape[1], config["hidden_size"]
                tensors.update({"markov_head.gate_proj.weight": torch.zeros(r, h + r), "markov_head.gate_proj.bias":
                                torch.zeros(r)})
                save_file(tensors, str(sf / "model.safetensors"))
            try:
                pinned_conversion(sf, target_hf, Path(tmp) / f"{what}.gguf")
                errors[what] = None
            except RuntimeError as e:
                errors[what] = str(e).strip().splitlines()[-1]
        deepspec = json.loads((hf / "config.json").read_text())
        ds = Path(tmp) / "deepspec"
        ds.mkdir()
        (ds / "config.json").write_text(json.dumps({**deepspec, "markov_head_type": "gated"}))
        (ds / "model.safetensors").symlink_to(hf / "model.safetensors")
        try:
            pinned_conversion(ds, target_hf, Path(tmp) / "deepspec.gguf")
            top = None
        except RuntimeError as e:
            top = str(e).strip().splitlines()[-1]
    show = lambda e: "wrote a GGUF" if e is None else f"failed: {e}"  # noqa: E731
    print(f"U15: markov_head_type 'gated' in SpecForge's dflash_config: pinned convert_hf_to_gguf.py "
          f"{show(errors['config'])}; with a gated head's gate_proj tensors: {show(errors['tensors'])}; the same "
          f"key at DeepSpec's top level: {show(top)}")
    return errors["config"] is None and top is not None and "markov_head_type" in top


def u16_conf_min_flag() -> bool:
    """U16: the pinned docs/speculative.md tells DSpark users to cut drafts with --spec-draft-conf-min,
    a flag the tools do not have; the confidence threshold is --spec-draft-p-min."""
    from dflash_llama import peers
    from dflash_llama.patchbuild import ROOT

    doc = (ROOT / "third_party" / "llama.cpp" / "docs" / "speculative.md").read_text()  # the pinned tree's docs
    _, target, _, draft = dspark_fixture("u12", seed=61)
    base = peers.speculative_command(target, PROMPT, 4, "draft-dspark", draft=draft, threads=1, n_ctx=256)
    named = peers.run_tool(base + ["--spec-draft-conf-min", "0.5"])
    p_min, none = tool_steps(target, draft, extra=["--spec-draft-p-min", "0.5"]), tool_steps(target, draft)
    print(f"U16: docs/speculative.md names --spec-draft-conf-min: {'--spec-draft-conf-min' in doc}; "
          f"llama-speculative-simple --spec-draft-conf-min 0.5: exit code {named.returncode}: "
          f"{_last(named, 'invalid argument')}; --spec-draft-p-min 0.5: {p_min.n_drafted} tokens drafted, "
          f"{none.n_drafted} without it (the confidence head's cut)")
    return "--spec-draft-conf-min" in doc and named.returncode != 0 and "invalid argument" in named.stderr


def u17_speculators_dspark_defaults() -> bool:
    """U17: speculators saves the draft's Qwen3 settings (`transformer_layer_config`) as a diff against
    Qwen3Config's defaults; the pinned converter flattens that diff without the defaults, so a draft
    whose rms_norm_eps is the default (1e-6, as Qwen3's) gets no dflash.attention.layer_norm_rms_epsilon
    and llama.cpp refuses to load it."""
    from dflash_llama import fixtures, gguf_info, peers
    from dflash_llama.converter import convert

    target_hf, target, hf, _ = dspark_fixture("u13", seed=62)
    key = "dflash.attention.layer_norm_rms_epsilon"
    with tempfile.TemporaryDirectory() as tmp:
        spec = fixtures.dspark_draft_as(Path(tmp) / "spec", hf, "speculators")
        pinned = pinned_conversion(spec, target_hf, Path(tmp) / "pinned.gguf")
        ours = convert(spec, target, Path(tmp) / "ours.gguf", "f32")
        written = [gguf_info(p).get(key) for p in (pinned, ours)]
        r = peers.run_tool(peers.speculative_command(target, PROMPT, 4, "draft-dspark", draft=pinned, threads=1,
                                                     n_ctx=256))
        ok = tool_steps(target, ours, n_predict=4).n_drafted
    print(f"U17: speculators DSpark draft, rms_norm_eps at Qwen3Config's default (left out of the config's diff): "
          f"{key} pinned {written[0]}, ours {written[1]:.1e}; llama-speculative-simple on the pinned GGUF: exit code "
          f"{r.returncode}: {_missing_key(r.stderr)}; on ours: {ok} tokens drafted")
    return written[0] is None and r.returncode != 0 and "key not found" in r.stderr


def _missing_key(log: str) -> str:
    m = re.search(r"key not found in model: \S+", log)
    return m.group(0) if m else (log.strip().splitlines() or ["ok"])[-1]



# --- llama-speculative-simple's generation budget -----------------------------------------------------

U18_PREDICT = 20  # -n
U18_DRAFT = 16    # --spec-draft-n-max


def u18_decoded(exe=None, n_predict: int = U18_PREDICT) -> tuple[int, str]:
    """llama-speculative-simple (`exe`: another build of it) with the tiny target as its own draft
    (every drafted token accepted), --spec-draft-n-max U18_DRAFT: the tokens it says it decoded, and
    its text."""
    from dflash_llama import peers

    from . import registry

    _, target = registry.tiny_target(registry.cache_dir())
    r = peers.run_tool(peers.speculative_command(target, PROMPT, n_predict, "draft-simple", draft=target,
                                                 n_max=U18_DRAFT, threads=1, n_ctx=256, exe=exe))
    m = re.search(r"n_predict = (\d+)", r.stderr)
    if not r.ok or m is None:
        raise RuntimeError(f"llama-speculative-simple exited with {r.returncode}: {_last(r, 'error')}")
    return int(m.group(1)), r.stdout


def u18_draft_past_n_predict() -> bool:
    """U18: llama-speculative-simple stops once it has decoded more than -n tokens, and asks each step
    for a draft of at most the tokens left minus one; one token before the end that is 0, which
    common_speculative_draft reads as no limit (it cuts a draft only when n_max > 0), so the last step
    drafts its whole --spec-draft-n-max (ngram-mod: 64) and the tool decodes up to that many tokens
    past -n, which its speed counts (the last ones its cheapest)."""
    n, _ = u18_decoded()
    print(f"U18: llama-speculative-simple -n {U18_PREDICT} --spec-type draft-simple --spec-draft-n-max {U18_DRAFT}, "
          f"the target as its own draft: decoded {n} tokens (plain decoding stops at {U18_PREDICT + 1})")
    return n > U18_PREDICT + 1


def u19_block_past_ubatch() -> bool:
    """U19: draft-dflash decodes each drafting sequence's whole block (n_max + 1 tokens) in one batch,
    every sequence of the step in the same batch (llama-server: every slot drafting at once), and the
    draft context takes the target's -ub; a non-causal batch must fit one ubatch
    (`GGML_ASSERT(... "non-causal attention requires n_ubatch >= n_tokens")` in llama_context), so a
    block, or the blocks of the slots drafting together, longer than -ub aborts the process. Shown
    with the tool: -ub 7 under a block of 8 (the server dies the same way at -np 4 -ub 16)."""
    from dflash_llama import peers

    target, draft = registry_fixture("tiny-f32")
    runs = {ub: peers.run_tool(peers.speculative_command(target, PROMPT, 8, "draft-dflash", draft=draft, n_max=7,
                                                         threads=1, n_ctx=256, extra_args=["-ub", str(ub)]))
            for ub in (8, 7)}
    print(f"U19: llama-speculative-simple --spec-type draft-dflash --spec-draft-n-max 7 (a block of 8): -ub 8 exit "
          f"code {runs[8].returncode}; -ub 7 exit code {runs[7].returncode}: {_last(runs[7], 'GGML_ASSERT')}")
    return runs[8].ok and runs[7].returncode != 0 and "non-causal attention requires n_ubatch" in runs[7].stderr

# --- suspected, refuted by a run: not findings (docs/variants.md) -------------------------------------

def s5_markov_bias_skipped() -> bool:
    """Suspected: build_dspark_markov_head returns without the Markov bias when a block is longer than
    dflash.block_size, and chains by argmax whatever the sampler. Checked through the tool: asked for twice
    the block (--spec-draft-n-max 12) draft-dspark clamps to it and drafts the reference's biased chain; at
    --temp 0.8 it still drafts the argmax chain (its draft sampler takes the top candidate), so the
    graph's argmax chain conditions each slot on the token the loop drafts. True if either diverges."""
    target_hf, target, hf, gguf = dspark_fixture("u12", seed=61)
    long = tool_steps(target, gguf, n_max=2 * DSPARK_DRAFT["block_size"])
    clamped = "clamping to" in long.log
    biased = agreement(long.drafts, reference_drafts(target, hf, long))
    unbiased = agreement(long.drafts, reference_drafts(target, hf, long, markov=False))
    hot = tool_steps(target, gguf, extra=["--temp", "0.8", "--seed", "3"])
    chain = agreement(hot.drafts, reference_drafts(target, hf, hot))
    print(f"S5: --spec-draft-n-max {2 * DSPARK_DRAFT['block_size']} on a block-{DSPARK_DRAFT['block_size']} "
          f"DSpark draft: clamped {clamped}, {max(map(len, long.drafts))} drafts a step, equal to the reference's "
          f"Markov chain {biased[0]}/{biased[1]}, to its unbiased drafts {unbiased[0]}/{unbiased[1]}; --temp 0.8: "
          f"drafts equal to the reference's greedy chain on the sampled path {chain[0]}/{chain[1]}")
    return not clamped or biased[0] < biased[1] or chain[0] < chain[1]


REFUTED = {"S5": s5_markov_bias_skipped}


FINDINGS.update({"U12": u12_dspark_own_head_dropped, "U13": u13_speculators_layout_guessed,
                 "U14": u14_anchor_first_dflash_as_draft_dflash, "U15": u15_specforge_markov_type_unread,
                 "U16": u16_conf_min_flag, "U17": u17_speculators_dspark_defaults,
                 "U18": u18_draft_past_n_predict, "U19": u19_block_past_ubatch})


if __name__ == "__main__":
    sys.exit(main())
