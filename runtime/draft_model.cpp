#include "draft_model.h"

#include "gguf_info.h"

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

// Bounds on every count before anything is sized from it (LLAMA_MAX_LAYERS for the depth).
constexpr int64_t MAX_LAYERS = 512, MAX_EMBD = 65536, MAX_HEADS = 1024, MAX_HEAD_DIM = 1024,
                  MAX_FF = 1 << 20, MAX_BLOCK = 1024;

// The refusal list of dflash_llama/schema.py (REFUSALS): keys the pinned llama.cpp reads and this
// runtime does not implement. tests/test_schema.py holds the two lists to the same entries.
void refuse_unsupported(const gguf_keys & kv, const std::string & path) {
    for (const char * key : { "dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank",
                              "dflash.selector_top_k" }) {
        if (kv.has(key)) {
            fail(path, std::string("'") + key + "': DFlash2 drafts (convolutions + candidate selector) are not supported yet");
        }
    }
    for (const char * key : { "dflash.attention.value_scale", "dflash.attention.scale",
                              "dflash.has_confidence_head", "dflash.hyper_connection.count" }) {
        if (kv.has(key)) {
            fail(path, std::string("'") + key + "' is not supported by this runtime yet");
        }
    }
    const std::string act = kv.string_or("dflash.hidden_activation", "silu");
    if (act != "silu") {
        fail(path, "'dflash.hidden_activation' is '" + display_string(act) + "': only silu FFNs are supported");
    }
    if (kv.boolean_or("dflash.sample_from_anchor", false)) {
        fail(path, "'dflash.sample_from_anchor' is true: DSpark drafts are not supported yet");
    }
}

// Sizes: every count bounded before anything is allocated from it.
void read_sizes(const gguf_keys & kv, draft_hparams & hp) {
    hp.n_embd    = (int32_t) kv.integer("dflash.embedding_length", 1, MAX_EMBD);
    hp.n_layer   = (int32_t) kv.integer("dflash.block_count", 1, MAX_LAYERS);
    hp.n_head    = (int32_t) kv.integer("dflash.attention.head_count", 1, MAX_HEADS);
    hp.n_head_kv = (int32_t) kv.integer_or("dflash.attention.head_count_kv", hp.n_head, 1, hp.n_head);
    if (hp.n_head % hp.n_head_kv != 0) {
        kv.fail("dflash.attention.head_count_kv", std::to_string(hp.n_head_kv),
                "a divisor of dflash.attention.head_count (" + std::to_string(hp.n_head) + ")");
    }
    const int64_t head_dim_default = hp.n_embd / hp.n_head;
    hp.head_dim  = (int32_t) kv.integer_or("dflash.attention.key_length", head_dim_default, 1, MAX_HEAD_DIM);
    if (hp.head_dim < 1) {
        kv.fail("dflash.attention.head_count", std::to_string(hp.n_head),
                "at most dflash.embedding_length (" + std::to_string(hp.n_embd) + ") without a key_length");
    }
    for (const char * key : { "dflash.attention.value_length", "dflash.rope.dimension_count" }) {
        if (kv.integer_or(key, hp.head_dim, 1, MAX_HEAD_DIM) != hp.head_dim) {
            fail(kv.path(), std::string("'") + key + "' different from key_length is not supported yet");
        }
    }
    hp.n_ff       = (int32_t) kv.integer("dflash.feed_forward_length", 1, MAX_FF);
    hp.block_size = (int32_t) kv.integer_or("dflash.block_size", 16, 2, MAX_BLOCK);
    if (kv.has("tokenizer.ggml.tokens")) {
        const size_t n = kv.n_strings("tokenizer.ggml.tokens");
        if (n > (size_t) INT32_MAX) {
            kv.fail("tokenizer.ggml.tokens", std::to_string(n) + " tokens", "at most 2^31 - 1");
        }
        hp.n_vocab = (int32_t) n;
    }
}

// M-RoPE sections, as drafts for M-RoPE targets (Qwen3.5/3.6) carry them. The pinned graph then ropes
// with ggml_rope_multi; a text position is the same in the temporal, height and width sections and 0
// in the fourth, so sections [s, 0, 0, 0] put every frequency on the temporal position: exactly the
// NeoX RoPE this graph computes (and the published model's 1-D rotary). Other sections would rope
// some frequencies with another position: refused.
void read_rope_sections(const gguf_keys & kv) {
    const char * key = "dflash.rope.dimension_sections";
    if (!kv.has(key)) {
        return;
    }
    const std::vector<int64_t> s = kv.integers(key, 4, 0, MAX_HEAD_DIM);
    for (size_t i = 1; i < s.size(); ++i) {
        if (s[i] != 0) {
            std::string shown;
            for (const int64_t v : s) {
                shown += (shown.empty() ? "" : ", ") + std::to_string(v);
            }
            fail(kv.path(), std::string("'") + key + "' is [" + shown + "]: only the temporal M-RoPE section is "
                            "supported ([n, 0, 0, 0], as drafts for M-RoPE targets carry)");
        }
    }
}

// RoPE, norms and scales: types checked, floats finite and in range.
void read_scalars(const gguf_keys & kv, draft_hparams & hp) {
    constexpr double big = 1e30;
    hp.rope_freq_base = (float) kv.number_or("dflash.rope.freq_base", 10000.0, 1e-30, big);
    const std::string scaling = kv.string_or("dflash.rope.scaling.type", "none");
    if (scaling == "linear") {
        hp.rope_freq_scale = (float) (1.0 / kv.number_or("dflash.rope.scaling.factor", 1.0, 1e-6, 1e6));
    } else if (scaling != "none") {
        fail(kv.path(), "'dflash.rope.scaling.type' is '" + display_string(scaling) +
                        "': only none and linear RoPE scaling are supported");
    }
    read_rope_sections(kv);
    hp.rms_eps         = (float) kv.number("dflash.attention.layer_norm_rms_epsilon", 0.0, 1.0);
    hp.embedding_scale = (float) kv.number_or("dflash.embedding_scale", 1.0, -big, big);
    hp.logit_scale     = (float) kv.number_or("dflash.logit_scale", 1.0, -big, big);
    hp.logit_softcap   = (float) kv.number_or("dflash.final_logit_softcapping", 0.0, 0.0, big);
    hp.causal = kv.has("dflash.attention.causal") ? (kv.boolean_or("dflash.attention.causal", false) ? 1 : 0) : -1;
}

draft_hparams read_hparams(const gguf_context * ctx, const std::string & path) {
    const gguf_keys kv{ctx, path};

    const std::string arch = kv.string_or("general.architecture", "");
    if (arch != "dflash") {
        fail(path, "general.architecture is '" + display_string(arch) + "', expected 'dflash' (a DFlash draft GGUF)");
    }
    refuse_unsupported(kv, path);

    draft_hparams hp;
    read_sizes(kv, hp);
    read_scalars(kv, hp);

    hp.sliding_window = (int32_t) kv.integer_or("dflash.attention.sliding_window", 0, 0, INT32_MAX);
    hp.swa_layers.assign(hp.n_layer, false);
    if (hp.sliding_window > 0) {
        // llama.cpp requires the pattern with a window
        const auto pattern = kv.integers("dflash.attention.sliding_window_pattern", MAX_LAYERS, 0, 1);
        if ((int32_t) pattern.size() != hp.n_layer) {
            fail(path, "'dflash.attention.sliding_window_pattern' has " + std::to_string(pattern.size()) +
                       " entries for " + std::to_string(hp.n_layer) + " layers");
        }
        for (int32_t il = 0; il < hp.n_layer; ++il) {
            hp.swa_layers[il] = pattern[il] != 0;
        }
    }

    if (!kv.has("dflash.target_layers")) {
        kv.missing("dflash.target_layers", "the target layers the draft reads; convert the draft with "
                                           "`dflash-llama convert`, which writes the default ids");
    }
    for (const int64_t id : kv.integers("dflash.target_layers", MAX_LAYERS, 0, MAX_LAYERS)) {
        hp.target_layer_ids.push_back((int32_t) id - 1);  // the GGUF stores "input of layer id+1"
    }
    if (hp.target_layer_ids.empty()) {
        fail(path, "dflash.target_layers is empty");
    }

    if (!kv.has("tokenizer.ggml.mask_token_id")) {
        kv.missing("tokenizer.ggml.mask_token_id", "the draft's MASK token");
    }
    hp.mask_token_id = (int32_t) kv.integer("tokenizer.ggml.mask_token_id", 0, INT32_MAX);
    return hp;
}

// Every tensor must be one this runtime reads: a DFlash2, DSpark or extra per-layer tensor changes
// what llama.cpp computes, and ignoring it would be a silent wrong answer. So would a draft's own
// token_embd, or its own output head over the whole vocabulary: llama.cpp uses them, the graph here
// uses the target's. An own head with a d2t is a reduced vocabulary, which the graph reads.
void refuse_unknown_tensors(const gguf_context * ctx, int32_t n_layer, const std::string & path) {
    static const char * const layer_names[] = { "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
        "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate.weight",
        "ffn_up.weight", "ffn_down.weight" };
    const bool has_d2t = gguf_find_tensor(ctx, "d2t") >= 0;
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx); ++i) {
        const std::string name = display_string(gguf_get_tensor_name(ctx, i), 200);
        if (name == "token_embd.weight" || (name == "output.weight" && !has_d2t)) {
            fail(path, "tensor '" + name + "': the runtime uses the target's embeddings and head; "
                       "a draft with its own is not supported by this runtime" +
                       std::string(name == "output.weight" ? " (an own head needs a d2t: a reduced vocabulary)" : ""));
        }
        bool known = name == "fc.weight" || name == "enc.output_norm.weight" || name == "output_norm.weight" ||
                     name == "d2t" || name == "output.weight";
        for (int32_t il = 0; il < n_layer && !known; ++il) {
            for (const char * suffix : layer_names) {
                known = known || name == "blk." + std::to_string(il) + "." + suffix;
            }
        }
        if (!known) {
            fail(path, "tensor '" + name + "' is not supported by this runtime (DFlash2, DSpark or extra "
                       "per-layer tensors)");
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
    std::string why;
    std::unique_ptr<gguf_context, void (*)(gguf_context *)> gguf(open_gguf(path, &meta, why), &gguf_free);
    if (!gguf) {
        fail(path, "not a readable GGUF file (bad magic, corrupt or truncated header)" +
                   (why.empty() ? "" : ": " + why));
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
        for (; i < GGML_MAX_DIMS; ++i) {
            if (t->ne[i] != 1) {
                fail(path, "tensor '" + name + "' has ne[" + std::to_string(i) + "] = " + std::to_string(t->ne[i]) +
                           ", expected " + std::to_string(shape.size()) + " dimensions");
            }
        }
        check_tensor_type(path, name, (int) t->type, name == "d2t" ? tensor_role::index
                                                     : shape.size() == 1 ? tensor_role::norm : tensor_role::matrix);
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

    if (ggml_get_tensor(meta, "d2t") != nullptr) {  // a reduced vocabulary: an own head over its rows
        const int64_t n_draft_vocab = ggml_get_tensor(meta, "d2t")->ne[0];
        if (n_draft_vocab < 1 || n_draft_vocab > INT32_MAX) {
            fail(path, "tensor 'd2t' has " + std::to_string(n_draft_vocab) + " entries");
        }
        draft.d2t    = tensor("d2t", { n_draft_vocab });
        if (ggml_get_tensor(meta, "output.weight") == nullptr) {
            fail(path, "tensor 'd2t' (a reduced vocabulary) needs the draft's own 'output.weight' over its " +
                       std::to_string(n_draft_vocab) + " rows");
        }
        draft.output = tensor("output.weight", { n_embd, n_draft_vocab });
    }

    check_tensors_in_file(gguf.get(), path);  // before any buffer is sized from the header

    // fc multiplies the target's hidden states as captured. A backend multiplies an f16 weight with its
    // activations converted to f16, and some targets' residual streams pass f16's 65,504 (Gemma 3 270M:
    // 101,960 at the BOS token), which turns the draft's whole context into inf: an f16 fc is widened
    // to f32 as it is read (exact; the file is unchanged).
    const bool widen_fc = draft.fc->type == GGML_TYPE_F16;
    if (widen_fc) {
        draft.fc->type  = GGML_TYPE_F32;
        draft.fc->nb[0] = sizeof(float);
        for (int d = 1; d < GGML_MAX_DIMS; ++d) {
            draft.fc->nb[d] = draft.fc->nb[d - 1] * draft.fc->ne[d - 1];
        }
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
    std::vector<uint8_t> staging;
    for (int64_t i = 0; i < gguf_get_n_tensors(gguf.get()); ++i) {
        const char * name = gguf_get_tensor_name(gguf.get(), i);
        ggml_tensor * t = ggml_get_tensor(meta, name);
        const size_t offset = gguf_get_data_offset(gguf.get()) + gguf_get_tensor_offset(gguf.get(), i);
        const bool widen = widen_fc && t == draft.fc;
        const size_t nbytes = widen ? (size_t) ggml_nelements(t) * sizeof(ggml_fp16_t) : ggml_nbytes(t);
        staging.resize(nbytes);
        if (std::fseek(f.get(), (long) offset, SEEK_SET) != 0 || std::fread(staging.data(), 1, nbytes, f.get()) != nbytes) {
            fail(path, std::string("cannot read tensor '") + display_string(name) + "'");
        }
        if (widen) {
            std::vector<float> f32((size_t) ggml_nelements(t));
            ggml_fp16_to_fp32_row((const ggml_fp16_t *) staging.data(), f32.data(), ggml_nelements(t));
            ggml_backend_tensor_set(t, f32.data(), 0, ggml_nbytes(t));
        } else {
            ggml_backend_tensor_set(t, staging.data(), 0, nbytes);
        }
        if (t == draft.d2t) {
            const auto * ids = (const int64_t *) staging.data();
            for (int64_t j = 0; j < t->ne[0]; ++j) {
                if (ids[j] < 0 || ids[j] > INT32_MAX) {
                    fail(path, "tensor 'd2t': entry " + std::to_string(j) + " is " + std::to_string(ids[j]) +
                               ", not a token id");
                }
                draft.d2t_ids.push_back((int32_t) ids[j]);
            }
        }
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
    std::vector<bool> seen(t_vocab, false);
    for (size_t j = 0; j < draft.d2t_ids.size(); ++j) {
        const int32_t id = draft.d2t_ids[j];
        if (id >= t_vocab) {
            fail(path, "d2t maps draft row " + std::to_string(j) + " to token " + std::to_string(id) +
                       ", outside the target's vocabulary of " + std::to_string(t_vocab) + " tokens");
        }
        if (seen[id]) {
            fail(path, "d2t maps two draft rows to token " + std::to_string(id));
        }
        seen[id] = true;
    }
}

} // namespace dflash
