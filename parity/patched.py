"""What each patch of the series (patches/series, built by `dflash_llama.patchbuild`) fixes,
shown where users run llama.cpp: each finding before (the pinned build) and after (the patched
one), and every registry fixture pair exact through the patched tool.

    python -m dflash_llama.parity.patched       # the whole series: every finding before and after,
                                                # then every registry fixture pair exact through it
    python -m dflash_llama.parity.patched patches/u5-dflash-full-block.patch
                                                # one patch, on the earlier patches of the series
                                                # that touch its files (`on_its_predecessors`)
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

from dflash_llama.patchbuild import (  # noqa: F401
    PATCHES,
    ROOT,
    SERIES,
    TOOLS,
    Build,
    patched_build,
    pinned_build,
    series,
    touched_files,
    use_core,
)


def patched_tool(patch, work: str | Path | None = None, tool: str = "llama-speculative-simple") -> Path:
    """`tool` built from the pinned tree with `patch` (one path or several) applied (`work`: unused,
    the build is cached)."""
    return patched_build(patch, tools=(tool,)).tool(tool)


_DRAFTED = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(-?\d+)\s+\(\s*([0-9.]+)\)")
_ACCEPTED = re.compile(r"accepted (\d+)/\d+ draft tokens, the last target token is: \((-?\d+)\)")


# the KV caches in f32 and no flash attention, as NativeDraft and the reference compute
F32_CACHES = ("-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32")


def _debug_log(exe: Path, target: Path, draft: Path, prompt: str, n_max: int, n_predict: int,
               f32: bool = False) -> str:
    """The tool's draft-dflash run at debug verbosity (-lv 5): its whole log (`f32`: F32_CACHES, -fa off)."""
    from dflash_llama import peers

    from .native import FLASH_ATTN

    r = peers.run_tool(peers.speculative_command(target, prompt, n_predict, "draft-dflash", draft=draft, n_max=n_max,
                                                 threads=1, n_ctx=256, flash_attn="off" if f32 else FLASH_ATTN,
                                                 extra_args=["-lv", "5", *(F32_CACHES if f32 else ())], exe=exe))
    if not r.ok:
        raise RuntimeError(f"{exe.name} failed: {r.log_tail()}")
    return r.stdout + r.stderr


def draft_log(exe: Path, target: Path, draft: Path, prompt: str, n_max: int,
              n_predict: int = 8) -> list[list[tuple[int, float]]]:
    """Per draft step, the top candidate (token, probability) at each block position, from the
    tool's debug log (-lv 5)."""
    blocks: list[list[tuple[int, float]]] = []
    for pos, tok, p in _DRAFTED.findall(_debug_log(exe, target, draft, prompt, n_max, n_predict)):
        if int(pos) == 0:
            blocks.append([])
        blocks[-1].append((int(tok), float(p)))
    return blocks


def draft_steps(exe: Path, target: Path, draft: Path, prompt: str, n_max: int,
                n_predict: int = 8) -> list[tuple[list[int], int, int]]:
    """Per verify step of the tool's debug log (KV caches in f32, -fa off): (the tokens drafted, how
    many the target accepted, the target's token after them), in order."""
    steps, drafted = [], []
    for line in _debug_log(exe, target, draft, prompt, n_max, n_predict, f32=True).splitlines():
        if m := _DRAFTED.search(line):
            drafted = [] if int(m.group(1)) == 0 else drafted
            drafted.append(int(m.group(2)))
        elif m := _ACCEPTED.search(line):
            steps.append((drafted, int(m.group(1)), int(m.group(2))))
            drafted = []
    return steps


def _builds(patched: Build) -> tuple[Build, Build]:
    return pinned_build(), patched


def _greedy_pair(exe: Path, target: Path, draft: Path, prompt: str | None = None, n_predict: int = 16,
                 n_max: int = 3) -> dict:
    """draft-dflash against the same tool drafting nothing, greedy, `-fa off`: exit status, and
    whether the texts are equal (token for token: one tokenizer, the texts compared whole)."""
    from dflash_llama import peers

    from .findings import PROMPT

    prompt = prompt or PROMPT
    runs = [peers.run_tool(peers.speculative_command(target, prompt, n_predict, "draft-dflash", draft=draft,
                                                     n_max=n, threads=1, n_ctx=1024, flash_attn="off", exe=exe))
            for n in (n_max, 0)]
    if not all(r.ok for r in runs):
        bad = next(r for r in runs if not r.ok)
        lines = [ln.strip() for ln in bad.stderr.splitlines() if "GGML_ASSERT" in ln or "error" in ln.lower()]
        return {"exit": bad.returncode, "exact": False, "error": (lines or [bad.log_tail()])[-1]}
    texts = [peers.parse_speculative(r.stdout, r.stderr, prompt, n_predict).text for r in runs]
    return {"exit": 0, "exact": bool(texts[0]) and texts[0] == texts[1]}


def _pair_lines(out: dict, what: str) -> list[str]:
    def one(r):
        return "exact (same text as drafting nothing)" if r["exact"] else (
            f"exit {r['exit']}: {r['error']}" if r["exit"] else "text differs from drafting nothing")
    return [f"{n:8s} {what}: {one(out[n])}" for n in ("pinned", "patched")]


def show_u1(patched: Build) -> dict:
    """U1 before and after: the converter on a draft whose config lists no target_layer_ids writes
    the published default taps, and llama-speculative-simple loads the file."""
    from dflash_llama import fixtures, gguf_info

    from .findings import tiny_fixture

    target_hf, target, hf, _ = tiny_fixture("u1", layers=2, block_size=8, seed=41)  # no target_layer_ids
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for build in _builds(patched):
            gguf = Path(tmp) / f"u1-{build.name}.gguf"
            fixtures.run_pinned_converter([str(hf), "--target-model-dir", str(target_hf), "--outfile", str(gguf),
                                           "--outtype", "f32"], script=build.converter)
            layers = gguf_info(gguf).metadata.get("dflash.target_layers")
            run = _greedy_pair(build.tool("llama-speculative-simple"), target, gguf)
            out[build.name] = {**run, "target_layers": [int(x) for x in layers] if layers is not None else None}
    out["fixed"] = (out["pinned"]["target_layers"] is None and out["pinned"]["exit"] != 0
                    and out["patched"]["exact"])
    out["lines"] = [f"{n:8s} converter wrote dflash.target_layers {out[n]['target_layers']}"
                    for n in ("pinned", "patched")]
    out["lines"] += _pair_lines(out, "llama-speculative-simple on the file")
    return out


def _first_drafts(build: Build, target: Path, draft: Path) -> dict:
    """The first block's greedy draft from the build's tool's log and from our runtime (features of
    the prompt minus its last token, the block opened by that token, as draft-dflash runs it)."""
    import dflash_llama

    from .findings import PROMPT
    from .graph import drafted_tokens

    rt = dflash_llama.Runtime(target, draft, n_threads=1, n_ctx=256, kv_f32=True, compact_draft_head=False)
    n = rt.block_size - 1
    tool = [t for t, _ in draft_log(build.tool("llama-speculative-simple"), target, draft, PROMPT, n)[0]]
    tokens = rt.tokenize(PROMPT)
    block = [tokens[-1]] + [rt.mask_token_id] * n
    ours = drafted_tokens(rt.trace_draft(rt.capture(tokens[:-1]), block), rt.n_vocab)[:n]
    return {"tool": tool, "runtime": ours}


def _show_capture(patched: Build, target: Path, draft: Path, what: str) -> dict:
    out = {b.name: _greedy_pair(b.tool("llama-speculative-simple"), target, draft) for b in _builds(patched)}
    out["drafts"] = _first_drafts(patched, target, draft) if out["patched"]["exit"] == 0 else None
    agree = out["drafts"] is not None and out["drafts"]["tool"] == out["drafts"]["runtime"]
    out["fixed"] = out["pinned"]["exit"] != 0 and out["patched"]["exact"] and agree
    out["lines"] = _pair_lines(out, what)
    if out["drafts"] is not None:
        out["lines"].append(f"patched  first block drafted {out['drafts']['tool']}; our runtime drafts "
                            f"{out['drafts']['runtime']}: {'same' if agree else 'DIFFERENT'}")
    return out


def show_u2(patched: Build) -> dict:
    """U2 before and after: a tap on the target's last layer (the registry's tiny-last-layer-tap pair):
    the patched tool runs, is exact, and drafts what our runtime (capturing `result_norm`) drafts."""
    from .findings import tiny_fixture

    _, target, _, draft = tiny_fixture("u2", layers=1, target_layer_ids=[3], block_size=4, seed=42)
    return _show_capture(patched, target, draft, "tap on target layer 3 of 4")


def show_u3(patched: Build) -> dict:
    """U3 before and after: a draft whose layer 1 is a sliding-window layer (window 4, block 8; the
    fixture of `findings U3`): the patched tool drafts what our runtime (and the reference) drafts."""
    from .findings import u3_fixture

    _, target, _, draft = u3_fixture()
    out = {b.name: {**_greedy_pair(b.tool("llama-speculative-simple"), target, draft),
                    **_first_drafts(b, target, draft)} for b in _builds(patched)}
    same = {n: out[n]["tool"] == out[n]["runtime"] for n in ("pinned", "patched")}
    out["fixed"] = not same["pinned"] and same["patched"] and out["patched"]["exact"]
    out["lines"] = [f"{n:8s} sliding layer 1: first block drafted {out[n]['tool']}; our runtime drafts "
                    f"{out[n]['runtime']}: {'same' if same[n] else 'DIFFERENT'}" for n in ("pinned", "patched")]
    out["lines"] += _pair_lines(out, "sliding-window draft")
    return out


def show_u7(patched: Build) -> dict:
    """U7 before and after: a DFlash draft on a gemma3 target (the registry's tiny-gemma3-f32 pair)."""
    from .findings import gemma3_fixture

    return _show_capture(patched, *gemma3_fixture(), "gemma3 target")


def _speculators_copy(hf: Path, out_dir: Path, verifier_copies: bool) -> Path:
    """`hf` saved again in speculators' format under the same folder name (the same general.name),
    with the verifier's frozen copies speculators may save (embed_tokens, lm_head, verifier_norm)."""
    import torch
    from safetensors.torch import load_file, save_file

    from dflash_llama import fixtures

    spec = fixtures.speculators_draft_hf(out_dir / hf.name, hf)
    if verifier_copies:
        tensors = load_file(spec / "model.safetensors")
        n_vocab, n_embd = json.loads((hf / "config.json").read_text())["vocab_size"], tensors["fc.weight"].shape[0]
        tensors.update({"embed_tokens.weight": torch.ones(n_vocab, n_embd), "verifier_norm.weight": torch.ones(n_embd),
                        "lm_head.weight": torch.ones(n_vocab, n_embd)})
        save_file(dict(sorted(tensors.items())), str(spec / "model.safetensors"), metadata={"format": "pt"})
    return spec


def show_u9(patched: Build) -> dict:
    """U9 before and after: each build's converter on speculators-format drafts (DFlash 2 as saved,
    DFlash 1 with the verifier's copies): the patched one writes the bytes of the z-lab format's
    conversion (ours, byte-identical to the pinned converter's on z-lab's format)."""
    from dflash_llama import fixtures

    from .findings import tiny_fixture

    drafts = {"dflash2": tiny_fixture("u9", variant="dflash2", layers=1, target_layer_ids=[1], seed=49),
              "dflash": tiny_fixture("u9-dflash1", layers=1, target_layer_ids=[1], seed=49)}
    out: dict = {b.name: {} for b in _builds(patched)}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, (target_hf, _, hf, zlab_gguf) in drafts.items():
            spec = _speculators_copy(hf, Path(tmp) / variant, verifier_copies=variant == "dflash")
            for build in _builds(patched):
                gguf = Path(tmp) / f"{variant}-{build.name}.gguf"
                try:
                    fixtures.run_pinned_converter([str(spec), "--target-model-dir", str(target_hf), "--outfile",
                                                   str(gguf), "--outtype", "f32"], script=build.converter)
                except RuntimeError as e:
                    out[build.name][variant] = "failed: " + str(e).strip().splitlines()[-1]
                    continue
                same = "same bytes as" if gguf.read_bytes() == zlab_gguf.read_bytes() else "DIFFERENT bytes from"
                out[build.name][variant] = f"{same} the z-lab copy's conversion"
    out["fixed"] = (out["pinned"]["dflash2"].startswith("failed") and
                    all(r.startswith("same") for r in out["patched"].values()))
    out["lines"] = [f"{n:8s} converter on a speculators-format {v} draft: {r}"
                    for n in ("pinned", "patched") for v, r in out[n].items()]
    return out


def show_u5(patched: Build) -> dict:
    """U5 before and after: drafts at --spec-draft-n-max 3 against the first 3 of the full block."""
    from .findings import PROMPT, tiny_fixture

    _, target, _, draft = tiny_fixture("u5", layers=2, target_layer_ids=[1, 2], block_size=8, seed=45)
    out = {}
    for build in _builds(patched):
        exe = build.tool("llama-speculative-simple")
        full = [[t for t, _ in b] for b in draft_log(exe, target, draft, PROMPT, 7)]
        short = [[t for t, _ in b] for b in draft_log(exe, target, draft, PROMPT, 3)]
        out[build.name] = {"n_max_7_first_3": full[0][:3], "n_max_3": short[0][:3],
                           "agree": [b[:3] for b in full[:len(short)]] == [b[:3] for b in short[:len(full)]]}
    out["fixed"] = out["patched"]["agree"] and not out["pinned"]["agree"]
    out["lines"] = [f"{n:8s} --spec-draft-n-max 7, first 3 drafts: {out[n]['n_max_7_first_3']}; --spec-draft-n-max 3: "
                    f"{out[n]['n_max_3']}; same drafts at every step: {out[n]['agree']}" for n in ("pinned", "patched")]
    return out


U10_PAIRS = ("tiny-dflash2-f32", "tiny-dflash2-llama-f32")  # DFlash 2, non-causal, blocks 8 and 16


def _u10_pair(patched: Build, pair: str, n_maxes: tuple[int, ...]) -> dict:
    """One DFlash 2 registry pair: the patched tool's drafts at each --spec-draft-n-max, step by step,
    against the first n_max of the reference's walk over the trained block on the same context; the
    pinned build's (llama.cpp's graph on its block of n_max + 1) against the same; both tools exact."""
    from .findings import PROMPT, registry_sides
    from .graph import drafted_tokens, reference_trace

    r, rt, native, ref_draft = registry_sides(pair, n_ctx=256)
    B, mask, exe = rt.block_size, rt.mask_token_id, patched.tool("llama-speculative-simple")
    prompt = rt.tokenize(PROMPT)
    out = {"block_size": B, "pinned": {}, "patched": {}}
    for n in n_maxes:
        steps = draft_steps(exe, r.target, r.draft, PROMPT, n)
        full, starts = list(prompt), []
        for drafted, k, last in steps:  # the sequence the tool produced, and each step's anchor
            starts.append(len(full) - 1)
            full += drafted[:k] + [last]
        feats = rt.capture(full)
        # the steps that drafted (with U18's patch the last ones, their budget spent, draft nothing)
        steps, starts = zip(*[(s, t) for s, t in zip(steps, starts) if s[0]]) if steps else ((), ())
        same = {"pinned": 0, "patched": 0}
        for (drafted, _, _), t in zip(steps, starts):
            want = drafted_tokens(reference_trace(ref_draft, feats[:t], [full[t]] + [mask] * (B - 1)), rt.n_vocab)[:n]
            pinned = drafted_tokens(native.trace(feats[:t], [full[t]] + [mask] * n), rt.n_vocab,
                                    native.selector_top_k)[:n]
            same["patched"] += drafted == want
            same["pinned"] += pinned == want
        for build in _builds(patched):
            out[build.name][n] = {"steps": len(steps), "same_as_reference": same[build.name],
                                  **_greedy_pair(build.tool("llama-speculative-simple"), r.target, r.draft, n_max=n)}
    return out


def show_u10(patched: Build, n_maxes: tuple[int, ...] = (3, 7)) -> dict:
    """U10 before and after: a DFlash 2 draft at --spec-draft-n-max 3 (the default) and 7, on the
    tiny DFlash 2 registry pairs (block 8 and 16): each draft step's tokens against the reference's
    walk over the trained block. The pinned build decodes a block of n_max + 1 (llama.cpp's graph
    run on that block, since its walk logs nothing); the patched tool's debug log shows its drafts."""
    out = {pair: _u10_pair(patched, pair, n_maxes) for pair in U10_PAIRS}
    runs = [(pair, build, n) for pair in U10_PAIRS for build in ("pinned", "patched") for n in n_maxes]
    out["fixed"] = (all(out[p]["patched"][n]["same_as_reference"] == out[p]["patched"][n]["steps"] > 0
                        for p in U10_PAIRS for n in n_maxes)
                    and any(out[p]["pinned"][3]["same_as_reference"] < out[p]["pinned"][3]["steps"] for p in U10_PAIRS)
                    and all(out[p][b][n]["exact"] for p, b, n in runs))
    def block(p, b, n):
        return n + 1 if b == "pinned" else max(out[p]["block_size"], n + 1)

    out["lines"] = [f"{b:8s} {p} (trained block {out[p]['block_size']}) --spec-draft-n-max {n}, a block of "
                    f"{block(p, b, n)}: drafts equal the reference's trained-block walk at "
                    f"{out[p][b][n]['same_as_reference']}/{out[p][b][n]['steps']} steps; the tool's greedy text "
                    + ("exact" if out[p][b][n]["exact"] else "NOT exact") for p, b, n in runs]
    return out


def tool_tau(build: Build, target: Path, draft: Path, n_maxes: tuple[int, ...] = (3, 7), n_prompts: int = 10,
             n_predict: int = 64) -> dict[int, dict]:
    """`build`'s llama-speculative-simple, greedy, -fa off, on `n_prompts` HumanEval prompts at each
    --spec-draft-n-max: n_max -> {tau (tokens per target decode, over all prompts), exact (prompts whose
    text equals the same tool's drafting nothing, over the shorter: a last verify may pass -n), prompts}."""
    from dflash_llama import peers, prompts

    texts = [p.text for p in prompts.spread(prompts.load("humaneval"), n_prompts)]

    def run(text, n):
        return peers.speculative(target, text, n_predict, "draft-dflash", draft=draft, n_max=n, threads=1,
                                 n_ctx=1024, flash_attn="off", exe=build.tool("llama-speculative-simple"))

    plain = [run(t, 0).text for t in texts]
    out = {}
    for n in n_maxes:
        runs = [run(t, n) for t in texts]
        tokens, accepted = sum(r.n_tokens for r in runs), sum(r.n_accept for r in runs)
        same = [bool(p) and r.text[:len(p)] == p[:len(r.text)] for r, p in zip(runs, plain)]
        out[n] = {"tau": tokens / (tokens - accepted), "exact": sum(same), "prompts": len(texts)}
    return out


def show_u4(patched: Build) -> dict:
    """U4 before and after: the top-candidate probabilities draft-dflash computes for the first block,
    against the published logits' (output_multiplier 0.25, soft-cap 2)."""
    from .findings import PROMPT, tiny_fixture, u4_probabilities

    p_raw, p_pub = u4_probabilities()
    _, target, _, draft = tiny_fixture("u4", layers=1, target_layer_ids=[1], block_size=8, seed=44,
                                extra_config={"output_multiplier": 0.25, "final_logit_softcapping": 2.0})
    out = {"published": round(float(p_pub.mean()), 3), "raw": round(float(p_raw.mean()), 3)}
    for build in _builds(patched):
        first = draft_log(build.tool("llama-speculative-simple"), target, draft, PROMPT, 7)[0]
        out[build.name] = round(float(np.mean([p for _, p in first])), 3)
    out["fixed"] = abs(out["patched"] - out["published"]) < 5e-3 and abs(out["pinned"] - out["raw"]) < 5e-3
    out["lines"] = [f"mean top-candidate probability of the first block: published logits {out['published']}, "
                    f"raw logits {out['raw']}; pinned tool {out['pinned']}, patched tool {out['patched']}"]
    return out


def fixtures_exact(build: Build, n_prompts: int = 3, n_predict: int = 24) -> dict[str, dict]:
    """Every fixture pair of the registry (a tiny target of each family, the SWA draft, the last-layer
    tap) through `build`'s llama-speculative-simple, greedy, `-fa off`: DFlash at the draft's whole
    block against the same tool drafting nothing, on `n_prompts` HumanEval prompts. Pair name ->
    {family, exact (count), prompts, errors}."""
    from dflash_llama import gguf_info, prompts

    from . import registry

    pairs, defaults = registry.load()
    texts = [p.text for p in prompts.spread(prompts.load("humaneval"), n_prompts)]
    exe = build.tool("llama-speculative-simple")
    out = {}
    for pair in (p for p in pairs if p.kind == "fixture"):
        r = registry.resolve(pair, defaults)
        n_max = int(gguf_info(r.draft).get("dflash.block_size", 16)) - 1
        runs = [_greedy_pair(exe, r.target, r.draft, t, n_predict, n_max) for t in texts]
        out[pair.name] = {"family": pair.family, "exact": sum(x["exact"] for x in runs), "prompts": len(runs),
                          "errors": sorted({x["error"] for x in runs if x.get("error")})}
    return out


def _fixture_lines(build: Build, result: dict[str, dict]) -> list[str]:
    return [f"{build.name:8s} {name} ({r['family']}): DFlash == drafting nothing on {r['exact']}/{r['prompts']} "
            f"prompts (-fa off)" + (f"; {r['errors'][0]}" if r["errors"] else "") for name, r in result.items()]


# finding -> (its patch, the demonstration before and after)
def show_u11(patched: Build, runs: int = 6) -> dict:
    """U11 before and after: the serving check's rollback check (tiny qwen35 target, a random draft
    whose every verify rolls back, -np 1 and -np 8) with the pinned and the patched llama-server."""
    import subprocess

    from .registry import cache_dir

    out: dict = {"lines": []}
    for name, exe in (("pinned", None), ("patched", patched.tool("llama-server"))):
        work = cache_dir() / "finding-u11"
        r = subprocess.run([sys.executable, "-m", "dflash_llama.bench.serving_check", "--out", str(work),
                            "--rollback-check", str(runs), "--n-max", "7", *(["--server", str(exe)] if exe else [])],
                           capture_output=True, text=True)
        if r.returncode not in (0, 1):
            raise RuntimeError(f"the serving check exited with {r.returncode}:\n{r.stderr.strip()[-1500:]}")
        res = json.loads((work / "rollback_check.json").read_text())
        out[name] = {p: sum(map(bool, res[p])) for p in ("np1", "np8")}
        out["lines"].append(f"{name:8s} llama-server, random draft, --spec-draft-n-max 7: runs with a text that is "
                            f"not the plain target's: {out[name]['np1']} of {runs} at -np 1, "
                            f"{out[name]['np8']} of {runs} at -np 8")
    out["fixed"] = out["pinned"]["np8"] > 0 and out["patched"]["np8"] == out["patched"]["np1"] == 0
    return out



def show_u18(patched: Build) -> dict:
    """U18 before and after: llama-speculative-simple -n 20 with a draft that is always accepted
    (findings.u18_decoded): the pinned tool decodes past -n at its last step, the patched one stops
    where plain decoding does, with the same text up to there."""
    from . import findings

    out: dict = {"lines": []}
    for name, exe in (("pinned", None), ("patched", patched.tool("llama-speculative-simple"))):
        out[name], out[f"{name}_text"] = findings.u18_decoded(exe)
        out["lines"].append(f"{name:8s} llama-speculative-simple -n {findings.U18_PREDICT} --spec-draft-n-max "
                            f"{findings.U18_DRAFT}, every draft accepted: {out[name]} tokens decoded")
    same = out["pinned_text"].startswith(out["patched_text"].rstrip())
    out["fixed"] = out["pinned"] > findings.U18_PREDICT + 1 and out["patched"] == findings.U18_PREDICT + 1 and same
    return out


def show_u19(patched: Build) -> dict:
    """U19 before and after: llama-speculative-simple with a block of 8 at -ub 7 (pinned: the
    assert; patched: one line, no drafts, the plain text), and llama-server with 4 slots drafting blocks
    of 8 together at -ub 16 (the serving check's ubatch check; pinned: dies at the first requests;
    patched: serves, every text the plain target's)."""
    import subprocess

    from dflash_llama import peers

    from . import findings
    from .registry import cache_dir

    target, draft = findings.registry_fixture("tiny-f32")
    out: dict = {"lines": []}
    plain = peers.run_tool(peers.speculative_command(target, findings.PROMPT, 8, "draft-dflash", draft=draft, n_max=0,
                                                     threads=1, n_ctx=256))
    for name, exe in (("pinned", None), ("patched", patched)):
        r = peers.run_tool(peers.speculative_command(target, findings.PROMPT, 8, "draft-dflash", draft=draft, n_max=7,
                                                     threads=1, n_ctx=256, extra_args=["-ub", "7"],
                                                     exe=exe and exe.tool("llama-speculative-simple")))
        said = [ln for ln in r.stderr.splitlines() if "GGML_ASSERT" in ln or "no drafts" in ln]
        tool = {"exit": r.returncode, "same_as_plain": r.ok and r.stdout == plain.stdout,
                "said": said[-1].split(": ", 1)[-1] if said else ""}
        work = cache_dir() / "finding-u19"
        s = subprocess.run([sys.executable, "-m", "dflash_llama.bench.serving_check", "--out", str(work),
                            "--ubatch-check", "16", "--n-max", "7", "-n", "16",
                            *(["--server", str(exe.tool("llama-server"))] if exe else [])],
                           capture_output=True, text=True)
        if s.returncode not in (0, 1):
            raise RuntimeError(f"the serving check exited with {s.returncode}:\n{s.stderr.strip()[-1500:]}")
        check = json.loads((work / "ubatch_check.json").read_text())
        served = check["same_as_plain"] if check["served"] else None
        out[name] = {"tool": tool, "server_exact": served}
        out["lines"].append(f"{name:8s} llama-speculative-simple, a block of 8 at -ub 7: exit code {tool['exit']}, "
                            f"{'text equal to plain decoding' if tool['same_as_plain'] else 'no text'} "
                            f"({tool['said']}); llama-server -np 4 -ub 16: " + (
                                "died" if served is None else f"{served} of {check['prompts']} texts the plain "
                                                              "target's"))
    out["fixed"] = (out["pinned"]["tool"]["exit"] != 0 and out["pinned"]["server_exact"] is None
                    and out["patched"]["tool"]["exit"] == 0 and out["patched"]["tool"]["same_as_plain"]
                    and out["patched"]["server_exact"] == 16)
    return out

SHOW = {"U1": ("u1-dflash-default-target-layers.patch", show_u1), "U2": ("u2-dflash-last-layer-tap.patch", show_u2),
        "U3": ("u3-dflash-causal-sliding-layers.patch", show_u3),
        "U4": ("u4-dflash1-logit-scale.patch", show_u4), "U5": ("u5-dflash-full-block.patch", show_u5),
        "U7": ("u7-gemma3-layer-inputs.patch", show_u7), "U9": ("u9-dflash-speculators-format.patch", show_u9),
        "U10": ("u10-dflash2-full-block.patch", show_u10),
        "U11": ("u11-recurrent-snapshots-follow-moved-cells.patch", show_u11),
        "U18": ("u18-speculative-simple-spent-budget.patch", show_u18),
        "U19": ("u19-dflash-blocks-fit-the-ubatch.patch", show_u19)}

# patches written and checked on a copy of the pinned tree, not in the series yet: patch -> its findings
PROPOSED: dict[str, tuple[str, ...]] = {
    "u13-u15-u17-dspark-converter.patch": ("U13", "U15", "U17"),
    "u16-dspark-docs-p-min.patch": ("U16",),
}

# findings of findings.py with no patch in the series, and why (docs/upstream_status.md)
UNPATCHED: dict[str, str] = {
    "U12": "the fix compares the checkpoint's head and embedding with the target's: not written",
    "U13": "patches/u13-u15-u17-dspark-converter.patch, not in the series yet",
    "U14": "which spec type llama.cpp picks for existing files is its maintainers' call: no patch",
    "U15": "patches/u13-u15-u17-dspark-converter.patch, not in the series yet",
    "U16": "patches/u16-dspark-docs-p-min.patch (docs only), not in the series yet",
    "U17": "patches/u13-u15-u17-dspark-converter.patch, not in the series yet",
}


def on_its_predecessors(patches: list[Path]) -> list[Path]:
    """`patches` (of the series or not), each after the earlier patches of the series that touch its
    files, theirs in turn: a patch of the series is a diff against the tree those leave (u10 follows
    u5). In series order; a patch outside the series last."""
    in_series = series()
    order = {p.name: i for i, p in enumerate(in_series)}
    names = {p.name for p in patches}
    for patch in patches:
        files = set(touched_files(patch))
        for earlier in reversed(in_series[:order.get(patch.name, len(in_series))]):
            if files & set(touched_files(earlier)):
                names.add(earlier.name)
                files |= set(touched_files(earlier))
    return [p for p in in_series if p.name in names] + [p for p in patches if p.name not in order]


def show(findings: list[str], patched: Build) -> int:
    """Print each finding before and after on `patched`; the number not shown fixed."""
    not_fixed = 0
    for finding in findings:
        result = SHOW[finding][1](patched)
        print("\n".join(result["lines"]))
        print(f"{finding}: " + ("reproduced on the pinned build, fixed on the patched build" if result["fixed"]
                                else "NOT shown fixed"))
        not_fixed += not result["fixed"]
    return not_fixed


def main(argv: list[str] | None = None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    if not argv:  # the whole series
        patches = series()
        names = [p.name for p in patches]
        findings = [f for f, (patch, _) in SHOW.items() if patch in names]
    else:
        patches = [Path(a) for a in argv]
        by_patch = {patch: f for f, (patch, _) in SHOW.items()}
        unknown = [p.name for p in patches if p.name not in by_patch]
        if unknown:
            print(f"no demonstration for {', '.join(unknown)}; known: {', '.join(by_patch)}", file=sys.stderr)
            return 2
        findings = [by_patch[p.name] for p in patches]
        patches = on_its_predecessors(patches)
    build = patched_build(patches)
    failed = show(findings, build)
    if not argv:  # the whole series: every fixture pair exact through the patched tool
        exact = fixtures_exact(build)
        print("\n".join(_fixture_lines(build, exact)))
        failed += sum(r["exact"] < r["prompts"] for r in exact.values())
    return failed


if __name__ == "__main__":
    sys.exit(main())
