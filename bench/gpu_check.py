"""The GPU check: is DFlash exact with the target (and the draft) on a GPU, and what does it gain?

    python -m dflash_llama.bench.gpu_check [-ngl -1] [--limit 12] [-n 128] [--bench-min 3] [--out DIR]
                                           [--build-seconds S]

`bench/gpu_check.sh` builds with CUDA and runs this; on a CPU build, `-ngl 0` runs the same checks
on the CPU (a dry run of the script). On the embedded default pair (SmolLM2-135M-Instruct Q4_1 and
its draft, as `dflash-llama run` decodes with it), with `-ngl` target layers offloaded:

1. **Verify logits against decode logits.** Greedy DFlash is exact by construction only where a
   verify of k tokens computes, for each position, the logits one-token decoding computes. On the
   CPU the build and the runtime make sure of it (docs/architecture.md); a GPU backend has its own
   kernels per batch size. Measured as in `tests/test_runtime_exactness.py`: the largest |logit
   difference| of a batched verify of 2, 8 and 16 tokens against one-at-a-time decoding, after 24
   and 300 cached tokens.
2. **Greedy exactness**: on `--limit` HumanEval prompts, `Runtime.generate` at draft_max 1, 3, the
   draft's whole block and `auto`, token for token against `Runtime.autoregressive`; the first
   differing token where one differs.
3. **The default-pair bench** (`dflash-llama bench`, without the server and n-gram phases, block
   sizes 2, 4 and 8, within `--bench-min` minutes) with the same `-ngl`, written to OUT/bench/.

Writes OUT/gpu_check.json and OUT/gpu_check.md (default OUT: reports/gpu-check-<device>/). Exits 3
when a greedy DFlash output differs from plain decoding, as the other commands do.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

DRAFT_MAXES = ("1", "3", "block", "auto")
VERIFY_BLOCKS = (2, 8, 16)
PREFIXES = (24, 300)


def devices() -> list[str]:
    """The GPUs `nvidia-smi -L` lists (none where it is missing or fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    run = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    return [line.strip() for line in run.stdout.splitlines() if line.startswith("GPU ")] if run.returncode == 0 else []


def slug(name: str) -> str:
    """A folder name for a device: 'GPU 0: NVIDIA H200 (UUID: ...)' -> 'nvidia-h200'."""
    name = re.sub(r"^GPU \d+:\s*|\s*\(UUID.*$", "", name)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cpu"


def verify_logits(rt, tokens: list[int]) -> list[dict]:
    """Per prefix and verify size: max |batched - one-at-a-time| over the block's logits."""
    import numpy as np

    rows = []
    for prefix in PREFIXES:
        one = rt.target_logits(tokens[:prefix + max(VERIFY_BLOCKS)], one_at_a_time=True, n_prefill=prefix)
        for block in VERIFY_BLOCKS:
            batched = rt.target_logits(tokens[:prefix + block])[prefix:]
            diff = np.abs(batched.astype(np.float64) - one[prefix:prefix + block])
            rows.append({"prefix": prefix, "block": block, "max_abs_diff": float(diff.max()),
                         "bit_equal": bool(np.array_equal(batched, one[prefix:prefix + block]))})
    return rows


def greedy_exactness(rt, texts: list[tuple[str, str]], n_predict: int, block: int) -> list[dict]:
    """Per prompt and draft_max: exact or the first differing token, with tau and tok/s."""
    from dflash_llama.results import first_mismatch

    rows = []
    for pid, text in texts:
        plain = rt.autoregressive(text, n_predict)
        rows.append({"prompt": pid, "method": "plain", "tokens": len(plain.tokens),
                     "tok_s": plain.stats.tokens_per_second})
        for dm in DRAFT_MAXES:
            draft_max = "auto" if dm == "auto" else block - 1 if dm == "block" else int(dm)
            g = rt.generate(text, n_predict, draft_max=draft_max)
            rows.append({"prompt": pid, "method": f"dflash-{draft_max}", "tokens": len(g.tokens),
                         "tok_s": g.stats.tokens_per_second, "tau": g.tau, "exact": g.tokens == plain.tokens,
                         "first_diff": None if g.tokens == plain.tokens else first_mismatch(plain.tokens, g.tokens)})
    return rows


def run_bench(args: argparse.Namespace, out: Path) -> dict:
    """The default-pair bench with the same -ngl, in a process of its own (its own report folder)."""
    cmd = [sys.executable, "-m", "dflash_llama.cli", "bench", "--limit", str(args.limit), "-n", str(args.n_predict),
           "--no-server", "--ngram-types", "none", "--block-sizes", "2,4,8", "--budget-min", f"{args.bench_min:g}",
           "-t", str(args.threads), "-ngl", str(args.n_gpu_layers), "--out", str(out / "bench")]
    t0 = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True)
    result = {"command": " ".join(cmd[2:]), "returncode": run.returncode, "seconds": time.monotonic() - t0}
    if run.returncode not in (0, 3):
        result["log_tail"] = (run.stdout + run.stderr)[-3000:]
    return result


def markdown(res: dict) -> str:
    lines = ["# GPU check: DFlash with the target on the GPU", "",
             f"Produced by `bench/gpu_check.sh` (`python -m dflash_llama.bench.gpu_check {res['argv']}`), "
             f"{res['started']}.", "",
             f"- devices: {', '.join(res['devices']) or 'none (nvidia-smi lists no GPU)'}; "
             f"GPU offload in this build: {'yes' if res['gpu_offload'] else 'no'}; -ngl {res['n_gpu_layers']}",
             f"- machine: {res['machine']}; dflash-llama {res['version']}, llama.cpp {res['llama_cpp']}",
             f"- pair: {res['target']} + {res['draft']}"]
    if res.get("build_seconds") is not None:
        lines.append(f"- build (`GGML_CUDA=ON ./setup.sh`, from bench/gpu_check.sh): {res['build_seconds']:.0f} s")
    lines.append(f"- checks: {res['check_seconds']:.0f} s; bench: {res['bench']['seconds']:.0f} s "
                 f"(exit {res['bench']['returncode']}, report in bench/)")
    lines += ["", "## Verify logits against one-token decode logits", "",
              "| cached tokens | verify of | max abs difference | bit for bit |", "|---:|---:|---:|---|"]
    lines += [f"| {r['prefix']} | {r['block']} | {r['max_abs_diff']:.3g} | {'yes' if r['bit_equal'] else 'no'} |"
              for r in res["verify_logits"]]
    rows = res["greedy"]
    plain = {r["prompt"]: r for r in rows if r["method"] == "plain"}
    lines += ["", f"## Greedy exactness ({len(plain)} HumanEval prompts, {res['n_predict']} tokens)", "",
              "| method | exact | tau (mean) | tok/s (median) | vs plain |", "|---|---:|---:|---:|---:|"]
    import statistics

    plain_tps = statistics.median(r["tok_s"] for r in plain.values())
    lines.append(f"| plain | – | – | {plain_tps:.1f} | 1.00x |")
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "plain"):
        rs = [r for r in rows if r["method"] == method]
        tps = statistics.median(r["tok_s"] for r in rs)
        exact, tau = sum(r["exact"] for r in rs), statistics.mean(r["tau"] for r in rs)
        lines.append(f"| {method} | {exact}/{len(rs)} | {tau:.2f} | {tps:.1f} | {tps / plain_tps:.2f}x |")
    bad = [r for r in rows if r.get("exact") is False]
    if bad:
        lines += ["", "Outputs that differ from plain decoding (first differing token):", ""]
        lines += [f"- {r['prompt']}, {r['method']}: token {r['first_diff']}" for r in bad]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_llama.bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("-ngl", "--n-gpu-layers", dest="n_gpu_layers", type=int, default=-1,
                   help="target layers on the GPU (default -1: all, so the draft runs there too; 0: a CPU dry run)")
    p.add_argument("--limit", type=int, default=12, help="HumanEval prompts, spread over the set (default 12)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens per generation (default 128)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default 0: all)")
    p.add_argument("--bench-min", type=float, default=3.0, help="time budget of the bench in minutes (default 3)")
    p.add_argument("--out", help="report folder (default reports/gpu-check-<device>/)")
    p.add_argument("--build-seconds", type=float, help="the build's time, for the report (bench/gpu_check.sh)")
    args = p.parse_args(argv)
    for name, value, low in (("--limit", args.limit, 1), ("-n", args.n_predict, 2), ("-t", args.threads, 0),
                             ("--bench-min", args.bench_min, 0.5)):
        if value < low:
            p.error(f"{name} must be at least {low}, got {value}")

    import dflash_llama
    from dflash_llama import fixtures, prompts
    from dflash_llama.converter.pair import DECODE_DRAFT_TYPE, DECODE_DRAFT_VOCAB, DEFAULT_DRAFT, resolve_draft
    from dflash_llama.runtime import Runtime

    gpus = devices()
    out = Path(args.out or f"reports/gpu-check-{slug(gpus[0]) if gpus and args.n_gpu_layers else 'cpu'}")
    out.mkdir(parents=True, exist_ok=True)
    target = fixtures.smollm2_gguf()
    draft = resolve_draft(DEFAULT_DRAFT, target, DECODE_DRAFT_TYPE, DECODE_DRAFT_VOCAB)
    try:
        rt = Runtime(target, draft, n_threads=args.threads, n_ctx=1024, n_gpu_layers=args.n_gpu_layers)
    except ValueError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t0 = time.monotonic()
    chosen = prompts.spread(prompts.humaneval(), args.limit)
    tokens = rt.tokenize("".join(p.text for p in prompts.humaneval()[:4]))[:340]
    res = {"schema": "dflash-llama-gpu-check/1", "argv": " ".join(argv if argv is not None else sys.argv[1:]),
           "started": started, "devices": gpus, "gpu_offload": dflash_llama.supports_gpu_offload(),
           "n_gpu_layers": args.n_gpu_layers, "machine": f"{platform.processor() or platform.machine()}, "
           f"{platform.platform()}", "version": dflash_llama.__version__, "llama_cpp": dflash_llama.llama_cpp_commit(),
           "target": target.name, "draft": Path(draft).name, "n_predict": args.n_predict,
           "build_seconds": args.build_seconds}
    print("gpu_check: verify logits against decode logits", file=sys.stderr)
    res["verify_logits"] = verify_logits(rt, tokens)
    print(f"gpu_check: greedy exactness on {len(chosen)} prompts", file=sys.stderr)
    res["greedy"] = greedy_exactness(rt, [(q.id, q.text) for q in chosen], args.n_predict, rt.block_size)
    res["check_seconds"] = time.monotonic() - t0
    del rt  # the bench loads its own
    print("gpu_check: the default-pair bench", file=sys.stderr)
    res["bench"] = run_bench(args, out)
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(res))
    print(f"gpu_check: wrote {out}/gpu_check.md", file=sys.stderr)
    exact = all(r.get("exact", True) for r in res["greedy"])
    return 0 if exact and res["bench"]["returncode"] == 0 else 3 if not exact or res["bench"]["returncode"] == 3 else 1


if __name__ == "__main__":
    sys.exit(main())
