#include "target.h"

#include "huge_pages.h"
#include "log.h"
#include "output_head.h"
#include "target_check.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "llama-ext.h"  // llama_{set,get}_embeddings_layer_inp: pinned internal API, as common/speculative.cpp uses
#include "llama-model.h"  // tensors_by_name: the buffers the weights live in

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <thread>

namespace dflash {

namespace {

// llama.cpp's tokenizer turns each invalid byte into U+FFFD without a word: refuse the text instead
void check_utf8(const std::string & text) {
    for (size_t i = 0; i < text.size();) {
        const unsigned char c = (unsigned char) text[i];
        const size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        bool ok = n > 0 && i + n <= text.size();
        uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
        for (size_t k = 1; ok && k < n; ++k) {
            const unsigned char b = (unsigned char) text[i + k];
            ok = (b & 0xC0) == 0x80;
            cp = (cp << 6) | (b & 0x3F);
        }
        static const uint32_t min_cp[5] = { 0, 0, 0x80, 0x800, 0x10000 };  // shorter forms are overlong
        ok = ok && cp >= min_cp[n] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
        if (!ok) {
            char buf[96];
            std::snprintf(buf, sizeof(buf), "the prompt is not valid UTF-8 (byte 0x%02x at offset %zu)", c, i);
            throw std::invalid_argument(buf);
        }
        i += n;
    }
}

} // namespace

target_runner::target_runner(const target_params & params) {
    std::error_code ec;
    if (!std::filesystem::exists(params.path, ec)) {
        throw std::invalid_argument(params.path + ": no such file");
    }
    if (params.n_batch < 1) {
        throw std::invalid_argument("n_batch must be at least 1, got " + std::to_string(params.n_batch));
    }
    if (params.n_ctx < 1) {
        throw std::invalid_argument("n_ctx must be at least 1, got " + std::to_string(params.n_ctx));
    }
    if (params.n_threads < -1 || params.n_threads > GGML_MAX_N_THREADS) {  // 0 and -1: all, as llama.cpp
        throw std::invalid_argument("n_threads must be in [1, " + std::to_string(GGML_MAX_N_THREADS) +
                                    "] (0 or -1: all CPUs), got " + std::to_string(params.n_threads));
    }
    if (params.n_seq < 1) {
        throw std::invalid_argument("n_seq must be at least 1, got " + std::to_string(params.n_seq));
    }
    if ((int64_t) params.n_ctx * params.n_seq > INT32_MAX) {
        throw std::invalid_argument("n_ctx * n_seq must be at most " + std::to_string(INT32_MAX) + ", got " +
                                    std::to_string((int64_t) params.n_ctx * params.n_seq));
    }
    if (params.n_gpu_layers < -1) {
        throw std::invalid_argument("n_gpu_layers must be at least -1 (-1: all layers), got " +
                                    std::to_string(params.n_gpu_layers));
    }
    if (params.n_gpu_layers != 0 && !llama_supports_gpu_offload()) {
        throw std::invalid_argument("n_gpu_layers " + std::to_string(params.n_gpu_layers) + ": " + kNoGpuBackend);
    }
    check_target_gguf(params.path);  // llama.cpp asserts on some bad values: refuse them here first
    clear_last_error();

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = params.n_gpu_layers;
    // Exactness: a verify must compute each position's logits as one-token decoding does. Two CPU
    // paths compute batches differently from one row: repacked weights (Q4_0, Q4_K, IQ4_NL, ...:
    // another kernel from 4 rows on) and the tiled K-quant matmul (from 8 rows). Both off; the
    // tiled switch is an environment variable ggml reads once per process.
    mparams.use_extra_bufts = false;
    setenv("GGML_CPU_TILED_MM", "0", 1);
    if (params.huge_pages) {
        mparams.load_mode = LLAMA_LOAD_MODE_NONE;  // read into anonymous memory, which huge pages can back
    }
    params_ = params;
    model_ = llama_model_load_from_file(params.path.c_str(), mparams);
    if (model_ == nullptr) {
        const std::string why = last_error();
        throw std::invalid_argument(params.path + ": llama.cpp could not load the target model" +
                                    (why.empty() ? std::string() : " (" + why + ")"));
    }
    try {
        check_target_causal(model_, params.path);
    } catch (...) {
        llama_model_free(model_);
        throw;
    }
    if (params.huge_pages) {
        std::vector<ggml_backend_buffer_t> buffers;
        for (const auto & [name, t] : model_->tensors_by_name) {
            if (t->buffer != nullptr && std::find(buffers.begin(), buffers.end(), t->buffer) == buffers.end()) {
                buffers.push_back(t->buffer);
            }
        }
        for (ggml_backend_buffer_t b : buffers) {
            huge_page_bytes_ += collapse_to_huge_pages(b);
        }
    }
    vocab_   = llama_model_get_vocab(model_);
    n_embd_  = llama_model_n_embd(model_);
    n_vocab_ = llama_vocab_n_tokens(vocab_);
    n_layer_ = llama_model_n_layer(model_);

    n_seq_ = params.n_seq;
    try {
        make_context(0);
    } catch (...) {
        llama_model_free(model_);
        model_ = nullptr;
        throw;
    }
    // llama.cpp may round the context up; the caller's size is the limit we honour
    n_ctx_   = std::min((int32_t) llama_n_ctx_seq(ctx_), params.n_ctx);
    n_batch_ = (int32_t) llama_n_batch(ctx_);
}

void target_runner::make_context(int32_t n_rs_seq) {
    const target_params & params = params_;
    const int32_t n_threads = params.n_threads > 0 ? params.n_threads
                                                   : (int32_t) std::max(1u, std::thread::hardware_concurrency());
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx             = (uint32_t) params.n_ctx * (uint32_t) params.n_seq;
    // one graph per chunk, so capture sees whole chunks; llama.cpp keeps the last n_rs_seq + 1 tokens
    // of a decode in one micro-batch for the snapshots, and asserts that it is larger than that
    const uint32_t n_batch    = std::max((uint32_t) params.n_batch, n_rs_seq > 0 ? (uint32_t) n_rs_seq + 2 : 0u);
    cparams.n_batch           = n_batch;
    cparams.n_ubatch          = n_batch;
    cparams.n_seq_max         = (uint32_t) params.n_seq;
    cparams.n_rs_seq          = (uint32_t) n_rs_seq;
    cparams.kv_unified        = false;  // each sequence attends only to its own cells
    cparams.n_threads         = n_threads;
    cparams.n_threads_batch   = n_threads;
    cparams.no_perf           = true;
    // flash attention off: on the CPU its result for a token depends on how many tokens share the
    // batch once the cache passes 256 cells, so a verify would not reproduce decoding bit for bit
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (params.kv_f32) {  // full precision for parity
        cparams.type_k = GGML_TYPE_F32;
        cparams.type_v = GGML_TYPE_F32;
    }
    cparams.cb_eval           = &target_runner::on_eval;
    cparams.cb_eval_user_data = this;
    if (ctx_ != nullptr) {
        llama_free(ctx_);
        ctx_ = nullptr;
    }
    clear_last_error();
    ctx_ = llama_init_from_model(model_, cparams);
    if (ctx_ == nullptr) {
        const std::string why = last_error();
        throw std::runtime_error(params.path + ": llama.cpp could not create a context" +
                                 (why.empty() ? std::string() : " (" + why + ")"));
    }
    set_layer_inp_outputs(true);  // a new context: the taps chosen so far
    head_mode_ = params_.own_head ? head_mode::unknown : head_mode::llama;  // its graph's end is checked again
    head_.reset();
}

std::string target_runner::architecture() const {
    char arch[64] = "?";
    llama_model_meta_val_str(model_, "general.architecture", arch, sizeof(arch));
    return arch;
}

bool target_runner::has_recurrent_state() const {
    return llama_model_is_recurrent(model_) || llama_model_is_hybrid(model_);
}

void target_runner::reserve_rollback(int32_t n_tokens) {
    if (!has_recurrent_state() || n_tokens <= n_rollback_) {
        return;
    }
    // a recurrent state (Gated DeltaNet, Mamba, ...) holds no per-token history. llama.cpp keeps
    // n_rs_seq snapshots of it, one per token of the last batch, for the architectures that support
    // it; for the others each decode saves the state first and a rollback replays the kept tokens
    // (llama.cpp clamps n_rs_seq to 0 for the others: that context serves checkpoints as it is)
    make_context(n_tokens);
    n_batch_    = (int32_t) llama_n_batch(ctx_);
    checkpoint_ = (int32_t) llama_n_rs_seq(ctx_) < n_tokens;
    if (checkpoint_) {
        const size_t size = llama_state_seq_get_size_ext(ctx_, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
        if (size == 0) {
            throw std::invalid_argument(params_.path + ": architecture '" + architecture() + "' keeps a recurrent "
                                        "state that llama.cpp can neither roll back nor save, so a draft's rejected "
                                        "tokens could not be undone: speculative decoding is not supported for it");
        }
    }
    n_rollback_ = n_tokens;
}

void target_runner::save_checkpoint(const int32_t * tokens, int32_t n, int32_t pos0) {
    const size_t size = llama_state_seq_get_size_ext(ctx_, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    ckpt_state_.resize(size);
    if (llama_state_seq_get_data_ext(ctx_, ckpt_state_.data(), size, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) != size) {
        throw std::runtime_error(params_.path + ": llama.cpp could not save the target's recurrent state");
    }
    ckpt_tokens_.assign(tokens, tokens + n);
    ckpt_pos0_ = pos0;
}

// Back to the state before the last decode, then the kept tokens [ckpt_pos0_, pos) decoded again:
// the same batch computation as before, so the state and the features equal the first pass's.
void target_runner::replay_to(int32_t pos) {
    const std::vector<uint8_t> state = std::move(ckpt_state_);
    const std::vector<int32_t> kept(ckpt_tokens_.begin(), ckpt_tokens_.begin() + (pos - ckpt_pos0_));
    const int32_t pos0 = ckpt_pos0_;
    if (llama_state_seq_set_data_ext(ctx_, state.data(), state.size(), 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == 0) {
        throw std::runtime_error(params_.path + ": llama.cpp could not restore the target's recurrent state");
    }
    // the attention layers of a hybrid drop the whole last decode (the restored state ends before it)
    if (!llama_memory_seq_rm(llama_get_memory(ctx_), 0, pos0, -1)) {
        throw std::runtime_error(params_.path + ": llama.cpp could not drop the target's cache from position " +
                                 std::to_string(pos0));
    }
    if (!kept.empty()) {
        decode(kept.data(), (int32_t) kept.size(), pos0, /*all_logits=*/false);
    } else {
        ckpt_tokens_.clear();
    }
}

target_runner::~target_runner() {
    if (ctx_)   llama_free(ctx_);
    if (model_) llama_model_free(model_);
}

// Architectures whose pinned graph records every layer's input (`t_layer_inp`, read by
// llama_get_embeddings_layer_inp); elsewhere llama.cpp aborts on the request, so the eval callback
// reads the taps. Checked against src/models/*.cpp of the pin.
static bool records_layer_inputs(const std::string & arch) {
    static const char * const archs[] = { "llama", "qwen3", "qwen3moe", "gpt-oss", "qwen35", "qwen35moe" };
    return std::any_of(std::begin(archs), std::end(archs), [&](const char * a) { return arch == a; });
}

void target_runner::set_layer_inp_outputs(bool on) {
    for (const int32_t il : tap_layer_inp_) {
        llama_set_embeddings_layer_inp(ctx_, (uint32_t) il, on);
    }
}

void target_runner::set_capture(const std::vector<int32_t> & layer_ids) {
    for (const int32_t id : layer_ids) {
        if (id < 0 || id >= n_layer_) {
            throw std::invalid_argument("capture layer " + std::to_string(id) + " is outside the target's " +
                                        std::to_string(n_layer_) + " layers");
        }
    }
    if (layer_ids == tap_ids_) {
        return;  // as it is (a change makes llama.cpp reserve its graphs again)
    }
    tap_ids_ = layer_ids;
    set_layer_inp_outputs(false);
    tap_layer_inp_.clear();
    tap_names_.clear();
    needs_all_rows_ = false;
    for (const int32_t id : layer_ids) {
        // the last layer's output, as Hugging Face reports it, is after the final norm
        if (id == n_layer_ - 1) {
            tap_names_.push_back("result_norm");
            needs_all_rows_ = true;
        } else {
            tap_names_.push_back("l_out-" + std::to_string(id));
        }
    }
    tap_rows_.assign(tap_names_.size(), {});
    // the taps as graph outputs where the graph records them (not the last layer: result_norm)
    if (!layer_ids.empty() && !needs_all_rows_ && records_layer_inputs(architecture())) {
        for (const int32_t id : layer_ids) {
            tap_layer_inp_.push_back(id + 1);
        }
        set_layer_inp_outputs(true);
    }
}

int32_t target_runner::tap_of(const char * name) const {
    for (size_t k = 0; k < tap_names_.size(); ++k) {
        if (tap_names_[k] == name) {
            return (int32_t) k;
        }
    }
    return -1;
}

bool target_runner::on_eval(ggml_tensor * t, bool ask, void * user_data) {
    auto * self = static_cast<target_runner *>(user_data);
    const bool taps  = !self->tap_names_.empty() && self->tap_layer_inp_.empty();
    const bool watch = self->stop_at_norm_ || self->head_mode_ == head_mode::unknown;
    if (!taps && !watch) {
        return ask ? false : true;
    }
    const char * name = ggml_get_name(t);
    const bool is_norm = watch && std::strcmp(name, "result_norm") == 0;
    if (ask) {
        if (self->head_mode_ == head_mode::unknown) {  // the graph's last two nodes, for the head's check
            self->seen_prev_ = self->seen_last_;
            self->seen_last_ = t;
        }
        return is_norm || (taps && self->tap_of(name) >= 0);
    }
    if (taps && !self->copy_tap(t, name)) {
        return false;  // not the tensor we expect: abort the compute rather than read garbage
    }
    if (is_norm) {
        if (t->type != GGML_TYPE_F32 || t->ne[0] != self->n_embd_ || !ggml_is_contiguous(t)) {
            self->head_mode_ = head_mode::llama;  // not the rows our head could read
            return !self->stop_at_norm_;
        }
        self->norm_rows_.resize((size_t) ggml_nelements(t));
        ggml_backend_tensor_get(t, self->norm_rows_.data(), 0, ggml_nbytes(t));
        if (self->stop_at_norm_) {
            return false;  // the rest of the graph is the head: ours computes the rows read
        }
    }
    return true;
}

bool target_runner::copy_tap(ggml_tensor * t, const char * name) {
    for (size_t k = 0; k < tap_names_.size(); ++k) {  // a layer may be tapped more than once
        if (tap_names_[k] != name) {
            continue;
        }
        if (t->type != GGML_TYPE_F32 || t->ne[0] != n_embd_ || !ggml_is_contiguous(t)) {
            return false;
        }
        auto & rows = tap_rows_[k];
        const size_t old = rows.size();
        rows.resize(old + (size_t) ggml_nelements(t));
        ggml_backend_tensor_get(t, rows.data() + old, 0, ggml_nbytes(t));
    }
    return true;
}

// After a decode that ran llama.cpp's whole graph with the head unknown: ours is used when the graph
// ends in result_output = mul_mat(W, result_norm), W in host memory, and ours computes the last kept
// row's logits bit for bit as llama.cpp did. Otherwise llama.cpp's head, always.
void target_runner::check_head() {
    head_mode_ = head_mode::llama;
    const ggml_tensor * out = seen_last_;
    const bool shape = out != nullptr && std::strcmp(ggml_get_name(out), "result_output") == 0 &&
                       out->op == GGML_OP_MUL_MAT && out->src[1] == seen_prev_ && seen_prev_ != nullptr &&
                       std::strcmp(ggml_get_name(seen_prev_), "result_norm") == 0 && out->src[0] != nullptr &&
                       out->src[0]->buffer != nullptr && ggml_backend_buffer_is_host(out->src[0]->buffer) &&
                       ggml_is_contiguous(out->src[0]) && out->src[0]->ne[1] == n_vocab_ &&
                       out->src[0]->ne[0] == n_embd_ && !norm_rows_.empty() && norm_rows_.size() % n_embd_ == 0;
    seen_last_ = seen_prev_ = nullptr;
    if (!shape || logits_.size() < (size_t) n_vocab_) {
        return;
    }
    auto head = std::make_unique<output_head>(out->src[0], (int32_t) llama_n_threads(ctx_));
    std::vector<float> ours((size_t) n_vocab_);
    head->compute(norm_rows_.data() + norm_rows_.size() - n_embd_, 1, ours.data());
    const float * theirs = logits_.data() + logits_.size() - n_vocab_;
    if (std::memcmp(ours.data(), theirs, ours.size() * sizeof(float)) == 0) {
        head_ = std::move(head);
        head_mode_ = head_mode::ours;
    }
}

const char * target_runner::head_name() const {
    return head_mode_ == head_mode::ours ? "ours" : head_mode_ == head_mode::llama ? "llama.cpp" : "";
}

void target_runner::set_threads(int32_t n_threads) {
    llama_set_n_threads(ctx_, n_threads, n_threads);
    if (head_) head_->set_threads(n_threads);
}

// The rows not yet computed of i0..i0+n-1, from the first missing one to the next computed one, in one
// batch of the head.
void target_runner::compute_missing(int32_t i0, int32_t n) {
    n = std::min(n, (int32_t) row_ready_.size() - i0);
    while (n > 0 && row_ready_[i0]) {
        ++i0;
        --n;
    }
    for (int32_t k = 1; k < n; ++k) {
        if (row_ready_[i0 + k]) {
            n = k;
            break;
        }
    }
    if (n <= 0) {
        return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    head_->compute(norm_rows_.data() + (size_t) (norm_base_ + i0) * n_embd_, n, lazy_logits_.data() + (size_t) i0 * n_vocab_);
    std::fill(row_ready_.begin() + i0, row_ready_.begin() + i0 + n, 1);
    head_rows_ += n;
    head_batches_ += 1;
    head_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void target_runner::prefetch_logits(int32_t i0, int32_t n) {
    if (lazy_) {
        compute_missing(i0, n);
    }
}

void target_runner::decode(const int32_t * tokens, int32_t n, int32_t pos0, bool all_logits) {
    if (n <= 0) {
        throw std::invalid_argument("decode of an empty token list");
    }
    if (pos0 + n > n_ctx_) {
        throw std::invalid_argument("the sequence needs " + std::to_string(pos0 + n) + " positions but the context holds " +
                                    std::to_string(n_ctx_) + " (raise n_ctx / -c)");
    }
    for (auto & rows : tap_rows_) {
        rows.clear();
    }
    logit_rows_.clear();
    logits_.clear();
    norm_rows_.clear();

    if (checkpoint_) {
        save_checkpoint(tokens, n, pos0);
    }
    const bool keep_all = all_logits || needs_all_rows_;
    // with our head, the graph stops at result_norm and logits(i) computes the rows read (with every
    // row's logits: when they come from one chunk, its result_norm)
    lazy_ = stop_at_norm_ = head_mode_ == head_mode::ours && (!all_logits || n <= n_batch_);
    const bool checking = head_mode_ == head_mode::unknown;
    llama_batch batch = llama_batch_init(n_batch_, 0, 1);
    for (int32_t off = 0; off < n; off += n_batch_) {
        const int32_t n_chunk = std::min(n_batch_, n - off);
        batch.n_tokens = n_chunk;
        for (int32_t i = 0; i < n_chunk; ++i) {
            batch.token[i]     = tokens[off + i];
            batch.pos[i]       = pos0 + off + i;
            batch.n_seq_id[i]  = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i]    = keep_all || off + i == n - 1;
        }
        clear_last_error();
        const int32_t rc = llama_decode(ctx_, batch);
        if (rc != 0) {
            stop_at_norm_ = lazy_ = false;
            llama_batch_free(batch);
            const std::string why = last_error();
            throw std::runtime_error("llama_decode failed with code " + std::to_string(rc) +
                                     (why.empty() ? std::string() : " (" + why + ")"));
        }
        for (size_t k = 0; k < tap_layer_inp_.size(); ++k) {
            const float * rows = llama_get_embeddings_layer_inp(ctx_, (uint32_t) tap_layer_inp_[k]);
            tap_rows_[k].insert(tap_rows_[k].end(), rows, rows + (size_t) n_chunk * n_embd_);
        }
        if (lazy_) {
            continue;  // logits on demand (logits(i)); llama.cpp's were not computed
        }
        // keep only the rows the caller asked for (a result_norm tap forces logits on every row)
        for (int32_t i = 0; i < n_chunk; ++i) {
            if (all_logits || off + i == n - 1) {
                const float * row = llama_get_logits_ith(ctx_, i);  // i: index in the batch
                logits_.insert(logits_.end(), row, row + n_vocab_);
                logit_rows_.push_back(off + i);
            }
        }
    }
    llama_batch_free(batch);
    stop_at_norm_ = false;
    if (lazy_) {
        // the kept rows are result_norm's last: all n, or the last token's (all of a result_norm tap's)
        const int32_t n_kept = all_logits ? n : 1;
        const size_t  n_norm = norm_rows_.size() / n_embd_;
        if (n_norm < (size_t) n_kept || (all_logits && n_norm != (size_t) n)) {
            throw std::runtime_error("result_norm gave " + std::to_string(n_norm) + " rows for " + std::to_string(n_kept) +
                                     " kept tokens");
        }
        norm_base_ = (int32_t) n_norm - n_kept;
        row_ready_.assign(n_kept, 0);
        if (lazy_logits_.size() < (size_t) n_kept * n_vocab_) {
            lazy_logits_.resize((size_t) n_kept * n_vocab_);
        }
        for (int32_t i = 0; i < n_kept; ++i) {
            logit_rows_.push_back(all_logits ? i : n - 1);
        }
    } else if (checking && n_seq_ == 1) {
        check_head();
    }

    const size_t n_taps = tap_names_.size();
    features_.assign((size_t) n * n_taps * n_embd_, 0.0f);
    for (size_t k = 0; k < n_taps; ++k) {
        if (tap_rows_[k].size() != (size_t) n * n_embd_) {
            throw std::runtime_error("capture of '" + tap_names_[k] + "' got " + std::to_string(tap_rows_[k].size() / n_embd_) +
                                     " rows for " + std::to_string(n) + " tokens: this architecture's graph does not "
                                     "name its layer outputs as the capture expects");
        }
        for (int32_t i = 0; i < n; ++i) {
            std::memcpy(features_.data() + ((size_t) i * n_taps + k) * n_embd_,
                        tap_rows_[k].data() + (size_t) i * n_embd_, (size_t) n_embd_ * sizeof(float));
        }
    }
}

const float * target_runner::logits(int32_t i) {
    if (i < 0 || (size_t) i >= logit_rows_.size()) {
        throw std::out_of_range("logits row " + std::to_string(i) + " was not kept by the last decode");
    }
    if (lazy_) {
        if (!row_ready_[i]) {
            // rows 0, 1, 2-3, 4-7, ...: read in order, a verify stops at its first rejection, and
            // rows in one batch cost less each (the weights stream once)
            compute_missing(i, std::max(1, i));
        }
        return lazy_logits_.data() + (size_t) i * n_vocab_;
    }
    return logits_.data() + (size_t) i * n_vocab_;
}

void target_runner::decode_multi(const std::vector<int32_t> & tokens, const std::vector<int32_t> & positions,
                                 const std::vector<int32_t> & seq_ids, const std::vector<bool> & want_logits) {
    const int32_t n = (int32_t) tokens.size();
    if (n == 0 || n > n_batch_ || positions.size() != tokens.size() || seq_ids.size() != tokens.size() ||
        want_logits.size() != tokens.size()) {
        throw std::invalid_argument("decode_multi: 1..n_batch tokens with one position, sequence and logits flag each");
    }
    tap_names_.clear();
    tap_rows_.clear();
    ckpt_tokens_.clear();  // batched decoding rolls back whole sequences only
    llama_batch batch = llama_batch_init(n, 0, 1);
    batch.n_tokens = n;
    for (int32_t i = 0; i < n; ++i) {
        if (seq_ids[i] < 0 || seq_ids[i] >= n_seq_ || positions[i] >= n_ctx_) {
            llama_batch_free(batch);
            throw std::invalid_argument("decode_multi: sequence " + std::to_string(seq_ids[i]) + " at position " +
                                        std::to_string(positions[i]) + " is out of range");
        }
        batch.token[i]     = tokens[i];
        batch.pos[i]       = positions[i];
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = seq_ids[i];
        batch.logits[i]    = want_logits[i];
    }
    clear_last_error();
    const int32_t rc = llama_decode(ctx_, batch);
    llama_batch_free(batch);
    if (rc != 0) {
        const std::string why = last_error();
        throw std::runtime_error("llama_decode failed with code " + std::to_string(rc) +
                                 (why.empty() ? std::string() : " (" + why + ")"));
    }
    logit_rows_.clear();
    logits_.clear();
    lazy_ = false;
    for (int32_t i = 0; i < n; ++i) {
        if (want_logits[i]) {
            const float * row = llama_get_logits_ith(ctx_, i);
            logits_.insert(logits_.end(), row, row + n_vocab_);
            logit_rows_.push_back(i);
        }
    }
}

void target_runner::rollback_seq(int32_t seq, int32_t pos) {
    // a recurrent state rolls back at most n_rollback_ tokens, once per decode; a full clear always works
    if (!llama_memory_seq_rm(llama_get_memory(ctx_), seq, pos, -1)) {
        throw std::runtime_error(params_.path + ": llama.cpp could not roll the target's memory (architecture '" +
                                 architecture() + "') back to position " + std::to_string(pos) +
                                 (has_recurrent_state() ? " (its recurrent state keeps " + std::to_string(n_rollback_) +
                                                          " per-token snapshots)" : std::string()));
    }
}

void target_runner::rollback(int32_t pos) {
    const int32_t ckpt_end = ckpt_pos0_ + (int32_t) ckpt_tokens_.size();
    if (checkpoint_ && pos > 0 && pos < ckpt_end) {
        if (pos < ckpt_pos0_) {
            throw std::runtime_error(params_.path + ": the target's recurrent state (architecture '" + architecture() +
                                     "') can only roll back into its last decode, at positions " +
                                     std::to_string(ckpt_pos0_) + ".." + std::to_string(ckpt_end - 1) +
                                     ", not to " + std::to_string(pos));
        }
        replay_to(pos);
        return;
    }
    rollback_seq(0, pos);
}

std::vector<int32_t> target_runner::tokenize(const std::string & text, bool add_special) const {
    check_utf8(text);
    if (text.size() > (size_t) INT32_MAX) {
        throw std::invalid_argument("the prompt has " + std::to_string(text.size()) + " bytes, more than llama.cpp tokenizes");
    }
    try {
        int32_t n = -llama_tokenize(vocab_, text.data(), (int32_t) text.size(), nullptr, 0, add_special, true);
        std::vector<int32_t> out(std::max(n, 0));
        if (n > 0) {
            llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), n, add_special, true);
        }
        return out;
    } catch (const std::exception & e) {
        vocab_error("tokenize the prompt", e);
    }
}

// llama.cpp's tokenizers throw (std::out_of_range, "unordered_map::at") when the vocabulary lacks what
// its tokenizer.ggml.model needs (a byte token, say): one line naming the file and the tokenizer.
void target_runner::vocab_error(const char * what, const std::exception & e) const {
    char model[64] = "?";
    llama_model_meta_val_str(model_, "tokenizer.ggml.model", model, sizeof(model));
    throw std::invalid_argument(params_.path + ": its tokenizer (tokenizer.ggml.model '" + model + "') cannot " + what +
                                " with this vocabulary (" + e.what() + ")");
}

std::string target_runner::piece(int32_t token) const {
    try {
        char buf[256];
        int32_t n = llama_token_to_piece(vocab_, token, buf, sizeof(buf), 0, false);
        if (n < 0) {
            std::string big((size_t) -n, '\0');
            llama_token_to_piece(vocab_, token, big.data(), -n, 0, false);
            return big;
        }
        return std::string(buf, (size_t) n);
    } catch (const std::exception & e) {
        vocab_error("write a token as text", e);
    }
}

std::string target_runner::detokenize(const std::vector<int32_t> & tokens) const {
    try {
        std::string out(tokens.size() * 8 + 16, '\0');
        int32_t n = llama_detokenize(vocab_, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(),
                                     false, false);
        if (n < 0) {
            out.resize((size_t) -n);
            n = llama_detokenize(vocab_, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(),
                                 false, false);
        }
        out.resize((size_t) std::max(n, 0));
        return out;
    } catch (const std::exception & e) {
        vocab_error("write tokens as text", e);
    }
}

bool target_runner::is_eog(int32_t token) const {
    return llama_vocab_is_eog(vocab_, token);
}

} // namespace dflash
