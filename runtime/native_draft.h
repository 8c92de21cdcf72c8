// llama.cpp's own DFlash draft (arch `dflash`, src/models/dflash.cpp of the pinned tree) as a peer
// for the parity harness: the draft GGUF loaded as a llama.cpp model, a draft context whose
// `ctx_other` is our target's context (it borrows the target's token embeddings and head), driven
// the way the pinned common/speculative.cpp `draft-dflash` drives it:
//
//   1. an embd batch of target features at positions 0..n-1: the decoder graph's fused path
//      (fc, hidden_norm, per layer K/V written into llama.cpp's KV cache);
//   2. a token batch of the block at positions n..n+B-1 with logits on, under the attention mode
//      `draft-dflash` sets (llama_set_causal_attn(ctx, dflash.attention.causal), default off); for a
//      DFlash 2 draft (dflash.selector.top_k > 0) with logits off and nextn embeddings unmasked, the
//      selector's packed lattice read back with llama_get_embeddings_nextn as `dflash2_lattice`;
//      for a DSpark draft (a `markov_w1.weight`, which makes the tool pick `draft-dspark`) with
//      nextn embeddings on and masked, as `draft-dspark` sets them, and read back as that loop reads
//      them: the biased logits of the drafted slots (from slot 0 when `dflash.sample_from_anchor`,
//      missing or "true", else from slot 1) through llama_get_logits as `biased_logits`, each
//      slot's confidence as the first column of its nextn row as `confidence` (with `conf_proj`).
//      The Markov head's own tensors are not named in llama.cpp's graph: each slot's bias is the
//      graph's product with `markov_w2.weight` (`markov_bias`; times `markov_w2.scale`, scattered
//      through `d2t` when the draft has them: the graph's last such node) and the token it conditions
//      on the row index of its get_rows from `markov_w1.weight` (`markov_prev`), both read in the
//      eval callback as the graph computes them.
//
// Every tensor of the shared vocabulary is read through the context's eval callback. The decoder
// graph has no `fc_out` (it names only the normed `inp_g_embeddings`); `fc_out` is read from one
// extra pass of llama.cpp's DFlash encoder graph (llama_process ENCODE) over the same features, a
// graph the `draft-dflash` loop itself never runs.
#pragma once

#include "draft_graph.h"  // traced_tensor, draft_trace
#include "target.h"

#include "llama.h"

#include <string>
#include <vector>

namespace dflash {

struct native_draft_params {
    std::string path;
    int32_t     n_ctx     = 512;   // positions of the draft context (features + block)
    int32_t     n_threads = 0;     // 0: the target context's
};

class native_draft {
public:
    // `target` must outlive this object: its context is the draft context's ctx_other.
    native_draft(const native_draft_params & params, target_runner & target);
    ~native_draft();
    native_draft(const native_draft &) = delete;
    native_draft & operator=(const native_draft &) = delete;

    // Every named intermediate for context features ([n_ctx_tokens, n_taps * n_embd_target],
    // positions 0..) and a block at the following positions. The draft KV cache is cleared before
    // and after. Shapes as ggml's ne (ne0 first, trailing 1s dropped), like draft_runner's trace.
    draft_trace trace(const std::vector<float> & features, int32_t n_ctx_tokens, const std::vector<int32_t> & block);

    // dflash.target_layers as llama.cpp read them (ids + 1: it captures layer inputs)
    const std::vector<int32_t> & target_layers() const { return target_layers_; }
    int32_t mask_token_id() const { return mask_token_id_; }
    int32_t block_size()    const { return block_size_; }
    bool    causal()        const { return causal_; }
    int32_t selector_top_k() const { return selector_top_k_; }  // 0: DFlash 1
    bool    dspark()        const { return dspark_; }              // a Markov head: draft-dspark
    bool    sample_from_anchor() const { return sample_from_anchor_; }  // as llama.cpp reads the key
    int32_t n_ctx()         const { return n_ctx_; }

private:
    static bool on_eval(struct ggml_tensor * t, bool ask, void * user_data);
    traced_tensor read_lattice(int32_t n_block) const;
    void read_dspark(int32_t n_block, draft_trace & out) const;

    target_runner &      target_;
    llama_model *        model_ = nullptr;
    llama_context *      ctx_   = nullptr;
    std::vector<int32_t> target_layers_;
    int32_t              mask_token_id_ = -1;
    int32_t              block_size_    = 16;
    bool                 causal_        = false;
    int32_t              selector_top_k_ = 0;
    bool                 dspark_ = false, has_confidence_ = false, sample_from_anchor_ = true;
    bool                 markov_scaled_ = false, reduced_vocab_ = false;  // markov_w2.scale, d2t: the bias's last node
    int32_t              n_ctx_ = 0, n_ubatch_ = 0, n_embd_in_ = 0;

    draft_trace *        recording_ = nullptr;  // where on_eval stores tensors; null: record nothing
    bool                 encoding_  = false;    // the encoder pass keeps only fc_out
    // DSpark: the Markov head's per-slot biases and the tokens they condition on, in graph order
    std::vector<std::vector<float>> markov_bias_;
    std::vector<int32_t>            markov_prev_;
};

} // namespace dflash
