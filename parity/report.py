"""parity.json (schema: parity/schema.json, documented in docs/parity.md), parity.md and parity.png."""

from __future__ import annotations

import json
import math
from pathlib import Path

SCHEMA_PATH = Path(__file__).with_name("schema.json")
PAIR_STYLE = {"reference/runtime": ("tab:blue", "o"), "reference/native": ("tab:orange", "s"),
              "runtime/native": ("tab:green", "^")}
FLOOR = 1e-12  # exact agreement is drawn here on the log scale


def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def validate(report: dict) -> None:
    """Raise jsonschema.ValidationError if `report` does not follow parity/schema.json."""
    import jsonschema

    jsonschema.validate(report, schema())


def json_safe(x):
    """JSON has no inf/nan: an infinite error becomes null (the markdown says "inf")."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write(report: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clean = json_safe(report)
    paths = {"json": out / "parity.json", "md": out / "parity.md", "png": out / "parity.png"}
    paths["json"].write_text(json.dumps(clean, indent=1) + "\n")
    plot(clean, paths["png"])
    paths["md"].write_text(markdown(clean, paths["png"].name))
    return paths


# ---------------------------------------------------------------- markdown

def _e(x) -> str:
    return "-" if x is None else ("inf" if isinstance(x, float) and math.isinf(x) else f"{x:.1e}")


def _status(s: str) -> str:
    return {"pass": "PASS", "fail": "**FAIL**", "skipped": "skipped"}.get(s, s)


def markdown(r: dict, png_name: str = "parity.png") -> str:
    st = r["stages"]
    lines = [f"# Parity report: {r['name']}", ""]
    if r.get("note"):
        lines += [f"> **{r['note'][0].upper() + r['note'][1:]}**", ""]
    verdict = "PASS" if r["passed"] else "**FAIL**"
    lines.append(f"Result: {verdict}")
    fd = r.get("first_divergence")
    lines += ["", f"First divergence: {fd['message']}" if fd else "First divergence: none (every intermediate "
              "within its bound)", ""]
    i = r["inputs"]
    lines += ["| input | value |", "|---|---|",
              f"| target | `{i['target']}` ({r['types']['target']} weights, head {r['types']['head']}) |",
              f"| draft | `{i['draft']}` ({r['types']['draft']} weights) |",
              f"| draft HF checkpoint | {('`' + i['draft_hf'] + '`') if i['draft_hf'] else '- (reference uses the GGUF weights)'} |",
              f"| target HF checkpoint | {('`' + i['target_hf'] + '`') if i['target_hf'] else '- (reference target: transformers GGUF loader, dequantised f32)'} |",
              f"| prompts | {len(i['prompts'])} ({', '.join(i['prompts'][:4])}{', ...' if len(i['prompts']) > 4 else ''}) |",
              f"| versions | dflash-llama {r['versions']['dflash_llama']}, llama.cpp {r['versions']['llama_cpp']} |",
              f"| llama.cpp build | {i.get('native_build', 'pinned')} |",
              f"| created | {r['created']} |", ""]
    lines += ["| stage | status |", "|---|---|"]
    for key, title in (("converter", "1. converter"), ("capture", "2. capture"), ("graph", "3. draft graph"),
                       ("end_to_end", "4. end to end")):
        s = st[key]
        lines.append(f"| {title} | {_status(s['status'])}{(': ' + s['reason']) if s.get('reason') else ''} |")
    lines += ["", f"![relative error per intermediate and per target layer]({png_name})", ""]

    c = st["converter"]
    lines += ["## 1. Converter: GGUF tensors against the HF checkpoint", ""]
    if c["status"] == "skipped":
        lines += [c["reason"], ""]
    else:
        lines += [f"Relative error of each dequantised GGUF tensor against the HF tensor (f32), and against the HF "
                  f"tensor re-quantised to the GGUF tensor's type by gguf-py (bound {_e(c['requant_bound'])}).", "",
                  "| GGUF tensor | type | error | re-quantised | bound | ok |", "|---|---|---|---|---|---|"]
        for t in c["tensors"]:
            lines.append(f"| `{t['name']}` | {t['type'] or '-'} | {_e(t['error'])} | {_e(t['requant_error'])} | "
                         f"{_e(t['bound'])} | {'yes' if t['passed'] else '**no**' + (' (' + t['detail'] + ')' if t.get('detail') else '')} |")
        lines.append("")

    cap = st["capture"]
    lines += ["## 2. Capture: target features against the reference target", ""]
    chk = cap["layer_check"]
    lines += [f"Target layers: {chk['message']} (dflash.target_layers = {chk['gguf_target_layers']}).", ""]
    if chk.get("tap_errors"):
        lines += ["| tap | GGUF reads layer | HF config says | error of the read features vs the HF layer |",
                  "|---|---|---|---|"]
        for k, t in enumerate(chk["tap_errors"]):
            lines.append(f"| {k} | {t['gguf_id']} | {t['hf_id']} | {_e(t['error'])} |")
        lines.append("")
    rounding = cap.get("rounding", {})
    lines += [f"Reference: transformers over `{cap['reference_path']}` "
              f"({'HF weights' if cap['reference'] == 'hf' else 'the GGUF, dequantised to f32'}); "
              f"{cap['n_tokens']} tokens ({cap['target_type']} target).", "",
              "The check is each layer's **own error**: the reference layer reads our runtime's output of the "
              "layer before, rounds each matmul's input as ggml does (weights: "
              f"{rounding.get('weights', '-')}), and its output is compared with ours relative to what the layer "
              f"adds; bound {_e(cap['own_bound'])}"
              + ("" if rounding.get("covered", True) else
                 " (the type's bound: not every matrix could be rounded as ggml does: "
                 + ", ".join(rounding.get("uncovered", [])[:4]) + ")")
              + f". The compounded error (the reference running freely from layer 0) and its NMSE are reported; "
              f"it grows with depth (the type's former fixed bound was {_e(cap['bound'])}).", ""]
    if cap.get("logits"):
        lines += [_logit_line("Logits of the prompt, runtime vs reference target", cap["logits"]), ""]
    lines += ["| target layer | tap | own error | compounded error | NMSE |", "|---|---|---|---|---|"]
    for row in cap["layers"]:
        flag = "" if row["own_error"] is not None and row["own_error"] <= cap["own_bound"] else " **over**"
        lines.append(f"| {row['layer']} | {'yes' if row['tap'] else ''} | {_e(row['own_error'])}{flag} | "
                     f"{_e(row['error'])} | {_e(row.get('nmse'))} |")
    lines.append("")

    g = st["graph"]
    lines += ["## 3. Draft graph: reference vs runtime vs llama.cpp", ""]
    if g["status"] == "skipped":
        lines += [g.get("reason", ""), ""]
    else:
        pairs = list(g["errors"])
        lines += [f"Maximum relative error over {len(g['inputs'])} input(s) (context features + block), graph order. "
                  f"Draft weights {g['draft_type']}, head {g['head_type']}. NMSE = relative error squared "
                  "(llama.cpp's conversion check: below 1e-2 passes, below 1e-6 is identical), reference vs runtime.",
                  "",
                  "| intermediate | " + " | ".join(pairs) + " | NMSE | bounds | ok |",
                  "|---|" + "---|" * len(pairs) + "---|---|---|"]
        failing = {(f["name"], f["pair"]) for f in g["failures"]}
        for name in g["names"]:
            cells = []
            for p in pairs:
                e = g["errors"][p].get(name)
                cells.append(_e(e) + (" **over**" if (name, p) in failing else ""))
            bnd = " / ".join(_e(g["bounds"][p][name]) for p in pairs)
            ok = not any(n == name for n, _ in failing)
            nm = _e((g.get("nmse") or {}).get("reference/runtime", {}).get(name))
            lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {nm} | {bnd} | {'yes' if ok else '**no**'} |")
        lines.append("")
        lines += _selector_lines(g.get("selector"))
        lines += _drafts_lines(g.get("drafts"))
        for impl, names in (g.get("missing") or {}).items():
            lines.append(f"- {impl} lacks: {', '.join(names)}")
        for note in g.get("notes", []):
            lines.append(f"- {note}")
        lines.append("")

    e = st["end_to_end"]
    lines += ["## 4. End to end", ""]
    if e["status"] == "skipped":
        lines += [e.get("reason", ""), ""]
    else:
        impls = list(e["tau"])
        lines += [f"Greedy, {e['n_predict']} new tokens per prompt, block size {e['block_size']}.", "",
                  "| prompt | " + " | ".join(f"tau {m}" for m in impls) + " | " +
                  " | ".join(f"{m} == target" for m in impls) + " |",
                  "|---|" + "---|" * (2 * len(impls))]
        for row in e["prompts"]:
            taus = [_tau(row.get(m, {}).get("tau")) for m in impls]
            ex = [_exact(row.get(m, {}).get("greedy_exact", False)) for m in impls]
            lines.append(f"| {row['prompt']} | " + " | ".join(taus) + " | " + " | ".join(ex) + " |")
        lines.append("| **mean** | " + " | ".join(_tau(e["tau"][m]) for m in impls) + " | " +
                     " | ".join(_exact(e["greedy_exact"].get(m)) for m in impls) + " |")
        if e.get("reference_mode") == "replay":
            same_ref = [row["reference"].get("same_tokens_as_runtime") for row in e["prompts"]]
            lines += ["", f"The reference was replayed, not run (a layer-streamed target): its own next token equals "
                          f"our runtime's greedy token at every generated position on {sum(same_ref)} of "
                          f"{len(same_ref)} prompts; its tau accepts its draft's blocks against those tokens."]
        same = [row["native"].get("same_text_as_runtime") for row in e["prompts"]
                if "same_text_as_runtime" in row.get("native", {})]
        if same:
            lines += ["", f"llama.cpp's text equals our runtime's autoregressive text on {sum(same)} of {len(same)} "
                          "prompts (it need not: docs/upstream_status.md, U6)."]
        if e.get("verify_logits"):
            lines += ["", _logit_line("Verify logits (generated positions, every prompt), runtime vs reference target",
                                      e["verify_logits"])]
        lines += _divergence_table(e)
        lines += ["", "Drafted-token agreement (the three drafts on identical replayed inputs):", ""]
        for pair, frac in e["draft_agreement"].items():
            lines.append(f"- {pair}: {frac:.1%}" if frac is not None else f"- {pair}: -")
        if e.get("native_error"):
            lines += ["", f"llama.cpp's loop failed: `{e['native_error'].splitlines()[-1]}`"]
        lines.append("")
        for note in e.get("notes", []):
            lines.append(f"- {note}")
        lines.append("")
    lines += _resources(r)
    lines += ["Bounds and method: docs/parity.md.", ""]
    return "\n".join(lines)


def _selector_lines(sel: dict | None) -> list[str]:
    """DFlash 2: the selector's lattices (scores keyed by slot, predecessor token and candidate token)
    and walked paths, per pair."""
    if not sel:
        return []
    lines = ["DFlash 2 candidate selector: lattice scores keyed by (slot, predecessor token, candidate token); "
             "llama.cpp's read from its nextn rows and walked as draft-dflash walks them.", "",
             "| pair | lattice error | bound | entries | on one side only | same drafted tokens |",
             "|---|---|---|---|---|---|"]
    for pair, row in sel["pairs"].items():
        lines.append(f"| {pair} | {_e(row['error'])} | {_e(row['bound'])} | {row['entries']} | "
                     f"{row['only_one_side']} | {'yes' if row['same_path'] else '**no**'} |")
    lines.append("")
    for item in sel["inputs"]:
        paths = {p: v for p, v in item.items() if isinstance(v, dict)}
        if paths:
            first = next(iter(paths.values()))
            lines.append(f"- {item['prompt']}: reference path {first['path_a']}")
    lines += [f"- **{f}**" for f in sel["failures"]]
    return lines + [""]


def _drafts_lines(drafts: dict | None) -> list[str]:
    """A chain draft (DSpark, or anchor-first): the tokens each implementation drafted, per pair."""
    if not drafts:
        return []
    lines = ["Drafted tokens of the chain (llama.cpp's read as its loop reads its outputs):", "",
             "| pair | same drafted tokens |", "|---|---|"]
    lines += [f"| {pair} | {'yes' if row['same'] else '**no**'} |" for pair, row in drafts["pairs"].items()]
    lines.append("")
    for item in drafts["inputs"]:
        rows = [v for p, v in item.items() if isinstance(v, dict)]
        if rows:
            lines.append(f"- {item['prompt']}: reference {rows[0]['drafts_a']}")
    lines += [f"- **{f}**" for f in drafts["failures"]]
    return lines + [""]


def _exact(x) -> str:
    return "yes" if x else "replayed" if x is None else "**no**"


def _logit_line(what: str, m: dict) -> str:
    return (f"{what}: KL divergence mean {_e(m['kl_mean'])}, 99th percentile {_e(m['kl_p99'])}, max "
            f"{_e(m['kl_max'])}; same top token at {m['same_top1']:.1%} of {m['n']} positions.")


def _divergence_table(e: dict) -> list[str]:
    """First divergence from plain decoding per implementation, verify width and length."""
    rows = e.get("divergence") or []
    if not rows:
        return []
    lengths = sorted({d["length"] for d in rows})
    lines = ["", "First divergence from plain greedy decoding (none: identical), over the prompts: our runtime "
             "in tokens, llama.cpp in characters of its text against its own plain run.", "",
             "| implementation | verify width | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for impl in ("runtime", "native"):
        for width in sorted({d["width"] for d in rows if d["impl"] == impl}):
            cells = []
            for n in lengths:
                got = [d for d in rows if (d["impl"], d["width"], d["length"]) == (impl, width, n)]
                hits = [d["first_divergence"] for d in got if d["first_divergence"] is not None]
                failed = [d for d in got if d.get("error")]
                cells.append("failed" if failed else "none" if not hits else f"**{min(hits)}**")
            lines.append(f"| {impl} | {width} | " + " | ".join(cells) + " |")
    return lines


def _resources(r: dict) -> list[str]:
    res = r.get("resources")
    if not res:
        return []
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    lines = ["## Time and memory", "",
             "Peak resident memory of this process per phase (reset at each phase's start), and of the "
             "llama.cpp tools it ran.", "", "| phase | wall time | peak RSS | tools' peak RSS |", "|---|---|---|---|"]
    for p in res["phases"]:
        lines.append(f"| {p['phase']} | {p['seconds']:.1f} s | {gib(p['peak_rss_bytes'])} | "
                     f"{gib(p.get('children_peak_rss_bytes'))} |")
    lines += [f"| **all** | {res['seconds']:.1f} s | {gib(res['peak_rss_bytes'])} | "
              f"{gib(res.get('children_peak_rss_bytes'))} |", ""]
    return lines


def _tau(x) -> str:
    return "-" if x is None else f"{x:.2f}"


# ---------------------------------------------------------------- plot

def plot(r: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = r["stages"]["graph"]
    cap = r["stages"]["capture"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(10, 0.28 * len(g.get("names", [])) + 3), 9),
                                  gridspec_kw={"height_ratios": [3, 2]})
    names = g.get("names", [])
    x = list(range(len(names)))
    values = [v for errs in g.get("errors", {}).values() for v in errs.values() if v]
    floor = 10 ** (math.floor(math.log10(min(values))) - 1) if values else FLOOR
    offsets = {"reference/runtime": -0.15, "reference/native": 0.0, "runtime/native": 0.15}
    for pair, errs in g.get("errors", {}).items():
        color, marker = PAIR_STYLE.get(pair, ("black", "."))
        ys = [max(errs.get(n) if errs.get(n) is not None else math.nan, floor) for n in names]
        xs = [i + offsets.get(pair, 0.0) for i in x]  # side by side: equal errors stay visible
        ax.plot(xs, ys, marker=marker, ms=4, lw=1.0, color=color, label=pair)
        bound = [g["bounds"][pair][n] for n in names]
        ax.step(x, bound, where="mid", ls="--", lw=0.8, color=color, alpha=0.6)
    ax.axhline(floor, color="0.6", lw=0.6)
    ax.annotate("exact (0)", (len(names) - 0.5, floor), fontsize=7, color="0.4", ha="right", va="bottom")
    for f in g.get("failures", []):
        at = names.index(f["name"]) + offsets.get(f["pair"], 0.0)
        if f["error"] is None:  # inf or NaN (stored as null): marked at the top of the axis
            ax.annotate("x inf", (at, 0.9), xycoords=("data", "axes fraction"), color="red", fontsize=8, ha="center")
        else:
            ax.plot(at, f["error"], "x", color="red", ms=9, mew=2)
    fd = r.get("first_divergence")
    if fd and fd.get("name") in names:
        ax.axvline(names.index(fd["name"]), color="red", lw=0.8, alpha=0.5)
        ax.annotate(f"first divergence: {fd['name']}", (names.index(fd["name"]) + 0.2, 0.98),
                    xycoords=("data", "axes fraction"), color="red", fontsize=8, ha="left", va="top")
    # shade odd draft layers so per-layer groups read at a glance
    for i, n in enumerate(names):
        tail = n.rpartition("-")[2]
        if tail.isdigit() and int(tail) % 2 == 1:
            ax.axvspan(i - 0.5, i + 0.5, color="0.93", zorder=0)
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("relative error (log)")
    ax.set_title(f"{r['name']}: draft intermediates ({g.get('draft_type', '?')} draft), dashed: bounds, shaded: odd layers; "
                 f"{'PASS' if r['passed'] else 'FAIL'}", fontsize=10)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")

    layers = cap.get("layers", [])
    if layers:
        lx = [row["layer"] for row in layers]
        ly = [max(row["error"] if row["error"] is not None else math.nan, FLOOR) for row in layers]
        ax2.plot(lx, ly, marker="o", ms=3, color="tab:purple", label="runtime capture vs reference hidden state")
        taps = [row for row in layers if row["tap"]]
        ax2.plot([t["layer"] for t in taps], [max(t["error"] or FLOOR, FLOOR) for t in taps], "D", ms=7,
                 mfc="none", color="tab:purple", label="draft taps")
        ax2.axhline(cap["bound"], ls="--", lw=0.8, color="tab:purple", alpha=0.6)
        if "own_bound" in cap:
            own = [max(row["own_error"] if row["own_error"] is not None else math.nan, FLOOR) for row in layers]
            ax2.plot(lx, own, marker="s", ms=3, color="tab:red", label="own error of the layer (the check)")
            ax2.axhline(cap["own_bound"], ls="--", lw=0.8, color="tab:red", alpha=0.6)
        ax2.set_yscale("log")
        ax2.set_xticks(lx if len(lx) <= 40 else lx[::2])
        ax2.set_xlabel("target layer (Hugging Face id: hidden_states[id + 1])")
        ax2.set_ylabel("relative error")
        ax2.set_title(f"target feature capture ({cap['target_type']} target, reference: "
                      f"{'HF weights' if cap['reference'] == 'hf' else 'dequantised GGUF'})", fontsize=10)
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=8)
    else:
        ax2.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
