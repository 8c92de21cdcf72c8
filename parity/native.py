"""llama.cpp's own DFlash graph as a peer, traced.

`NativeDraft`: the draft GGUF as a llama.cpp model (arch `dflash`) in a draft context whose
`ctx_other` is a `Runtime`'s target context, driven as the pinned `draft-dflash` drives it
(runtime/native_draft.h); a DSpark draft (a Markov head) as `draft-dspark` drives it. `trace(features,
block)` returns the same names as `Runtime.trace_draft`, in the same NumPy order. llama.cpp's
speculative loop (`llama-speculative-simple --spec-type draft-dflash`, or `draft-dspark`) runs through
`dflash_llama.peers`, with `FLASH_ATTN`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

# llama.cpp's default (auto: on for the CPU), unlike the bench's -fa off: parity measures draft-dflash
# as the tool runs it by default, and judges its text against the same tool drafting nothing
FLASH_ATTN = "auto"


class NativeDraft:
    """llama.cpp's DFlash graph on a draft GGUF, sharing `runtime`'s target for embeddings and head;
    f32 KV cache and no flash attention (what parity compares)."""

    def __init__(self, runtime, draft_gguf: str | os.PathLike, *, n_ctx: int = 512, n_threads: int = 0):
        from dflash_llama import _core

        self.path = Path(draft_gguf)
        self._runtime = runtime  # keeps the target context (ctx_other) alive
        self._draft = _core.NativeDraft(runtime._engine, os.fspath(draft_gguf), int(n_ctx), int(n_threads))

    @property
    def target_layers(self) -> list[int]:
        """dflash.target_layers as llama.cpp reads them: Hugging Face ids + 1 (layer inputs)."""
        return list(self._draft.target_layers)

    @property
    def mask_token_id(self) -> int:
        return self._draft.mask_token_id

    @property
    def block_size(self) -> int:
        return self._draft.block_size

    @property
    def causal(self) -> bool:
        return self._draft.causal

    @property
    def selector_top_k(self) -> int:
        """dflash.selector.top_k: > 0 for a DFlash 2 draft, whose trace holds `dflash2_lattice`."""
        return self._draft.selector_top_k

    @property
    def dspark(self) -> bool:
        """Whether the draft has a Markov head (`markov_w1.weight`): llama.cpp's tool runs it as
        draft-dspark, and the trace holds `markov_prev`, `markov_bias`, `biased_logits` (the drafted
        slots) and, with a confidence head, `confidence`."""
        return self._draft.dspark

    @property
    def sample_from_anchor(self) -> bool:
        """dflash.sample_from_anchor as llama.cpp reads it (missing: true); draft-dspark drafts from
        block position 0 when true, else from 1 (draft-dflash always from 1)."""
        return self._draft.sample_from_anchor

    def trace(self, features: np.ndarray, block: Sequence[int]) -> dict[str, np.ndarray]:
        """Every named intermediate for context `features` ([n, n_taps * n_embd], positions 0..)
        and `block` at positions n..; `fc_out` comes from llama.cpp's encoder graph."""
        feats = np.ascontiguousarray(features, dtype=np.float32)
        if feats.ndim != 2:
            raise ValueError(f"features must be 2-D [n_tokens, n_taps * n_embd], got shape {feats.shape}")
        return dict(self._draft.trace(feats, [int(t) for t in block]))
