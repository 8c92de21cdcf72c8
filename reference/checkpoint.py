"""Load a DFlash 1 draft from a published Hugging Face directory or from a DFlash GGUF.

HF: `config.json` + `model.safetensors` (or sharded with `model.safetensors.index.json`), bf16,
f16 or f32. GGUF: the layout the pinned llama.cpp reads (arch `dflash`), ours or llama.cpp's,
any type gguf-py can dequantise. Both give the same `DFlashDraft`, in float32 by default. What the
files mean, and what is refused, is `dflash_llama.schema`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from dflash_llama import schema as S

from .gguf_tensors import read_tensor
from .model import DFlashDraft, DraftConfig, interleaved_to_halves

# the q/k rows a checkpoint with interleaved RoPE needs permuted to NeoX order (as llama.cpp does)
_ROPE_PERMUTED = tuple(S.hf_tensor_name(t.format(bid=0))[0].removeprefix("layers.0.")
                       for t in S.ROPE_PERMUTED)


def load_draft(path: str | os.PathLike, embed_tokens: torch.Tensor | None = None,
               lm_head: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> DFlashDraft:
    """A DFlash draft from an HF directory or a `.gguf` file, in `dtype`, in eval mode.

    embed_tokens / lm_head: the target's [vocab, hidden] tensors. A GGUF that carries its own
    `token_embd` / `output` uses those instead (as llama.cpp does).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"draft {path} does not exist")
    if path.is_dir():
        cfg = read_hf_config(path)
        tensors, own = _check_hf_tensors(path, cfg, _read_safetensors(path)), {}
    else:
        cfg, tensors, own = read_draft_gguf(path)

    draft = DFlashDraft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(tensors[name].to(torch.float32))
    draft = draft.to(dtype).eval().requires_grad_(False)  # inference; a trainer turns it back on
    # llama.cpp's order: the draft's own output, else its own token_embd, else the target's head
    embed = own["embed"] if "embed" in own else embed_tokens
    head = own["head"] if "head" in own else own["embed"] if "embed" in own else lm_head
    if embed is not None and head is not None:
        draft.attach_target(embed, head)
    return draft


# ---------------------------------------------------------------- Hugging Face directory

def read_hf_config(path: Path) -> DraftConfig:
    """The config of an HF draft directory, checked as runnable (target layers resolved)."""
    f = Path(path) / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"{path} is not a DFlash draft directory: no config.json")
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e
    cfg = S.DraftHParams.from_hf_config(raw, str(f))
    if cfg.n_vocab is None:
        raise ValueError(f"{f}: config has no 'vocab_size'")
    if cfg.target_layer_ids is None:
        if cfg.n_layer_target is None:
            raise ValueError(f"{f}: neither target_layer_ids nor num_target_layers is set")
        cfg = dataclasses.replace(
            cfg, target_layer_ids=S.default_target_layer_ids(cfg.n_layer_target, cfg.n_layer))
    S.refuse(dict(cfg.to_gguf_kv()), (), str(f))  # what the runtime refuses in the converted GGUF
    return cfg


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors (nor an index of shards)")
    tensors = {}
    for name in files:
        try:
            tensors.update(load_file(str(path / name)))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path / name}: unreadable safetensors file ({e})") from e
    # some exports prefix every name with "model."
    return {k.removeprefix("model."): v for k, v in tensors.items()}


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DFlash 1 draft: published names, torch shapes (from the layout table)."""
    shapes = {}
    for spec in S.TENSORS:
        if spec.required:
            for bid in range(cfg.n_layer) if "{bid}" in spec.hf else [None]:
                shapes[spec.hf.format(bid=bid)] = tuple(reversed(S.expected_shape(spec, cfg.dims())))
    return shapes


def _check_shapes(source, cfg: DraftConfig, tensors: dict) -> None:
    shapes = expected_shapes(cfg)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"{source}: missing tensors {', '.join(missing[:3])}{more}")
    unexpected = sorted(set(tensors) - set(shapes))
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors {', '.join(unexpected[:3])} "
                         "(not a DFlash 1 draft, or a variant the reference does not support)")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                             f"the config implies {shape}")


def _check_hf_tensors(path, cfg: DraftConfig, tensors: dict) -> dict:
    _check_shapes(path, cfg, tensors)
    if not cfg.rope_neox:  # interleaved-pair RoPE -> NeoX halves, per head, like llama.cpp's converter
        for name in list(tensors):
            if name.endswith(_ROPE_PERMUTED):
                tensors[name] = interleaved_to_halves(tensors[name], cfg.head_dim)
    return tensors


# ---------------------------------------------------------------- GGUF

def read_draft_gguf(path: Path) -> tuple[DraftConfig, dict, dict]:
    """Config, published-name tensors (f32) and any own embedding / head from a DFlash GGUF."""
    from dflash_llama import gguf_info

    info = gguf_info(path)  # the native header parser: clear errors for foreign/truncated files
    if info.architecture != "dflash":
        raise ValueError(f"{path}: architecture is {info.architecture!r}, not a DFlash draft "
                         "('dflash')")
    S.refuse(info.metadata, [t.name for t in info.tensors], str(path))
    cfg = S.DraftHParams.from_gguf(info.metadata, source=str(path))
    if cfg.n_vocab is None:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens (the vocabulary size is unknown)")

    tensors, own = {}, {}
    for t in info.tensors:
        hit = S.hf_tensor_name(t.name)  # the layout table shared with the converter (refused: None)
        value = read_tensor(path, info.data_offset, t)
        if hit[0] in ("embed_tokens.weight", "lm_head.weight"):  # optional own embedding / head
            own["embed" if hit[0] == "embed_tokens.weight" else "head"] = value
        else:
            tensors[hit[0]] = value
    _check_shapes(path, cfg, tensors)
    return cfg, tensors, own


def load_draft_for_target(path: str | os.PathLike, target,
                          dtype: torch.dtype = torch.float32) -> DFlashDraft:
    """A draft wired to a `target.Target`, after checking that it was made for that target."""
    draft = load_draft(path, dtype=dtype)
    cfg = draft.config
    if cfg.n_embd != target.hidden_size:
        raise ValueError(f"draft {path} has hidden size {cfg.n_embd} but target "
                         f"{target.source} has {target.hidden_size}: the draft was made for "
                         "another target")
    if cfg.n_vocab != target.vocab_size:
        raise ValueError(f"draft {path} has vocab size {cfg.n_vocab} but target "
                         f"{target.source} has {target.vocab_size}: the draft was made for "
                         "another target")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ValueError(f"draft {path}: mask_token_id {cfg.mask_token_id} is outside the "
                         f"target's vocabulary of {target.vocab_size}")
    try:
        target.check_layer_ids(cfg.target_layer_ids)
    except ValueError as e:
        raise ValueError(f"draft {path}: {e}") from e
    if draft.embed_tokens is None:  # a GGUF with its own embeddings and head keeps them
        draft.attach_target(target.embed_tokens.detach(), target.lm_head.detach())
    return draft
