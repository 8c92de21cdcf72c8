"""Quantisation study: one draft checkpoint as f32, f16, bf16, q8_0 and q4_0 GGUFs, each compared
with the reference (the HF weights in f32) intermediate by intermediate, and each one's acceptance
length (tau) with our runtime and with llama.cpp's draft-dflash loop on the same prompts.

    dflash-llama parity --quant-study [--target T.gguf --draft-hf DIR] --out reports/NAME/quant/

writes quant.json, quant.md and quant.png (the command line is parity/cli.py's). Default: the
embedded pair (SmolLM2-135M Q4_1 and its trained draft).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path

import numpy as np

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def run_study(target: Path, draft_hf: Path, work: Path, prompts: list, n_predict: int, n_threads: int = 1,
              graph_prompts: int = 2, native: bool = True, outtypes=OUTTYPES, progress_bar: bool = True) -> dict:
    import torch

    from dflash_llama import Runtime, peers
    from dflash_llama.converter import convert
    from dflash_llama.reference import generate_speculative
    from dflash_llama.reference.checkpoint import load_draft
    from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

    from . import bounds as B
    from .native import FLASH_ATTN, NativeDraft
    from .stages import (
        ParityConfig,
        Progress,
        graph_inputs,
        head_type,
        keep_last,
        load_reference_target,
        stage_graph,
        tensor_types,
    )

    torch.set_num_threads(max(1, n_threads))
    work.mkdir(parents=True, exist_ok=True)
    tw = target_weights_from_gguf(target)
    ref_draft = load_draft(draft_hf, tw.embed_tokens, tw.lm_head)
    head = B.category(head_type(tensor_types(target)))
    progress = Progress(len(outtypes) * (graph_prompts + len(prompts)) + len(prompts), progress_bar)
    rows = []
    try:
        # the reference's tau does not depend on the GGUF type: once, on the reference target
        reference_target = load_reference_target(target, quiet=not progress_bar)
        ref_tau = []
        probe = Runtime(target, None, n_threads=n_threads, n_ctx=512)
        for p in prompts:
            tokens = keep_last(probe.tokenize(p.text), 192)
            with torch.no_grad():
                ref_tau.append(generate_speculative(reference_target, ref_draft, tokens, n_predict).tau)
            progress.step("reference")
        del probe
        for outtype in outtypes:
            gguf = work / f"draft-{outtype}.gguf"
            convert(draft_hf, target, gguf, outtype=outtype)
            cfg = ParityConfig(target=target, draft=gguf, draft_hf=draft_hf, prompts=prompts,
                               graph_prompts=graph_prompts, n_threads=n_threads, n_predict=n_predict)
            rt = Runtime(target, gguf, n_threads=n_threads, n_ctx=512, kv_f32=True, compact_draft_head=False)
            nd = NativeDraft(rt, gguf, n_ctx=512, n_threads=n_threads) if native else None
            cat = B.file_category(tensor_types(gguf), skip=("token_embd.weight", "output.weight"))
            graph = stage_graph(cfg, graph_inputs(cfg, rt, nd), ref_draft, cat, head, progress)
            rt_e2e = Runtime(target, gguf, n_threads=n_threads, n_ctx=512)
            taus, native_taus = [], []
            for p in prompts:
                tokens = keep_last(rt_e2e.tokenize(p.text), 192)
                taus.append(rt_e2e.generate(tokens, n_predict, draft_max=None, stop_at_eog=False).tau)
                if native:
                    try:
                        ns = peers.speculative(target, rt_e2e.detokenize(tokens), n_predict, "draft-dflash",
                                               draft=gguf, n_max=rt_e2e.block_size - 1, threads=n_threads,
                                               n_ctx=2048, flash_attn=FLASH_ATTN)
                        native_taus.append(ns.tau)
                    except peers.PeerError:
                        native_taus.append(math.nan)
                progress.step(outtype)
            rows.append({"outtype": outtype, "category": cat, "file_bytes": gguf.stat().st_size,
                         "graph_status": graph["status"], "names": graph["names"], "errors": graph["errors"],
                         "bounds": graph["bounds"],
                         "max_error": {pair: max(e.values()) for pair, e in graph["errors"].items()},
                         "tau_runtime": float(np.mean(taus)),
                         "tau_native": float(np.nanmean(native_taus)) if native_taus else None})
            del rt, nd, rt_e2e
    finally:
        progress.close()
    from dflash_llama.paths import display_path

    return {"created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "target": display_path(target), "draft_hf": display_path(draft_hf), "prompts": [p.id for p in prompts],
            "n_predict": n_predict, "tau_reference": float(np.mean(ref_tau)), "rows": rows}


def write(study: dict, out: Path, title: str) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "quant.json", "md": out / "quant.md", "png": out / "quant.png"}
    from .report import json_safe

    paths["json"].write_text(json.dumps(json_safe(study), indent=1) + "\n")
    _plot(study, paths["png"], title)
    lines = [f"# Quantisation study: {title}", "",
             f"Target `{study['target']}`, draft checkpoint `{study['draft_hf']}`; reference = the checkpoint's "
             f"weights in f32. {len(study['prompts'])} prompts, {study['n_predict']} tokens each, greedy. "
             f"Reference tau (transformers target, f32 draft): {study['tau_reference']:.2f}.", "",
             "| draft GGUF | size | ref/runtime, before the head | ref/runtime, `result_output` | "
             "ref/native, before the head | runtime/native | graph check | tau runtime | tau native |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in study["rows"]:
        tn = "-" if r["tau_native"] is None or math.isnan(r["tau_native"]) else f"{r['tau_native']:.2f}"
        lines.append(f"| {r['outtype']} | {r['file_bytes'] / 1e6:.1f} MB | {_body_max(r, 'reference/runtime'):.1e} | "
                     f"{r['errors'].get('reference/runtime', {}).get('result_output', math.nan):.1e} | "
                     f"{_body_max(r, 'reference/native'):.1e} | {r['max_error'].get('runtime/native', math.nan):.1e} | "
                     f"{r['graph_status']} | {r['tau_runtime']:.2f} | {tn} |")
    lines += ["", "![intermediate errors and tau per type](quant.png)", "",
              "Errors: maximum over intermediates and inputs of ||impl - reference|| / ||reference||; \"before the "
              "head\" excludes `result_output`, which also carries the rounding of the target's q8_0 head (about "
              "6e-3 whatever the draft's type). The graph check applies the bounds of docs/parity.md for each type.",
              ""]
    paths["md"].write_text("\n".join(lines))
    return paths


def _body_max(row: dict, pair: str) -> float:
    errs = row["errors"].get(pair, {})
    vals = [v for n, v in errs.items() if n != "result_output" and v is not None]
    return max(vals) if vals else math.nan


def _plot(study: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = study["rows"]
    names = rows[0]["names"] if rows else []
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(16, 6), gridspec_kw={"width_ratios": [3, 1]})
    cmap = plt.get_cmap("viridis")
    values = [v for r in rows for e in r["errors"].values() for v in e.values() if v]
    floor = 10 ** (math.floor(math.log10(min(values))) - 1) if values else 1e-12
    ax.axhline(floor, color="0.6", lw=0.6)
    ax.annotate("exact (0)", (len(names) - 0.5, floor), fontsize=7, color="0.4", ha="right", va="bottom")
    for i, r in enumerate(rows):
        errs = r["errors"].get("reference/runtime", {})
        ax.plot(range(len(names)), [max(errs.get(n, math.nan), floor) for n in names], marker="o", ms=3,
                color=cmap(i / max(1, len(rows) - 1)), label=f"{r['outtype']} (ref/runtime)")
        nat = r["errors"].get("reference/native")
        if nat:
            ax.plot(range(len(names)), [max(nat.get(n, math.nan), floor) for n in names], ls=":", lw=1,
                    color=cmap(i / max(1, len(rows) - 1)))
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("relative error vs reference (log); dotted: llama.cpp's graph")
    ax.set_title(f"{title}: draft intermediates by GGUF type")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)

    x = np.arange(len(rows))
    ax2.bar(x - 0.2, [r["tau_runtime"] for r in rows], 0.4, label="runtime")
    ax2.bar(x + 0.2, [r["tau_native"] if r["tau_native"] is not None else math.nan for r in rows], 0.4,
            label="llama.cpp draft-dflash")
    ax2.axhline(study["tau_reference"], color="k", ls="--", lw=1, label="reference (f32)")
    ax2.set_xticks(x)
    ax2.set_xticklabels([r["outtype"] for r in rows])
    ax2.set_ylabel("tau (tokens per target verify)")
    ax2.set_title("acceptance length")
    ax2.set_ylim(0, max([1.0, study["tau_reference"]] + [r["tau_runtime"] for r in rows]) * 1.2)
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

