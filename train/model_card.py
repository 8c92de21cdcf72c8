"""The model card of a trained draft (README.md next to its config.json), from the files the trainer
and the evaluation left: train_log.json, train_state.pt's config, eval.json, dataset manifests."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_llama.paths import display_path


def dataset_summary(data_dir: Path) -> dict:
    """What a model card shows of one dataset, from its manifest; the trainer keeps it in train_log.json
    so that a later stage's card can still show the datasets of the stages before it."""
    m = json.loads((Path(data_dir) / "manifest.json").read_text())
    return {"name": Path(data_dir).name, "source": m.get("source", "?"), "target": m["target"],
            "max_new_tokens": m["max_new_tokens"], "sequences": m["prompts_done"],
            "response_tokens": m["n_response_tokens"], "tokens": m["n_tokens"]}


def write_model_card(ckpt: Path, data_dirs: list[Path]) -> Path:
    cfg = json.loads((ckpt / "config.json").read_text())
    log = json.loads((ckpt / "train_log.json").read_text()) if (ckpt / "train_log.json").exists() else {}
    ev = json.loads((ckpt / "eval.json").read_text()) if (ckpt / "eval.json").exists() else None
    stages = []
    stage = log
    while stage:
        stages.insert(0, stage)
        stage = stage.get("init")
    datasets = _datasets(stages, [dataset_summary(d) for d in data_dirs])
    n_resp = sum(d["response_tokens"] for d in datasets)
    n_prompts = sum(d["sequences"] for d in datasets)
    with_prompts = (f" ({sum(d['tokens'] for d in datasets):,} with prompts)"
                    if all(d.get("tokens") is not None for d in datasets) else "")
    dc = cfg["dflash_config"]
    params = _count_params(ckpt)
    variant = _variant(cfg)

    target = Path(datasets[-1]["target"]) if datasets else Path("target")
    lengths = sorted({d["max_new_tokens"] for d in datasets}) or ["?"]
    lines = [
        f"# {target.name.split('.')[0]} {'DFlash' if variant.name == 'dflash' else variant.title} draft (dflash-llama)",
        "",
        f"A {variant.title} block-diffusion draft for the target `{display_path(target)}`, trained with "
        f"`dflash-llama train`. Published Hugging Face format ({_files(ckpt)}, bf16): "
        "`dflash-llama convert`, llama.cpp's `convert_hf_to_gguf.py` and the `dflash` package all load it.",
        "",
        "## Model",
        "",
        f"- {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads / "
        f"{cfg['num_key_value_heads']} KV heads of {cfg['head_dim']}, MLP {cfg['intermediate_size']}; "
        f"{params / 1e6:.2f} M parameters (the target's embeddings and head are not part of it)",
        f"- block size {cfg['block_size']}, mask token {dc['mask_token_id']}{_token_text(target, dc['mask_token_id'])}, "
        f"target layers {dc['target_layer_ids']} of {cfg['num_target_layers']}",
        *_dflash2_heads(dc),
        *_dspark_heads(dc),
        "",
        "## Data",
        "",
        "Code-completion prompts (a signature and a docstring, HumanEval-shaped) cut from documented "
        "public functions of the Python sources a fresh machine has"
        + _self_written(datasets)
        + " (`train/data.py`); "
        "HumanEval itself is held out for evaluation and never read. The target's own greedy "
        f"responses (up to {' or '.join(map(str, lengths))} tokens each, through our C++ runtime), its features at the draft's target "
        "layers captured once and stored as f16 (f32 in a shard where a value passes f16's range).",
        "",
        "| dataset | prompts (`dflash_llama.train.data`) | sequences | response tokens |",
        "|---|---|---:|---:|",
    ]
    for d in datasets:
        lines.append(f"| {d['name']} | `{d['source']}` | {d['sequences']:,} | {d['response_tokens']:,} |")
    lines += [f"| all | | {n_prompts:,} | {n_resp:,}{with_prompts} |", "", "## Training", ""]
    for i, st in enumerate(stages):
        c = st.get("config", {})
        what = "from random weights" if i == 0 else "then, starting from that checkpoint (`--init`)"
        lines += [f"{i + 1}. {what}: `{st.get('command', '?')}`",
                  f"   - {st.get('steps')} optimizer steps of {c.get('batch', '?')} sequences x {c.get('anchors', '?')} "
                  f"anchor blocks, {st.get('wall_s', 0) / 60:.0f} min wall time{_threads(st)}{_autocast(c)}; "
                  f"AdamW lr {c.get('lr', '?')} with {100 * c.get('warmup', 0):.0f}% warmup and cosine decay, "
                  f"{_loss_vocabulary(c, st.get('draft_vocab_size'))}{_distill(c)}{_gamma(c)}{_selector(c, i)}{_dspark_loss(c, i)}; final loss {st.get('final_loss') or float('nan'):.3f}, held-out "
                  f"{_heldout_measure(c)} tau (greedy, full vocabulary) {st.get('heldout_tau') or float('nan'):.3f}"] + ([f"   - {st['note']}"] if st.get("note") else [])
    if stages:
        lines += ["", "Recipe: random anchors in the responses, per-block attention masks, position weights "
                  "exp(-(k-1)/gamma), the target's embeddings and head frozen (`train/trainer.py`)."]
    if ev:
        lines += ["", "## Measured", "", f"Greedy, block {ev['block_size']}, {ev['n_predict']} new tokens per "
                  "HumanEval prompt (`dflash-llama train --eval-only`):", "",
                  "| engine | prompts | tau | acceptance rate | exact |", "|---|---:|---:|---:|---|"]
        for s in map(_score, ev["scores"]):
            exact = "" if s.exact is None else ("yes" if s.exact else "NO")
            tau = f"{s.tau:.3f}" if s.steps else "n/a"
            lines.append(f"| {s.engine} | {s.prompts} | {tau} | {s.acceptance_rate:.3f} | {exact} |")
        lines += ["", "tau: tokens produced per target verify; acceptance rate: accepted / drafted tokens. "
                  "\"exact\": every speculative output equal to the target's own greedy output."]
    out = ckpt / "README.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _count_params(ckpt: Path) -> int:
    """Parameters in the checkpoint's weights (one file or its shards); a d2t's offsets are none."""
    import math

    from safetensors import safe_open

    total = 0
    for path in sorted(ckpt.glob("model*.safetensors")):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k != "d2t")
    return total


def _files(ckpt: Path) -> str:
    shards = sorted(p.name for p in ckpt.glob("model-*-of-*.safetensors"))
    if not shards:
        return "config.json + model.safetensors"
    return f"config.json + {len(shards)} shards {shards[0]} .. and model.safetensors.index.json, each under 25 MB"


def _variant(cfg: dict):
    from dflash_llama import schema as L

    names = cfg.get("architectures") or []
    return next((v for v in L.VARIANTS.values() if v.architecture in names), L.DFLASH1)


def _dflash2_heads(dc: dict) -> list[str]:
    if not dc.get("conv_kernel_size"):
        return []
    return [f"- DFlash 2 heads: grouped dynamic causal convolutions around attention and the MLP of every layer "
            f"({dc['conv_kernel_size']} taps, {dc['conv_group_size']} channels per dynamic coefficient), and a "
            f"candidate selector of rank {dc['selector_rank']} walking the top {dc['selector_top_k']} candidates "
            f"of each draft slot"]


def _dspark_heads(dc: dict) -> list[str]:
    if not dc.get("markov_rank"):
        return []
    conf = ", and a confidence head (each slot's chance of acceptance, from [hidden ; W1 row])" \
        if dc.get("enable_confidence_head") else ""
    layout = ("anchor-first block: B inputs give B drafts" if dc.get("sample_from_anchor", True)
              else "DFlash 1's block layout: B inputs give B - 1 drafts")
    return [f"- DSpark heads: a vanilla Markov head of rank {dc['markov_rank']} (a bias on each slot's logits from "
            f"the token before it){conf}; {layout}"]


def _dspark_loss(c: dict, stage: int) -> str:
    """A DSpark stage's loss, and where its heads started."""
    if not c.get("markov_rank"):
        return ""
    tv, conf = c.get("tv_weight", 0.9), c.get("confidence_weight", 1.0)
    flags = (f"`--variant dspark --markov-rank {c['markov_rank']} --confidence-head "
             f"{'on' if c.get('confidence_head') else 'off'} --block-layout "
             f"{'anchor-first' if c.get('sample_from_anchor') else 'dflash'} --tv-weight {tv:g} "
             f"--confidence-weight {conf:g} --head-lr-scale {c.get('head_lr_scale', 10.0):g}`")
    start = (" (the DFlash 1 checkpoint before it as a DSpark draft: a zero Markov bias, so its first step "
             "drafts what that checkpoint drafts)") if stage else ""
    return (f", all on the Markov-biased logits (teacher-forced: each slot's bias from the true token before it) "
            f"and mixed as DSpark's paper mixes them: {1 - tv:g} x that loss + {tv:g} x the total variation from "
            f"the target's distribution + {conf:g} x the confidence head's BCE on the analytic acceptance 1 - TV, "
            f"the heads at {c.get('head_lr_scale', 10.0):g} x the learning rate ({flags}){start}")


def _selector(c: dict, stage: int) -> str:
    """A DFlash 2 stage's extra loss, and where its heads started."""
    if not c.get("conv_kernel_size"):
        return ""
    start = (" (the DFlash 1 checkpoint before it as a DFlash 2 draft: identity convolutions, a small random "
             "selector, so its first step drafts what that checkpoint drafts)") if stage else ""
    return (f", plus {c.get('selector_weight', 1.0):g} x the candidate selector's loss (cross-entropy of its scores "
            f"over the top {c['selector_top_k']} candidates after the true predecessor; `--variant dflash2 "
            f"--conv-kernel-size {c['conv_kernel_size']} --conv-group-size {c['conv_group_size']} --selector-rank "
            f"{c['selector_rank']} --selector-top-k {c['selector_top_k']}`){start}")


def _datasets(stages: list[dict], given: list[dict]) -> list[dict]:
    """Every dataset a stage trained on, oldest first, once each: the summaries the stages recorded,
    then the given ones (read from their manifests now, so they win over a stage's record)."""
    by_name = {}
    for d in (d for st in stages for d in st.get("datasets", [])):
        by_name.setdefault(d["name"], d)
    for d in given:
        by_name[d["name"]] = d
    return list(by_name.values())


def _self_written(datasets: list[dict]) -> str:
    """What the data paragraph says of exercises the target wrote itself, by prompt style."""
    sources = [m.get("source", "") for m in datasets if m.get("source", "").startswith("self_prompts")]
    if not sources:
        return ""
    kinds = []
    if any("style='humaneval'" not in s for s in sources):
        kinds.append("each prompt opening a docstring")
    if any("style='humaneval'" in s for s in sources):
        kinds.append("or, with `style='humaneval'`, followed by a docstring it sampled too (half with doctest "
                     "examples) and closed, so the prompt ends where a HumanEval prompt ends")
    return (", and exercises the target wrote itself (`self_prompts`: function signatures it sampled, "
            + ", ".join(kinds) + ")")


def _loss_vocabulary(c: dict, kept: int | None = None) -> str:
    """kept: the draft vocabulary's size as trained (train_log's draft_vocab_size), when the responses used
    fewer tokens than --draft-vocab asked for."""
    if c.get("draft_vocab"):
        size = (f"{kept:,} tokens (`--draft-vocab {c['draft_vocab']}`: every token the responses use"
                if kept and kept < c["draft_vocab"] else f"{c['draft_vocab']} tokens (`--draft-vocab`")
        return (f"a reduced draft vocabulary of {size}, saved as d2t: the most frequent response tokens and the "
                f"end-of-generation ones), the loss over them plus each batch's targets")
    return f"loss over the {c.get('vocab_subset', '?')} most frequent response tokens plus each batch's targets"


def _threads(stage: dict) -> str:
    """ "at N threads", from the stage's command (`-t N` / `--threads N`); "" when it did not say."""
    words = stage.get("command", "").split()
    for flag, value in zip(words, words[1:]):
        if flag in ("-t", "--threads") and value.isdigit():
            return f" at {value} thread{'s' if value != '1' else ''}"
    return ""


def _score(recorded: dict):
    """An eval.json score as a train_eval.EngineScore: tau and acceptance from the counts, not the rounded
    values stored beside them (which a second rounding could move by one in the last digit)."""
    from dataclasses import fields

    from .eval import EngineScore

    return EngineScore(**{f.name: recorded[f.name] for f in fields(EngineScore) if f.name in recorded})


def _token_text(target: Path, token_id: int) -> str:
    """` (`<text>`)` of a token of the target's vocabulary, or nothing where the target is not at hand."""
    from dflash_llama import gguf_info

    try:
        tokens = gguf_info(target).metadata.get("tokenizer.ggml.tokens") or []
    except (OSError, ValueError):
        return ""
    return f" (`{tokens[token_id]}`)" if 0 <= token_id < len(tokens) else ""


def _heldout_measure(c: dict) -> str:
    """How a stage estimated tau on its held-out sequences (logs before replay: teacher forced)."""
    return {"replay": "replayed"}.get(c.get("heldout_measure", "teacher-forced"), "teacher-forced")


def _autocast(c: dict) -> str:
    """The matmul precision of a stage (logs written before it was recorded: bf16 autocast)."""
    return " (bf16 autocast)" if c.get("bf16", True) else " (f32)"


def _gamma(c: dict) -> str:
    g = c.get("gamma", 0.0)
    return f", position weights exp(-(k-1)/{g:g}) (`--gamma {g:g}`)" if g else ""


def _distill(c: dict) -> str:
    w = c.get("distill", 0.0)
    return (f", {1 - w:g} x cross-entropy on the target's greedy token + {w:g} x KL divergence from the "
            f"target's next-token distribution (`--distill {w:g}`)") if w else ""
