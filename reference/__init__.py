"""dflash_llama.reference: the DFlash draft, target adapter and speculative loop in PyTorch.

Names are imported on first use, so `dflash-llama --help` does not pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_draft": ".checkpoint", "load_draft_for_target": ".checkpoint", "read_hf_config": ".checkpoint",
    "DFlashDraft": ".model", "DraftCache": ".model", "DraftConfig": ".model", "Walk": ".model",
    "default_target_layer_ids": ".model",
    "GenerationResult": ".speculative", "Sampling": ".speculative", "Step": ".speculative",
    "generate_autoregressive": ".speculative", "generate_speculative": ".speculative",
    "Target": ".target", "TargetOutput": ".target",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
