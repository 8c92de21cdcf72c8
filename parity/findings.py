"""Where the pinned llama.cpp's DFlash path disagrees with the published model: one small,
runnable reproduction per finding of docs/upstream_status.md.

    python -m dflash_llama.parity.findings            # all
    python -m dflash_llama.parity.findings U3 U5      # some
    python -m dflash_llama.parity.findings --patched  # each on the pinned build and on patches/series
    python -m dflash_llama.parity.findings --dflash2-study [PAIR [N]]  # DFlash 2 drafts at each n_max

Each prints what it measured and whether the divergence is present; the exit status is the number
of findings reproduced (0 once llama.cpp has fixed them all). With `--patched`, each finding the
series patches runs on both builds, and the exit status is the number not shown fixed (a finding
with no patch counts when it reproduces). Tiny fixtures are built on demand into the parity cache
folder (`$DFLASH_LLAMA_CACHE`).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

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


if __name__ == "__main__":
    sys.exit(main())
