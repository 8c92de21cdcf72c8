"""A reduced draft vocabulary (`--draft-vocab K`): which K target tokens the draft's head keeps, and
its rows, taken from the target's own head.

The pinned `dflash` graph reads it as `d2t` (i64 target ids) plus the draft's own `output.weight`
over those rows; a draft step then multiplies by K rows instead of the whole vocabulary (the head is
most of a small draft's step). Tokens the target emits outside the K can never be drafted, so they
cost acceptance, never exactness: the target verifies every drafted token.

Which tokens: every end-of-generation token (so the draft can propose the stop), then the target
tokenizer's most likely tokens first: by score where the vocabulary has scores (SentencePiece
log-probabilities), else by id (byte-level BPE vocabularies number tokens in merge order, most
frequent pairs first). Control and unused tokens are never chosen otherwise.
"""

from __future__ import annotations

import numpy as np

from .checkpoint import ConversionError, SourceTensor, read_tensors
from .target import TargetInfo

# llama.cpp's token types (gguf-py TokenType)
_NORMAL, _USER_DEFINED, _BYTE = 1, 4, 6
_EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def eog_tokens(tokenizer: dict, n_vocab: int) -> set[int]:
    """The end-of-generation token ids among `tokenizer.*` keys (a GGUF's, or TargetInfo's fields)."""
    return {int(tokenizer[key]) for key in _EOG_KEYS
            if isinstance(tokenizer.get(key), int) and 0 <= tokenizer[key] < n_vocab}


def choose_tokens(target: TargetInfo, k: int) -> np.ndarray:
    """The K target token ids the draft's head keeps, ascending (int64)."""
    if not 0 < k < target.vocab:
        raise ConversionError(f"--draft-vocab {k}: expected 1 to {target.vocab - 1} (the target {target.path} "
                              f"has {target.vocab} tokens; 0 keeps the whole vocabulary)")
    fields = {f.key: f.value for f in target.tokenizer_fields()}
    eog = eog_tokens(fields, target.vocab)
    if k <= len(eog):
        raise ConversionError(f"--draft-vocab {k}: the target has {len(eog)} end-of-generation tokens, "
                              "which the draft keeps; ask for more")
    types = np.asarray(fields.get("tokenizer.ggml.token_type") or [_NORMAL] * target.vocab)
    candidates = np.flatnonzero(np.isin(types[:target.vocab], (_NORMAL, _USER_DEFINED, _BYTE)))
    scores = fields.get("tokenizer.ggml.scores")
    if scores is not None and len(scores) >= target.vocab:
        s = np.asarray(scores, dtype=np.float64)[candidates]
        if s.size and np.ptp(s) > 0:
            candidates = candidates[np.argsort(-s, kind="stable")]
    rest = [int(t) for t in candidates if int(t) not in eog][:k - len(eog)]
    return np.array(sorted(eog | set(rest)), dtype=np.int64)


def head_rows(target: TargetInfo, ids: np.ndarray, embeddings: bool = False) -> np.ndarray:
    """Rows `ids` of the target's output head (its tied embeddings if it has none), f32 [K, hidden];
    embeddings: of its token embeddings."""
    rows, _ = _target_rows(target, ids, embeddings)
    return rows


# the target tensor types whose values a 16-bit or f32 draft copy can equal exactly
_FLOAT_TYPES = ("f32", "f16", "bf16", "F32", "F16", "BF16")


def _target_rows(target: TargetInfo, ids: np.ndarray, embeddings: bool) -> tuple[np.ndarray, bool]:
    """(rows, whether they are stored as floats, not quantized)."""
    if target.kind == "gguf":
        from dflash_llama import gguf_info

        info = gguf_info(target.path)
        names = {t.name: t for t in info.tensors}
        name = "token_embd.weight" if embeddings or "output.weight" not in names else "output.weight"
        if name not in names:
            raise ConversionError(f"target {target.path}: no output.weight nor token_embd.weight to take the "
                                  "draft's head rows from")
        try:
            rows = info.read(name, rows=ids)
        except ValueError as e:
            raise ConversionError(f"target {target.path}: {e}") from e
        exact = names[name].type in _FLOAT_TYPES
    else:
        tensors = read_tensors(target.path)
        order = ("model.embed_tokens.weight", "embed_tokens.weight") if embeddings else (
            "lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")
        head = next((tensors[n] for n in order if n in tensors), None)
        if head is None:
            raise ConversionError(f"target {target.path}: no lm_head.weight nor embed_tokens.weight to take the "
                                  "draft's head rows from")
        rows, exact = head.load_f32()[ids], True
    if rows.shape != (len(ids), target.hidden):
        raise ConversionError(f"target {target.path}: output head rows have shape {list(rows.shape)}, "
                              f"expected [{len(ids)}, {target.hidden}]")
    return np.ascontiguousarray(rows, dtype=np.float32), exact


def same_as_target(own: SourceTensor, target: TargetInfo, embeddings: bool) -> bool | None:
    """Whether a draft's own copy [vocab, hidden] holds the target's head (or embeddings), rounded to
    the copy's dtype; None when the target is quantized (no exact comparison)."""
    rows, exact = _target_rows(target, np.arange(target.vocab), embeddings)
    if not exact:
        return None
    if own.dtype == "BF16":  # round to nearest even, as torch casts
        bits = rows.view(np.uint32).astype(np.uint64)
        rows = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    elif own.dtype == "F16":
        rows = rows.astype(np.float16).astype(np.float32)
    return bool(np.array_equal(own.load_f32(), rows))
