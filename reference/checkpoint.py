"""Load a DFlash 1 draft from a published Hugging Face directory or from a DFlash GGUF.

HF: `config.json` + `model.safetensors` (or sharded with `model.safetensors.index.json`), bf16,
f16 or f32. GGUF: the layout the pinned llama.cpp reads (arch `dflash`), ours or llama.cpp's,
any type gguf-py can dequantise. Both give the same `DFlashDraft`, in float32 by default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dflash_llama.converter import gguf_layout as L

from .gguf_tensors import read_tensor
from .model import (FULL_ATTENTION, SLIDING_ATTENTION, DFlashDraft, DraftConfig, default_target_layer_ids,
                    interleaved_to_halves)

# tensors that mark DFlash 2 / DSpark / reduced-vocabulary drafts, which this reference lacks
GGUF_UNSUPPORTED_MARKERS = ("selector_hidden.weight", "markov_w1.weight", "d2t")

# the q/k rows a checkpoint with interleaved RoPE needs permuted to NeoX order (as llama.cpp does)
_ROPE_PERMUTED = tuple(L.hf_tensor_name(t.format(bid=0))[0].removeprefix("layers.0.")
                       for t in L.ROPE_PERMUTED)


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
        raw = _hf_config(path)
        cfg = draft_config_from_hf(raw, source=str(path))
        interleaved = raw.get("rope_is_neox_style", True) is False
        tensors, own = _check_hf_tensors(path, cfg, _read_safetensors(path), interleaved), {}
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

def _hf_config(path: Path) -> dict:
    f = path / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"{path} is not a DFlash draft directory: no config.json")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e


def draft_config_from_hf(cfg: dict, source: str = "config.json") -> DraftConfig:
    """DraftConfig from a published config.json (the published package's reading rules).

    DFlash keys (mask_token_id, target_layer_ids, block_size, input_embedding_scale,
    output_multiplier, final_logit_softcapping, num_target_layers) come from `dflash_config`
    first, then the top level. Architecture keys follow transformers' Qwen3Config: the sliding
    window counts only with `use_sliding_window`, and `layer_types` defaults from it.
    """
    archs = cfg.get("architectures") or []
    if any("DFlash2" in a for a in archs):
        raise ValueError(f"{source}: DFlash 2 drafts ({archs[0]}) are not supported yet")
    dflash = cfg.get("dflash_config") or {}

    def value(name, default=None):
        return dflash[name] if name in dflash else cfg.get(name, default)

    def need(name):
        if name not in cfg:
            raise ValueError(f"{source}: config has no {name!r}")
        return cfg[name]

    mask = value("mask_token_id")
    if mask is None:
        raise ValueError(f"{source}: no mask_token_id (looked in dflash_config and at top level)")
    for key in ("attention_value_scale", "conv_kernel_size"):
        if value(key) is not None:
            raise ValueError(f"{source}: {key!r} is not supported by the reference")
    if cfg.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias = true is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

    n_layers = need("num_hidden_layers")
    n_target = value("num_target_layers")
    ids = value("target_layer_ids")
    if ids is None:
        if n_target is None:
            raise ValueError(f"{source}: neither target_layer_ids nor num_target_layers is set")
        ids = default_target_layer_ids(int(n_target), int(n_layers))

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ValueError(f"{source}: RoPE type {rope_type!r} is not supported "
                         "(only 'default' and 'linear')")
    linear = float(rope.get("factor", 1.0)) if rope_type == "linear" else 1.0
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor != 1 is not supported")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))

    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    layer_types = cfg.get("layer_types") or [
        SLIDING_ATTENTION if window is not None and i >= cfg.get("max_window_layers", 28)
        else FULL_ATTENTION for i in range(n_layers)]
    softcap = value("final_logit_softcapping")
    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    try:
        return DraftConfig(
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab_size=need("vocab_size"),
            mask_token_id=int(mask),
            target_layer_ids=[int(i) for i in ids],
            block_size=int(value("block_size", 16)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_linear_factor=linear,
            layer_types=list(layer_types),
            sliding_window=window,
            is_causal=cfg.get("is_causal"),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            num_target_layers=None if n_target is None else int(n_target),
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


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
    dims = {"n_embd": cfg.hidden_size, "n_taps": cfg.n_taps, "n_head": cfg.num_heads,
            "n_head_kv": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "n_ff": cfg.intermediate_size, "n_vocab": cfg.vocab_size}
    shapes = {}
    for spec in L.TENSORS:
        if spec.required:
            for bid in range(cfg.num_layers) if "{bid}" in spec.hf else [None]:
                shapes[spec.hf.format(bid=bid)] = tuple(reversed(L.expected_shape(spec, dims)))
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


def _check_hf_tensors(path, cfg, tensors, interleaved: bool) -> dict:
    _check_shapes(path, cfg, tensors)
    if interleaved:  # interleaved-pair RoPE -> NeoX halves, per head, like llama.cpp's converter
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
    names = {t.name for t in info.tensors}
    for marker in GGUF_UNSUPPORTED_MARKERS:
        if marker in names:
            raise ValueError(f"{path}: holds {marker}, a DFlash 2 / DSpark / reduced-vocabulary "
                             "draft, which the reference does not support yet")
    cfg = draft_config_from_gguf(info.metadata, source=str(path))

    tensors, own = {}, {}
    for t in info.tensors:
        hit = L.hf_tensor_name(t.name)  # the layout table shared with the converter
        if hit is None:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} in a DFlash 1 draft")
        value = read_tensor(path, info.data_offset, t)
        if hit[0] in ("embed_tokens.weight", "lm_head.weight"):  # optional own embedding / head
            own["embed" if hit[0] == "embed_tokens.weight" else "head"] = value
        else:
            tensors[hit[0]] = value
    _check_shapes(path, cfg, tensors)
    return cfg, tensors, own


def draft_config_from_gguf(kv: dict, source: str = "draft.gguf") -> DraftConfig:
    """DraftConfig from DFlash GGUF metadata (`dflash.target_layers` holds ids + 1).

    Without `dflash.attention.causal` the published rule applies (sliding layers causal).
    """

    def need(key):
        if key not in kv:
            raise ValueError(f"{source}: missing GGUF key {key!r}")
        return kv[key]

    n_layers = int(need(L.BLOCK_COUNT))
    for key in (L.VALUE_SCALE, L.ROPE_DIMENSION_SECTIONS, "dflash.attention.scale"):
        if key in kv:
            raise ValueError(f"{source}: {key} is not supported by the reference")
    act = kv.get("dflash.hidden_activation", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden activation {act!r} is not supported (only 'silu')")
    rope_scaling = kv.get(L.ROPE_SCALING_TYPE, "none")
    if rope_scaling not in ("none", "linear"):
        raise ValueError(f"{source}: RoPE scaling {rope_scaling!r} is not supported "
                         "(only none and linear)")
    head_dim = int(need(L.KEY_LENGTH))
    if int(kv.get(L.VALUE_LENGTH, head_dim)) != head_dim:
        raise ValueError(f"{source}: key_length != value_length is not supported")
    if int(kv.get(L.ROPE_DIMENSION_COUNT, head_dim)) != head_dim:
        raise ValueError(f"{source}: partial RoPE (rope.dimension_count < key_length) is not "
                         "supported")
    layers = [int(x) for x in need(L.TARGET_LAYERS)]
    if any(x < 1 for x in layers):
        raise ValueError(f"{source}: dflash.target_layers {layers} must all be >= 1 "
                         "(they hold target layer ids + 1)")
    mask = kv.get(L.MASK_TOKEN_ID)
    if mask is None:
        raise ValueError(f"{source}: no {L.MASK_TOKEN_ID}")
    tokens = kv.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{source}: no tokenizer.ggml.tokens (the vocabulary size is unknown)")

    window = kv.get(L.SLIDING_WINDOW)
    layer_types = []
    if window:
        pattern = kv.get(L.SLIDING_WINDOW_PATTERN)
        if pattern is None or len(pattern) != n_layers:
            raise ValueError(f"{source}: attention.sliding_window needs a sliding_window_pattern "
                             f"with {n_layers} entries")
        layer_types = [SLIDING_ATTENTION if p else FULL_ATTENTION for p in pattern]
    causal = kv.get(L.CAUSAL)
    softcap = kv.get(L.FINAL_LOGIT_SOFTCAPPING)
    n_head = int(need(L.HEAD_COUNT))
    try:
        return DraftConfig(
            hidden_size=int(need(L.EMBEDDING_LENGTH)),
            intermediate_size=int(need(L.FEED_FORWARD_LENGTH)),
            num_layers=n_layers,
            num_heads=n_head,
            num_kv_heads=int(kv.get(L.HEAD_COUNT_KV, n_head)),
            head_dim=head_dim,
            vocab_size=len(tokens),
            mask_token_id=int(mask),
            target_layer_ids=L.target_layer_ids_from_gguf(layers),
            block_size=int(kv.get(L.BLOCK_SIZE, 16)),
            rms_norm_eps=float(need(L.RMS_EPS)),
            rope_theta=float(kv.get(L.ROPE_FREQ_BASE, 10000.0)),
            rope_linear_factor=float(kv.get(L.ROPE_SCALING_FACTOR, 1.0) or 1.0),
            layer_types=layer_types,
            sliding_window=int(window) if window else None,
            is_causal=None if causal is None else bool(causal),
            input_embedding_scale=float(kv.get(L.EMBEDDING_SCALE, 1.0) or 1.0),
            output_multiplier=float(kv.get(L.LOGIT_SCALE, 1.0) or 1.0),
            final_logit_softcapping=None if softcap is None else float(softcap),
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def load_draft_for_target(path: str | os.PathLike, target,
                          dtype: torch.dtype = torch.float32) -> DFlashDraft:
    """A draft wired to a `target.Target`, after checking that it was made for that target."""
    draft = load_draft(path, dtype=dtype)
    cfg = draft.config
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(f"draft {path} has hidden size {cfg.hidden_size} but target "
                         f"{target.source} has {target.hidden_size}: the draft was made for "
                         "another target")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"draft {path} has vocab size {cfg.vocab_size} but target "
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
