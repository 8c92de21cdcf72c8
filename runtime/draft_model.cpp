#include "draft_model.h"

#include "gguf.h"
#include "llama.h"

#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>

namespace dflash {

namespace {

[[noreturn]] void fail(const std::string & path, const std::string & reason) {
    throw std::invalid_argument(path + ": " + reason);
}

// Typed access to one GGUF's key-values, with errors that name the file and the key.
struct gguf_keys {
    const gguf_context * ctx;
    const std::string &  path;

    int64_t find(const std::string & key) const { return gguf_find_key(ctx, key.c_str()); }

    int64_t require(const std::string & key) const {
        const int64_t id = find(key);
        if (id < 0) {
            fail(path, "missing key '" + key + "' (is this a DFlash draft GGUF?)");
        }
        return id;
    }

    int64_t get_int(const std::string & key, int64_t id) const {
        switch (gguf_get_kv_type(ctx, id)) {
            case GGUF_TYPE_UINT8:  return gguf_get_val_u8 (ctx, id);
            case GGUF_TYPE_INT8:   return gguf_get_val_i8 (ctx, id);
            case GGUF_TYPE_UINT16: return gguf_get_val_u16(ctx, id);
            case GGUF_TYPE_INT16:  return gguf_get_val_i16(ctx, id);
            case GGUF_TYPE_UINT32: return gguf_get_val_u32(ctx, id);
            case GGUF_TYPE_INT32:  return gguf_get_val_i32(ctx, id);
            case GGUF_TYPE_UINT64: return (int64_t) gguf_get_val_u64(ctx, id);
            case GGUF_TYPE_INT64:  return gguf_get_val_i64(ctx, id);
            default: fail(path, "key '" + key + "' is not an integer");
        }
    }

    int32_t u32(const std::string & key) const { return (int32_t) get_int(key, require(key)); }

    int32_t u32_or(const std::string & key, int32_t fallback) const {
        const int64_t id = find(key);
        return id < 0 ? fallback : (int32_t) get_int(key, id);
    }

    float f32_or(const std::string & key, float fallback) const {
        const int64_t id = find(key);
        if (id < 0) {
            return fallback;
        }
        switch (gguf_get_kv_type(ctx, id)) {
            case GGUF_TYPE_FLOAT32: return gguf_get_val_f32(ctx, id);
            case GGUF_TYPE_FLOAT64: return (float) gguf_get_val_f64(ctx, id);
            default: return (float) get_int(key, id);
        }
    }

    float f32(const std::string & key) const {
        require(key);
        return f32_or(key, 0.0f);
    }

    std::vector<int64_t> int_array(const std::string & key) const {
        const int64_t id = require(key);
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY) {
            fail(path, "key '" + key + "' is not an array");
        }
        const size_t n = gguf_get_arr_n(ctx, id);
        const void * data = gguf_get_arr_data(ctx, id);
        std::vector<int64_t> out(n);
        for (size_t i = 0; i < n; ++i) {
            switch (gguf_get_arr_type(ctx, id)) {
                case GGUF_TYPE_INT32:  out[i] = ((const int32_t  *) data)[i]; break;
                case GGUF_TYPE_UINT32: out[i] = ((const uint32_t *) data)[i]; break;
                case GGUF_TYPE_INT64:  out[i] = ((const int64_t  *) data)[i]; break;
                case GGUF_TYPE_UINT64: out[i] = (int64_t) ((const uint64_t *) data)[i]; break;
                case GGUF_TYPE_BOOL:   out[i] = ((const int8_t   *) data)[i] != 0; break;
                case GGUF_TYPE_INT8:   out[i] = ((const int8_t   *) data)[i]; break;
                case GGUF_TYPE_UINT8:  out[i] = ((const uint8_t  *) data)[i]; break;
                default: fail(path, "key '" + key + "' is not an integer array");
            }
        }
        return out;
    }
};

// The refusal list of dflash_llama/schema.py (REFUSALS): keys the pinned llama.cpp reads and this
// runtime does not implement. tests/test_schema.py holds the two lists to the same entries.
void refuse_unsupported(const gguf_context * ctx, const gguf_keys & kv, const std::string & path) {
    for (const char * key : { "dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank",
                              "dflash.selector_top_k" }) {
        if (kv.find(key) >= 0) {
            fail(path, std::string("'") + key + "': DFlash2 drafts (convolutions + candidate selector) are not supported yet");
        }
    }
    for (const char * key : { "dflash.attention.value_scale", "dflash.attention.scale", "dflash.rope.dimension_sections",
                              "dflash.has_confidence_head", "dflash.hyper_connection.count" }) {
        if (kv.find(key) >= 0) {
            fail(path, std::string("'") + key + "' is not supported by this runtime yet");
        }
    }
    const int64_t act_id = kv.find("dflash.hidden_activation");
    if (act_id >= 0 && (gguf_get_kv_type(ctx, act_id) != GGUF_TYPE_STRING ||
                        std::string(gguf_get_val_str(ctx, act_id)) != "silu")) {
        if (gguf_get_kv_type(ctx, act_id) != GGUF_TYPE_STRING) {
            fail(path, "'dflash.hidden_activation' is not a string");
        }
        fail(path, std::string("'dflash.hidden_activation' is '") + gguf_get_val_str(ctx, act_id) +
                   "': only silu FFNs are supported");
    }
    const int64_t anchor_id = kv.find("dflash.sample_from_anchor");
    if (anchor_id >= 0 && (gguf_get_kv_type(ctx, anchor_id) != GGUF_TYPE_BOOL || gguf_get_val_bool(ctx, anchor_id))) {
        fail(path, "'dflash.sample_from_anchor' is true: DSpark drafts are not supported yet");
    }
}

draft_hparams read_hparams(const gguf_context * ctx, const std::string & path) {
    const gguf_keys kv{ctx, path};

    const int64_t arch_id = kv.find("general.architecture");
    const std::string arch = arch_id >= 0 ? gguf_get_val_str(ctx, arch_id) : "";
    if (arch != "dflash") {
        fail(path, "general.architecture is '" + arch + "', expected 'dflash' (a DFlash draft GGUF)");
    }
    refuse_unsupported(ctx, kv, path);

    draft_hparams hp;
    hp.n_embd      = kv.u32("dflash.embedding_length");
    hp.n_layer     = kv.u32("dflash.block_count");
    hp.n_head      = kv.u32("dflash.attention.head_count");
    hp.n_head_kv   = kv.u32_or("dflash.attention.head_count_kv", hp.n_head);
    hp.head_dim    = kv.u32_or("dflash.attention.key_length", hp.n_head > 0 ? hp.n_embd / hp.n_head : 0);
    for (const char * key : { "dflash.attention.value_length", "dflash.rope.dimension_count" }) {
        if (kv.u32_or(key, hp.head_dim) != hp.head_dim) {
            fail(path, std::string("'") + key + "' different from key_length is not supported yet");
        }
    }
    hp.n_ff        = kv.u32("dflash.feed_forward_length");
    hp.block_size  = kv.u32_or("dflash.block_size", 16);
    hp.rope_freq_base  = kv.f32_or("dflash.rope.freq_base", 10000.0f);
    const int64_t scaling_id = kv.find("dflash.rope.scaling.type");
    const std::string scaling = scaling_id >= 0 ? gguf_get_val_str(ctx, scaling_id) : "none";
    if (scaling == "linear") {
        const float factor = kv.f32_or("dflash.rope.scaling.factor", 1.0f);
        if (!(factor > 0.0f)) {
            fail(path, "dflash.rope.scaling.factor must be > 0, got " + std::to_string(factor));
        }
        hp.rope_freq_scale = 1.0f / factor;
    } else if (scaling != "none") {
        fail(path, "'dflash.rope.scaling.type' is '" + scaling + "': only none and linear RoPE scaling are supported");
    }
    hp.rms_eps         = kv.f32("dflash.attention.layer_norm_rms_epsilon");
    hp.embedding_scale = kv.f32_or("dflash.embedding_scale", 1.0f);
    hp.logit_scale     = kv.f32_or("dflash.logit_scale", 1.0f);
    hp.logit_softcap   = kv.f32_or("dflash.final_logit_softcapping", 0.0f);

    const int64_t causal_id = kv.find("dflash.attention.causal");
    hp.causal = causal_id < 0 ? -1 : (gguf_get_val_bool(ctx, causal_id) ? 1 : 0);

    hp.sliding_window = kv.u32_or("dflash.attention.sliding_window", 0);
    hp.swa_layers.assign(hp.n_layer, false);
    if (hp.sliding_window > 0) {
        // llama.cpp requires the pattern with a window
        const auto pattern = kv.int_array("dflash.attention.sliding_window_pattern");
        if ((int32_t) pattern.size() != hp.n_layer) {
            fail(path, "'dflash.attention.sliding_window_pattern' has " + std::to_string(pattern.size()) +
                       " entries for " + std::to_string(hp.n_layer) + " layers");
        }
        for (int32_t il = 0; il < hp.n_layer; ++il) {
            hp.swa_layers[il] = pattern[il] != 0;
        }
    }

    if (kv.find("dflash.target_layers") < 0) {
        fail(path, "missing key 'dflash.target_layers' (the target layers the draft reads); "
                   "convert the draft with `dflash-llama convert`, which writes the default ids");
    }
    for (const int64_t id : kv.int_array("dflash.target_layers")) {
        hp.target_layer_ids.push_back((int32_t) id - 1);  // the GGUF stores "input of layer id+1"
    }

    const int64_t mask_id = kv.find("tokenizer.ggml.mask_token_id");
    if (mask_id < 0) {
        fail(path, "missing key 'tokenizer.ggml.mask_token_id' (the draft's MASK token)");
    }
    hp.mask_token_id = (int32_t) kv.get_int("tokenizer.ggml.mask_token_id", mask_id);

    const int64_t tokens_id = kv.find("tokenizer.ggml.tokens");
    hp.n_vocab = tokens_id < 0 ? 0 : (int32_t) gguf_get_arr_n(ctx, tokens_id);

    if (hp.n_embd <= 0 || hp.n_layer <= 0 || hp.n_head <= 0 || hp.n_head_kv <= 0 || hp.head_dim <= 0 ||
        hp.n_ff <= 0 || hp.n_head % hp.n_head_kv != 0) {
        fail(path, "inconsistent hyper-parameters (n_embd " + std::to_string(hp.n_embd) + ", n_head " +
                   std::to_string(hp.n_head) + ", n_head_kv " + std::to_string(hp.n_head_kv) + ")");
    }
    if (hp.block_size < 2) {
        fail(path, "dflash.block_size is " + std::to_string(hp.block_size) + ", must be at least 2");
    }
    if (hp.target_layer_ids.empty()) {
        fail(path, "dflash.target_layers is empty");
    }
    return hp;
}

// Every tensor must be one this runtime reads: a d2t, DFlash2, DSpark or extra per-layer tensor
// changes what llama.cpp computes, and ignoring it would be a silent wrong answer. So would a
// draft's own token_embd / output: llama.cpp uses them, the graph here uses the target's.
void refuse_unknown_tensors(const gguf_context * ctx, int32_t n_layer, const std::string & path) {
    static const char * const layer_names[] = { "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
        "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate.weight",
        "ffn_up.weight", "ffn_down.weight" };
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx); ++i) {
        const std::string name = gguf_get_tensor_name(ctx, i);
        if (name == "token_embd.weight" || name == "output.weight") {
            fail(path, "tensor '" + name + "': the runtime uses the target's embeddings and head; "
                       "a draft with its own is not supported by this runtime");
        }
        bool known = name == "fc.weight" || name == "enc.output_norm.weight" || name == "output_norm.weight";
        for (int32_t il = 0; il < n_layer && !known; ++il) {
            for (const char * suffix : layer_names) {
                known = known || name == "blk." + std::to_string(il) + "." + suffix;
            }
        }
        if (!known) {
            fail(path, "tensor '" + name + "' is not supported by this runtime (reduced-vocabulary d2t, DFlash2, "
                       "DSpark or extra per-layer tensors)");
        }
    }
}

} // namespace

draft_model::~draft_model() {
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    if (ctx) {
        ggml_free(ctx);
    }
}

void load_draft(draft_model & draft, const std::string & path, ggml_backend_buffer_type_t buft) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) {
        fail(path, "no such file");
    }

    ggml_context * meta = nullptr;
    gguf_init_params params = { /*no_alloc =*/ true, /*ctx =*/ &meta };
    std::unique_ptr<gguf_context, void (*)(gguf_context *)> gguf(gguf_init_from_file(path.c_str(), params), &gguf_free);
    if (!gguf) {
        fail(path, "not a readable GGUF file (bad magic, corrupt or truncated header)");
    }
    draft.path    = path;
    draft.ctx     = meta;
    draft.hparams = read_hparams(gguf.get(), path);
    const draft_hparams & hp = draft.hparams;

    auto tensor = [&](const std::string & name, std::initializer_list<int64_t> shape) {
        ggml_tensor * t = ggml_get_tensor(meta, name.c_str());
        if (t == nullptr) {
            fail(path, "missing tensor '" + name + "'");
        }
        int i = 0;
        for (const int64_t n : shape) {
            if (t->ne[i] != n) {
                fail(path, "tensor '" + name + "' has ne[" + std::to_string(i) + "] = " + std::to_string(t->ne[i]) +
                           ", expected " + std::to_string(n));
            }
            ++i;
        }
        return t;
    };
    refuse_unknown_tensors(gguf.get(), hp.n_layer, path);
    const int64_t n_embd = hp.n_embd, q_dim = (int64_t) hp.n_head * hp.head_dim, kv_dim = (int64_t) hp.n_head_kv * hp.head_dim;
    draft.fc          = tensor("fc.weight", { hp.n_taps() * n_embd, n_embd });
    draft.hidden_norm = tensor("enc.output_norm.weight", { n_embd });
    draft.output_norm = tensor("output_norm.weight", { n_embd });
    draft.layers.resize(hp.n_layer);
    for (int32_t il = 0; il < hp.n_layer; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        draft_layer & l = draft.layers[il];
        l.attn_norm   = tensor(p + "attn_norm.weight",   { n_embd });
        l.wq          = tensor(p + "attn_q.weight",      { n_embd, q_dim });
        l.wk          = tensor(p + "attn_k.weight",      { n_embd, kv_dim });
        l.wv          = tensor(p + "attn_v.weight",      { n_embd, kv_dim });
        l.wo          = tensor(p + "attn_output.weight", { q_dim, n_embd });
        l.attn_q_norm = tensor(p + "attn_q_norm.weight", { hp.head_dim });
        l.attn_k_norm = tensor(p + "attn_k_norm.weight", { hp.head_dim });
        l.ffn_norm    = tensor(p + "ffn_norm.weight",    { n_embd });
        l.ffn_gate    = tensor(p + "ffn_gate.weight",    { n_embd, hp.n_ff });
        l.ffn_up      = tensor(p + "ffn_up.weight",      { n_embd, hp.n_ff });
        l.ffn_down    = tensor(p + "ffn_down.weight",    { hp.n_ff, n_embd });
    }

    // read every tensor's bytes from the file into one backend buffer
    draft.buf = ggml_backend_alloc_ctx_tensors_from_buft(meta, buft);
    if (draft.buf == nullptr) {
        fail(path, "cannot allocate the draft's weights");
    }
    ggml_backend_buffer_set_usage(draft.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    std::unique_ptr<FILE, int (*)(FILE *)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
    if (!f) {
        fail(path, "cannot open for reading");
    }
    const uint64_t file_size = std::filesystem::file_size(path, ec);
    const size_t data_offset = gguf_get_data_offset(gguf.get());
    std::vector<uint8_t> staging;
    for (int64_t i = 0; i < gguf_get_n_tensors(gguf.get()); ++i) {
        const char * name = gguf_get_tensor_name(gguf.get(), i);
        ggml_tensor * t = ggml_get_tensor(meta, name);
        const size_t offset = data_offset + gguf_get_tensor_offset(gguf.get(), i);
        const size_t nbytes = ggml_nbytes(t);
        if (offset + nbytes > file_size) {
            fail(path, std::string("truncated: tensor '") + name + "' ends at byte " + std::to_string(offset + nbytes) +
                       " but the file has " + std::to_string(file_size));
        }
        staging.resize(nbytes);
        if (std::fseek(f.get(), (long) offset, SEEK_SET) != 0 || std::fread(staging.data(), 1, nbytes, f.get()) != nbytes) {
            fail(path, std::string("cannot read tensor '") + name + "'");
        }
        ggml_backend_tensor_set(t, staging.data(), 0, nbytes);
    }
}

void check_draft_fits_target(const draft_model & draft, const llama_model * target) {
    const draft_hparams & hp = draft.hparams;
    const std::string & path = draft.path;
    const int32_t t_embd  = llama_model_n_embd(target);
    const int32_t t_layer = llama_model_n_layer(target);
    const int32_t t_vocab = llama_vocab_n_tokens(llama_model_get_vocab(target));

    if (hp.n_embd != t_embd) {
        fail(path, "draft hidden size " + std::to_string(hp.n_embd) + " does not match the target's " +
                   std::to_string(t_embd) + ": this draft was made for another target");
    }
    if (hp.n_vocab != 0 && hp.n_vocab != t_vocab) {
        fail(path, "draft vocabulary has " + std::to_string(hp.n_vocab) + " tokens, the target's has " +
                   std::to_string(t_vocab) + ": this draft was made for another target");
    }
    for (const int32_t id : hp.target_layer_ids) {
        if (id < 0 || id >= t_layer) {
            fail(path, "draft reads target layer " + std::to_string(id) + " but the target has " +
                       std::to_string(t_layer) + " layers (valid ids 0.." + std::to_string(t_layer - 1) + ")");
        }
    }
    if (hp.mask_token_id < 0 || hp.mask_token_id >= t_vocab) {
        fail(path, "mask token id " + std::to_string(hp.mask_token_id) + " is outside the target's vocabulary of " +
                   std::to_string(t_vocab) + " tokens");
    }
}

} // namespace dflash
