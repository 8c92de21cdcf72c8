"""dflash_llama.reference: the DFlash draft, target adapter and speculative loop in PyTorch."""

from .checkpoint import (draft_config_from_gguf, draft_config_from_hf, load_draft,
                         load_draft_for_target)
from .model import DFlashDraft, DraftCache, DraftConfig, default_target_layer_ids
from .speculative import (GenerationResult, Sampling, Step, generate_autoregressive,
                          generate_speculative)
from .target import Target, TargetOutput

__all__ = [
    "DFlashDraft", "DraftCache", "DraftConfig", "GenerationResult", "Sampling", "Step", "Target",
    "TargetOutput", "default_target_layer_ids", "draft_config_from_gguf", "draft_config_from_hf",
    "generate_autoregressive", "generate_speculative", "load_draft", "load_draft_for_target",
]
