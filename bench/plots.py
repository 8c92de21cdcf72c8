"""The benchmark's pictures (PNG, matplotlib), drawn from the bench.json dictionary."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

DPI = 120
OURS, NATIVE = "tab:blue", "tab:orange"


def _ours(res: dict) -> list[dict]:
    """Our runtime's speculative methods, by block size then N."""
    ms = [m for m in res["methods"] if m["impl"] == "dflash-llama" and m["kind"] == "dflash"]
    return sorted(ms, key=lambda m: (m["block_size"], m["draft_max"] is not None, m["n_draft"]))


def acceptance_length(res: dict, path: Path) -> Path:
    """Fraction of verify steps producing 1, 2, ... tokens: one panel per setting of our runtime."""
    ms = _ours(res)
    top = max(m["block_size"] for m in ms)
    fig, axes = plt.subplots(len(ms), 1, figsize=(max(7.0, 0.45 * top + 3), 1.25 * len(ms) + 1.3),
                             sharex=True, squeeze=False)
    cmap = plt.get_cmap("viridis")
    xs = np.arange(1, top + 1)
    for i, (ax, m) in enumerate(zip(axes[:, 0], ms)):
        s = res["summary"][m["key"]]
        hist = {int(k): v for k, v in s["acceptance_length_histogram"].items()}
        total = sum(hist.values()) or 1
        ax.bar(xs, [hist.get(int(x), 0) / total for x in xs], 0.75, color=cmap(i / max(1, len(ms) - 1) * 0.85))
        ax.axvline(s["tau"], color="black", ls="--", lw=1)
        ax.text(1.01, 0.5, f"{m['label'].replace('dflash-llama DFlash ', '')}\ntau {s['tau']:.2f}",
                transform=ax.transAxes, va="center", fontsize=8.5)
        ax.set_ylim(0, 1.0)
        ax.set_yticks([0, 0.5, 1.0])
        ax.grid(axis="y", alpha=0.3)
    axes[-1, 0].set_xticks(xs)
    axes[-1, 0].set_xlabel("tokens produced per verify step (accepted drafts + 1); dashed: the mean, tau")
    fig.supylabel("fraction of steps", fontsize=10)
    fig.suptitle("Acceptance length, dflash-llama runtime (all prompts pooled)")
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def acceptance_by_position(res: dict, path: Path) -> Path:
    """Fraction of steps whose drafted token i was accepted (so were all before it)."""
    ms = [m for m in _ours(res) if m["draft_max"] is None and not m.get("adaptive")]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    cmap = plt.get_cmap("viridis")
    for i, m in enumerate(ms):
        surv = res["summary"][m["key"]]["acceptance_by_position"]
        ax.plot(range(1, len(surv) + 1), surv, marker="o", ms=4, color=cmap(i / max(1, len(ms) - 1) * 0.85),
                label=f"B={m['block_size']}")
    cm = res.get("cost_model")
    if cm and cm.get("survival"):
        surv = cm["survival"]
        ax.plot(range(1, len(surv) + 1), surv, ls="--", color="gray",
                label=f"pilot prompts, B={cm['block_size']} (cost model)")
    ax.set_xlabel("drafted token position (1 = first drafted token)")
    ax.set_ylabel("fraction of steps accepting it")
    ax.set_ylim(0, 1.02)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("Acceptance by block position, dflash-llama runtime")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def speed_by_block_size(res: dict, path: Path) -> Path:
    """Tokens per second and speedup over llama-completion, by block size, for every implementation."""
    summ = res["summary"]
    ms = res["methods"]
    base = summ["llama-completion"]["tokens_per_second"]
    fig, axes = plt.subplots(1, 2, figsize=(13.5, 4.8))
    for ax, speedup in zip(axes, (False, True)):
        def y(key, speedup=speedup):
            v = summ[key]["tokens_per_second"]
            return v / base if speedup else v

        for impl, stock, chain, color, ls, name in (
                ("dflash-llama", False, False, OURS, "-", "dflash-llama DFlash"),
                ("llama.cpp", False, False, NATIVE, "-", "llama.cpp native DFlash"),
                ("llama.cpp", True, False, NATIVE, "--", "llama.cpp native DFlash, stock build"),
                ("llama.cpp", False, True, "teal", "-.", "llama.cpp chain ngram-mod,draft-dflash"),
                ("llama.cpp", True, True, "teal", ":", "llama.cpp chain ngram-mod,draft-dflash, stock build")):
            pts = sorted((m["block_size"], y(m["key"])) for m in ms
                         if m["impl"] == impl and m["kind"] == "dflash" and m["draft_max"] is None
                         and not m.get("adaptive") and bool(m.get("stock")) == stock
                         and bool(m.get("chain")) == chain)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, ls=ls, label=name)
        for m in ms:
            if m.get("adaptive"):
                off = m.get("ngram") is False
                ax.plot([m["block_size"]], [y(m["key"])], marker="d" if off else "D", ms=10,
                        color="salmon" if off else "crimson", ls="none",
                        label=f"dflash-llama B={m['block_size']}, adaptive (--draft-max auto"
                              f"{', --ngram off' if off else ''})")
            elif m["auto"] or (m["impl"] == "dflash-llama" and m["kind"] == "dflash" and m["draft_max"] is not None):
                ax.plot([m["block_size"]], [y(m["key"])], marker="*", ms=14, color=OURS, ls="none",
                        label=f"dflash-llama B={m['block_size']}, N={m['draft_max']}"
                              + (" (cost model)" if m["auto"] else ""))
        flat = [("runtime-ar", "black", "-", "dflash-llama autoregressive"),
                ("llama-completion", "dimgray", "--", "llama-completion")]
        if "llama-spec-ar" in summ:
            flat.append(("llama-spec-ar", "darkgoldenrod", (0, (2, 2)), "llama-speculative-simple, no drafts"))
        if "stock-spec-ar" in summ:
            flat.append(("stock-spec-ar", "peru", (0, (1, 1)), "llama-speculative-simple, no drafts (stock)"))
        styles = [":", "-.", (0, (3, 1, 1, 1)), (0, (5, 2)), (0, (1, 2))]
        flat += [(m["key"], plt.get_cmap("tab10")(2 + i), styles[i % len(styles)], f"llama.cpp {m['key']}")
                 for i, m in enumerate(m for m in ms if m["kind"] == "ngram")]
        for key, color, ls, name in flat:
            ax.axhline(y(key), color=color, ls=ls, lw=1.3, label=name)
        sizes = sorted({m["block_size"] for m in ms if m["block_size"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(s) for s in sizes])
        ax.set_xlabel("verify block size B (B-1 drafted tokens)")
        ax.set_ylabel("speedup over llama-completion" if speedup else "decode tokens / s")
        ax.set_title("Speedup over llama-completion" if speedup else "Decode speed")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.745, 0.5), fontsize=8, frameon=False)
    fig.suptitle(f"All prompts, -n {res['settings']['n_predict']}, {res['settings']['threads']} threads")
    fig.tight_layout(rect=(0, 0, 0.745, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def per_prompt_speedup(res: dict, path: Path) -> Path:
    """Per prompt: speedup over llama-completion of our trained-block setting, the cost model's pick,
    and native DFlash at the trained block."""
    b = res["settings"]["draft_block_size"]
    keys = [m["key"] for m in res["methods"] if m["kind"] == "dflash" and m["block_size"] == b]
    keys = sorted(keys, key=lambda k: (not k.startswith("runtime"), k))
    rows = {(r["prompt"], r["method"]): r for r in res["rows"]}
    prompts = [p["id"] for p in res["settings"]["prompts"]]
    labels = {m["key"]: m["label"] for m in res["methods"]}
    fig, ax = plt.subplots(figsize=(max(8.0, 0.42 * len(prompts) * max(1, len(keys)) / 2 + 3), 4.8))
    width = 0.8 / max(1, len(keys))
    colors = [OURS, "tab:cyan", NATIVE, "tab:red", "peru"]
    for i, k in enumerate(keys):
        ys = []
        for p in prompts:
            r, base = rows[(p, k)], rows[(p, "llama-completion")]
            ys.append(r["tokens_per_second"] / base["tokens_per_second"]
                      if r["tokens_per_second"] and base["tokens_per_second"] else np.nan)
        ax.bar(np.arange(len(prompts)) - 0.4 + width * (i + 0.5), ys, width, label=labels[k],
               color=colors[i % len(colors)])
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(range(len(prompts)))
    ax.set_xticklabels([p.replace("HumanEval/", "HE/") for p in prompts], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("speedup over llama-completion")
    ax.set_title(f"Per-prompt speedup at the draft's block size B={b} (1 = as fast as plain decoding)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def cost_model(res: dict, path: Path) -> Path:
    """Predicted speed by number of verified drafts, with the measured speeds of this run."""
    cm = res["cost_model"]
    preds = cm["predictions"]
    fig, ax1 = plt.subplots(figsize=(10, 4.4))
    ns = [p["n_draft"] for p in preds]
    ax2 = ax1.twinx()  # step time bars behind the speed lines
    ax2.bar([c["n_draft"] for c in cm["costs"]], [c["step_ms"] for c in cm["costs"]], color="gray", alpha=0.18,
            label="step time (ms, right axis)")  # every measured N, also those beyond the acceptance curve
    ax2.set_ylabel("step time, ms")
    ax1.plot(ns, [p["tokens_per_second"] for p in preds], marker="o", color=OURS, label="predicted (pilot prompts)")
    post = cm.get("predictions_bench_acceptance")
    if post:
        ax1.plot([p["n_draft"] for p in post], [p["tokens_per_second"] for p in post], marker="o", ms=3, ls="--",
                 color=OURS, alpha=0.6, label="predicted, benchmark prompts'\nacceptance (check)")
    ax1.axhline(cm["autoregressive_tokens_per_second"], color="black", lw=1, label="plain decoding (pilot prompts)")
    measured = [(m["n_draft"], res["summary"][m["key"]]["tokens_per_second"]) for m in res["methods"]
                if m["impl"] == "dflash-llama" and m["kind"] == "dflash" and m["block_size"] == cm["block_size"]]
    if measured:
        ax1.plot([x for x, _ in measured], [y for _, y in measured], marker="*", ms=14, color="tab:red", ls="none",
                 label="measured (all benchmark prompts)")
    ax1.axvline(cm["pick"]["n_draft"], color="gray", ls=":", label=f"pick: N={cm['pick']['n_draft']}")
    ax1.set_xlabel(f"drafted tokens verified per step N (draft block B={cm['block_size']})")
    ax1.set_ylabel("decode tokens / s")
    ax1.set_xticks(ns)
    tops = [p["tokens_per_second"] for p in preds + (post or [])] + [y for _, y in measured if y]
    ax1.set_ylim(0, 1.15 * max(tops + [cm["autoregressive_tokens_per_second"]]))
    ax1.grid(alpha=0.3)
    ax1.set_zorder(ax2.get_zorder() + 1)
    ax1.patch.set_visible(False)
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    fig.legend(h1 + h2, l1 + l2, loc="center left", bbox_to_anchor=(0.70, 0.5), fontsize=8, frameon=False)
    ax1.set_title("Cost model: expected speed by draft length")
    fig.tight_layout(rect=(0, 0, 0.70, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def target_types(res: dict, path: Path) -> Path:
    """The `--target-types` sweep: DFlash / plain decoding per type (auto and the pick), and the cost
    of verifying k tokens in units of one decode per type."""
    sweep = res["target_types"]
    by = sweep["by_type"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12.5, 4.6))
    xs = np.arange(len(by))
    auto = "DFlash auto" + ("" if sweep["auto_request"] else " (the runtime's default draft_max)")
    for i, (key, name, color) in enumerate((("dflash-auto", auto, OURS),
                                            ("dflash-pick", "DFlash, the cost model's pick", "tab:cyan"))):
        ys = [t["methods"][key]["ratio_vs_runtime_ar"] or np.nan for t in by]
        bars = ax1.bar(xs - 0.2 + 0.4 * i, ys, 0.4, color=color, label=name)
        ax1.bar_label(bars, labels=[f"{y:.2f}" if y == y else "" for y in ys], fontsize=8, padding=2)
    ax1.axhline(1.0, color="black", lw=1, label="plain decoding")
    ax1.set_xticks(xs)
    ax1.set_xticklabels([f"{t['type']}\nN={t['pick']}" for t in by])
    ax1.set_ylabel("speed / our plain decoding (all tokens)")
    ax1.set_title("DFlash / plain decoding, by target type")
    ax1.set_ylim(0, 1.25 * max([1.0] + [t["methods"][k]["ratio_vs_runtime_ar"] or 0 for t in by
                                        for k in ("dflash-auto", "dflash-pick")]))
    ax1.legend(fontsize=8, loc="upper right")
    ax1.grid(axis="y", alpha=0.3)
    top = 1
    cmap = plt.get_cmap("tab10")
    for i, t in enumerate(by):
        pts = sorted((int(k), v) for k, v in t["verify_cost"].items())
        pts = [(1, 1.0)] + pts  # one token: one decode
        top = max(top, pts[-1][0])
        ax2.plot([k for k, _ in pts], [v for _, v in pts], marker="o", ms=4, color=cmap(i), label=t["type"])
    ks = np.arange(1, top + 1)
    ax2.plot(ks, ks, color="gray", ls="--", lw=1, label="k decodes (no gain from batching)")
    ax2.axhline(1.0, color="gray", ls=":", lw=1, label="one decode (free verify)")
    ax2.set_xticks(ks)
    ax2.set_xlabel("tokens verified in one target decode, k")
    ax2.set_ylabel("cost, in plain decode steps")
    ax2.set_title("Verify cost (our runtime's timed steps)")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"Target weight types, -n {res['settings']['n_predict']}, {res['settings']['threads']} threads, "
                 f"{len(sweep['prompts'])} prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def draw_all(res: dict, out: Path) -> list[str]:
    out = Path(out)
    made = [acceptance_length(res, out / "acceptance_length.png"),
            acceptance_by_position(res, out / "acceptance_by_position.png"),
            speed_by_block_size(res, out / "speed_by_block_size.png"),
            per_prompt_speedup(res, out / "per_prompt_speedup.png"),
            cost_model(res, out / "cost_model.png")] if "summary" in res else []
    if res.get("target_types"):
        made.append(target_types(res, out / "target_types.png"))
    return [p.name for p in made]
