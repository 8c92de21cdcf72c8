"""The DFlash GGUF layout: every key and tensor the pinned llama.cpp reads for arch `dflash`.

This is the one place that knows DFlash GGUF names. The converter writes with it, the PyTorch
reference loads GGUFs with it, the parity harness lines tensors up with it. Everything here was
checked against the pinned llama.cpp (0c1e570): `conversion/qwen.py` (`DFlashModel`, the writer),
`src/models/dflash.cpp` (the loader and graph), `src/llama-arch.cpp` (names) and
`common/speculative.cpp` (the keys the `draft-dflash` loop reads itself).

Shapes are in ggml order (ne0 first, the fastest-moving dimension), i.e. the reverse of the
PyTorch shape of the same tensor: `fc.weight` is [n_embd, n_taps * n_embd] in PyTorch and
("n_taps*n_embd", "n_embd") here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGUFValueType

ARCH = "dflash"

# --- keys ---------------------------------------------------------------------------------------

GENERAL_ARCHITECTURE = "general.architecture"
GENERAL_TYPE = "general.type"
GENERAL_NAME = "general.name"
GENERAL_FILE_TYPE = "general.file_type"
GENERAL_QUANTIZATION_VERSION = "general.quantization_version"

BLOCK_COUNT = f"{ARCH}.block_count"
CONTEXT_LENGTH = f"{ARCH}.context_length"
EMBEDDING_LENGTH = f"{ARCH}.embedding_length"
FEED_FORWARD_LENGTH = f"{ARCH}.feed_forward_length"
HEAD_COUNT = f"{ARCH}.attention.head_count"
HEAD_COUNT_KV = f"{ARCH}.attention.head_count_kv"
KEY_LENGTH = f"{ARCH}.attention.key_length"
VALUE_LENGTH = f"{ARCH}.attention.value_length"
RMS_EPS = f"{ARCH}.attention.layer_norm_rms_epsilon"
ROPE_FREQ_BASE = f"{ARCH}.rope.freq_base"
ROPE_SCALING_TYPE = f"{ARCH}.rope.scaling.type"
ROPE_SCALING_FACTOR = f"{ARCH}.rope.scaling.factor"
ROPE_DIMENSION_COUNT = f"{ARCH}.rope.dimension_count"
ROPE_DIMENSION_SECTIONS = f"{ARCH}.rope.dimension_sections"
BLOCK_SIZE = f"{ARCH}.block_size"
TARGET_LAYERS = f"{ARCH}.target_layers"
CAUSAL = f"{ARCH}.attention.causal"
SLIDING_WINDOW = f"{ARCH}.attention.sliding_window"
SLIDING_WINDOW_PATTERN = f"{ARCH}.attention.sliding_window_pattern"
VALUE_SCALE = f"{ARCH}.attention.value_scale"
LOGIT_SCALE = f"{ARCH}.logit_scale"
FINAL_LOGIT_SOFTCAPPING = f"{ARCH}.final_logit_softcapping"
EMBEDDING_SCALE = f"{ARCH}.embedding_scale"

TOKENIZER_PREFIX = "tokenizer."  # every key under it is copied from the target
MASK_TOKEN_ID = "tokenizer.ggml.mask_token_id"

U32, F32, BOOL, STR, ARR = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL,
                            GGUFValueType.STRING, GGUFValueType.ARRAY)


@dataclass(frozen=True)
class KeySpec:
    key: str
    type: GGUFValueType  # as the pinned converter writes it (arrays: element type in `element`)
    required: bool  # the pinned llama.cpp cannot run the draft without it
    hf: str  # where the value comes from in the draft's config.json (or the target)
    llama_cpp: str  # what the pinned llama.cpp does with it
    element: GGUFValueType | None = None


KEYS: tuple[KeySpec, ...] = (
    KeySpec(GENERAL_ARCHITECTURE, STR, True, '"dflash"', "selects llama_model_dflash"),
    KeySpec(GENERAL_TYPE, STR, False, '"model"', "informational"),
    KeySpec(GENERAL_NAME, STR, False, "draft directory name", "informational"),
    KeySpec(GENERAL_FILE_TYPE, U32, False, "--outtype (llama_ftype)", "informational, printed"),
    KeySpec(GENERAL_QUANTIZATION_VERSION, U32, False, "2", "checked by the quantizer"),
    KeySpec(BLOCK_COUNT, U32, True, "num_hidden_layers", "number of draft layers"),
    KeySpec(CONTEXT_LENGTH, U32, True, "max_position_embeddings (Qwen3 default 32768)",
            "n_ctx_train; the draft context defaults to it"),
    KeySpec(EMBEDDING_LENGTH, U32, True, "hidden_size", "n_embd; must equal the target's"),
    KeySpec(FEED_FORWARD_LENGTH, U32, True, "intermediate_size", "n_ff, shapes of ffn_*"),
    KeySpec(HEAD_COUNT, U32, True, "num_attention_heads", "n_head"),
    KeySpec(HEAD_COUNT_KV, U32, False, "num_key_value_heads", "n_head_kv (default n_head)"),
    KeySpec(KEY_LENGTH, U32, False, "head_dim", "head size of q/k (default n_embd / n_head)"),
    KeySpec(VALUE_LENGTH, U32, False, "head_dim", "head size of v (default n_embd / n_head)"),
    KeySpec(RMS_EPS, F32, True, "rms_norm_eps", "epsilon of every RMSNorm"),
    KeySpec(ROPE_FREQ_BASE, F32, False, "rope_theta or rope_parameters.rope_theta",
            "RoPE base (default 10000); NeoX rotation"),
    KeySpec(ROPE_SCALING_TYPE, STR, False, 'rope_parameters.rope_type == "linear"',
            "RoPE scaling type (default linear with factor 1)"),
    KeySpec(ROPE_SCALING_FACTOR, F32, False, "rope_parameters.factor", "RoPE frequency scale 1/factor"),
    KeySpec(ROPE_DIMENSION_COUNT, U32, False, "head_dim * partial_rotary_factor",
            "n_rot (default head_dim)"),
    KeySpec(ROPE_DIMENSION_SECTIONS, ARR, False, "[head_dim/2, 0, 0, 0] for M-RoPE targets",
            "switches the draft to M-RoPE on the temporal dimension", GGUFValueType.INT32),
    KeySpec(BLOCK_SIZE, U32, False, "dflash_config.block_size, block_size (default 16)",
            "draft-dflash block size; n_max is clamped to block_size - 1; 16 when absent"),
    KeySpec(TARGET_LAYERS, ARR, True, "dflash_config.target_layer_ids + 1 (default rule when absent)",
            "target layers whose INPUT is captured; fc input = len * n_embd", GGUFValueType.INT32),
    KeySpec(CAUSAL, BOOL, False, "is_causal, dflash_config.causal",
            "draft-dflash sets causal attention from it (default: non-causal)"),
    KeySpec(SLIDING_WINDOW, U32, False, "dflash_config.swa_window_size, sliding_window",
            "window of sliding-attention layers (written only with use_sliding_window / use_swa)"),
    KeySpec(SLIDING_WINDOW_PATTERN, ARR, False, 'layer_types[i] == "sliding_attention"',
            "per-layer SWA flags; required when sliding_window is set", GGUFValueType.BOOL),
    KeySpec(VALUE_SCALE, F32, False, "dflash_config.attention_value_scale", "scales V"),
    KeySpec(LOGIT_SCALE, F32, False, "output_multiplier", "draft logits *= value"),
    KeySpec(FINAL_LOGIT_SOFTCAPPING, F32, False, "final_logit_softcapping (written when > 0)",
            "logits = c * tanh(logits / c)"),
    KeySpec(EMBEDDING_SCALE, F32, False, "input_embedding_scale", "block embeddings *= value"),
    KeySpec(MASK_TOKEN_ID, U32, True, "dflash_config.mask_token_id",
            "the MASK token filling block positions 1..B-1"),
)
KEY: dict[str, KeySpec] = {k.key: k for k in KEYS}


# --- tensors ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    gguf: str  # GGUF name; "{bid}" is the draft layer index
    hf: str  # safetensors name in a published DFlash checkpoint (a "model." prefix is allowed)
    shape: tuple[str, ...]  # ggml order, in the symbols of `expected_shape`
    required: bool
    role: str


TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("fc.weight", "fc.weight", ("n_taps*n_embd", "n_embd"), True,
               "projects the concatenated target features to n_embd"),
    TensorSpec("enc.output_norm.weight", "hidden_norm.weight", ("n_embd",), True,
               "RMSNorm after fc (hidden_norm)"),
    TensorSpec("output_norm.weight", "norm.weight", ("n_embd",), True, "final RMSNorm"),
    TensorSpec("blk.{bid}.attn_norm.weight", "layers.{bid}.input_layernorm.weight", ("n_embd",), True,
               "RMSNorm before attention"),
    TensorSpec("blk.{bid}.attn_q.weight", "layers.{bid}.self_attn.q_proj.weight",
               ("n_embd", "n_head*head_dim"), True, "query projection (block tokens only)"),
    TensorSpec("blk.{bid}.attn_k.weight", "layers.{bid}.self_attn.k_proj.weight",
               ("n_embd", "n_head_kv*head_dim"), True, "key projection (context and block)"),
    TensorSpec("blk.{bid}.attn_v.weight", "layers.{bid}.self_attn.v_proj.weight",
               ("n_embd", "n_head_kv*head_dim"), True, "value projection (context and block)"),
    TensorSpec("blk.{bid}.attn_output.weight", "layers.{bid}.self_attn.o_proj.weight",
               ("n_head*head_dim", "n_embd"), True, "attention output projection"),
    TensorSpec("blk.{bid}.attn_q_norm.weight", "layers.{bid}.self_attn.q_norm.weight", ("head_dim",),
               True, "per-head RMSNorm of q"),
    TensorSpec("blk.{bid}.attn_k_norm.weight", "layers.{bid}.self_attn.k_norm.weight", ("head_dim",),
               True, "per-head RMSNorm of k"),
    TensorSpec("blk.{bid}.ffn_norm.weight", "layers.{bid}.post_attention_layernorm.weight", ("n_embd",),
               True, "RMSNorm before the MLP (post_attention_layernorm)"),
    TensorSpec("blk.{bid}.ffn_gate.weight", "layers.{bid}.mlp.gate_proj.weight", ("n_embd", "n_ff"), True,
               "SwiGLU gate"),
    TensorSpec("blk.{bid}.ffn_up.weight", "layers.{bid}.mlp.up_proj.weight", ("n_embd", "n_ff"), True,
               "SwiGLU up"),
    TensorSpec("blk.{bid}.ffn_down.weight", "layers.{bid}.mlp.down_proj.weight", ("n_ff", "n_embd"), True,
               "SwiGLU down"),
    # A draft normally borrows the target's embeddings and head (llama.cpp: through ctx_other).
    TensorSpec("token_embd.weight", "embed_tokens.weight", ("n_embd", "n_vocab"), False,
               "own token embeddings (optional)"),
    TensorSpec("output.weight", "lm_head.weight", ("n_embd", "n_vocab"), False,
               "own output head (optional)"),
)

# Rows of q_proj / k_proj / q_norm / k_norm that the pinned converter reorders for drafts trained
# with interleaved RoPE (config `rope_is_neox_style: false`), since llama.cpp's draft ropes NeoX-style.
ROPE_PERMUTED = ("blk.{bid}.attn_q.weight", "blk.{bid}.attn_k.weight",
                 "blk.{bid}.attn_q_norm.weight", "blk.{bid}.attn_k_norm.weight")


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{bid\}", r"(\d+)") + "$")


_BY_HF = [(_pattern(t.hf), t) for t in TENSORS]
_BY_GGUF = [(_pattern(t.gguf), t) for t in TENSORS]


def gguf_tensor_name(hf_name: str) -> tuple[str, TensorSpec] | None:
    """The GGUF name (and its spec) of an HF checkpoint tensor; None for a name not in the table."""
    name = hf_name.removeprefix("model.")
    for pattern, spec in _BY_HF:
        if m := pattern.match(name):
            return spec.gguf.format(bid=m.group(1)) if m.groups() else spec.gguf, spec
    return None


def hf_tensor_name(gguf_name: str) -> tuple[str, TensorSpec] | None:
    """The HF checkpoint name (and spec) of a GGUF tensor; None for a name not in the table."""
    for pattern, spec in _BY_GGUF:
        if m := pattern.match(gguf_name):
            return spec.hf.format(bid=m.group(1)) if m.groups() else spec.hf, spec
    return None


def layer_index(name: str) -> int | None:
    """The draft layer a GGUF or HF tensor name belongs to (`blk.3.` / `layers.3.`), else None."""
    m = re.match(r"^(?:model\.)?(?:blk|layers)\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def expected_shape(spec: TensorSpec, dims: dict[str, int]) -> tuple[int, ...]:
    """Shape in ggml order from `dims` with n_embd, n_taps, n_head, n_head_kv, head_dim, n_ff, n_vocab."""
    def size(sym: str) -> int:
        out = 1
        for factor in sym.split("*"):
            out *= dims[factor]
        return out

    return tuple(size(s) for s in spec.shape)


def stays_f32(gguf_name: str, n_dims: int) -> bool:
    """The pinned converter's rule: 1-D tensors, norms and non-`.weight` tensors are never quantised."""
    return n_dims <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight")


def target_layers_from_ids(target_layer_ids: list[int]) -> list[int]:
    """`dflash.target_layers`: llama.cpp captures the INPUT of layer i+1 = the output of layer i."""
    return [int(i) + 1 for i in target_layer_ids]


def target_layer_ids_from_gguf(target_layers: list[int]) -> list[int]:
    """Inverse of `target_layers_from_ids`: the HF `target_layer_ids` a GGUF draft was made with."""
    return [int(i) - 1 for i in target_layers]
