// A DFlash-family draft read from GGUF: hyper-parameters, weights in a backend buffer, checks against
// the target. A DFlash 2 draft adds grouped dynamic convolutions to every layer and a candidate
// selector, a DSpark draft a Markov head and optionally a confidence head (draft_variant); a draft
// of either DFlash 1 or DSpark may draft anchor-first (draft_hparams::sample_from_anchor). The draft owns no token embedding: it borrows the target's (see
// draft_graph.h), so a draft for another target is refused here with both values named. Its LM head
// is the target's too, unless it has a reduced vocabulary: its own `output.weight` over n_draft_vocab
// rows, and `d2t` mapping row i to target token d2t[i] (absolute ids, as the pinned `dflash` graph
// reads them).
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <string>
#include <vector>

struct llama_model;

namespace dflash {

// The heads a variant adds to the DFlash 1 backbone.
enum class draft_head { backbone, conv, selector, markov, confidence };

// A kind of DFlash-family draft, mirroring dflash_llama/schema.py (`Variant`, `DFLASH1`, `DFLASH2`,
// `DSPARK`): the heads it adds to the DFlash 1 backbone (a DSpark draft may lack its confidence
// head), the GGUF keys it needs, all present and > 0, and the tensor whose presence says it. The one
// C++ place that knows variants; everything else asks draft_hparams::variant().
struct draft_variant {
    const char * name;   // as the CLI and the reports spell it
    const char * title;  // as prose spells it
    std::vector<draft_head>   heads;
    std::vector<const char *> keys;
    const char * marker = "";    // the tensor that says this variant (DSpark's markov_w1.weight)
    bool anchor_first   = false; // the block layout when a draft does not say (dflash.sample_from_anchor)

    bool has(draft_head head) const;
};

extern const draft_variant DFLASH1;
extern const draft_variant DFLASH2;
extern const draft_variant DSPARK;

struct draft_hparams {
    int32_t n_embd     = 0;
    int32_t n_layer    = 0;
    int32_t n_head     = 0;
    int32_t n_head_kv  = 0;
    int32_t head_dim   = 0;   // dflash.attention.key_length
    int32_t n_ff       = 0;
    int32_t n_vocab    = 0;   // tokens in the draft's tokenizer (must equal the target's)
    int32_t block_size = 0;
    float   rope_freq_base = 10000.0f;
    float   rope_freq_scale = 1.0f;         // linear RoPE scaling: 1 / dflash.rope.scaling.factor
    float   rms_eps        = 1e-6f;
    float   embedding_scale = 1.0f;     // dflash.embedding_scale (input_embedding_scale)
    float   logit_scale     = 1.0f;     // dflash.logit_scale (output_multiplier)
    float   logit_softcap   = 0.0f;     // dflash.final_logit_softcapping, 0 = off
    int32_t causal          = -1;       // dflash.attention.causal: -1 absent (per layer: SWA layers causal), 0/1 all layers
    int32_t sliding_window  = 0;        // 0 = none
    std::vector<bool>    swa_layers;    // per layer: sliding-window (and causal) attention
    std::vector<int32_t> target_layer_ids;  // HF ids: the GGUF stores ids + 1
    int32_t mask_token_id = -1;
    // DFlash 2 (0: a DFlash 1 draft; all four or none): convolution taps and channels per dynamic
    // coefficient, selector rank and candidates per drafted slot
    int32_t conv_kernel_size = 0;  // dflash.conv_kernel_size
    int32_t conv_group_size  = 0;  // dflash.conv_group_size, divides n_embd
    int32_t selector_rank    = 0;  // dflash.selector_rank
    int32_t selector_top_k   = 0;  // dflash.selector_top_k
    // DSpark (0: none): the Markov head's rank (markov_w1's ne0: no key), and its confidence head
    int32_t markov_rank         = 0;
    bool    has_confidence_head = false;
    // the block layout (dflash.sample_from_anchor; missing: the variant's): anchor-first, the block
    // [anchor, MASK x (B-1)] drafts B tokens, slot k the token after anchor + k; else slot 0 is the
    // anchor only and B inputs draft B - 1 (DFlash's layout)
    bool    sample_from_anchor  = false;

    int32_t n_taps() const { return (int32_t) target_layer_ids.size(); }
    const draft_variant & variant() const {
        return conv_kernel_size > 0 ? DFLASH2 : markov_rank > 0 ? DSPARK : DFLASH1;
    }
    int32_t conv_groups() const { return conv_group_size > 0 ? n_embd / conv_group_size : 0; }
    // the block position of the first drafted slot, and the most tokens a block of `block` drafts
    int32_t first_draft_slot() const { return sample_from_anchor ? 0 : 1; }
    int32_t max_draft(int32_t block) const { return block - first_draft_slot(); }
};

struct draft_layer {
    ggml_tensor * attn_norm   = nullptr;
    ggml_tensor * wq          = nullptr;
    ggml_tensor * wk          = nullptr;
    ggml_tensor * wv          = nullptr;
    ggml_tensor * wo          = nullptr;
    ggml_tensor * attn_q_norm = nullptr;
    ggml_tensor * attn_k_norm = nullptr;
    ggml_tensor * ffn_norm    = nullptr;  // post-attention norm
    ggml_tensor * ffn_gate    = nullptr;
    ggml_tensor * ffn_up      = nullptr;
    ggml_tensor * ffn_down    = nullptr;
    // DFlash 2: static taps [n_embd, K, 2] (f32; side 0 the input side, 1 the output side) and the
    // projection to dynamic taps [n_embd, 2*K*groups], around attention and around the MLP
    ggml_tensor * attn_conv_base = nullptr;
    ggml_tensor * attn_conv_proj = nullptr;
    ggml_tensor * ffn_conv_base  = nullptr;
    ggml_tensor * ffn_conv_proj  = nullptr;
};

struct draft_model {
    std::string   path;
    draft_hparams hparams;

    ggml_tensor * fc          = nullptr;  // [n_taps * n_embd, n_embd]
    ggml_tensor * hidden_norm = nullptr;  // enc.output_norm
    ggml_tensor * output_norm = nullptr;
    std::vector<draft_layer> layers;
    ggml_tensor * output      = nullptr;  // reduced vocabulary only: [n_embd, n_draft_vocab]
    ggml_tensor * d2t         = nullptr;  // reduced vocabulary only: i64 [n_draft_vocab]
    std::vector<int32_t> d2t_ids;         // its values, on the host
    // DFlash 2's selector: codebooks A and B [rank, n_vocab] (rows by target token, in their stored
    // type, in host memory whatever the draft's device: only the host reads them, a few rows per
    // drafted slot) and the gate projection [n_embd, rank] (in the graph)
    ggml_tensor * selector_predecessor = nullptr;
    ggml_tensor * selector_successor   = nullptr;
    ggml_tensor * selector_hidden      = nullptr;
    // DSpark's Markov head W1 [rank, n_vocab] (rows by target token), W2 [rank, n_vocab] (rows by draft
    // token: a reduced vocabulary's n_draft_vocab rows), the optional factor on W2's product [1] (f32,
    // finite) and the confidence head [n_embd + rank, 1] + bias [1]: in host memory, read by the
    // host's chain (markov.h)
    ggml_tensor * markov_w1   = nullptr;
    ggml_tensor * markov_w2   = nullptr;
    ggml_tensor * markov_w2_s = nullptr;
    ggml_tensor * conf_proj   = nullptr;
    ggml_tensor * conf_proj_b = nullptr;

    bool reduced_vocab() const { return d2t != nullptr; }

    ggml_context *        ctx = nullptr;       // tensor metadata
    ggml_backend_buffer_t buf = nullptr;       // tensor data
    ggml_backend_buffer_t host_buf = nullptr;  // the selector's codebooks, the DSpark heads (host memory)

    draft_model() = default;
    draft_model(const draft_model &) = delete;
    draft_model & operator=(const draft_model &) = delete;
    ~draft_model();
};

// Reads a DFlash GGUF (ours or llama.cpp's converter output) into a buffer of `buft`.
// Throws std::invalid_argument naming the path and what is wrong.
void load_draft(draft_model & draft, const std::string & path, ggml_backend_buffer_type_t buft);

// Refuses a draft that does not fit the target: hidden size, vocabulary (the selector's codebooks'
// too), target layers within the target's depth, mask token and d2t ids within the vocabulary.
// Throws std::invalid_argument.
void check_draft_fits_target(const draft_model & draft, const llama_model * target);

// Row `row` of a 2-D tensor in host memory as f32 (ne0 values), dequantised from its stored type.
void host_row(const ggml_tensor * t, int64_t row, float * out);

} // namespace dflash
