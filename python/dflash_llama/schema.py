"""The DFlash draft schema: every GGUF key and tensor, the draft hyper-parameters, what we refuse.

This is the one place that knows DFlash names. The converter writes with it, the PyTorch
reference loads HF directories and GGUFs with it, the trainer writes config.json with it, the
parity harness lines tensors up with it, and a test checks the C++ runtime's key literals against
it. Everything here was checked against the pinned llama.cpp (0c1e570): `conversion/qwen.py`
(`DFlashModel`, the writer), `src/models/dflash.cpp` (the loader and graph), `src/llama-arch.cpp`
(names) and `common/speculative.cpp` (the keys the `draft-dflash` loop reads itself).

Shapes are in ggml order (ne0 first, the fastest-moving dimension), i.e. the reverse of the
PyTorch shape of the same tensor: `fc.weight` is [n_embd, n_taps * n_embd] in PyTorch and
("n_taps*n_embd", "n_embd") here.

No torch here: the converter and the CLI import this without PyTorch.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFValueType

ARCH = "dflash"
U32, F32, BOOL, STR, ARR = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL,
                            GGUFValueType.STRING, GGUFValueType.ARRAY)

# --- keys ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeySpec:
    key: str
    type: GGUFValueType  # as the pinned converter writes it (arrays: element type in `element`)
    required: bool  # the pinned llama.cpp cannot run the draft without it
    hf: str  # where the value comes from in the draft's config.json (or the target)
    llama_cpp: str  # what the pinned llama.cpp does with it
    element: GGUFValueType | None = None


_keys: list[KeySpec] = []


def _key(key: str, type: GGUFValueType, required: bool, hf: str, llama_cpp: str, element=None) -> str:
    _keys.append(KeySpec(key, type, required, hf, llama_cpp, element))
    return key


_A = f"{ARCH}."  # every model key is under the architecture's name
GENERAL_ARCHITECTURE = _key("general.architecture", STR, True, '"dflash"', "selects llama_model_dflash")
GENERAL_TYPE = _key("general.type", STR, False, '"model"', "informational")
GENERAL_NAME = _key("general.name", STR, False, "draft directory name", "informational")
GENERAL_FILE_TYPE = _key("general.file_type", U32, False, "--outtype (llama_ftype)", "informational, printed")
GENERAL_QUANTIZATION_VERSION = _key("general.quantization_version", U32, False, "2", "checked by the quantizer")
BLOCK_COUNT = _key(_A + "block_count", U32, True, "num_hidden_layers", "number of draft layers")
CONTEXT_LENGTH = _key(_A + "context_length", U32, True, "max_position_embeddings (Qwen3 default 32768)",
                      "n_ctx_train; the draft context defaults to it")
EMBEDDING_LENGTH = _key(_A + "embedding_length", U32, True, "hidden_size", "n_embd; must equal the target's")
FEED_FORWARD_LENGTH = _key(_A + "feed_forward_length", U32, True, "intermediate_size", "n_ff, shapes of ffn_*")
HEAD_COUNT = _key(_A + "attention.head_count", U32, True, "num_attention_heads", "n_head")
HEAD_COUNT_KV = _key(_A + "attention.head_count_kv", U32, False, "num_key_value_heads", "n_head_kv (default n_head)")
KEY_LENGTH = _key(_A + "attention.key_length", U32, False, "head_dim", "head size of q/k (default n_embd / n_head)")
VALUE_LENGTH = _key(_A + "attention.value_length", U32, False, "head_dim", "head size of v (default n_embd / n_head)")
RMS_EPS = _key(_A + "attention.layer_norm_rms_epsilon", F32, True, "rms_norm_eps", "epsilon of every RMSNorm")
ROPE_FREQ_BASE = _key(_A + "rope.freq_base", F32, False, "rope_theta or rope_parameters.rope_theta",
                      "RoPE base (default 10000); NeoX rotation")
ROPE_SCALING_TYPE = _key(_A + "rope.scaling.type", STR, False, 'rope_parameters.rope_type == "linear"',
                         "RoPE scaling type (default linear with factor 1)")
ROPE_SCALING_FACTOR = _key(_A + "rope.scaling.factor", F32, False, "rope_parameters.factor",
                           "RoPE frequency scale 1/factor")
ROPE_DIMENSION_COUNT = _key(_A + "rope.dimension_count", U32, False, "head_dim * partial_rotary_factor",
                            "n_rot (default head_dim)")
ROPE_DIMENSION_SECTIONS = _key(_A + "rope.dimension_sections", ARR, False, "[head_dim/2, 0, 0, 0] for M-RoPE targets",
                               "switches the draft to M-RoPE on the temporal dimension", GGUFValueType.INT32)
BLOCK_SIZE = _key(_A + "block_size", U32, False, "dflash_config.block_size, block_size (default 16)",
                  "draft-dflash block size; n_max is clamped to block_size - 1; 16 when absent")
TARGET_LAYERS = _key(_A + "target_layers", ARR, True, "dflash_config.target_layer_ids + 1 (default rule when absent)",
                     "target layers whose INPUT is captured; fc input = len * n_embd", GGUFValueType.INT32)
CAUSAL = _key(_A + "attention.causal", BOOL, False, "is_causal, dflash_config.causal",
              "draft-dflash sets causal attention from it (default: non-causal)")
SLIDING_WINDOW = _key(_A + "attention.sliding_window", U32, False, "dflash_config.swa_window_size, sliding_window",
                      "window of sliding-attention layers (written only with use_sliding_window / use_swa)")
SLIDING_WINDOW_PATTERN = _key(_A + "attention.sliding_window_pattern", ARR, False,
                              'layer_types[i] == "sliding_attention"',
                              "per-layer SWA flags; required when sliding_window is set", GGUFValueType.BOOL)
VALUE_SCALE = _key(_A + "attention.value_scale", F32, False, "dflash_config.attention_value_scale", "scales V")
LOGIT_SCALE = _key(_A + "logit_scale", F32, False, "output_multiplier", "draft logits *= value")
FINAL_LOGIT_SOFTCAPPING = _key(_A + "final_logit_softcapping", F32, False, "final_logit_softcapping (written when > 0)",
                               "logits = c * tanh(logits / c)")
EMBEDDING_SCALE = _key(_A + "embedding_scale", F32, False, "input_embedding_scale", "block embeddings *= value")
TOKENIZER_PREFIX = "tokenizer."  # every key under it is copied from the target
MASK_TOKEN_ID = _key("tokenizer.ggml.mask_token_id", U32, True, "dflash_config.mask_token_id",
                     "the MASK token filling block positions 1..B-1")
HIDDEN_ACTIVATION = _key(_A + "hidden_activation", STR, False, "(never written: DFlash 1 drafts are silu)",
                         "FFN activation: silu (default) or gelu")
ATTENTION_SCALE = _key(_A + "attention.scale", F32, False, "(never written)",
                       "attention scale instead of 1/sqrt(head_dim)")
# DFlash 2 (grouped dynamic causal convolutions + candidate selector): all four or none (VARIANTS)
CONV_KERNEL_SIZE = _key(_A + "conv_kernel_size", U32, False, "dflash_config.conv_kernel_size",
                        "DFlash 2: taps of each convolution; draft-dflash switches to DFlash 2 when > 0")
CONV_GROUP_SIZE = _key(_A + "conv_group_size", U32, False, "dflash_config.conv_group_size",
                       "DFlash 2: channels sharing one dynamic kernel coefficient (n_embd % it == 0)")
SELECTOR_RANK = _key(_A + "selector_rank", U32, False, "dflash_config.selector_rank",
                     "DFlash 2: rank of the selector's codebooks")
SELECTOR_TOP_K = _key(_A + "selector_top_k", U32, False, "dflash_config.selector_top_k",
                      "DFlash 2: candidates per slot (llama.cpp needs n_embd >= K (K + 1))")
DFLASH2_KEYS = (CONV_KERNEL_SIZE, CONV_GROUP_SIZE, SELECTOR_RANK, SELECTOR_TOP_K)
# DSpark (Markov / confidence heads; the rank is markov_w1's ne0, as the pinned loader reads it):
# our converter writes both keys for every DSpark-family draft, so no reader has to guess
SAMPLE_FROM_ANCHOR = _key(_A + "sample_from_anchor", BOOL, False,
                          "sample_from_anchor (speculators), dflash_config.sample_from_anchor; DeepSpec: true",
                          "the block layout: slot 0 (the anchor) is a draft slot too; missing: true")
HAS_CONFIDENCE_HEAD = _key(_A + "has_confidence_head", BOOL, False,
                           "enable_confidence_head (conf_proj.weight present)",
                           "draft-dspark needs it true for --spec-draft-p-min; missing: true")
HYPER_CONNECTION_COUNT = _key(_A + "hyper_connection.count", U32, False, "(DSpark on a DeepSeek-V4 backbone)",
                              "switches the draft to DeepSeek-V4 blocks with hyper-connections")
KEYS: tuple[KeySpec, ...] = tuple(_keys)
KEY: dict[str, KeySpec] = {k.key: k for k in KEYS}


# --- draft variants -------------------------------------------------------------------------------

CONV, SELECTOR = "conv", "selector"  # the heads a variant adds to the DFlash 1 backbone
MARKOV, CONFIDENCE = "markov", "confidence"  # DSpark's


@dataclass(frozen=True)
class Variant:
    """A kind of DFlash-family draft: the heads it adds to the DFlash 1 backbone and the block
    layout it drafts with. This table is the one place that knows; everything else asks
    `DraftHParams.variant`, and the C++ runtime's `draft_variant` mirrors it (draft_model.h)."""

    name: str  # as the CLI and the reports spell it (`--variant`)
    title: str  # as prose spells it
    architecture: str  # the HF class in a checkpoint's `architectures`
    heads: tuple[str, ...]  # beyond the backbone: CONV, SELECTOR
    keys: tuple[str, ...]  # GGUF keys it needs, all present and > 0 (and none of them in another variant)
    # the block layout when a draft does not say (`DraftHParams.sample_from_anchor` is the draft's own:
    # DSpark exports with DFlash's layout exist, and DeepSpec's "DFlash" drafts are anchor-first)
    anchor_first: bool = False
    optional_heads: tuple[str, ...] = ()  # heads a draft of this variant may lack
    marker: str = ""  # the tensor whose presence says this variant (the pinned loop's detection)

    def has(self, head: str) -> bool:
        return head in self.heads


DFLASH1 = Variant("dflash", "DFlash 1", "DFlashDraftModel", (), ())
DFLASH2 = Variant("dflash2", "DFlash 2", "DFlash2DraftModel", (CONV, SELECTOR), DFLASH2_KEYS)
DSPARK = Variant("dspark", "DSpark", "DSparkDraftModel", (MARKOV, CONFIDENCE), (), anchor_first=True,
                 optional_heads=(CONFIDENCE,), marker="markov_w1.weight")
VARIANTS: dict[str, Variant] = {v.name: v for v in (DFLASH1, DFLASH2, DSPARK)}
# every HF class of a DSpark-family checkpoint: DeepSpec's, SpecForge's, speculators'; with markov_rank
# 0 (DeepSpec's "DFlash" drafts) it is an anchor-first DFlash 1 draft
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator")


def variant_of_gguf(kv: dict[str, Any], tensor_names=()) -> Variant:
    """The variant a GGUF says: a DFlash 2 key present: DFlash 2; a `markov_w1.weight`: DSpark (as the
    pinned loop detects them)."""
    if any(k in kv for k in DFLASH2_KEYS):
        return DFLASH2
    return DSPARK if DSPARK.marker in tensor_names else DFLASH1


# --- tensors ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    gguf: str  # GGUF name; "{bid}" is the draft layer index
    hf: str  # safetensors name in a published DFlash checkpoint (a "model." prefix is allowed)
    shape: tuple[str, ...]  # ggml order, in the symbols of `expected_shape`
    required: bool  # ... in every draft whose variant has this tensor's head
    role: str
    head: str = ""  # the variant head it belongs to (Variant.heads); "": the DFlash 1 backbone
    hf_aliases: tuple[str, ...] = ()  # other checkpoint spellings of `hf`


def _layer(gguf: str, hf: str, shape: tuple[str, ...], role: str, head: str = "") -> TensorSpec:
    return TensorSpec(f"blk.{{bid}}.{gguf}.weight", f"layers.{{bid}}.{hf}.weight", shape, True, role, head)


def _conv(gguf: str, hf: str, where: str) -> tuple[TensorSpec, TensorSpec]:
    """One DFlash 2 convolution (around attention or the MLP): its static taps (F32, no `.weight`,
    index 0 the input side, 1 the output side) and the projection giving each position its dynamic
    coefficients, one per group of conv_group_size channels."""
    return (TensorSpec(f"blk.{{bid}}.{gguf}_base", f"layers.{{bid}}.{hf}.base_kernel", ("n_embd", "conv_k", "2"),
                       True, f"static taps of the convolutions {where} [side, tap, channel]", CONV),
            _layer(f"{gguf}_proj", f"{hf}.kernel_projection", ("n_embd", "2*conv_k*conv_groups"),
                   f"dynamic taps of the convolutions {where}, from the sublayer's normed input", CONV))


MARKOV_SCALE = "markov_w2.scale"  # DSpark: an optional factor on the Markov bias
TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("fc.weight", "fc.weight", ("n_taps*n_embd", "n_embd"), True,
               "projects the concatenated target features to n_embd"),
    TensorSpec("enc.output_norm.weight", "hidden_norm.weight", ("n_embd",), True, "RMSNorm after fc (hidden_norm)"),
    TensorSpec("output_norm.weight", "norm.weight", ("n_embd",), True, "final RMSNorm"),
    _layer("attn_norm", "input_layernorm", ("n_embd",), "RMSNorm before attention"),
    _layer("attn_q", "self_attn.q_proj", ("n_embd", "n_head*head_dim"), "query projection (block tokens only)"),
    _layer("attn_k", "self_attn.k_proj", ("n_embd", "n_head_kv*head_dim"), "key projection (context and block)"),
    _layer("attn_v", "self_attn.v_proj", ("n_embd", "n_head_kv*head_dim"), "value projection (context and block)"),
    _layer("attn_output", "self_attn.o_proj", ("n_head*head_dim", "n_embd"), "attention output projection"),
    _layer("attn_q_norm", "self_attn.q_norm", ("head_dim",), "per-head RMSNorm of q"),
    _layer("attn_k_norm", "self_attn.k_norm", ("head_dim",), "per-head RMSNorm of k"),
    _layer("ffn_norm", "post_attention_layernorm", ("n_embd",), "RMSNorm before the MLP (post_attention_layernorm)"),
    _layer("ffn_gate", "mlp.gate_proj", ("n_embd", "n_ff"), "SwiGLU gate"),
    _layer("ffn_up", "mlp.up_proj", ("n_embd", "n_ff"), "SwiGLU up"),
    _layer("ffn_down", "mlp.down_proj", ("n_ff", "n_embd"), "SwiGLU down"),
    # A draft normally borrows the target's embeddings and head (llama.cpp: through ctx_other). The
    # converter writes a checkpoint's own, as the pinned one does; the runtime refuses them (REFUSALS).
    TensorSpec("token_embd.weight", "embed_tokens.weight", ("n_embd", "n_vocab"), False,
               "own token embeddings (optional)"),
    TensorSpec("output.weight", "lm_head.weight", ("n_embd", "n_vocab"), False, "own output head (optional)"),
    # DFlash 2
    *_conv("attn_conv", "attention_conv", "before and after attention"),
    *_conv("ffn_conv", "mlp_conv", "before and after the MLP"),
    TensorSpec("selector_predecessor.weight", "candidate_selector.predecessor_codebook",
               ("selector_rank", "n_vocab"), True, "selector codebook A: the predecessor token's row", SELECTOR,
               ("candidate_selector.predecessor_codebook.weight",)),
    TensorSpec("selector_successor.weight", "candidate_selector.successor_codebook",
               ("selector_rank", "n_vocab"), True, "selector codebook B: the candidate token's row", SELECTOR,
               ("candidate_selector.successor_codebook.weight",)),
    TensorSpec("selector_hidden.weight", "candidate_selector.hidden_projection.weight",
               ("n_embd", "selector_rank"), True, "selector gate W_h: the slot's post-norm hidden state", SELECTOR),
    # DSpark: the same names in DeepSpec's, SpecForge's and speculators' checkpoints
    TensorSpec("markov_w1.weight", "markov_head.markov_w1.weight", ("markov_rank", "n_vocab"), True,
               "Markov head W1: the row of the token before the slot (an embedding, target vocabulary)", MARKOV),
    TensorSpec("markov_w2.weight", "markov_head.markov_w2.weight", ("markov_rank", "n_vocab_draft"), True,
               "Markov head W2: that row to a bias on the slot's logits (draft vocabulary)", MARKOV),
    # optional: one factor on the bias (llama.cpp's per-tensor `_s` scale, bias = scale * W2 @ W1[prev]).
    # No published checkpoint format stores it (a GGUF's, as quantizing tools write them); the converter
    # passes a [1] one through under this name
    TensorSpec(MARKOV_SCALE, "markov_head.markov_w2.scale", ("1",), False,
               "Markov head: a factor on W2's bias (optional, one finite f32)", MARKOV),
    TensorSpec("conf_proj.weight", "confidence_head.proj.weight", ("n_embd+markov_rank", "1"), True,
               "confidence head: [post-norm hidden state ; W1 row] to the slot's acceptance logit", CONFIDENCE),
    TensorSpec("conf_proj.bias", "confidence_head.proj.bias", ("1",), True, "confidence head bias", CONFIDENCE),
)

# A reduced draft vocabulary, as the pinned `dflash` graph reads it: `d2t` (i64 [n_draft_vocab],
# ascending target token ids) and the draft's own `output.weight` [n_embd, n_draft_vocab] over those
# rows; the draft's logits are scattered into the target's vocabulary, -inf elsewhere.
D2T = "d2t"
DRAFT_VOCAB_SIZE = "draft_vocab_size"  # its size in a checkpoint's config.json (d2t there: offsets, i + d2t[i])

# Rows of q_proj / k_proj / q_norm / k_norm that the pinned converter reorders for drafts trained
# with interleaved RoPE (config `rope_is_neox_style: false`), since llama.cpp's draft ropes NeoX-style.
ROPE_PERMUTED = ("blk.{bid}.attn_q.weight", "blk.{bid}.attn_k.weight",
                 "blk.{bid}.attn_q_norm.weight", "blk.{bid}.attn_k_norm.weight")


# --- what this project cannot run -------------------------------------------------------------

@dataclass(frozen=True)
class Refusal:
    """A key or tensor the pinned llama.cpp reads and neither our runtime nor the reference runs."""

    name: str  # GGUF key, or tensor name ("{bid}": any draft layer)
    why: str
    allowed: tuple = ()  # a key is refused when present, unless its value is one of these
    same_as: str | None = None  # ... or equals this key (with llama.cpp's default)
    tensor: bool = False
    accept: Callable[[Any], bool] | None = None  # ... or passes this test
    pending: bool = False  # the reference runs it; only the runtime refuses it (`refusals(runtime=False)`)


def temporal_rope_sections(value: Any) -> bool:
    """M-RoPE sections [n, 0, 0, 0]: a text position is the same in the temporal, height and width
    sections (0 in the fourth), so every frequency ropes with the temporal position, which is the
    NeoX RoPE our graph and the published model compute. Other sections are not."""
    return isinstance(value, list) and 0 < len(value) <= 4 and all(v == 0 for v in value[1:])


_OWN = "the runtime uses the target's embeddings and head; a draft with its own is not supported by this runtime"
REFUSALS: tuple[Refusal, ...] = (
    Refusal(HIDDEN_ACTIVATION, "only silu FFNs are supported", allowed=("silu",)),
    Refusal(ATTENTION_SCALE, "a custom attention scale is not supported"),
    Refusal(VALUE_SCALE, "V scaling is not supported"),
    Refusal(ROPE_DIMENSION_SECTIONS, "only the temporal M-RoPE section is supported ([n, 0, 0, 0], as drafts "
            "for M-RoPE targets carry)", accept=temporal_rope_sections),
    Refusal(ROPE_SCALING_TYPE, "only none and linear RoPE scaling are supported", allowed=("none", "linear")),
    Refusal(VALUE_LENGTH, "value_length different from key_length is not supported", same_as=KEY_LENGTH),
    Refusal(ROPE_DIMENSION_COUNT, "partial RoPE (dimension_count != key_length) is not supported",
            same_as=KEY_LENGTH),
    Refusal(HYPER_CONNECTION_COUNT, "DSpark drafts on a DeepSeek-V4 backbone are not supported"),
    # llama.cpp uses a draft's own embeddings and head; our graph uses the target's: refused, never
    # ignored. An own head with a d2t is a reduced vocabulary, which both read (see `refusals`).
    Refusal("token_embd.weight", _OWN, tensor=True),
    Refusal("output.weight", _OWN + " (an own head needs a d2t: a reduced vocabulary)", tensor=True, pending=True),
    Refusal("fc.scale", "a scaled fc is not supported", tensor=True),
    Refusal("rope_freqs.weight", "RoPE frequency factors are not supported", tensor=True),
    *(Refusal(t, "extra per-layer tensors (Gemma-style norms, output scales, sinks) are not supported", tensor=True)
      for t in ("blk.{bid}.post_attention_norm.weight", "blk.{bid}.post_ffw_norm.weight",
                "blk.{bid}.layer_output_scale.weight", "blk.{bid}.attn_sinks.weight")),
)


def refusals(kv: dict[str, Any], tensor_names=(), runtime: bool = True) -> list[str]:
    """One line per thing in a draft GGUF that this project cannot run (empty: none).

    `kv`: GGUF metadata; `tensor_names`: every tensor in the file. A tensor that is neither in
    TENSORS nor in REFUSALS is refused too (llama.cpp may read it; we would silently ignore it).
    runtime False: what the PyTorch reference cannot run (it runs the `pending` ones).
    """
    tensor_names = list(tensor_names)
    out = _variant_refusals(kv, tensor_names)
    variant = variant_of_gguf(kv, tensor_names)
    active = [r for r in REFUSALS if runtime or not r.pending]
    for r in active:
        if r.tensor or r.name not in kv:
            continue
        value = kv[r.name]
        if (value in r.allowed or (r.same_as is not None and value == _head_dim(kv))
                or (r.accept is not None and r.accept(value))):
            continue
        out.append(f"'{r.name}' = {value!r}: {r.why}")
    reduced = D2T in tensor_names
    refused = [(_pattern(r.name), r.why) for r in active if r.tensor and not (reduced and r.name == "output.weight")]
    if reduced and "output.weight" not in tensor_names:
        out.append(f"tensor '{D2T}': a reduced vocabulary needs the draft's own 'output.weight' over its rows")
    for name in tensor_names:
        if name == D2T:
            continue
        why = next((why for p, why in refused if p.match(name)), None)
        known = hf_tensor_name(name)
        if why is None and known is None:
            why = "not a tensor of a DFlash 1 or DFlash 2 draft"
        elif why is None and known[1].head and not variant.has(known[1].head):
            owner = next(v for v in VARIANTS.values() if v.has(known[1].head))
            lacks = " / ".join(owner.keys) if owner.keys else owner.marker
            why = f"a {owner.title} tensor in a {variant.title} draft (no {lacks})"
        if why is not None:
            out.append(f"tensor '{name}': {why}")
    return out


def _variant_refusals(kv: dict[str, Any], tensor_names=()) -> list[str]:
    """A variant's keys: all of them or none, each a positive integer; one variant per draft."""
    variant = variant_of_gguf(kv, tensor_names)
    out = [f"'{k}' missing: a {variant.title} draft needs {', '.join(variant.keys)}"
           for k in variant.keys if k not in kv]
    if variant is DFLASH2 and DSPARK.marker in tensor_names:
        out.append(f"tensor '{DSPARK.marker}': a DSpark head on a DFlash 2 draft is not supported")
    for k in variant.keys:
        v = kv.get(k)
        if k in kv and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 < v <= INT32_MAX):
            out.append(f"'{k}' = {_show(v)}: expected a positive integer")
    return out


def _head_dim(kv: dict[str, Any]) -> int | None:
    """key_length, else llama.cpp's default n_embd / n_head."""
    if KEY_LENGTH in kv:
        return kv[KEY_LENGTH]
    n_embd, n_head = kv.get(EMBEDDING_LENGTH), kv.get(HEAD_COUNT)
    return n_embd // n_head if n_embd and n_head else None


def refuse(kv: dict[str, Any], tensor_names=(), source: str = "draft", runtime: bool = True) -> None:
    """Raise ValueError naming `source` and the first thing `refusals` finds."""
    found = refusals(kv, tensor_names, runtime)
    if found:
        raise ValueError(f"{source}: {found[0]}")


# --- tensor names ---------------------------------------------------------------------------------

def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{bid\}", r"(\d+)") + "$")


_BY_HF = [(_pattern(t.hf), t) for t in TENSORS]
_BY_GGUF = [(_pattern(t.gguf), t) for t in TENSORS]
_ROPE_PERMUTED = [_pattern(t) for t in ROPE_PERMUTED]


_BY_HF += [(_pattern(alias), t) for t in TENSORS for alias in t.hf_aliases]


def _rename(name: str, table: list, to: str) -> tuple[str, TensorSpec] | None:
    for pattern, spec in table:
        if m := pattern.match(name):
            return getattr(spec, to).format(bid=m.group(1) if m.groups() else None), spec
    return None


def gguf_tensor_name(hf_name: str) -> tuple[str, TensorSpec] | None:
    """The GGUF name (and its spec) of an HF checkpoint tensor; None for a name not in the table."""
    return _rename(hf_name.removeprefix("model."), _BY_HF, "gguf")


def hf_tensor_name(gguf_name: str) -> tuple[str, TensorSpec] | None:
    """The HF checkpoint name (and spec) of a GGUF tensor; None for a name not in the table."""
    return _rename(gguf_name, _BY_GGUF, "hf")


def layer_index(name: str) -> int | None:
    """The draft layer a GGUF or HF tensor name belongs to (`blk.3.` / `layers.3.`), else None."""
    m = re.match(r"^(?:model\.)?(?:blk|layers)\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def expected_shape(spec: TensorSpec, dims: dict[str, int]) -> tuple[int, ...]:
    """Shape in ggml order from `dims` with n_embd, n_taps, n_head, n_head_kv, head_dim, n_ff, n_vocab
    (a DFlash 2 draft's conv_k, conv_groups, selector_rank; a DSpark draft's markov_rank,
    n_vocab_draft); digits are literal sizes, `*` and `+` combine symbols."""
    return tuple(sum(math.prod(int(f) if f.isdigit() else dims[f] for f in term.split("*"))
                     for term in sym.split("+")) for sym in spec.shape)


def stays_f32(gguf_name: str, n_dims: int) -> bool:
    """The pinned converter's rule: 1-D tensors, norms and non-`.weight` tensors are never quantised."""
    return n_dims <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight")


def is_rope_permuted(gguf_name: str) -> bool:
    """A q/k row tensor that interleaved-RoPE checkpoints need reordered (see rope_halves_order)."""
    return any(p.match(gguf_name) for p in _ROPE_PERMUTED)


def rope_halves_order(n_rows: int, head_dim: int) -> np.ndarray:
    """Row order taking interleaved RoPE pairs (2i, 2i+1) to NeoX halves, per head: even dims
    first, then odd (llama.cpp permutes llama's q/k the other way). `rows[order]` reorders a
    NumPy array or a torch tensor alike."""
    return np.arange(n_rows).reshape(-1, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


# --- target layers --------------------------------------------------------------------------------

def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published rule when a checkpoint has no `target_layer_ids`."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 3) - 1
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def target_layers_from_ids(target_layer_ids: list[int]) -> list[int]:
    """`dflash.target_layers`: llama.cpp captures the INPUT of layer i+1 = the output of layer i."""
    return [int(i) + 1 for i in target_layer_ids]


def target_layer_ids_from_gguf(target_layers: list[int]) -> list[int]:
    """Inverse of `target_layers_from_ids`: the HF `target_layer_ids` a GGUF draft was made with."""
    return [int(i) - 1 for i in target_layers]


# --- hyper-parameters -----------------------------------------------------------------------------

DFLASH_ARCHITECTURE = "DFlashDraftModel"
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass
class DraftHParams:
    """A DFlash 1 draft's hyper-parameters, in llama.cpp's names (`draft_hparams` in
    runtime/draft_model.h). Read from config.json (with the defaults of Qwen3Config, the class
    published drafts load with) or from GGUF metadata; None: the source does not say."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    mask_token_id: int
    target_layer_ids: list[int] | None  # HF ids (GGUF: ids + 1); None: the default rule applies
    n_vocab: int | None = None
    n_layer_target: int | None = None  # num_target_layers; GGUFs do not store it
    block_size: int = 16
    n_ctx_train: int | None = None
    rms_eps: float = 1e-6
    rope_freq_base: float = 10000.0
    rope_linear_factor: float | None = None  # linear RoPE scaling: positions / factor
    n_rot: int | None = None  # rotated dims of a partial-RoPE draft (refused)
    rope_neox: bool = True  # False: the checkpoint's q/k rows are interleaved pairs (HF only)
    causal: bool | None = None  # None: sliding layers causal, full layers not
    sliding_window: int | None = None  # window of the sliding layers; None: no window
    swa_layers: list[bool] = field(default_factory=list)  # per layer: a sliding layer; empty: none
    embedding_scale: float | None = None  # input_embedding_scale
    logit_scale: float | None = None  # output_multiplier
    logit_softcap: float | None = None  # final_logit_softcapping (> 0)
    value_scale: float | None = None  # attention_value_scale (refused)
    # DFlash 2 (0: absent; all four or none): convolution taps and group size, selector rank and top-K
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # DSpark (markov_rank 0: none): the Markov head's rank, whether it has a confidence head
    markov_rank: int = 0
    has_confidence_head: bool = False
    # the block layout: slot 0 (the anchor) is a draft slot too, B inputs give B drafts (DSpark's, and
    # DeepSpec's "DFlash" drafts'); False: DFlash's, B inputs give B - 1 drafts
    sample_from_anchor: bool = False
    # `is_causal: false` at the top level of config.json: the pinned converter writes the key early
    causal_at_top: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self):
        if not self.swa_layers:
            self.swa_layers = [False] * self.n_layer
        if len(self.swa_layers) != self.n_layer:
            raise ValueError(f"layer_types has {len(self.swa_layers)} entries for {self.n_layer} layers")
        if self.n_head % self.n_head_kv != 0:
            raise ValueError(f"{self.n_head} attention heads are not a multiple of {self.n_head_kv} kv heads")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        dflash2 = (self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k)
        if any(dflash2) and not all(v > 0 for v in dflash2):
            raise ValueError("a DFlash 2 draft needs conv_kernel_size, conv_group_size, selector_rank and "
                             f"selector_top_k, all positive (got {', '.join(map(str, dflash2))})")
        if self.conv_group_size and self.n_embd % self.conv_group_size != 0:
            raise ValueError(f"conv_group_size {self.conv_group_size} does not divide the hidden size {self.n_embd}")
        if self.selector_top_k and self.n_vocab is not None and self.selector_top_k > self.n_vocab:
            raise ValueError(f"selector_top_k {self.selector_top_k} is larger than the vocabulary ({self.n_vocab})")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank {self.markov_rank} must be >= 0")
        if self.has_confidence_head and not self.markov_rank:
            raise ValueError("a confidence head needs a Markov head (its input is [hidden ; markov_w1 row])")
        if self.markov_rank and self.conv_kernel_size:
            raise ValueError("a DSpark head on a DFlash 2 draft is not supported")
        if self.sample_from_anchor and self.conv_kernel_size:
            raise ValueError("an anchor-first block (sample_from_anchor) is not supported for DFlash 2 drafts")

    @property
    def variant(self) -> Variant:
        return DFLASH2 if self.conv_kernel_size else DSPARK if self.markov_rank else DFLASH1

    @property
    def heads(self) -> tuple[str, ...]:
        """The heads this draft has: its variant's, less an optional one it lacks."""
        lacks = () if self.has_confidence_head else (CONFIDENCE,)
        return tuple(h for h in self.variant.heads if h not in lacks or h not in self.variant.optional_heads)

    @property
    def n_drafted(self) -> int:
        """Tokens one full block proposes: B anchor-first, else B - 1."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def tensor_specs(self, required_only: bool = True) -> list[TensorSpec]:
        """The tensors of this draft (the backbone's and its heads')."""
        return [t for t in TENSORS if (t.required or not required_only) and (not t.head or t.head in self.heads)]

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_is_causal(self, il: int) -> bool:
        """The published rule: a sliding layer is causal, a full one is not, unless `causal`."""
        return bool(self.causal) if self.causal is not None else self.swa_layers[il]

    def layer_window(self, il: int) -> int | None:
        return self.sliding_window if self.swa_layers[il] else None

    def dims(self, n_vocab: int | None = None, n_vocab_draft: int | None = None) -> dict[str, int]:
        """The symbols of `expected_shape` (n_vocab_draft: a reduced vocabulary's size, else the whole
        vocabulary's: the rows of a DSpark draft's markov_w2)."""
        return {"n_embd": self.n_embd, "n_taps": self.n_taps, "n_head": self.n_head,
                "n_head_kv": self.n_head_kv, "head_dim": self.head_dim, "n_ff": self.n_ff,
                "n_vocab": n_vocab or self.n_vocab or 0, "conv_k": self.conv_kernel_size,
                "conv_groups": self.n_embd // self.conv_group_size if self.conv_group_size else 0,
                "selector_rank": self.selector_rank, "markov_rank": self.markov_rank,
                "n_vocab_draft": n_vocab_draft or n_vocab or self.n_vocab or 0}

    # --- config.json ------------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict, source: str = "config.json") -> DraftHParams:
        """Check a DFlash 1 draft's config.json and read it; errors are ValueErrors naming `source`.

        DFlash keys come from `dflash_config` first, then the top level (the published lookup
        order). Sliding attention is read as the pinned converter reads it: Qwen3Config nulls
        `sliding_window` unless `use_sliding_window` (or `dflash_config.use_swa`: every layer).
        """
        try:
            return cls(**_hf_fields(normalized_hf_config(config)))
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e

    def to_hf_config(self, torch_dtype: str = "bfloat16") -> dict:
        """config.json in the published format; `from_hf_config` reads it back to an equal object."""
        dflash: dict[str, Any] = {"mask_token_id": self.mask_token_id}
        if self.target_layer_ids is not None:
            dflash["target_layer_ids"] = list(self.target_layer_ids)
        if self.variant is DFLASH2:
            dflash.update(conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size,
                          selector_rank=self.selector_rank, selector_top_k=self.selector_top_k)
        architecture = self.variant.architecture
        if self.variant is DSPARK or self.sample_from_anchor:  # SpecForge's layout: the keys in dflash_config
            architecture = DSPARK.architecture
            dflash.update(markov_rank=self.markov_rank, markov_head_type="vanilla",
                          enable_confidence_head=self.has_confidence_head, confidence_head_with_markov=True,
                          sample_from_anchor=self.sample_from_anchor)
        dflash.update({k: v for k, v in (("input_embedding_scale", self.embedding_scale),
                                         ("output_multiplier", self.logit_scale),
                                         ("final_logit_softcapping", self.logit_softcap),
                                         ("attention_value_scale", self.value_scale)) if v is not None})
        config: dict[str, Any] = {
            "architectures": [architecture], "model_type": "qwen3",
            "hidden_size": self.n_embd, "intermediate_size": self.n_ff, "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head, "num_key_value_heads": self.n_head_kv,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_freq_base, "max_position_embeddings": self.n_ctx_train,
            "vocab_size": self.n_vocab, "tie_word_embeddings": False, "attention_bias": False,
            "attention_dropout": 0.0, "block_size": self.block_size, "num_target_layers": self.n_layer_target,
            "dflash_config": dflash, "torch_dtype": torch_dtype,
        }
        config = {k: v for k, v in config.items() if v is not None}
        if self.rope_linear_factor is not None:
            config["rope_parameters"] = {"rope_type": "linear", "factor": self.rope_linear_factor,
                                         "rope_theta": self.rope_freq_base}
        if self.n_rot is not None:
            config["partial_rotary_factor"] = self.n_rot / self.head_dim
        if not self.rope_neox:
            config["rope_is_neox_style"] = False
        if self.sliding_window is not None or any(self.swa_layers):
            config["layer_types"] = [SLIDING_ATTENTION if s else FULL_ATTENTION for s in self.swa_layers]
        if self.sliding_window is not None:
            config.update(sliding_window=self.sliding_window, use_sliding_window=True)
        if self.causal is not None:
            config["is_causal"] = self.causal
        return config

    # --- GGUF -------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, kv: dict[str, Any], source: str = "draft.gguf", tensors: dict[str, tuple] | None = None,
                  runtime: bool = True) -> DraftHParams:
        """Read DFlash GGUF metadata (`dflash.target_layers` holds ids + 1), refusing what `refuse`
        refuses; the defaults are llama.cpp's. `tensors`: every tensor's ggml shape, for what only
        the tensors say (a DSpark draft's Markov rank and confidence head)."""
        def need(key):
            if key not in kv:
                raise ValueError(f"missing GGUF key {key!r}")
            return kv[key]

        tensors = tensors or {}
        refuse(kv, list(tensors), source, runtime)
        try:
            n_embd, n_layer, n_head = int(need(EMBEDDING_LENGTH)), int(need(BLOCK_COUNT)), int(need(HEAD_COUNT))
            n_ff, rms_eps = int(need(FEED_FORWARD_LENGTH)), float(need(RMS_EPS))
            layers = [int(x) for x in need(TARGET_LAYERS)]
            if any(x < 1 for x in layers):
                raise ValueError(f"{TARGET_LAYERS} {layers} must all be >= 1 (they hold target layer ids + 1)")
            mask = need(MASK_TOKEN_ID)
            window, pattern = kv.get(SLIDING_WINDOW) or None, kv.get(SLIDING_WINDOW_PATTERN)
            if window and (pattern is None or len(pattern) != n_layer):
                raise ValueError(f"{SLIDING_WINDOW} needs a {SLIDING_WINDOW_PATTERN} with {n_layer} entries")
            tokens = kv.get("tokenizer.ggml.tokens")
            optional = {name: float(kv[key]) for name, key in (
                ("embedding_scale", EMBEDDING_SCALE), ("logit_scale", LOGIT_SCALE),
                ("logit_softcap", FINAL_LOGIT_SOFTCAPPING), ("value_scale", VALUE_SCALE)) if key in kv}
            if not optional.get("logit_softcap", 1.0) > 0:
                del optional["logit_softcap"]
            optional.update({name: int(kv[key]) for name, key in (
                ("conv_kernel_size", CONV_KERNEL_SIZE), ("conv_group_size", CONV_GROUP_SIZE),
                ("selector_rank", SELECTOR_RANK), ("selector_top_k", SELECTOR_TOP_K)) if key in kv})
            optional.update(_gguf_dspark_fields(kv, tensors))
            return cls(
                n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=int(kv.get(HEAD_COUNT_KV, n_head)),
                head_dim=int(kv.get(KEY_LENGTH, n_embd // n_head)), n_ff=n_ff, mask_token_id=int(mask),
                target_layer_ids=target_layer_ids_from_gguf(layers), n_vocab=None if tokens is None else len(tokens),
                block_size=int(kv.get(BLOCK_SIZE, 16)),
                n_ctx_train=int(kv[CONTEXT_LENGTH]) if CONTEXT_LENGTH in kv else None,
                rms_eps=rms_eps, rope_freq_base=float(kv.get(ROPE_FREQ_BASE, 10000.0)),
                rope_linear_factor=(float(kv.get(ROPE_SCALING_FACTOR, 1.0))
                                    if kv.get(ROPE_SCALING_TYPE) == "linear" else None),
                n_rot=int(kv[ROPE_DIMENSION_COUNT]) if ROPE_DIMENSION_COUNT in kv else None,
                causal=bool(kv[CAUSAL]) if CAUSAL in kv else None,
                sliding_window=int(window) if window else None,
                swa_layers=[bool(p) for p in pattern] if window else [], **optional)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e

    def to_gguf_kv(self, file_type: int | None = None, mrope: bool = False) -> list[tuple[str, Any]]:
        """The model keys in the order the pinned converter writes them (after general.*, before
        the tokenizer; the MASK token id goes after the tokenizer). `file_type` adds
        general.file_type and general.quantization_version; `mrope`: the target uses M-RoPE."""
        if self.target_layer_ids is None:
            raise ValueError("target_layer_ids must be resolved before writing GGUF metadata")
        kv: list[tuple[str, Any]] = [(BLOCK_COUNT, self.n_layer)]
        if self.n_ctx_train is not None:
            kv.append((CONTEXT_LENGTH, self.n_ctx_train))
        kv += [(EMBEDDING_LENGTH, self.n_embd), (FEED_FORWARD_LENGTH, self.n_ff), (HEAD_COUNT, self.n_head),
               (HEAD_COUNT_KV, self.n_head_kv)]
        if self.causal_at_top:  # the pinned base class writes this one early
            kv.append((CAUSAL, False))
        if self.rope_linear_factor is not None:
            kv += [(ROPE_SCALING_TYPE, "linear"), (ROPE_SCALING_FACTOR, self.rope_linear_factor)]
        kv += [(ROPE_FREQ_BASE, self.rope_freq_base), (RMS_EPS, self.rms_eps),
               (KEY_LENGTH, self.head_dim), (VALUE_LENGTH, self.head_dim)]
        kv += [(k, v) for k, v in ((GENERAL_FILE_TYPE, file_type), (ROPE_DIMENSION_COUNT, self.n_rot),
                                   (VALUE_SCALE, self.value_scale)) if v is not None]
        kv.append((BLOCK_SIZE, self.block_size))
        if self.variant is DFLASH2:
            kv += [(CONV_KERNEL_SIZE, self.conv_kernel_size), (CONV_GROUP_SIZE, self.conv_group_size),
                   (SELECTOR_RANK, self.selector_rank), (SELECTOR_TOP_K, self.selector_top_k)]
        kv += [(k, v) for k, v in ((LOGIT_SCALE, self.logit_scale), (FINAL_LOGIT_SOFTCAPPING, self.logit_softcap),
                                   (EMBEDDING_SCALE, self.embedding_scale)) if v is not None]
        kv.append((TARGET_LAYERS, target_layers_from_ids(self.target_layer_ids)))
        if self.sliding_window is not None:
            kv += [(SLIDING_WINDOW, self.sliding_window), (SLIDING_WINDOW_PATTERN, list(self.swa_layers))]
        if self.causal is not None and not self.causal_at_top:
            kv.append((CAUSAL, self.causal))
        if mrope:  # the draft ropes on the temporal section only
            kv.append((ROPE_DIMENSION_SECTIONS, [self.head_dim // 2, 0, 0, 0]))
        if self.variant is DSPARK or self.sample_from_anchor:  # both always: llama.cpp's defaults are true
            kv += [(SAMPLE_FROM_ANCHOR, self.sample_from_anchor), (HAS_CONFIDENCE_HEAD, self.has_confidence_head)]
        if file_type is not None:
            kv.append((GENERAL_QUANTIZATION_VERSION, GGML_QUANT_VERSION))
        return kv


def _gguf_dspark_fields(kv: dict[str, Any], tensors: dict[str, tuple]) -> dict[str, Any]:
    """A DSpark draft's rank (markov_w1's ne0, as the pinned loader reads it), its confidence head
    (conf_proj.weight present; `dflash.has_confidence_head` must agree) and its block layout
    (`dflash.sample_from_anchor`; missing: the variant's default, as the pinned loop reads it)."""
    w1 = tensors.get(DSPARK.marker)
    rank = int(w1[0]) if w1 is not None and len(w1) == 2 else 0
    if w1 is not None and not 0 < rank <= INT32_MAX:
        raise ValueError(f"tensor '{DSPARK.marker}' has shape {list(w1)}: expected [markov_rank, n_vocab]")
    scale = tensors.get(MARKOV_SCALE)
    if rank and scale is not None and not all(d == 1 for d in scale):
        raise ValueError(f"tensor '{MARKOV_SCALE}' has shape {list(scale)}: expected [1] (one factor)")
    has_conf = "conf_proj.weight" in tensors
    if rank and HAS_CONFIDENCE_HEAD in kv and bool(kv[HAS_CONFIDENCE_HEAD]) != has_conf:
        raise ValueError(f"'{HAS_CONFIDENCE_HEAD}' = {bool(kv[HAS_CONFIDENCE_HEAD])} but the draft "
                         f"{'has' if has_conf else 'has no'} conf_proj.weight")
    for key in (SAMPLE_FROM_ANCHOR, HAS_CONFIDENCE_HEAD):
        if key in kv and not isinstance(kv[key], (bool, np.bool_)):
            raise ValueError(f"'{key}' = {_show(kv[key])}: expected a bool")
    anchor_first = bool(kv.get(SAMPLE_FROM_ANCHOR, (DSPARK if rank else DFLASH1).anchor_first))
    return dict(markov_rank=rank, has_confidence_head=bool(rank) and has_conf, sample_from_anchor=anchor_first)


def markov_scale(values) -> float:
    """A DSpark draft's `markov_w2.scale` (its values, as read): the one finite factor on the Markov
    bias; ValueError in the words the runtime's loader uses."""
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"tensor '{MARKOV_SCALE}' has {flat.size} values: expected [1] (one factor)")
    if not math.isfinite(flat[0]):
        raise ValueError(f"tensor '{MARKOV_SCALE}' is {float(flat[0])}: expected a finite factor")
    return float(flat[0])


# --- reading config.json (errors say what is wrong; from_hf_config names the file) ----------------

INT32_MAX = 2**31 - 1
F32_MAX = 3.4028234663852886e38  # the largest finite float32: every float below is written as F32
# Every size and count of config.json, bounded before anything is sized by it (name: lowest, highest).
# Generous for every published model; a corrupt value is one error line, never a hang or a huge list.
HF_INTEGERS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 512),  # llama.cpp's LLAMA_MAX_LAYERS (src/llama-hparams.h)
    "num_target_layers": (1, 512),  # the target is a llama.cpp model too
    "num_attention_heads": (1, 1024),  # 8x the most published (DeepSeek-V3: 128)
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),  # 4x the largest published (Gemma 3: 256)
    "hidden_size": (1, 65536),  # 4x the largest published (Llama 3.1 405B: 16384)
    "intermediate_size": (1, 1 << 20),  # ~20x the largest published (Llama 3.1 405B: 53248)
    "vocab_size": (1, INT32_MAX),  # a llama_token is an int32
    "mask_token_id": (0, INT32_MAX),
    "block_size": (2, 1024),  # the runtime needs an anchor and a MASK; published drafts: 16
    "max_position_embeddings": (1, INT32_MAX),  # llama.cpp's n_ctx is an int32
    "sliding_window": (1, INT32_MAX),  # a context length
    "max_window_layers": (0, INT32_MAX),  # only compared with layer indices
    "target_layer_ids": (-INT32_MAX - 1, INT32_MAX),  # an INT32 GGUF array; the target bounds them further
    "conv_kernel_size": (1, 64),  # published: 2
    "conv_group_size": (1, 65536),  # published: 16; must divide hidden_size
    "selector_rank": (1, 65536),  # published: 256
    "selector_top_k": (1, 1024),  # published: 16
    "markov_rank": (0, 65536),  # published: 256; 0: no Markov head
}
MAX_TARGET_LAYER_IDS = 512  # one tap per target layer at most (LLAMA_MAX_LAYERS)
# Every float of config.json: finite, lowest < value <= highest, also once rounded to float32.
HF_NUMBERS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),  # published: 1e-6 .. 1e-5
    "rope_theta": (0.0, 1e12),  # published: 1e4 .. 1e7
    "rope factor": (0.0, 1e6),  # linear RoPE scaling; published: 2 .. 64
    "partial_rotary_factor": (0.0, 1.0),
    "final_logit_softcapping": (-F32_MAX, F32_MAX),  # <= 0: off
    "input_embedding_scale": (-F32_MAX, F32_MAX),
    "output_multiplier": (-F32_MAX, F32_MAX),
    "attention_value_scale": (-F32_MAX, F32_MAX),
}


def _show(v) -> str:
    """A config value as an error line shows it: its repr, at most 60 characters."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def hf_integer(name: str, v) -> int:
    """`v` checked as the config.json integer `name` (bounds: HF_INTEGERS); ValueError naming both."""
    lo, hi = HF_INTEGERS[name]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{name} = {_show(v)}: expected an integer in {lo}..{hi}")
    return v


def hf_number(name: str, v) -> float:
    """`v` checked as the config.json float `name` (bounds: HF_NUMBERS); ValueError naming both."""
    lo, hi = HF_NUMBERS[name]
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and lo < v <= hi
    if ok:  # in range as a float32 too (1e-50 is 0 there)
        x = float(v)
        ok = lo < struct.unpack("<f", struct.pack("<f", x))[0] <= hi
    if not ok:
        raise ValueError(f"{name} = {_show(v)}: expected a finite number in ({lo:g}, {hi:g}]")
    return x


def _flag(name: str, v) -> bool | None:
    """A JSON bool (null: not set); "false" or 0 are errors, not silently true or false."""
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"{name} = {_show(v)}: expected true or false")
    return v


def _object(name: str, v) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"{name} = {_show(v)}: expected a JSON object")
    return v


def _hf_kind(config: dict) -> tuple[Variant, dict]:
    """Refuse what is not a DFlash 1 or DFlash 2 config.json (z-lab's format: `normalized_hf_config`
    reads the others); its variant and `dflash_config`."""
    archs, dflash = config.get("architectures") or [], config.get("dflash_config")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"architectures = {_show(archs)}: expected a list of class names")
    known = {v.architecture: v for v in VARIANTS.values()} | {a: DSPARK for a in DSPARK_ARCHITECTURES}
    if archs and not any(a in known for a in archs):
        raise ValueError(f"unsupported architecture {archs}: expected one of {sorted(known)}")
    if not isinstance(dflash, dict):
        raise ValueError("no 'dflash_config': this is not a DFlash draft checkpoint")
    has_conv = "conv_kernel_size" in dflash or "conv_kernel_size" in config
    variant = next((known[a] for a in archs if a in known), DFLASH2 if has_conv else DFLASH1)
    if variant is DFLASH1 and has_conv:
        raise ValueError(f"conv_kernel_size in a {DFLASH1.architecture} config: a DFlash 2 draft says "
                         f"architectures [\"{DFLASH2.architecture}\"]")
    if (act := config.get("hidden_act", "silu")) != "silu":
        raise ValueError(f"hidden_act {_show(act)} is not supported (DFlash drafts use silu)")
    if _flag("attention_bias", config.get("attention_bias")):
        raise ValueError("attention_bias = true is not supported")
    return variant, dflash


# Qwen3Config's defaults (transformers 4.5x and 5.x): `speculators` writes its transformer_layer_config
# as a diff against them, so a value equal to its default is not in the file
# (tests/test_schema.py checks them against the installed transformers).
QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "use_sliding_window": False,
    "sliding_window": 4096, "max_window_layers": 28, "attention_bias": False,
}
SPECULATORS_TYPES = {"dflash": DFLASH1, "dflash2": DFLASH2, "dspark": DSPARK}  # speculators_model_type
# the defaults of speculators' DFlash(2)SpeculatorConfig (speculators 0.9.0)
_SPECULATORS_DEFAULTS: dict[str, Any] = {"block_size": 8, "sample_from_anchor": False,
                                         "conv_kernel_size": 2, "conv_group_size": 16,
                                         "selector_rank": 256, "selector_top_k": 16}
# DSpark's settings, with the defaults of speculators' DSparkSpeculatorConfig (DeepSpec's and
# SpecForge's configs agree, and they are what the pinned converter assumes)
DSPARK_DEFAULTS: dict[str, Any] = {"sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla",
                                   "enable_confidence_head": True, "confidence_head_with_markov": True}
# DeepSpec's top-level DFlash settings (its config is the target's with these added)
_DEEPSPEC_KEYS = ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers", *DSPARK_DEFAULTS)


# a DeepSeek-V4 DSpark checkpoint's own keys (hyper-connections; its block size, mask and taps under
# their own names: the pinned converter's DeepseekV4DSparkModel): refused wherever a config holds them,
# never ignored (a Qwen3 reading of such a draft would be silently wrong)
DEEPSEEK_V4_HF_KEYS = ("hc_mult", "hc_sinkhorn_iters", "hc_eps", "dspark_block_size", "dspark_noise_token_id",
                       "dspark_target_layer_ids")


def _refuse_deepseek_v4(config: dict) -> None:
    """ValueError naming the first DeepSeek-V4 key (not null) at the top level, in dflash_config or in
    speculators' transformer_layer_config."""
    for where in ("", "dflash_config", "transformer_layer_config"):
        node = config.get(where) if where else config
        if not isinstance(node, dict):
            continue
        key = next((k for k in DEEPSEEK_V4_HF_KEYS if node.get(k) is not None), None)
        if key is not None:
            raise ValueError(f"{where + '.' if where else ''}{key} = {_show(node[key])}: DSpark drafts on a "
                             "DeepSeek-V4 backbone (hyper-connections) are not supported")


def checkpoint_format(config: dict) -> str:
    """Which format a draft's config.json is in: "speculators" (vLLM's), "deepspec" (DeepSeek's
    `Qwen3DSparkModel`: DFlash keys at the top level, no dflash_config) or "z-lab" (the published
    DFlash format, which our trainer and SpecForge write too)."""
    if not isinstance(config, dict):
        return "z-lab"
    if "speculators_model_type" in config:
        return "speculators"
    archs = config.get("architectures")
    if isinstance(archs, list) and "Qwen3DSparkModel" in archs and "dflash_config" not in config:
        return "deepspec"
    return "z-lab"


def normalized_hf_config(config: dict) -> dict:
    """config.json in z-lab's format: a speculators one rewritten (its transformer_layer_config with
    Qwen3Config's defaults at the top level, the DFlash keys in `dflash_config`, its
    `aux_hidden_state_layer_ids` (hidden-state indices) as target_layer_ids = ids - 1, its
    `sliding_window_non_causal` as is_causal); a DeepSpec one with its top-level DFlash keys in
    `dflash_config`; a z-lab one as it is. ValueError for what cannot be."""
    if isinstance(config, dict):
        _refuse_deepseek_v4(config)
    if checkpoint_format(config) == "deepspec":
        dflash = {k: config[k] for k in _DEEPSPEC_KEYS if k in config}
        return {**config, "architectures": [DSPARK.architecture], "dflash_config": dflash}
    if checkpoint_format(config) != "speculators":
        return config
    kind = config["speculators_model_type"]
    if not isinstance(kind, str) or kind not in SPECULATORS_TYPES:  # a list or an object: unhashable
        raise ValueError(f"speculators_model_type = {_show(kind)} is not supported "
                         f"(only {', '.join(sorted(SPECULATORS_TYPES))})")
    variant = SPECULATORS_TYPES[kind]
    defaults = {**_SPECULATORS_DEFAULTS, **(DSPARK_DEFAULTS if variant is DSPARK else {})}
    value = lambda name: config.get(name, defaults.get(name))  # noqa: E731
    if variant is not DSPARK and _flag("sample_from_anchor", value("sample_from_anchor")):
        raise ValueError("sample_from_anchor = true (an anchor-first block, as DSpark drafts) is not "
                         f"supported for {variant.title} drafts")
    layer = _object("transformer_layer_config", config.get("transformer_layer_config"))
    if (model_type := layer.get("model_type", "qwen3")) != "qwen3":  # QWEN3_DEFAULTS fill its gaps
        raise ValueError(f"transformer_layer_config.model_type = {_show(model_type)} is not supported "
                         "(only qwen3, the class speculators' DFlash drafts are built with)")
    out = {**QWEN3_DEFAULTS, **{k: v for k, v in layer.items() if k not in ("architectures", "is_causal")}}
    target_hidden = config.get("target_hidden_size")
    if target_hidden is not None and target_hidden != out["hidden_size"]:
        raise ValueError(f"target_hidden_size {_show(target_hidden)} differs from the draft's hidden size "
                         f"{out['hidden_size']}: not supported")
    dflash: dict[str, Any] = {"block_size": value("block_size"), "mask_token_id": config.get("mask_token_id")}
    aux = config.get("aux_hidden_state_layer_ids")
    if aux is None:  # speculators cannot build the draft without them: no default rule to apply
        raise ValueError("no aux_hidden_state_layer_ids: a speculators draft lists the target hidden states "
                         "it was trained on")
    if not isinstance(aux, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        raise ValueError(f"aux_hidden_state_layer_ids = {_show(aux)}: expected a list of integers")
    dflash["target_layer_ids"] = [i - 1 for i in aux]
    if variant is DFLASH2:
        dflash.update({k: value(k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                              "selector_top_k")})
    if variant is DSPARK:
        dflash.update({k: value(k) for k in DSPARK_DEFAULTS})
    non_causal = _flag("sliding_window_non_causal", config.get("sliding_window_non_causal", variant is DFLASH2))
    if non_causal:  # full layers are never causal there
        out["is_causal"] = False
    out.update(architectures=[variant.architecture], dflash_config=dflash, block_size=dflash["block_size"])
    if (draft_vocab := config.get(DRAFT_VOCAB_SIZE)) is not None and draft_vocab != out["vocab_size"]:
        out[DRAFT_VOCAB_SIZE] = draft_vocab
    return out


def _hf_rope(config: dict) -> tuple[str, dict]:
    """(RoPE type, its parameters): rope_parameters (per attention type since transformers 5), else
    rope_scaling."""
    name = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    rope = _object(name, config.get(name) if config.get(name) is not None else {})
    if "full_attention" in rope:
        rope = _object(f"{name}.full_attention", rope["full_attention"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ValueError(f"RoPE type {_show(rope_type)} is not supported (only default and linear)")
    return rope_type, rope


def _hf_fields(config: dict) -> dict[str, Any]:
    """DraftHParams fields from a DFlash 1 config.json, with Qwen3Config's defaults; every value is
    type-checked and bounded (HF_INTEGERS, HF_NUMBERS) before anything is sized by it."""
    variant, dflash = _hf_kind(config)

    def value(name: str, default=None):  # dflash_config first, then the top level (the published order)
        return dflash.get(name, config.get(name, default))

    def required(name: str) -> int:
        if name not in config:
            raise ValueError(f"missing {name}")
        return hf_integer(name, config[name])

    def optional(check, name: str, v):
        return None if v is None else check(name, v)

    n_layer, n_head = required("num_hidden_layers"), required("num_attention_heads")
    rope_type, rope = _hf_rope(config)
    head_dim = hf_integer("head_dim", config.get("head_dim", 128))  # Qwen3Config's default
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    window, swa_layers = _hf_sliding(config, dflash, n_layer)
    top_causal = _flag("is_causal", config.get("is_causal"))  # wins over dflash_config.causal
    causal = top_causal if top_causal is not None else _flag("dflash_config.causal", dflash.get("causal"))
    softcap = optional(hf_number, "final_logit_softcapping", value("final_logit_softcapping"))
    n_kv = config.get("num_key_value_heads")  # Qwen3Config: null is n_head
    n_embd, n_head_kv = required("hidden_size"), n_head if n_kv is None else hf_integer("num_key_value_heads", n_kv)
    n_ff, mask = required("intermediate_size"), value("mask_token_id")
    if mask is None:
        raise ValueError("no mask_token_id (dflash_config.mask_token_id)")
    n_vocab, n_layer_target = config.get("vocab_size"), value("num_target_layers")
    neox = _flag("rope_is_neox_style", config.get("rope_is_neox_style"))
    return dict(
        n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff,
        mask_token_id=hf_integer("mask_token_id", mask), target_layer_ids=_hf_target_layer_ids(value),
        n_vocab=optional(hf_integer, "vocab_size", n_vocab),
        n_layer_target=optional(hf_integer, "num_target_layers", n_layer_target),
        block_size=hf_integer("block_size", value("block_size", 16)),
        n_ctx_train=hf_integer("max_position_embeddings", config.get("max_position_embeddings", 32768)),
        rms_eps=hf_number("rms_norm_eps", config.get("rms_norm_eps", 1e-6)),
        rope_freq_base=hf_number("rope_theta", rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rope_linear_factor=(hf_number("rope factor", rope["factor"])
                            if rope_type == "linear" and "factor" in rope else None),
        n_rot=None if partial is None else int(head_dim * hf_number("partial_rotary_factor", partial)),
        rope_neox=neox is not False, causal=causal, sliding_window=window, swa_layers=swa_layers,
        embedding_scale=optional(hf_number, "input_embedding_scale", value("input_embedding_scale")),
        logit_scale=optional(hf_number, "output_multiplier", value("output_multiplier")),
        logit_softcap=softcap if softcap is not None and softcap > 0 else None,
        value_scale=optional(hf_number, "attention_value_scale", dflash.get("attention_value_scale")),
        causal_at_top=top_causal is False, **_hf_variant_fields(variant, value))


def _hf_variant_fields(variant: Variant, value) -> dict[str, Any]:
    """The DFlash 2 sizes (missing ones are an error, not a default: published heads differ); a
    DSpark-family draft's heads and block layout (DSPARK_DEFAULTS)."""
    if variant is DSPARK:
        return _hf_dspark_fields(value)
    if variant is not DFLASH2:
        return {}
    out = {}
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if value(name) is None:
            raise ValueError(f"a DFlash 2 config needs dflash_config.{name}")
        out[name] = hf_integer(name, value(name))
    return out


def _hf_dspark_fields(value) -> dict[str, Any]:
    """markov_rank (0: DeepSpec's anchor-first "DFlash"), the confidence head, the block layout;
    only the vanilla Markov head and a confidence head reading the Markov row, as the pinned
    llama.cpp runs them."""
    setting = lambda name: value(name) if value(name) is not None else DSPARK_DEFAULTS[name]  # noqa: E731
    rank = setting("markov_rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= HF_INTEGERS["markov_rank"][1]:
        raise ValueError(f"markov_rank = {_show(rank)}: expected an integer in 0..{HF_INTEGERS['markov_rank'][1]}")
    if (kind := setting("markov_head_type")) != "vanilla" and rank:
        raise ValueError(f"markov_head_type = {_show(kind)} is not supported (only vanilla, as the pinned "
                         "llama.cpp runs it)")
    confidence = bool(rank) and _flag("enable_confidence_head", setting("enable_confidence_head"))
    if confidence and not _flag("confidence_head_with_markov", setting("confidence_head_with_markov")):
        raise ValueError("confidence_head_with_markov = false is not supported (the pinned llama.cpp's "
                         "confidence head reads [hidden ; markov_w1 row])")
    return dict(markov_rank=rank, has_confidence_head=confidence,
                sample_from_anchor=_flag("sample_from_anchor", setting("sample_from_anchor")))


def _hf_target_layer_ids(value) -> list[int] | None:
    """`target_layer_ids`: None (the default rule applies) or 1..MAX_TARGET_LAYER_IDS integers."""
    ids = value("target_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_TARGET_LAYER_IDS:
        raise ValueError(f"target_layer_ids = {_show(ids)}: expected a list of 1..{MAX_TARGET_LAYER_IDS} "
                         "target layer ids")
    return [hf_integer("target_layer_ids", i) for i in ids]


def _hf_sliding(config: dict, dflash: dict, n_layer: int) -> tuple[int | None, list[bool]]:
    """(window or None, per-layer sliding flags), Qwen3Config's defaults for `layer_types`."""
    use_swa = _flag("dflash_config.use_swa", dflash.get("use_swa"))
    enabled = _flag("use_sliding_window", config.get("use_sliding_window")) or use_swa
    window = (dflash.get("swa_window_size") or config.get("sliding_window")) if enabled else None
    window = None if window in (None, 0) else hf_integer("sliding_window", window)
    if use_swa and window:
        return window, [True] * n_layer
    layer_types = config.get("layer_types")
    if layer_types is None or layer_types == []:
        first_swa = hf_integer("max_window_layers", config.get("max_window_layers", 28))
        layer_types = [SLIDING_ATTENTION if window is not None and i >= first_swa else FULL_ATTENTION
                       for i in range(n_layer)]
    if not isinstance(layer_types, list):
        raise ValueError(f"layer_types = {_show(layer_types)}: expected a list of {n_layer} layer types")
    if len(layer_types) != n_layer:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {n_layer} layers")
    for t in layer_types:
        if t not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise ValueError(f"layer type {_show(t)} is not supported "
                             f"(only {FULL_ATTENTION!r} and {SLIDING_ATTENTION!r})")
    return window, [t == SLIDING_ATTENTION for t in layer_types]
