// The DFlash draft as our own ggml graphs, in two passes over one draft KV cache:
//
//   inject(features, pos0, n):  c = hidden_norm(fc(features)); per layer K = rope(k_norm(Wk c)),
//                               V = Wv c, written into the cache at positions pos0..pos0+n-1
//   forward_block(tokens, start): the block [last token, MASK, ...] at positions start.., its
//                               queries attending to cache[0, start) and to the whole block,
//                               final norm, logits for the drafted slots (block positions 1..B-1,
//                               or 0..B-1 for an anchor-first draft; or fewer) through the target's
//                               output head
//
// A DFlash 2 draft wraps attention and the MLP of every block layer in grouped dynamic causal
// convolutions (conv(): the input side on the sublayer's normed input, the output side on its
// output, with the same dynamic taps; never across the block start, never on the injected context),
// and its block forward also returns the selector's gate, selector_hidden @ result_norm, of the
// drafted slots (selector.h chooses the tokens).
//
// Traced `result_output` is the raw head output of all block positions, as in llama.cpp's graph;
// the logits returned for positions 1.. have dflash.logit_scale and the soft-cap applied.
// With a compact head, generation reads a Q4_0 copy of the head (made at load): on a CPU the head is
// the largest read of a draft step, and a draft's proposals only need its argmax; exactness does not
// depend on it (the target verifies). Traces always use the head itself.
// A draft with a reduced vocabulary (d2t) multiplies by its own head of n_head_rows() rows: its logits
// are over those rows, row r standing for target token token_of_row(r). Traced `result_output` is
// scattered into the target's vocabulary (-inf elsewhere), as llama.cpp's graph does.
// The block's own K/V are written to the cache only past the cached context, where attention reads
// them as one view and the next injection overwrites them (the published loop crops them away), so
// cropping the cache after a rejection is only `crop(n)`. Token embeddings and the LM head are the
// target's tensors, used in place. Every intermediate is named as in llama.cpp's `dflash` graph
// (the vocabulary parity compares, docs/parity.md) and can be read back with a trace.
#pragma once

#include "draft_model.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <map>
#include <string>
#include <vector>

struct llama_model;

namespace dflash {

// A named intermediate read back from a graph: ggml shape (ne0 first) and f32 data.
struct traced_tensor {
    std::vector<int64_t> shape;
    std::vector<float>   data;
};
using draft_trace = std::map<std::string, traced_tensor>;

// What a block forward returns for its n drafted slots (from draft_hparams::first_draft_slot()):
// logits [n, n_head_rows()] (logit_scale and the soft-cap applied); for a DFlash 2 draft the
// selector's gate [n, selector_rank], for a draft with a confidence head the slots' result_norm
// [n, n_embd] (else empty).
struct block_output {
    std::vector<float> logits;
    std::vector<float> gate;
    std::vector<float> hidden;
};

// The device the draft runs on beside `target`: the GPU holding the target's output head, or
// nullptr (the CPU). The draft's weights belong in a buffer of that device.
ggml_backend_dev_t draft_device(const llama_model * target);

class draft_runner {
public:
    // n_ctx: the most positions the draft cache holds (the target context size). compact_head: a
    // Q4_0 copy of the target's head for generation, when the target's is larger and in host memory
    // (CPU only). device: where the graphs run and the cache lives (nullptr: the CPU backend).
    draft_runner(const draft_model & draft, const llama_model * target, int32_t n_ctx, int32_t n_threads,
                 bool compact_head = false, ggml_backend_dev_t device = nullptr);
    ~draft_runner();
    draft_runner(const draft_runner &) = delete;
    draft_runner & operator=(const draft_runner &) = delete;

    // Projects target features of n tokens ([n, n_taps * n_embd], row-major) into the cache at
    // positions pos0.. ; pos0 must equal n_cached() (the cache holds a contiguous prefix).
    void inject(const float * features, int32_t n, int32_t pos0, draft_trace * trace = nullptr);

    // Runs the block (n_block tokens at positions start..start+n_block-1; start == n_cached()) and
    // writes the outputs of the first n_logits drafted slots into `out` (row-major): block positions
    // 1..n_logits, or 0..n_logits-1 anchor-first; n_logits -1: all the block drafts.
    void forward_block(const int32_t * tokens, int32_t n_block, int32_t start, block_output & out,
                       draft_trace * trace = nullptr, int32_t n_logits = -1);

    // Forgets cached context at positions >= n.
    void crop(int32_t n);

    // CPU threads of the graphs from now on.
    void set_threads(int32_t n_threads);

    int32_t n_cached() const { return n_cached_; }
    int32_t n_vocab()  const { return n_vocab_; }       // the target's vocabulary (block tokens)
    int32_t n_head_rows() const { return n_head_rows_; } // logits per position: n_vocab, or the d2t size
    int32_t token_of_row(int32_t r) const { return draft_.reduced_vocab() ? draft_.d2t_ids[r] : r; }
    bool    compact_head() const { return head_ != output_; }
    const draft_hparams & hparams() const { return draft_.hparams; }
    const draft_model &   model() const { return draft_; }

private:
    struct graph_ctx;

    ggml_tensor * rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * gain) const;
    ggml_tensor * rope(ggml_context * ctx, ggml_tensor * x, ggml_tensor * pos) const;
    ggml_tensor * attention_mask(graph_ctx & g, int32_t n_kv, int32_t n_block, bool causal, int32_t window);
    ggml_tensor * conv(ggml_context * ctx, ggml_tensor * y, ggml_tensor * dynamic, ggml_tensor * base, int side) const;
    void store_kv(graph_ctx & g, int32_t il, ggml_tensor * k, ggml_tensor * v, int32_t pos0, int32_t n);
    void copy_to_host();
    void scatter_to_vocab(traced_tensor & t) const;
    void make_compact_head();
    void compute(graph_ctx & g, draft_trace * trace);

    const draft_model & draft_;
    ggml_tensor *       tok_embd_;  // the target's, in place
    ggml_tensor *       output_;    // the target's, in place; or the draft's own (reduced vocabulary)
    ggml_tensor *       head_;      // what generation multiplies by: output_, or its Q4_0 copy
    int32_t             n_vocab_;
    int32_t             n_head_rows_;
    int32_t             n_ctx_;
    int32_t             n_cached_ = 0;

    ggml_backend_t        backend_cpu_ = nullptr;
    ggml_backend_t        backend_     = nullptr;  // where the graphs run: backend_cpu_ or a GPU's
    ggml_backend_sched_t  sched_       = nullptr;
    ggml_context *        kv_ctx_      = nullptr;
    ggml_backend_buffer_t kv_buf_      = nullptr;
    ggml_context *        host_ctx_    = nullptr;  // host copies of device-resident target tensors
    ggml_backend_buffer_t host_buf_    = nullptr;
    ggml_context *        head_ctx_    = nullptr;  // the compact head, if any
    ggml_backend_buffer_t head_buf_    = nullptr;
    std::vector<ggml_tensor *> cache_k_;  // per layer [head_dim, n_head_kv, n_ctx]
    std::vector<ggml_tensor *> cache_v_;  // per layer [n_ctx, head_dim, n_head_kv] (transposed)
    std::vector<uint8_t>  graph_meta_;     // scratch for graph metadata, reused
};

} // namespace dflash
