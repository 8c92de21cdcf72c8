// The target: a GGUF model run by llama.cpp, one sequence (or n_seq side by side, for batched
// autoregressive generation), with the draft's features captured as it decodes. Capture reads, through the context's eval callback, the output of each tapped layer
// (`l_out-L`, which is the input of layer L+1) and, for a tap on the last layer, `result_norm`:
// the same tensors Hugging Face returns as hidden_states[L+1]. It works for every architecture
// whose llama.cpp graph names its layer outputs `l_out-L`, and needs no change to llama.cpp.
#pragma once

#include "llama.h"

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace dflash {

class output_head;

// Why n_gpu_layers / -ngl cannot offload in a CPU-only build (every tool says it in these words).
inline constexpr const char * kNoGpuBackend = "this build has no GPU backend (build with GGML_CUDA=ON ./setup.sh)";

struct target_params {
    std::string path;
    int32_t n_ctx        = 4096;
    int32_t n_batch      = 512;
    int32_t n_threads    = 0;   // 0: all hardware threads
    int32_t n_gpu_layers = 0;
    bool    kv_f32       = false;  // f32 KV cache (parity runs); llama.cpp's default is f16
    int32_t n_seq        = 1;      // sequences decoded side by side (batched generation); n_ctx is per sequence
    bool    own_head     = true;   // our output head where the graph allows it (output_head.h); false: llama.cpp's
    bool    huge_pages   = true;   // weights read into memory backed by huge pages (huge_pages.h); false: mmap
};

class target_runner {
public:
    explicit target_runner(const target_params & params);
    // Bytes of the weights in huge pages (huge_pages.h; 0: none, as with huge_pages off).
    size_t huge_page_bytes() const { return huge_page_bytes_; }
    ~target_runner();  // out of line: output_head is incomplete here
    target_runner(const target_runner &) = delete;
    target_runner & operator=(const target_runner &) = delete;

    // Which layers to capture (Hugging Face ids: 0 = first layer's output); empty = none.
    void set_capture(const std::vector<int32_t> & layer_ids);

    // Decodes tokens at positions pos0..pos0+n-1 in chunks of n_batch. Logits are kept for every
    // token when all_logits, else for the last one only. Captured features of all n tokens are in
    // features() afterwards. Throws std::runtime_error if llama_decode fails.
    void decode(const int32_t * tokens, int32_t n, int32_t pos0, bool all_logits);

    // Logits of token i of the last decode (i counts tokens with logits, in order). Where the target's
    // graph allows it they are computed on demand by our output head (output_head.h): read the rows
    // in order and stop early.
    const float * logits(int32_t i);
    // Computes the rows i0..i0+n-1 not yet computed in one batch (sampling reads them all).
    void prefetch_logits(int32_t i0, int32_t n);
    // Whether decodes leave the head to us (known after the first decode), and the rows it computed
    // and the time it took so far.
    bool    lazy_head() const { return head_ != nullptr; }
    // "ours", "llama.cpp", or "" before the first decode has shown which
    const char * head_name() const;
    double  head_ms()   const { return head_ms_; }
    int64_t head_rows() const { return head_rows_; }
    int64_t head_batches() const { return head_batches_; }  // calls of the head (a batch of rows each)
    void   set_threads(int32_t n_threads);

    // One decode of tokens from several sequences (n_seq > 1); logits(i) then gives the i-th token
    // with want_logits set. Capture is switched off. Throws std::runtime_error if llama_decode fails.
    void decode_multi(const std::vector<int32_t> & tokens, const std::vector<int32_t> & positions,
                      const std::vector<int32_t> & seq_ids, const std::vector<bool> & want_logits);
    void rollback_seq(int32_t seq, int32_t pos);
    int32_t n_seq() const { return n_seq_; }

    // [n, n_taps * n_embd] row-major: features of the last decode's tokens, taps concatenated.
    const std::vector<float> & features() const { return features_; }

    // Drops the KV cache from position pos on. Throws std::runtime_error if llama.cpp cannot.
    void rollback(int32_t pos);

    // Lets rollback() drop up to n_tokens tokens of the last decode, as speculative decoding needs.
    // Attention-only targets always can. A target with a recurrent state (hybrid or recurrent) gets a
    // new context with n_tokens per-token snapshots of it where llama.cpp keeps them for its
    // architecture; elsewhere each decode saves the state and a rollback restores it and decodes the
    // kept tokens again. std::invalid_argument naming the architecture if neither works.
    void reserve_rollback(int32_t n_tokens);
    bool has_recurrent_state() const;
    std::string architecture() const;

    std::vector<int32_t> tokenize(const std::string & text, bool add_special) const;
    std::string          piece(int32_t token) const;
    std::string          detokenize(const std::vector<int32_t> & tokens) const;
    bool                 is_eog(int32_t token) const;

    llama_model *   model()   const { return model_; }
    llama_context * context() const { return ctx_; }
    int32_t n_ctx()   const { return n_ctx_; }
    int32_t n_batch() const { return n_batch_; }
    int32_t n_embd()  const { return n_embd_; }
    int32_t n_vocab() const { return n_vocab_; }
    int32_t n_layer() const { return n_layer_; }
    int32_t n_taps()  const { return (int32_t) tap_names_.size(); }

private:
    static bool on_eval(struct ggml_tensor * t, bool ask, void * user_data);
    bool copy_tap(ggml_tensor * t, const char * name);
    void check_head();
    void compute_missing(int32_t i0, int32_t n);
    [[noreturn]] void vocab_error(const char * what, const std::exception & e) const;
    int32_t tap_of(const char * name) const;
    void make_context(int32_t n_rs_seq);  // (re)creates ctx_ from params_
    void set_layer_inp_outputs(bool on);  // the graph outputs of tap_layer_inp_, on ctx_
    void save_checkpoint(const int32_t * tokens, int32_t n, int32_t pos0);
    void replay_to(int32_t pos);

    target_params       params_;
    int32_t             n_rollback_ = 0;  // tokens a rollback may drop (recurrent state only)
    // checkpoint mode (a recurrent state llama.cpp keeps no snapshots of): the state before the
    // last decode, and that decode's tokens
    bool                 checkpoint_ = false;
    std::vector<uint8_t> ckpt_state_;
    std::vector<int32_t> ckpt_tokens_;
    int32_t              ckpt_pos0_ = 0;
    llama_model *       model_ = nullptr;
    llama_context *     ctx_   = nullptr;
    const llama_vocab * vocab_ = nullptr;
    int32_t n_ctx_ = 0, n_batch_ = 0, n_embd_ = 0, n_vocab_ = 0, n_layer_ = 0, n_seq_ = 1;
    size_t  huge_page_bytes_ = 0;

    std::vector<std::string> tap_names_;    // per tap: "l_out-L" or "result_norm"
    // per tap, the llama.cpp layer whose input it is (HF id + 1), when the taps are read as graph
    // outputs (llama_set_embeddings_layer_inp) rather than by the eval callback, which splits the
    // graph compute at every tap
    std::vector<int32_t>     tap_layer_inp_;
    std::vector<int32_t>     tap_ids_;      // the layer ids of the current taps (set_capture's argument)
    bool                     needs_all_rows_ = false;  // a result_norm tap: keep every row's output
    std::vector<std::vector<float>> tap_rows_;  // per tap, rows captured so far in this decode
    std::vector<float>       features_;
    std::vector<int32_t>     logit_rows_;   // decode-local index of each kept logit row
    std::vector<float>       logits_;       // kept logits, [n_kept, n_vocab]

    // the output head (output_head.h): unknown until the first decode has shown the graph's end
    enum class head_mode { unknown, ours, llama };
    head_mode                    head_mode_ = head_mode::unknown;
    std::unique_ptr<output_head> head_;
    bool                 stop_at_norm_ = false;  // this decode: stop the graph after result_norm
    bool                 lazy_ = false;          // the last decode left its logits to our head
    const ggml_tensor *  seen_prev_ = nullptr;   // the graph's last two nodes (the head's check)
    const ggml_tensor *  seen_last_ = nullptr;
    std::vector<float>   norm_rows_;             // result_norm of the last decode's kept rows
    std::vector<char>    row_ready_;             // per row of a lazy decode: computed
    std::vector<float>   lazy_logits_;           // [n, n_vocab], grown only
    int32_t              norm_base_ = 0;          // norm_rows_ row of logits row 0
    double               head_ms_ = 0.0;
    int64_t              head_rows_ = 0;
    int64_t              head_batches_ = 0;
};

} // namespace dflash
