"""Load a DFlash draft (DFlash 1 or DFlash 2) from a Hugging Face directory or from a DFlash GGUF.

HF: `config.json` + `model.safetensors` (or sharded with `model.safetensors.index.json`), bf16,
f16 or f32, in z-lab's published format or speculators' (read through
`schema.normalized_hf_config`); a tensor may be spelled as any of its checkpoint names
(`TensorSpec.hf_aliases`: DFlash 2 codebooks with or without `.weight`). GGUF: the layout the
pinned llama.cpp reads (arch `dflash`), ours or llama.cpp's, any type gguf-py can dequantise.
Both give the same `DFlashDraft`, in float32 by default. What the files mean, and what is
refused, is `dflash_llama.schema`. A draft uses the target's token embeddings and head, except a
DSpark-family checkpoint's own copies (DeepSpec's) and a GGUF's own `output.weight`, as llama.cpp
reads them; a GGUF's own `token_embd.weight` is refused. The reference also reads a GGUF's own
`output.weight` without a d2t, which the runtime refuses (`schema.refusals(runtime=False)`).
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


def load_draft(path: str | os.PathLike, embed_tokens: torch.Tensor | None = None,
               lm_head: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> DFlashDraft:
    """A DFlash draft from an HF directory or a `.gguf` file, in `dtype`, in eval mode.

    embed_tokens / lm_head: the target's [vocab, hidden] tensors (attached when both are given).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"draft {path} does not exist")
    if path.is_dir():
        cfg, tensors = read_hf_config(path), _canonical_names(path, _read_safetensors(path))
        d2t = tensors.pop(S.D2T, None)  # a reduced vocabulary: offsets, target id = row + d2t[row]
        own = _own_copies(cfg, tensors)
        _check_shapes(path, cfg, tensors, None if d2t is None else len(d2t))
        if not cfg.rope_neox:  # interleaved-pair RoPE -> NeoX halves, per head, like llama.cpp's converter
            tensors = {n: interleaved_to_halves(t, cfg.head_dim) if S.is_rope_permuted(S.gguf_tensor_name(n)[0])
                       else t for n, t in tensors.items()}
        # a DSpark checkpoint's own head with its d2t is the reduced vocabulary's (speculators')
        vocabulary = None if d2t is None else (torch.arange(len(d2t)) + d2t.long(), own.pop("lm_head", None))
    else:
        cfg, tensors, vocabulary = read_draft_gguf(path)
        own = {"lm_head": tensors.pop("lm_head.weight")} if "lm_head.weight" in tensors else {}
    scale = tensors.pop(_MARKOV_SCALE, None)

    # a DSpark draft's W2 over a reduced vocabulary's rows, as the file holds it
    draft = DFlashDraft(cfg, None if vocabulary is None else len(vocabulary[0]))
    if scale is not None:
        try:
            draft.markov_head.scale = S.markov_scale(scale)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(tensors[name].to(torch.float32))
    draft = draft.to(dtype).eval().requires_grad_(False)  # inference; a trainer turns it back on
    if vocabulary is not None:
        draft.set_vocabulary(*vocabulary)
    draft.set_own(**{k: v.to(torch.float32) for k, v in own.items()})
    if embed_tokens is not None and lm_head is not None:
        draft.attach_target(embed_tokens, lm_head)
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
    S.refuse(dict(cfg.to_gguf_kv()), (), str(f), runtime=False)  # what the converted GGUF could not run
    return cfg


def _own_copies(cfg: DraftConfig, tensors: dict) -> dict[str, torch.Tensor]:
    """A DSpark-family checkpoint's own embeddings and head (DeepSpec saves copies of the target's),
    taken out of `tensors`: the draft uses them, as the published model does."""
    if cfg.variant is not S.DSPARK and not cfg.sample_from_anchor:
        return {}
    return {name: tensors.pop(f"{name}.weight") for name in ("embed_tokens", "lm_head") if f"{name}.weight" in tensors}


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


def _canonical_names(source, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor under the layout table's own name (`TensorSpec.hf`), not one of its aliases;
    names not in the table stay (`_check_shapes` names them)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        known = S.gguf_tensor_name(name)
        canonical = name if known is None else S.hf_tensor_name(known[0])[0]
        if canonical in out:
            raise ValueError(f"{source}: tensor {canonical} is there twice (also as {name})")
        out[canonical] = t
    return out


_MARKOV_SCALE = S.hf_tensor_name(S.MARKOV_SCALE)[0]


def _check_shapes(source, cfg: DraftConfig, tensors: dict, n_vocab_draft: int | None = None) -> None:
    """Exactly the required tensors of the layout table (and a head's optional ones it holds: a DSpark
    draft's markov_w2.scale), in the shapes the config implies; n_vocab_draft: a reduced vocabulary's
    size (the rows of a DSpark draft's markov_w2)."""
    dims = cfg.dims(n_vocab_draft=n_vocab_draft)
    shapes = {spec.hf.format(bid=bid): tuple(reversed(S.expected_shape(spec, dims)))
              for spec in cfg.tensor_specs(required_only=False)
              if spec.required or (spec.head and spec.hf in tensors)
              for bid in (range(cfg.n_layer) if "{bid}" in spec.hf else [None])}
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"{source}: missing tensors {', '.join(missing[:3])}{more}")
    unexpected = sorted(set(tensors) - set(shapes))
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors {', '.join(unexpected[:3])} "
                         f"(not a tensor of a {cfg.variant.title} draft)")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                             f"the config implies {shape}")


# ---------------------------------------------------------------- GGUF

def read_draft_gguf(path: Path) -> tuple[DraftConfig, dict, tuple[torch.Tensor, torch.Tensor] | None]:
    """Config, published-name tensors (f32) and reduced vocabulary (d2t, own head; else None) of a
    DFlash GGUF, refusing what the runtime refuses."""
    from dflash_llama import gguf_info

    info = gguf_info(path)  # the native header parser: clear errors for foreign/truncated files
    if info.architecture != "dflash":
        raise ValueError(f"{path}: architecture is {info.architecture!r}, not a DFlash draft ('dflash')")
    shapes = {t.name: tuple(t.shape) for t in info.tensors}
    cfg = S.DraftHParams.from_gguf(info.metadata, source=str(path), tensors=shapes, runtime=False)
    if cfg.n_vocab is None:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens (the vocabulary size is unknown)")
    # every name is in the layout table (refuse() saw to it)
    tensors = {S.hf_tensor_name(t.name)[0]: read_tensor(info, t.name) for t in info.tensors if t.name != S.D2T}
    vocabulary = None
    if any(t.name == S.D2T for t in info.tensors):
        vocabulary = read_tensor(info, S.D2T), tensors.pop("lm_head.weight")
    _restore_unit_dims(cfg, tensors)
    _check_shapes(path, cfg, {k: v for k, v in tensors.items() if k != "lm_head.weight"},
                  None if vocabulary is None else len(vocabulary[0]))
    return cfg, tensors, vocabulary


def _restore_unit_dims(cfg: DraftConfig, tensors: dict) -> None:
    """Tensors read back without their size-1 dimensions (conf_proj.weight [1, H + R]) in the
    table's shape."""
    for spec in cfg.tensor_specs():
        shape = tuple(reversed(S.expected_shape(spec, cfg.dims())))
        t = tensors.get(spec.hf)
        if t is not None and tuple(t.shape) != shape and [d for d in shape if d != 1] == list(t.shape):
            tensors[spec.hf] = t.reshape(shape)


def load_draft_for_target(path: str | os.PathLike, target,
                          dtype: torch.dtype = torch.float32) -> DFlashDraft:
    """A draft wired to a `target.Target`, after checking that it was made for that target."""
    draft = load_draft(path, dtype=dtype)
    cfg = draft.config
    for what, ours, theirs in (("hidden size", cfg.n_embd, target.hidden_size),
                               ("vocab size", cfg.n_vocab, target.vocab_size)):
        if ours != theirs:
            raise ValueError(f"draft {path} has {what} {ours} but target {target.source} has {theirs}: "
                             "the draft was made for another target")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ValueError(f"draft {path}: mask_token_id {cfg.mask_token_id} is outside the "
                         f"target's vocabulary of {target.vocab_size}")
    try:
        target.check_layer_ids(cfg.target_layer_ids)
    except ValueError as e:
        raise ValueError(f"draft {path}: {e}") from e
    draft.attach_target(target.embed_tokens.detach(), target.lm_head.detach())
    return draft
