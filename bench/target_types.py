"""`dflash-llama bench --target-types Q4_1,Q8_0,F16`: where DFlash pays on this CPU, by the weight
type of the target.

A verify of k tokens costs about k plain decodes where the target's matrix kernels are bound by
compute, and about one where a decode is bound by memory bandwidth; which of the two a CPU is
depends on the target's weight type. For each type the sweep makes the target from the given GGUF
with the pinned `llama-quantize --allow-requantize` (`typed_target`: cached in the package's cache
folder by the input's content, the type and the llama.cpp pin; the input's own type is used as it
is), loads it with the one draft, and measures with our runtime, in one run:

- the cost model on the pilot prompts (`Bench.cost_model`): a plain decode step, the step costs of
  N = 1..B-1 verified drafts, the acceptance curve and the pick; the verify cost of k tokens in
  units of one decode is t_verify(k) / t_decode from those timed steps (our runtime's own decodes:
  logits of every row, at the prompts' context, as the speculative loop pays them);
- on every benchmark prompt, side by side in an order rotated per prompt: plain decoding
  (`runtime-ar`), DFlash with `draft_max="auto"` (`dflash-auto`) and DFlash at the cost model's
  pick (`dflash-pick`), each DFlash row checked token for token against the plain decoding of the
  same type and prompt.

Prompts are the outer loop and types the inner one (rotated too), so drift of the machine falls
on every type alike and a time budget stops every type after the same prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from dflash_llama.converter.conversion import NATIVE_OUTTYPES, QUANTIZE_OUTTYPES

SCHEMA = "dflash-llama-bench-target-types/2"
TYPES = tuple(t.upper() for t in (*NATIVE_OUTTYPES, *QUANTIZE_OUTTYPES))  # what llama-quantize makes without an imatrix
VERIFY_K = (2, 4, 8)  # verify sizes of the report's table (the JSON has every k up to the block)
METHODS = ("runtime-ar", "dflash-auto", "dflash-pick")
VERIFY_SOURCE = ("our runtime's timed steps on the pilot prompts (cost model calibration): "
                 "median verify time of k tokens / median plain decode step")


def parse_types(text: str) -> list[str]:
    """argparse type of `--target-types`: comma-separated llama-quantize type names, in the given order."""
    names = [t.strip().upper() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TYPES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown target type {bad[0] if bad else text!r}; "
                                         f"choose from {','.join(TYPES)}")
    return list(dict.fromkeys(names))


def file_type(path: str | os.PathLike) -> str | None:
    """The weight type a GGUF declares (general.file_type, as a TYPES name), None if it declares none."""
    import gguf

    from dflash_llama import gguf_info, schema

    value = gguf_info(path).metadata.get(schema.GENERAL_FILE_TYPE)
    try:
        name = gguf.LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return None
    return name.split("_", 1)[1] if name.startswith(("MOSTLY_", "ALL_")) else name


def tensor_types(path: str | os.PathLike) -> dict[str, int]:
    """How many tensors of each ggml type a GGUF holds (upper case, as TYPES)."""
    from dflash_llama import gguf_info

    return dict(sorted(Counter(t.type.upper() for t in gguf_info(path).tensors).items()))


def cache_key(src: Path) -> str:
    """The content of `src` and the llama.cpp pin whose llama-quantize makes the derived files."""
    import dflash_llama

    h = hashlib.sha256(dflash_llama.llama_cpp_commit().encode())
    with open(src, "rb") as f:  # in pieces: a target may be larger than memory
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()[:12]


def typed_target(src: str | os.PathLike, qtype: str, threads: int | None = None) -> tuple[Path, bool]:
    """The target of weight type `qtype` made from `src`: `src` itself when it is of that type, else
    the pinned llama-quantize's output, cached in `cache_dir()/targets`. Returns (path, requantized)."""
    from dflash_llama import peers
    from dflash_llama.paths import cache_dir

    src = Path(src)
    if file_type(src) == qtype:
        return src, False
    out = cache_dir() / "targets" / f"{src.stem}-{cache_key(src)}-{qtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:  # the cache holds whole files only
            peers.quantize(src, tmp, qtype, allow_requantize=True, threads=threads)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out, True


def llama_bench_verify_cost(target: str, threads: int | None, n_gpu_layers: int = 0) -> dict[str, float]:
    """The pinned `llama-bench`'s view of the same costs: k * pp1 / ppk, a k-token prompt decode in
    units of a one-token one (the last row's logits only, an empty cache), for k in VERIFY_K."""
    from dflash_llama import peers

    tps = peers.prompt_speeds(target, (1, *VERIFY_K), threads=threads or os.cpu_count() or 1,
                              n_gpu_layers=n_gpu_layers)
    return {str(k): k * tps[1] / tps[k] for k in VERIFY_K}


def _auto_kwargs() -> dict:
    """Runtime.generate's arguments for the `dflash-auto` row (the one place that says what it runs)."""
    return {"draft_max": "auto"}


def _method_kwargs(method: str, pick: int) -> dict:
    return _auto_kwargs() if method == "dflash-auto" else {"draft_max": pick}


def _measure(bench, method: str, prompt, pick: int) -> dict:
    """One generation of `method` on `prompt` with `bench`'s runtime: its speed and tokens."""
    toks, n = bench.tokens[prompt.id], bench.s.n_predict
    if method == "runtime-ar":
        g = bench.rt.autoregressive(toks, n)
    else:
        g = bench.rt.generate(toks, n, block_size=bench.block_size, **_method_kwargs(method, pick))
    st = g.stats
    decode_ms, n_dec = st.t_total_ms - st.t_prefill_ms, st.n_generated - 1  # the first token: the prompt's logits
    row = {"prompt": prompt.id, "method": method, "n_tokens": st.n_generated, "decode_tokens": n_dec,
           "decode_ms": decode_ms, "tokens_per_second": 1000.0 * n_dec / decode_ms if n_dec > 0 and decode_ms > 0
           else None, "stop_reason": g.stop_reason, "_tokens": list(g.tokens)}
    if method != "runtime-ar":
        row.update(steps=len(g.steps), tau=g.tau, drafted=sum(len(x.drafted) for x in g.steps),
                   accepted=sum(x.accepted for x in g.steps))
        policy = getattr(g, "policy", None)  # what the adaptive loop chose (auto only)
        if policy is not None:
            row["policy"] = dataclasses.asdict(policy)
    return row


def _one_prompt(qtype: str, bench, prompt, pick: int, shift: int, progress: Callable[[int, str], None]) -> list[dict]:
    """The three methods on one prompt (in an order rotated by `shift`), the DFlash rows judged
    token for token against plain decoding."""
    from dflash_llama.results import first_mismatch

    order = METHODS[shift % len(METHODS):] + METHODS[: shift % len(METHODS)]
    got = {}
    for m in order:
        got[m] = _measure(bench, m, prompt, pick)
        progress(1, f"{qtype} {prompt.id} {m}")
    ar = got["runtime-ar"]["_tokens"]
    out = []
    for m in METHODS:
        r = got[m]
        if m != "runtime-ar":
            r.update(exact=r["_tokens"] == ar, first_difference=first_mismatch(r["_tokens"], ar))
        out.append({"type": qtype} | {k: v for k, v in r.items() if not k.startswith("_")})
    return out


def _speed(rows: list[dict]) -> float | None:
    ms = sum(r["decode_ms"] for r in rows)
    return 1000.0 * sum(r["decode_tokens"] for r in rows) / ms if ms > 0 else None


def _method_summary(rows: list[dict], ar: dict[str, dict]) -> dict:
    """Speed over all tokens, ratios to plain decoding (all tokens, median per prompt), exactness."""
    tps, base = _speed(rows), _speed(list(ar.values()))
    per = [r["tokens_per_second"] / ar[r["prompt"]]["tokens_per_second"] for r in rows
           if r["tokens_per_second"] and ar[r["prompt"]]["tokens_per_second"]]
    out = {"prompts": len(rows), "tokens_per_second": tps,
           "ratio_vs_runtime_ar": tps / base if tps and base else None,
           "median_prompt_ratio_vs_runtime_ar": statistics.median(per) if per else None}
    if rows and "steps" in rows[0]:
        steps, drafted, accepted = (sum(r[k] for r in rows) for k in ("steps", "drafted", "accepted"))
        out.update(exact=sum(r["exact"] for r in rows), all_exact=all(r["exact"] for r in rows),
                   tau=(accepted + steps) / steps if steps else None,
                   acceptance_rate=accepted / drafted if drafted else None)
    return out


def ceilings(cm: dict) -> dict:
    """The most DFlash / plain decoding could reach on this type, from the cost model's measurements:
    max over N of E[tokens per step](N) / (step cost in decodes), once with the draft free (verify
    only: no draft, however cheap, passes it) and once with the measured draft and bookkeeping."""
    decode_ms = cm["autoregressive_step_ms"]
    cost = {c["n_draft"]: c for c in cm["costs"]}
    free, measured = {}, {}
    for pr in cm["predictions"]:
        c = cost[pr["n_draft"]]
        free[pr["n_draft"]] = pr["expected_tokens"] * decode_ms / c["verify_ms"]
        measured[pr["n_draft"]] = pr["expected_tokens"] * decode_ms / c["step_ms"]
    best_free, best = max(free, key=free.get), max(measured, key=measured.get)
    return {"free_draft": free[best_free], "free_draft_n": best_free,
            "measured_draft": measured[best], "measured_draft_n": best}


def _type_summary(qtype: str, info: dict, cm: dict, rows: list[dict]) -> dict:
    """One type: where its target came from, its decode and verify costs, the ceilings, the pick, the
    three methods."""
    decode_ms = cm["autoregressive_step_ms"]
    verify = {str(c["n_draft"] + 1): c["verify_ms"] / decode_ms for c in cm["costs"]}
    ar = {r["prompt"]: r for r in rows if r["method"] == "runtime-ar"}
    methods = {m: _method_summary([r for r in rows if r["method"] == m], ar) for m in METHODS}
    return info | {"type": qtype, "decode_ms": decode_ms, "decode_tokens_per_second": 1000.0 / decode_ms,
                   "verify_cost": verify, "ceiling": ceilings(cm), "pick": cm["pick"]["n_draft"],
                   "pick_predicted_tokens_per_second": cm["pick"]["tokens_per_second"],
                   "pick_predicted_beats_plain": cm["pick"]["tokens_per_second"] > 1000.0 / decode_ms,
                   "methods": methods, "cost_model": cm}


def _prepare(base, types: list[str], progress: Callable[[int, str], None]) -> list[tuple[str, object, dict]]:
    """Per type: its target (made or reused), a loaded `Bench` on it, and where the target came from."""
    from .runner import Bench

    out = []
    for qtype in types:
        path, requantized = typed_target(base.target, qtype, base.threads)
        s = dataclasses.replace(base, target=str(path), block_sizes=[], ngram_types=[], native=False, server=False)
        info = {"target": str(path), "requantized": requantized, "tensor_types": tensor_types(path),
                "file_bytes": path.stat().st_size}
        out.append((qtype, Bench(s, lambda n, what, q=qtype: progress(n, f"{q} {what}")), info))
    return out


def run_sweep(base, types: list[str], progress: Callable[[int, str], None] = lambda n, what: None,
              retotal: Callable[[int], None] = lambda extra: None) -> dict:
    """The sweep for `base` (a `runner.Settings`: target, draft, prompts, pilot, -n, threads, context,
    calibration, deadline) over `types`; the `target_types` value of bench.json."""
    from .runner import REPORT_S

    t0 = time.monotonic()
    benches = _prepare(base, types, progress)
    retotal(sum(b.count_runs()["warmup"] + b.count_runs()["cost_model"] for _, b, _ in benches)
            + len(benches) * len(METHODS) * len(base.prompts))
    cms = {}
    for qtype, bench, info in benches:
        bench.warmup()
        cms[qtype] = bench.cost_model()
        info["llama_bench_verify_cost"] = llama_bench_verify_cost(info["target"], base.threads, base.n_gpu_layers)
    rows: list[dict] = []
    done = 0
    started = time.monotonic()
    for i, p in enumerate(base.prompts):
        per_prompt_s = (time.monotonic() - started) / i if i else 0.0
        if i and base.deadline is not None and time.monotonic() + per_prompt_s + REPORT_S > base.deadline:
            break
        for qtype, bench, _ in benches[i % len(benches):] + benches[: i % len(benches)]:
            rows += _one_prompt(qtype, bench, p, cms[qtype]["pick"]["n_draft"], i, progress)
        done += 1
    retotal(-(len(base.prompts) - done) * len(benches) * len(METHODS))
    return {"schema": SCHEMA, "source": base.target, "source_type": file_type(base.target), "types": types,
            "block_size": benches[0][1].block_size,  # one draft for every type
            "auto_request": {k: str(v) for k, v in _auto_kwargs().items()}, "verify_source": VERIFY_SOURCE,
            "prompts": [p.id for p in base.prompts[:done]], "prompts_planned": len(base.prompts),
            "stopped_by_budget": done < len(base.prompts), "pilot_prompts": [p.id for p in base.pilot],
            "wall_s": time.monotonic() - t0,
            "by_type": [_type_summary(q, info, cms[q], [r for r in rows if r["type"] == q]) for q, _, info in benches],
            "rows": rows}


def result(base, started: float) -> dict:
    """bench.json of a run that is only the sweep (`started`: its time.time()); `target_types` goes in."""
    from .runner import SCHEMA, machine_info

    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {"schema": SCHEMA,
            "meta": machine_info() | {"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
                                      "wall_s": time.time() - started, "loadavg_end": load},
            "settings": {"target": base.target, "draft": base.draft, "n_predict": base.n_predict,
                         "threads": base.threads, "n_ctx": base.n_ctx, "calibration_tokens": base.calibration_tokens,
                         "prompts": [{"id": p.id} for p in base.prompts], "pilot_prompts": [p.id for p in base.pilot]}}


def inexact_rows(sweep: dict) -> list[dict]:
    """The DFlash rows of a sweep whose tokens differ from plain decoding of the same type."""
    return [r for r in sweep["rows"] if r["method"] != "runtime-ar" and not r["exact"]]
