"""Target families with published DFlash drafts: which tiny target stands for each.

Each family is a transformers config built from `fixtures.TinyTargetConfig`'s sizes (hidden 64,
4 layers, 4 heads, 2 KV heads, head 16, FFN 128), the model class that holds it, the extra
arguments the pinned llama.cpp converter needs, and which norm classes keep their gain as
`1 + weight` (so the random-gain trick draws the weight around 0 there):

- qwen3: dense, q/k norms (the default; its files are those of the first tiny target);
- llama: dense, no q/k norms;
- qwen3moe: 4 experts, top 2, every layer sparse;
- gpt-oss: 4 experts, top 2, sliding (window 8) and full layers alternating, attention sinks and
  biases, YaRN RoPE as published except `truncate`: llama.cpp always rounds YaRN's correction
  range (`ggml_rope_yarn_corr_dims`), gpt-oss's config says `truncate: false`, and the target's
  hidden states would differ between llama.cpp and transformers (docs/families.md);
- gemma3: sliding layers (window 8) by Gemma 3's rule, every sixth layer full (so all four of the
  tiny target's are sliding: the pinned converter writes no pattern for gemma3 and llama.cpp
  assumes that one), q/k norms, the embedding scaled by
  sqrt(hidden) (its rows drawn that much smaller), tied input/output embeddings, GELU MLP, pre-
  and post-norms around attention and MLP;
- qwen35: Qwen3.5, three Gated DeltaNet (linear attention) layers and one gated full-attention
  layer, partial M-RoPE (sections [2, 1, 1] = half the rotary dimensions, interleaved);
- qwen35moe: the same with 4 experts (top 2) and a shared expert.

All families share SmolLM2's tokenizer: the pinned converter takes its BPE vocabulary for every
one of them (gemma3 falls back to it when there is no tokenizer.model; for qwen35moe transformers
5.x would swap in its Qwen3.5 tokenizer class, see `Family.trust_saved_tokenizer`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .fixtures import TinyTargetConfig

TINY_WINDOW = 8  # sliding window of the tiny sliding-window families: shorter than most prompts


@dataclass(frozen=True)
class Family:
    name: str
    model_class: str  # the transformers class holding the config
    config: Callable  # (TinyTargetConfig, tokenizer) -> transformers config
    converter_args: tuple[str, ...] = ()  # extra arguments of the pinned convert_hf_to_gguf.py
    offset_norms: tuple[str, ...] = ()  # norm classes whose gain is 1 + weight
    # model types for which transformers ignores the saved tokenizer class (its list of hub configs
    # with a wrong class) and rebuilds SmolLM2's vocabulary with its own pre-tokenizer: the pinned
    # converter then meets an unknown pre-tokenizer hash, so it is run trusting the saved class
    trust_saved_tokenizer: tuple[str, ...] = ()
    # the model multiplies its embedding by sqrt(hidden): rows are drawn with std init_std / sqrt(hidden),
    # so that it enters the residual stream at init_std as in the other families (at init_std a tied
    # head sees each input token's own row 8 times over, and greedy decoding repeats the last token)
    scaled_embedding: bool = False


def _common(cfg: TinyTargetConfig, tok) -> dict:
    return dict(vocab_size=len(tok), hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=cfg.init_std,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _qwen3(cfg: TinyTargetConfig, tok):
    from transformers import Qwen3Config

    return Qwen3Config(**_common(cfg, tok), intermediate_size=cfg.ffn, rope_theta=cfg.rope_theta,
                       tie_word_embeddings=False, torch_dtype="float32")


def _llama(cfg: TinyTargetConfig, tok):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(cfg, tok), intermediate_size=cfg.ffn, rope_theta=cfg.rope_theta,
                       tie_word_embeddings=False, torch_dtype="float32")


def _qwen3moe(cfg: TinyTargetConfig, tok):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_common(cfg, tok), intermediate_size=cfg.ffn, moe_intermediate_size=cfg.ffn // 2,
                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
                          rope_theta=cfg.rope_theta, tie_word_embeddings=False, torch_dtype="float32")


def _gpt_oss(cfg: TinyTargetConfig, tok):
    from transformers import GptOssConfig

    return GptOssConfig(**_common(cfg, tok), intermediate_size=cfg.ffn // 2, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=TINY_WINDOW,
                        layer_types=["sliding_attention", "full_attention"] * (cfg.layers // 2),
                        rope_parameters={"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": 32.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                                         "original_max_position_embeddings": 4096},
                        tie_word_embeddings=False, torch_dtype="float32")


def _gemma3(cfg: TinyTargetConfig, tok):
    from transformers import Gemma3TextConfig

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    # layer_types by the published rule (every sixth layer full): the pinned converter writes no
    # pattern for gemma3 and llama.cpp assumes that one, so any other would run differently there
    return Gemma3TextConfig(**_common(cfg, tok), intermediate_size=cfg.ffn, query_pre_attn_scalar=cfg.head_dim,
                            sliding_window=TINY_WINDOW, sliding_window_pattern=6,
                            rope_parameters={"sliding_attention": dict(rope), "full_attention": dict(rope)},
                            tie_word_embeddings=True, torch_dtype="float32")


def _qwen35_common(cfg: TinyTargetConfig, tok) -> dict:
    return dict(**_common(cfg, tok), linear_conv_kernel_dim=4, linear_key_head_dim=cfg.head_dim,
                linear_value_head_dim=cfg.head_dim, linear_num_key_heads=cfg.kv_heads,
                linear_num_value_heads=cfg.heads,
                layer_types=["linear_attention"] * (cfg.layers - 1) + ["full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 0.5,
                                 "mrope_section": _mrope_section(cfg.head_dim // 2), "mrope_interleaved": True},
                tie_word_embeddings=False, torch_dtype="float32")


def _mrope_section(rotary_dims: int) -> list[int]:
    """M-RoPE sections (temporal, height, width) summing to half the rotary dimensions."""
    half = rotary_dims // 2
    return [half - 2 * (half // 4), half // 4, half // 4]


def _qwen35(cfg: TinyTargetConfig, tok):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_qwen35_common(cfg, tok), intermediate_size=cfg.ffn)


def _qwen35moe(cfg: TinyTargetConfig, tok):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**_qwen35_common(cfg, tok), moe_intermediate_size=cfg.ffn // 2,
                                shared_expert_intermediate_size=cfg.ffn // 2, num_experts=4, num_experts_per_tok=2)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", "Qwen3ForCausalLM", _qwen3),
    Family("llama", "LlamaForCausalLM", _llama),
    Family("qwen3moe", "Qwen3MoeForCausalLM", _qwen3moe),
    Family("gpt-oss", "GptOssForCausalLM", _gpt_oss),
    Family("gemma3", "Gemma3ForCausalLM", _gemma3, offset_norms=("Gemma3RMSNorm",), scaled_embedding=True),
    Family("qwen35", "Qwen3_5ForCausalLM", _qwen35, converter_args=("--no-mtp",),
           offset_norms=("Qwen3_5RMSNorm",)),
    Family("qwen35moe", "Qwen3_5MoeForCausalLM", _qwen35moe, converter_args=("--no-mtp",),
           offset_norms=("Qwen3_5MoeRMSNorm",), trust_saved_tokenizer=("qwen3_5_moe_text",)),
)}
NAMES = tuple(FAMILIES)


def get(name: str) -> Family:
    """The family called `name`; ValueError listing the known ones otherwise."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown target family {name!r}: known families are {', '.join(NAMES)}") from None


def build_model(cfg: TinyTargetConfig, tok):
    """The family's random model in f32 (from cfg.seed), norm gains drawn uniform in 0.5..1.5."""
    import torch
    import transformers

    family = get(cfg.family)
    config = family.config(cfg, tok)
    torch.manual_seed(cfg.seed)
    model = getattr(transformers, family.model_class)(config).to(torch.float32).eval()
    with torch.no_grad():
        if family.scaled_embedding:
            model.get_input_embeddings().weight.normal_(0.0, cfg.init_std / math.sqrt(cfg.hidden))
        # random norm gains, so a swapped norm is visible in parity
        for module_name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not (module_name + ".weight").endswith("norm.weight") or weight is None:
                continue
            low = -0.5 if type(module).__name__ in family.offset_norms else 0.5
            weight.uniform_(low, low + 1.0)
    return model
