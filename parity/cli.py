"""`dflash-llama parity`: layer-by-layer parity of a DFlash GGUF draft, three ways.

    dflash-llama parity -m T.gguf -md D.gguf [--draft-hf DIR] [--target-hf DIR] \\
                        [--prompts FILE] --out reports/NAME/
    dflash-llama parity -m T.gguf -md DRAFT_HF_DIR [--outtype f16] --out reports/NAME/   # converted, cached
    dflash-llama parity --all [--only NAME,...] [--out reports/parity/]
    dflash-llama parity --quant-study [-m T.gguf --draft-hf DIR] --out reports/NAME/quant/
    dflash-llama parity --default [--outtype f16]          # the embedded pair -> reports/smollm2-135m-dflash/
    dflash-llama parity --patch patches/u5-dflash-full-block.patch   # a fix, on a copy of the pinned tree
    dflash-llama parity --all --patched    # on the pinned llama.cpp + patches/series

Writes parity.md, parity.json and parity.png into --out; exits 1 when a stage fails (2 for bad
input). Method and bounds: docs/parity.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_llama.argtypes import int_list
from dflash_llama.cli_args import add_model_args, add_threads_arg, threads

DEFAULT_LIMIT = 3
DEFAULT_N_PREDICT = 32
DEFAULT_PROMPT_TOKENS = 192


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p, target_help="target GGUF",
                   draft_help="DFlash draft: GGUF, or HF directory (converted to --outtype once and cached; it is "
                              "then also --draft-hf)")
    p.add_argument("--draft-hf", type=Path, help="the draft's Hugging Face checkpoint: enables the converter "
                                                 "stage and the target-layer check, and is the reference's weights")
    p.add_argument("--target-hf", type=Path, help="the target's Hugging Face directory for the reference target "
                                                  "(default: transformers' GGUF loader on --target, dequantised)")
    p.add_argument("--prompts", default="humaneval",
                   help="'humaneval' (default) or a prompt file (.jsonl/.json or one prompt per line)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                   help=f"prompts used, spread over the set (default {DEFAULT_LIMIT})")
    p.add_argument("-n", "--n-predict", type=int, default=DEFAULT_N_PREDICT,
                   help=f"tokens generated per prompt in the end-to-end stage, a check kept short "
                        f"(default {DEFAULT_N_PREDICT})")
    p.add_argument("--graph-prompts", type=int, default=2, help="prompts feeding the graph stage (default 2)")
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS,
                   help=f"prompt tokens kept per prompt, longer prompts cut from the left (default "
                        f"{DEFAULT_PROMPT_TOKENS}; every stage decodes each prompt several times, so on a large "
                        f"target on a CPU this sets much of the time)")
    p.add_argument("--reference-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the reference target's weights and activations (default float32; bfloat16 halves "
                        "its memory and loosens nothing: its errors show against the bounds)")
    p.add_argument("--reference-device", default="cpu", choices=("cpu", "cuda"),
                   help="where the reference target and its layers run (default cpu; cuda when the "
                        "installed torch sees a GPU)")
    p.add_argument("--divergence-lengths", type=lambda t: int_list(t, "--divergence-lengths", 1),
                   help="generation lengths of the first-divergence table (default: n/2 and n)")
    p.add_argument("--verify-widths", type=lambda t: int_list(t, "--verify-widths", 1),
                   help="verify widths (drafted tokens verified per step) of the first-divergence table "
                        "(default: 1 and B-1 for a block of B)")
    add_threads_arg(p)
    p.add_argument("--out", type=Path, help="output folder (reports/NAME/); with --all the parent of one "
                                            "folder per pair (default reports/parity/)")
    p.add_argument("--name", help="report name (default: the --out folder's name)")
    p.add_argument("--no-native", action="store_true", help="skip llama.cpp's own DFlash graph and loop")
    p.add_argument("--no-end-to-end", action="store_true", help="skip stage 4")
    p.add_argument("--default", action="store_true",
                   help="the embedded default pair (SmolLM2-135M Q4_1 + its draft, converted to --outtype); "
                        "--out defaults to reports/smollm2-135m-dflash/")
    p.add_argument("--outtype", default="f16", help="with --default or an HF -md: the draft's GGUF type (default "
                                                   "f16, as `dflash-llama run` uses)")
    p.add_argument("--all", action="store_true", help="check every pair of the registry")
    p.add_argument("--only", help="with --all: comma-separated pair names")
    p.add_argument("--registry", type=Path, help="registry file (default: parity/registry.toml)")
    p.add_argument("--quant-study", action="store_true",
                   help="the draft at f32, f16, bf16, q8_0 and q4_0: intermediate errors and tau "
                        "(default pair unless --target/--draft-hf are given)")
    p.add_argument("--patch", type=Path, help="apply a patch (patches/*.patch) to a copy of the pinned llama.cpp, "
                                              "build the patched llama-speculative-simple and show the finding gone")
    p.add_argument("--patched", action="store_true",
                   help="run on a build of the pinned llama.cpp with patches/series applied (built once, cached): "
                        "llama.cpp's graph, its speculative loop and our runtime's library; with --all, pairs "
                        "whose finding a patch of the series fixes are expected to pass")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _prompts(args):
    from dflash_llama import prompts

    if args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    return prompts.spread(prompts.load(args.prompts), args.limit)


def _config(args, target, draft, draft_hf, target_hf, name):
    from .stages import ParityConfig

    if args.n_predict < 1:
        raise ValueError(f"--n-predict must be at least 1, got {args.n_predict}")
    if args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be at least 1, got {args.prompt_tokens}")
    build = args.native_build  # None: the pinned build
    return ParityConfig(target=Path(target), draft=Path(draft), draft_hf=draft_hf and Path(draft_hf),
                        target_hf=target_hf and Path(target_hf), prompts=_prompts(args), name=name,
                        n_predict=args.n_predict, graph_prompts=args.graph_prompts, n_threads=args.threads,
                        native=not args.no_native, end_to_end=not args.no_end_to_end,
                        native_tool=build.tool("llama-speculative-simple") if build else None,
                        native_build=build.label if build else "pinned", reference_dtype=args.reference_dtype,
                        reference_device=args.reference_device, divergence_lengths=args.divergence_lengths,
                        verify_widths=args.verify_widths, max_context=args.prompt_tokens)


def _native_build(args):
    """The build of llama.cpp's tools the native end-to-end stage runs: None (the pinned one), or the
    pinned tree with patches/series."""
    if not args.patched:
        return None
    if args.no_native:
        raise ValueError("--patched runs llama.cpp's patched loop: it cannot go with --no-native")
    for path, what in ((args.target, "--target"), (args.draft, "--draft")):  # before the build, not after it
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"{what} {path}: no such file")
    from dflash_llama import patchbuild
    from dflash_llama.toolbuild import CORE

    build = patchbuild.patched_build(tools=("llama-speculative-simple", CORE),
                                     log=lambda m: None if args.quiet else print(m))
    patchbuild.use_core(build)  # the in-process llama.cpp graph (and our runtime) on the patched library too
    print(f"llama.cpp: {build.label}")
    return build


def _summary(report: dict, paths: dict) -> str:
    verdict = "PASS" if report["passed"] else "FAIL"
    fd = report.get("first_divergence")
    lines = [f"parity {report['name']}: {verdict}" + (f" ({report['note']})" if report.get("note") else "")]
    for key, s in report["stages"].items():
        lines.append(f"  {key:11s} {s['status']}")
    if fd:
        lines.append(f"  first divergence: {fd['message']}")
    e2e = report["stages"]["end_to_end"]
    if e2e.get("tau"):
        taus = (f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in e2e["tau"].items())
        lines.append("  tau: " + ", ".join(taus))
    lines.append(f"  report: {paths['md']}")
    return "\n".join(lines)


def run_one(args, target, draft, draft_hf, target_hf, out: Path, name: str, note: str | None = None) -> dict:
    from . import report as R
    from .stages import run_parity

    report = run_parity(_config(args, target, draft, draft_hf, target_hf, name), progress_bar=not args.quiet)
    if note:
        report["note"] = note
    paths = R.write(report, out)
    print(_summary(report, paths))
    return report


def main(args) -> int:
    args.threads = threads(args.threads)  # a count: llama.cpp's tools and torch take one
    if args.patch:
        if args.patched:
            raise ValueError("--patch shows one patch on its own build; --patched runs parity on the whole series")
        from .patched import main as patched_main

        return patched_main([str(args.patch)])
    if args.patched and args.quant_study:
        raise ValueError("--patched applies to parity runs, not --quant-study")
    args.native_build = _native_build(args)
    if args.quant_study:
        return _main_quant_study(args)
    if args.all:
        return _main_all(args)
    if args.default:
        return _main_default(args)
    flags = (("target", "-m"), ("draft", "-md"), ("out", "--out"))
    missing = [flag for key, flag in flags if getattr(args, key) is None]
    if missing:
        raise ValueError(f"{' '.join(missing)} required (or --all)")
    draft, draft_hf = Path(args.draft), args.draft_hf
    if draft.is_dir() and (draft / "config.json").exists():  # an HF draft: the one conversion, cached
        from dflash_llama.converter.pair import resolve_draft

        draft, draft_hf = resolve_draft(draft, args.target, args.outtype), draft_hf or draft
    report = run_one(args, args.target, draft, draft_hf, args.target_hf, args.out,
                     args.name or args.out.resolve().name)
    return 0 if report["passed"] else 1


def _main_default(args) -> int:
    from . import registry

    _, defaults = registry.load(args.registry or registry.REGISTRY_PATH)
    pair = registry.Pair(name=f"smollm2-135m-dflash-{args.outtype}", kind="default", outtype=args.outtype)
    res = registry.resolve(pair, defaults)
    out = args.out or Path("reports") / defaults.get("draft_dir", "smollm2-135m-dflash")
    report = run_one(args, res.target, res.draft, res.draft_hf, None, out, args.name or pair.name)
    return 0 if report["passed"] else 1


def _main_quant_study(args) -> int:
    import math

    from dflash_llama import fixtures

    from . import quant_study, registry

    if args.out is None:
        raise ValueError("--quant-study needs --out")
    if (args.target is None) != (args.draft_hf is None):
        raise ValueError("--quant-study needs both -m and --draft-hf (or neither)")
    if args.target is None:  # the embedded pair
        _, defaults = registry.load(args.registry or registry.REGISTRY_PATH)
        target, draft_hf = fixtures.smollm2_gguf(), registry.default_draft_dir(defaults)
        title = args.name or "smollm2-135m-dflash"
    else:
        target, draft_hf = args.target, args.draft_hf
        title = args.name or args.out.resolve().name
    work = registry.cache_dir() / "quant" / Path(draft_hf).resolve().name  # GGUFs stay out of reports/
    study = quant_study.run_study(Path(target), Path(draft_hf), work, _prompts(args), args.n_predict,
                                  n_threads=args.threads, graph_prompts=args.graph_prompts,
                                  native=not args.no_native, progress_bar=not args.quiet)
    paths = quant_study.write(study, args.out, title)
    for r in study["rows"]:
        print(f"{r['outtype']:5s} max ref/runtime {r['max_error'].get('reference/runtime', math.nan):.1e}  "
              f"tau runtime {r['tau_runtime']:.2f}  graph {r['graph_status']}")
    print(f"quantisation study: {paths['md']}")
    return 0


def _main_all(args) -> int:
    from . import registry

    pairs, defaults = registry.load(args.registry or registry.REGISTRY_PATH)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {p.name for p in pairs})
        if unknown:
            raise ValueError(f"--only: no registry pair named {', '.join(unknown)}")
        pairs = [p for p in pairs if p.name in wanted]
    out_root = args.out or Path("reports") / "parity"
    rows, ok = [], True
    for pair in pairs:
        res = registry.resolve(pair, defaults)
        if res.skip:
            print(f"parity {pair.name}: skipped ({res.skip})")
            rows.append((pair.name, "skipped", res.skip))
            continue
        report = run_one(args, res.target, res.draft, res.draft_hf, res.target_hf, out_root / pair.name,
                         pair.name)
        got = "pass" if report["passed"] else "fail"
        patches = args.native_build.patches if args.native_build else ()
        expect = pair.expected(patches)
        if got == expect:
            verdict = got if expect == "pass" else f"fail as expected ({pair.finding})"
            if expect != pair.expect:
                verdict += f" (fixed by {pair.patch})"
        else:
            ok = False
            verdict = (f"UNEXPECTED {got}" + (f": expected to fail ({pair.finding}); update the registry"
                                              if expect == "fail" else
                                              f": {pair.patch} should fix {pair.finding}" if pair.patch in patches
                                              else ""))
        fd = report.get("first_divergence")
        rows.append((pair.name, verdict, fd["message"] if fd else ""))
    out_root.mkdir(parents=True, exist_ok=True)
    lines = ["# Parity: every registry pair", "",
             f"llama.cpp: {args.native_build.label if args.native_build else 'pinned'} build.", "",
             "| pair | result | first divergence |", "|---|---|---|"]
    lines += [f"| {n if v == 'skipped' else f'[{n}]({n}/parity.md)'} | {v} | {d.replace('|', '/')} |"
              for n, v, d in rows]
    (out_root / "summary.md").write_text("\n".join(lines) + "\n")
    (out_root / "summary.json").write_text(json.dumps(
        [{"pair": n, "result": v, "first_divergence": d} for n, v, d in rows], indent=1) + "\n")
    print(f"parity --all: {'OK' if ok else 'FAILED'} ({out_root / 'summary.md'})")
    return 0 if ok else 1
