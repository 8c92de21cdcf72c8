"""The target: a transformers causal LM (qwen3, llama, ...) with the features DFlash needs.

Loads an HF directory, or a GGUF through transformers' GGUF loader (dequantised to f32). One
forward gives logits and, when asked, the draft's context features: the concatenation over taps
of `hidden_states[id + 1]` (the output of target layer `id`). For `id == n_layers - 1` transformers
returns the FINAL-NORM output there, not the raw last layer output; the published reference reads
it that way, and so do we (llama.cpp's capture of "input of layer id+1" has no such layer).
The KV cache is a transformers DynamicCache, cropped back after each verify. A cache with
recurrent layers (Gated DeltaNet, Mamba) cannot be cropped: transformers' crop cuts their
convolution window only and leaves the recurrent state after the whole block. For such a cache
each forward keeps a copy of the state before it, and a crop restores that copy and runs the kept
tokens again, as the runtime's checkpoint rollback does.
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n or logits_to_keep, V]
    features: torch.Tensor | None  # [n, n_taps * H]


class Target:
    def __init__(self, model, tokenizer=None, source: str = ""):
        self.model = model.eval()
        self.config = model.config.get_text_config(decoder=True)
        self._tokenizer = tokenizer
        self.source = source
        # transformers renamed the forward's `past_key_values` to `cache` (5.2x)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def load(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Target:
        """From an HF directory or a `.gguf` file (transformers' GGUF loader)."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"target {path} does not exist")
        try:
            if path.is_dir():
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, dtype=dtype, **_gguf_overrides(path))
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"cannot load target {path} with transformers: {e}") from e
        return cls(model.to(dtype), source=str(path))

    @property
    def tokenizer(self):
        """The target's tokenizer, loaded on first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            path = Path(self.source)
            self._tokenizer = (AutoTokenizer.from_pretrained(path) if path.is_dir() else
                               AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
        return self._tokenizer

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.shape[0]

    @property
    def embed_tokens(self) -> torch.Tensor:
        """[vocab, hidden]"""
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> torch.Tensor:
        """[vocab, hidden]; the embedding table itself when tied."""
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"target {self.source}: an output head with a bias is not supported")
        return head.weight

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-generation ids from the generation config (else the model config)."""
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def check_layer_ids(self, layer_ids: list[int]) -> None:
        for i in layer_ids:
            if not 0 <= i < self.n_layers:
                raise ValueError(f"target layer id {i} is out of range for a target with "
                                 f"{self.n_layers} layers (valid: 0..{self.n_layers - 1})")

    def new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if hasattr(cache, "activate_past_recording"):  # sliding layers must stay croppable
            cache.activate_past_recording()
        return cache

    def crop(self, cache, length: int) -> None:
        """Drop every cached position >= length (for a recurrent cache: within the last forward)."""
        checkpoint = getattr(cache, "_before_last_forward", None)
        if checkpoint is None:
            cache.crop(length - cache.get_seq_length())
            return
        layers, start, ids = checkpoint
        if length == start + len(ids):
            return
        if not start <= length < start + len(ids):
            raise ValueError(f"a recurrent cache rolls back within its last forward (positions {start}.."
                             f"{start + len(ids) - 1}), not to {length}")
        cache.layers = layers
        cache._before_last_forward = None
        if length > start:
            self.forward(ids[:length - start], start, cache)

    @staticmethod
    def _is_recurrent(cache) -> bool:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor | list[int], start: int, cache,
                feature_layers: list[int] | None = None, logits_to_keep: int = 0,
                trace: dict | None = None) -> TargetOutput:
        """Run ids at positions start.. with the cache (which must hold exactly start tokens).

        feature_layers: target layer ids whose outputs make the draft features; trace: stores
        `target_feat-L` ([n, H], the output of target layer L) for each of them.
        """
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
        if cache.get_seq_length() != start:
            raise ValueError(f"the target cache holds {cache.get_seq_length()} tokens, "
                             f"not {start}")
        if self._is_recurrent(cache):
            cache._before_last_forward = (copy.deepcopy(cache.layers), start, ids[0].tolist())
        positions = torch.arange(start, start + ids.shape[1])[None]
        want = bool(feature_layers)
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True,
                         output_hidden_states=want, logits_to_keep=logits_to_keep,
                         **{self._cache_arg: cache})
        features = None
        if want:
            taps = [out.hidden_states[i + 1][0] for i in feature_layers]
            features = torch.cat(taps, dim=-1)
            if trace is not None:
                for i, t in zip(feature_layers, taps):
                    trace[f"target_feat-{i}"] = t
        return TargetOutput(out.logits[0].float(), features)


def _gguf_overrides(path: Path) -> dict:
    """Config values transformers' GGUF loader misses: it leaves qwen3's head_dim at its default
    (128) instead of reading `<arch>.attention.key_length`."""
    from dflash_llama import gguf_info

    key_length = gguf_info(path).get("attention.key_length")
    return {} if key_length is None else {"head_dim": int(key_length)}
