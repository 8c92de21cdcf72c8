"""llama.cpp's own DFlash path as a peer: its draft graph, traced, and its speculative loop.

- `NativeDraft`: the draft GGUF as a llama.cpp model (arch `dflash`) in a draft context whose
  `ctx_other` is a `Runtime`'s target context, driven as the pinned `draft-dflash` drives it
  (runtime/native_draft.h). `trace(features, block)` returns the same names as
  `Runtime.trace_draft`, in the same NumPy order.
- `speculative_simple(...)`: the pinned `llama-speculative-simple --spec-type draft-dflash`, greedy,
  its acceptance statistics parsed from its log.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from dflash_llama import paths


class NativeDraft:
    """llama.cpp's DFlash graph on a draft GGUF, sharing `runtime`'s target for embeddings and head.

    kv_f32: f32 KV cache and no flash attention (what parity compares); False gives llama.cpp's
    defaults (f16 cache, flash attention auto), as `llama-speculative-simple` runs it.
    """

    def __init__(self, runtime, draft_gguf: str | os.PathLike, *, n_ctx: int = 512,
                 n_threads: int = 0, kv_f32: bool = True):
        from dflash_llama import _core

        self.path = Path(draft_gguf)
        self._runtime = runtime  # keeps the target context (ctx_other) alive
        self._draft = _core.NativeDraft(runtime._engine, os.fspath(draft_gguf), int(n_ctx),
                                        int(n_threads), bool(kv_f32))

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

    def trace(self, features: np.ndarray, block: Sequence[int]) -> dict[str, np.ndarray]:
        """Every named intermediate for context `features` ([n, n_taps * n_embd], positions 0..)
        and `block` at positions n..; `fc_out` comes from llama.cpp's encoder graph."""
        feats = np.ascontiguousarray(features, dtype=np.float32)
        if feats.ndim != 2:
            raise ValueError(f"features must be 2-D [n_tokens, n_taps * n_embd], got shape {feats.shape}")
        return dict(self._draft.trace(feats, [int(t) for t in block]))


@dataclass
class NativeSpeculative:
    """What `llama-speculative-simple` reports for one prompt."""
    text: str  # generated text (the prompt excluded)
    n_predict: int  # tokens generated
    n_drafted: int
    n_accept: int
    returncode: int
    log_tail: str  # the last lines of its log, for reports when it failed

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def n_verify(self) -> int:
        """Target verifies: each produces the accepted tokens plus one."""
        return self.n_predict - self.n_accept

    @property
    def tau(self) -> float:
        return self.n_predict / self.n_verify if self.n_verify > 0 else 0.0


_STAT = re.compile(r"\b(n_predict|n_drafted|n_accept)\s*=\s*(\d+)")


def speculative_simple(target: str | os.PathLike, draft: str | os.PathLike, prompt: str,
                       n_predict: int, draft_n_max: int, *, n_threads: int = 2, n_ctx: int = 2048,
                       timeout: float = 600) -> NativeSpeculative:
    """Run the pinned `llama-speculative-simple --spec-type draft-dflash` greedily on one prompt.

    draft_n_max: drafted tokens per step; the native block is draft_n_max + 1 tokens, so pass
    block_size - 1 for the trained block.
    """
    exe = paths.tool("llama-speculative-simple")
    cmd = [str(exe), "-m", os.fspath(target), "-md", os.fspath(draft), "--spec-type", "draft-dflash",
           "--spec-draft-n-max", str(draft_n_max), "--spec-draft-n-min", "0",
           "-p", prompt, "-n", str(n_predict), "--temp", "0", "--top-k", "1", "--seed", "0",
           "-c", str(n_ctx), "-t", str(n_threads), "-tb", str(n_threads), "-ngl", "0"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"timed out after {timeout:.0f} s", 124
    stats = {k: int(v) for k, v in _STAT.findall(out + "\n" + err)}
    lines = (err or out).strip().splitlines()
    failed = [ln for ln in lines if "GGML_ASSERT" in ln or "error" in ln.lower()]
    tail = "\n".join(failed[-3:] if rc != 0 and failed else lines[-8:])
    return NativeSpeculative(text=_generated_text(out, prompt), n_predict=stats.get("n_predict", 0),
                             n_drafted=stats.get("n_drafted", 0), n_accept=stats.get("n_accept", 0),
                             returncode=rc, log_tail=tail)


def _generated_text(stdout: str, prompt: str) -> str:
    """The tool's stdout: two newlines, the prompt's pieces, the generated pieces, four newlines."""
    body = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    at = body.find(prompt)
    return body[at + len(prompt):] if at >= 0 else body
