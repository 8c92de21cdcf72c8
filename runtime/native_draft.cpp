#include "native_draft.h"

#include "log.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"
#include "llama-ext.h"  // llama_model_target_layer_ids (pinned internal API, as common/speculative.cpp uses)

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace dflash {

namespace {

// The shared vocabulary of draft intermediates: llama.cpp's `dflash` graph names, which all three
// parity implementations use (docs/parity.md); "-N" suffixes are per layer.
const char * const kTracedNames[] = {
    "fc_out", "inp_g_embeddings", "Kcur_injected", "Vcur_injected", "inp_noise_embd", "noise_norm",
    "Qcur", "Kcur", "Vcur", "ffn_inp", "ffn_norm", "ffn_out", "l_out", "result_norm", "result_output",
    // DFlash 2: the convolutions' sides (their dynamic taps are not named in llama.cpp's graph; the
    // selector's lattice is read as the loop reads it, see read_lattice)
    "attn_conv_in", "attn_conv_out", "ffn_conv_in", "ffn_conv_out",
};

// "Qcur-3" -> "Qcur"; names without a numeric suffix unchanged
std::string base_name(const char * name) {
    const char * dash = std::strrchr(name, '-');
    if (dash == nullptr || dash[1] == '\0') {
        return name;
    }
    for (const char * c = dash + 1; *c; ++c) {
        if (*c < '0' || *c > '9') {
            return name;
        }
    }
    return std::string(name, dash - name);
}

bool is_traced(const char * name) {
    const std::string base = base_name(name);
    for (const char * n : kTracedNames) {
        if (base == n) {
            return true;
        }
    }
    return false;
}

// A tensor of the graph as f32 in NumPy order, whatever its strides (views included) and float type.
traced_tensor read_tensor(const ggml_tensor * t) {
    traced_tensor out;
    out.shape.assign(t->ne, t->ne + ggml_n_dims(t));
    out.data.resize((size_t) ggml_nelements(t));
    if (t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
        ggml_backend_tensor_get(t, out.data.data(), 0, ggml_nbytes(t));
        return out;
    }
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16 && t->type != GGML_TYPE_BF16) {
        throw std::runtime_error(std::string("native draft: cannot read tensor ") + ggml_get_name(t) + " of type " +
                                 ggml_type_name(t->type));
    }
    std::vector<uint8_t> raw(ggml_nbytes(t));  // the strided span the view covers
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    size_t k = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
    for (int64_t i1 = 0; i1 < t->ne[1]; ++i1)
    for (int64_t i0 = 0; i0 < t->ne[0]; ++i0) {
        const uint8_t * p = raw.data() + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
        float v;
        if (t->type == GGML_TYPE_F32) {
            std::memcpy(&v, p, sizeof(float));
        } else if (t->type == GGML_TYPE_F16) {
            v = ggml_fp16_to_fp32(*reinterpret_cast<const ggml_fp16_t *>(p));
        } else {
            v = ggml_bf16_to_fp32(*reinterpret_cast<const ggml_bf16_t *>(p));
        }
        out.data[k++] = v;
    }
    return out;
}

// DFlash 2's packed selector lattice, [n_embd, B]: row 0 zeros; row p: K candidate ids (as floats), then
// K x K scores (index pred * K + cand)
const char * const kLattice = "dflash2_lattice";

// DSpark's Markov head in llama.cpp's graph names none of its tensors: a slot's bias is the product
// with markov_w2 (then times markov_w2.scale when the draft has one, then scattered through d2t into
// the target's vocabulary when it has a reduced one: the last of these nodes), and the token it
// conditions on the row index of its get_rows from markov_w1
enum class markov_node { none, bias, prev };

bool named(const ggml_tensor * t, const char * name) {
    return t != nullptr && std::strcmp(ggml_get_name(t), name) == 0;
}

// the bias over the draft's rows: W2's product, or that times the scale (`scaled`)
bool markov_rows_bias(const ggml_tensor * t, bool scaled) {
    if (scaled) {
        return t != nullptr && t->op == GGML_OP_MUL && named(t->src[1], "markov_w2.scale") &&
               markov_rows_bias(t->src[0], false);
    }
    return t != nullptr && t->op == GGML_OP_MUL_MAT && named(t->src[0], "markov_w2.weight");
}

markov_node markov_node_of(const ggml_tensor * t, bool scaled, bool reduced) {
    if (t->src[0] == nullptr) {
        return markov_node::none;
    }
    // (ggml_set_rows keeps its rows in src[0], its indices in src[1] and the destination in src[2])
    const bool bias = reduced ? t->op == GGML_OP_SET_ROWS && t->src[0]->op == GGML_OP_RESHAPE &&
                                    markov_rows_bias(t->src[0]->src[0], scaled)
                              : markov_rows_bias(t, scaled);
    if (bias) {
        return markov_node::bias;
    }
    if (t->op == GGML_OP_GET_ROWS && named(t->src[0], "markov_w1.weight")) {
        return markov_node::prev;
    }
    return markov_node::none;
}

struct batch_guard {
    llama_batch_ext * b;
    ~batch_guard() { llama_batch_ext_free(b); }
};

} // namespace

native_draft::native_draft(const native_draft_params & params, target_runner & target) : target_(target) {
    std::error_code ec;
    if (!std::filesystem::exists(params.path, ec)) {
        throw std::invalid_argument(params.path + ": no such file");
    }
    if (params.n_ctx < 2) {
        throw std::invalid_argument("native draft n_ctx must be at least 2, got " + std::to_string(params.n_ctx));
    }
    clear_last_error();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    model_ = llama_model_load_from_file(params.path.c_str(), mparams);
    if (model_ == nullptr) {
        const std::string why = last_error();
        throw std::invalid_argument(params.path + ": llama.cpp could not load the draft as a model" +
                                    (why.empty() ? std::string() : " (" + why + ")"));
    }
    char arch[64] = {};
    llama_model_meta_val_str(model_, "general.architecture", arch, sizeof(arch));
    if (std::strcmp(arch, "dflash") != 0) {
        llama_model_free(model_);
        throw std::invalid_argument(params.path + ": architecture is '" + arch + "', not a DFlash draft ('dflash')");
    }
    if (llama_model_n_embd(model_) != target.n_embd()) {
        const int32_t n = llama_model_n_embd(model_);
        llama_model_free(model_);
        throw std::invalid_argument(params.path + ": draft hidden size " + std::to_string(n) + " != target's " +
                                    std::to_string(target.n_embd()));
    }

    // what common_speculative_impl_draft_dflash reads from the draft
    const int32_t * ids = llama_model_target_layer_ids(model_);
    target_layers_.assign(ids, ids + llama_model_target_layer_ids_n(model_));
    mask_token_id_ = llama_vocab_mask(llama_model_get_vocab(model_));
    char buf[32] = {};
    if (llama_model_meta_val_str(model_, "dflash.block_size", buf, sizeof(buf)) >= 0) {
        block_size_ = std::atoi(buf);
    }
    if (llama_model_meta_val_str(model_, "dflash.attention.causal", buf, sizeof(buf)) >= 0) {
        causal_ = std::strcmp(buf, "true") == 0;
    }
    selector_top_k_ = std::max(0, llama_model_dflash_selector_top_k(model_));  // > 0: a DFlash 2 draft
    {   // the tool picks draft-dspark for a draft with a Markov head (common_speculative_types_from_gguf)
        const gguf_init_params gp = { /*no_alloc*/ true, /*ctx*/ nullptr };
        gguf_context * g = gguf_init_from_file(params.path.c_str(), gp);
        if (g == nullptr) {
            llama_model_free(model_);
            throw std::invalid_argument(params.path + ": cannot read its GGUF tensor list");
        }
        dspark_         = gguf_find_tensor(g, "markov_w1.weight") >= 0;
        has_confidence_ = gguf_find_tensor(g, "conf_proj.weight") >= 0;
        markov_scaled_  = gguf_find_tensor(g, "markov_w2.scale") >= 0;
        reduced_vocab_  = gguf_find_tensor(g, "d2t") >= 0;
        gguf_free(g);
    }
    if (llama_model_meta_val_str(model_, "dflash.sample_from_anchor", buf, sizeof(buf)) >= 0) {
        sample_from_anchor_ = std::strcmp(buf, "true") == 0;  // missing: true, as the graph and the loop read it
    }
    n_embd_in_ = (int32_t) target_layers_.size() * target.n_embd();

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = (uint32_t) params.n_ctx;
    cparams.n_batch         = (uint32_t) params.n_ctx;  // one ubatch per call: one graph, whole tensors
    cparams.n_ubatch        = (uint32_t) params.n_ctx;
    cparams.n_seq_max       = 1;
    cparams.n_rs_seq        = 0;
    const int32_t n_threads = params.n_threads > 0 ? params.n_threads : (int32_t) llama_n_threads(target.context());
    cparams.n_threads       = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.no_perf         = true;
    cparams.ctx_other       = target.context();
    // f32 KV cache and no flash attention: parity compares full-precision graphs
    cparams.type_k          = GGML_TYPE_F32;
    cparams.type_v          = GGML_TYPE_F32;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cparams.cb_eval           = &native_draft::on_eval;
    cparams.cb_eval_user_data = this;
    ctx_ = llama_init_from_model(model_, cparams);
    if (ctx_ == nullptr) {
        const std::string why = last_error();
        llama_model_free(model_);
        throw std::runtime_error(params.path + ": llama.cpp could not create a draft context" +
                                 (why.empty() ? std::string() : " (" + why + ")"));
    }
    llama_set_causal_attn(ctx_, causal_);  // as draft-dflash does: non-causal unless the GGUF says causal
    if (selector_top_k_ > 0) {
        // as draft-dflash does for DFlash 2: the lattice comes back as nextn rows, one per block token
        llama_set_embeddings_nextn(ctx_, true, /*masked*/ false);
    } else if (dspark_) {
        // as draft-dspark does: the confidences come back as nextn rows
        llama_set_embeddings_nextn(ctx_, true, /*masked*/ true);
    }
    n_ctx_    = std::min((int32_t) llama_n_ctx(ctx_), params.n_ctx);
    n_ubatch_ = (int32_t) llama_n_ubatch(ctx_);
}

native_draft::~native_draft() {
    if (ctx_)   llama_free(ctx_);
    if (model_) llama_model_free(model_);
}

traced_tensor native_draft::read_lattice(int32_t n_block) const {
    const float * rows = llama_get_embeddings_nextn(ctx_);
    if (rows == nullptr) {
        throw std::runtime_error("native draft: the DFlash 2 selector produced no lattice");
    }
    const int32_t n_embd = llama_model_n_embd(model_);
    traced_tensor out;
    out.shape = { n_embd, n_block };
    out.data.assign(rows, rows + (size_t) n_embd * n_block);
    return out;
}

void native_draft::read_dspark(int32_t n_block, draft_trace & out) const {
    const int32_t first = sample_from_anchor_ ? 0 : 1;  // draft-dspark reads the slots from here
    const int32_t n = n_block - first;
    if ((int32_t) markov_bias_.size() != n || (int32_t) markov_prev_.size() != n) {
        throw std::runtime_error("native draft: llama.cpp's graph computed " + std::to_string(markov_bias_.size()) +
                                 " Markov biases on " + std::to_string(markov_prev_.size()) + " tokens for " +
                                 std::to_string(n) + " drafted slots");
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model_));
    const float * logits = llama_get_logits(ctx_);
    if (logits == nullptr) {
        throw std::runtime_error("native draft: the DSpark block produced no logits");
    }
    traced_tensor & biased = out["biased_logits"];
    biased.shape = { n_vocab, n };
    biased.data.assign(logits + (size_t) first * n_vocab, logits + (size_t) n_block * n_vocab);
    traced_tensor & bias = out["markov_bias"];
    traced_tensor & prev = out["markov_prev"];
    bias.shape = { n_vocab, n };
    prev.shape = { n };
    for (int32_t i = 0; i < n; ++i) {
        if ((int32_t) markov_bias_[i].size() != n_vocab) {
            throw std::runtime_error("native draft: a Markov bias of " + std::to_string(markov_bias_[i].size()) +
                                     " values, the vocabulary has " + std::to_string(n_vocab));
        }
        if (markov_prev_[i] < 0) {
            throw std::runtime_error("native draft: the Markov head's token at slot " + std::to_string(i) +
                                     " is not one i32 row index");
        }
        bias.data.insert(bias.data.end(), markov_bias_[i].begin(), markov_bias_[i].end());
        prev.data.push_back((float) markov_prev_[i]);
    }
    if (has_confidence_) {
        const float * rows = llama_get_embeddings_nextn(ctx_);
        if (rows == nullptr) {
            throw std::runtime_error("native draft: the DSpark confidence head produced no nextn rows");
        }
        const int32_t n_embd = llama_model_n_embd(model_);
        traced_tensor & conf = out["confidence"];
        conf.shape = { n };
        for (int32_t i = first; i < n_block; ++i) {
            conf.data.push_back(rows[(size_t) i * n_embd]);  // broadcast across the row; the loop reads column 0
        }
    }
}

bool native_draft::on_eval(ggml_tensor * t, bool ask, void * user_data) {
    auto * self = static_cast<native_draft *>(user_data);
    if (self->recording_ == nullptr) {
        return ask ? false : true;
    }
    if (self->dspark_ && !self->encoding_) {
        const markov_node kind = markov_node_of(t, self->markov_scaled_, self->reduced_vocab_);
        if (kind != markov_node::none) {
            if (ask) {
                return true;
            }
            if (kind == markov_node::bias) {
                self->markov_bias_.push_back(read_tensor(t).data);
            } else {
                const ggml_tensor * rows = t->src[1];  // [n_blocks] i32, computed before this node
                int32_t id = -1;  // not one i32 (more than one block): read_dspark refuses it
                if (rows->type == GGML_TYPE_I32 && ggml_nelements(rows) == 1) {
                    ggml_backend_tensor_get(rows, &id, 0, sizeof(id));
                }
                self->markov_prev_.push_back(id);
            }
            return true;
        }
    }
    const char * name = ggml_get_name(t);
    const bool wanted = self->encoding_ ? std::strcmp(name, "fc_out") == 0 : is_traced(name);
    if (ask) {
        return wanted;
    }
    if (wanted) {
        (*self->recording_)[name] = read_tensor(t);
    }
    return true;
}

draft_trace native_draft::trace(const std::vector<float> & features, int32_t n_ctx_tokens, const std::vector<int32_t> & block) {
    const int32_t n_block = (int32_t) block.size();
    if (n_ctx_tokens < 1) {
        throw std::invalid_argument("the native draft needs at least one context token of features");
    }
    if (features.size() != (size_t) n_ctx_tokens * n_embd_in_) {
        throw std::invalid_argument("features must be [" + std::to_string(n_ctx_tokens) + ", " + std::to_string(n_embd_in_) +
                                    "] (" + std::to_string(target_layers_.size()) + " taps), got " +
                                    std::to_string(features.size()) + " values");
    }
    if (n_block < 1) {
        throw std::invalid_argument("empty block");
    }
    for (const int32_t t : block) {
        if (t < 0 || t >= target_.n_vocab()) {
            throw std::invalid_argument("block token " + std::to_string(t) + " is outside the vocabulary");
        }
    }
    if (selector_top_k_ > 0 && n_block > block_size_) {
        // draft-dflash clamps --spec-draft-n-max to B - 1; the selector packs at most B lattice rows and
        // reading more aborts in ggml_backend_tensor_get
        throw std::invalid_argument("a DFlash 2 block of " + std::to_string(n_block) + " tokens exceeds the trained block of " +
                                    std::to_string(block_size_) + " (llama.cpp's selector lattice holds " +
                                    std::to_string(block_size_) + " rows)");
    }
    if (dspark_ && n_block > block_size_) {
        // llama.cpp's graph leaves out the Markov bias for a longer block; draft-dspark clamps to the trained one
        throw std::invalid_argument("a DSpark block of " + std::to_string(n_block) + " tokens exceeds the trained block of " +
                                    std::to_string(block_size_));
    }
    if (n_ctx_tokens + n_block > n_ctx_ || std::max(n_ctx_tokens, n_block) > n_ubatch_) {
        throw std::invalid_argument("features (" + std::to_string(n_ctx_tokens) + ") + block (" + std::to_string(n_block) +
                                    ") exceed the native draft context of " + std::to_string(n_ctx_) + " positions");
    }

    draft_trace out;
    llama_memory_t mem = llama_get_memory(ctx_);
    llama_memory_clear(mem, true);
    batch_guard batch{ llama_batch_ext_init(ctx_) };
    auto run = [&](llama_process_type type, const char * what) {
        clear_last_error();
        const int32_t rc = llama_process(ctx_, type, batch.b);
        if (rc != 0) {
            const std::string why = last_error();
            throw std::runtime_error(std::string("native draft: llama_process (") + what + ") failed with code " +
                                     std::to_string(rc) + (why.empty() ? std::string() : " (" + why + ")"));
        }
    };
    auto add_features = [&](bool output) {
        llama_batch_ext_clear(batch.b);
        for (int32_t i = 0; i < n_ctx_tokens; ++i) {
            const llama_embd row = { features.data() + (size_t) i * n_embd_in_, 1, (size_t) n_embd_in_ };
            const int32_t idx = llama_batch_ext_add_embd(batch.b, 0, row);
            if (idx < 0) {
                throw std::runtime_error("native draft: could not add feature row " + std::to_string(i) +
                                         " to the batch (error " + std::to_string(idx) + ")");
            }
            const llama_pos pos[4] = { i, i, i, 0 };
            llama_batch_ext_set_pos(batch.b, idx, pos);
            llama_batch_ext_set_output_logits(batch.b, idx, output);
        }
    };

    recording_ = &out;
    try {
        // the encoder graph: fc_out (draft-dflash never runs it; it holds the only fc_out)
        encoding_ = true;
        add_features(true);
        run(LLAMA_PROCESS_TYPE_ENCODE, "encoder graph");
        encoding_ = false;
        llama_memory_clear(mem, true);
        // 1. inject: the decoder graph on an embd batch writes the context K/V into the cache
        add_features(false);
        run(LLAMA_PROCESS_TYPE_DECODE, "feature injection");
        // 2. the block, logits on every position (draft-dflash reads positions 1..); DFlash 2 asks for
        //    no logits (draft-dflash walks the lattice, read from the nextn rows)
        llama_batch_ext_clear(batch.b);
        for (int32_t i = 0; i < n_block; ++i) {
            const int32_t idx = llama_batch_ext_add_token(batch.b, 0, block[i]);
            if (idx < 0) {
                throw std::runtime_error("native draft: could not add block token " + std::to_string(i) + " to the batch");
            }
            const llama_pos pos[4] = { n_ctx_tokens + i, 0, 0, 0 };
            llama_batch_ext_set_pos(batch.b, idx, pos);
            llama_batch_ext_set_output_logits(batch.b, idx, selector_top_k_ == 0);
        }
        markov_bias_.clear();
        markov_prev_.clear();
        run(LLAMA_PROCESS_TYPE_DECODE, "block");
        if (selector_top_k_ > 0) {
            out[kLattice] = read_lattice(n_block);
        }
        if (dspark_) {
            read_dspark(n_block, out);
        }
    } catch (...) {
        recording_ = nullptr;
        encoding_  = false;
        llama_memory_clear(mem, true);
        throw;
    }
    recording_ = nullptr;
    llama_memory_clear(mem, true);
    return out;
}

} // namespace dflash
