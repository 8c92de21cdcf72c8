#include "draft_model.h"

#include "huge_pages.h"

#include "gguf_info.h"

#include "ggml-alloc.h"
#include "gguf.h"
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>

namespace dflash {

const draft_variant DFLASH1 = { "dflash", "DFlash 1", {}, {} };
const draft_variant DFLASH2 = { "dflash2", "DFlash 2", { draft_head::conv, draft_head::selector },
                                { "dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank",
                                  "dflash.selector_top_k" } };
const draft_variant DSPARK  = { "dspark", "DSpark", { draft_head::markov, draft_head::confidence }, {},
                                "markov_w1.weight", /*anchor_first=*/true };

bool draft_variant::has(draft_head head) const {
    return head == draft_head::backbone || std::find(heads.begin(), heads.end(), head) != heads.end();
}

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
    for (const char * key : { "dflash.attention.value_scale", "dflash.attention.scale" }) {
        if (kv.has(key)) {
            fail(path, std::string("'") + key + "' is not supported by this runtime yet");
        }
    }
    if (kv.has("dflash.hyper_connection.count")) {
        fail(path, "'dflash.hyper_connection.count': DSpark drafts on a DeepSeek-V4 backbone are not supported");
    }
    const std::string act = kv.string_or("dflash.hidden_activation", "silu");
    if (act != "silu") {
        fail(path, "'dflash.hidden_activation' is '" + display_string(act) + "': only silu FFNs are supported");
    }
}

// DSpark's heads and the block layout: the rank is markov_w1's ne0 (no key, as the pinned loader
// reads it), the confidence head is conf_proj.weight's presence (dflash.has_confidence_head, when
// present, must agree), the layout dflash.sample_from_anchor (missing: the variant's default), as
// schema._gguf_dspark_fields reads them.
void read_dspark(const gguf_keys & kv, const ggml_context * meta, draft_hparams & hp) {
    const ggml_tensor * w1 = ggml_get_tensor(const_cast<ggml_context *>(meta), DSPARK.marker);
    const bool has_conf = ggml_get_tensor(const_cast<ggml_context *>(meta), "conf_proj.weight") != nullptr;
    if (w1 != nullptr && hp.conv_kernel_size > 0) {
        fail(kv.path(), std::string("tensor '") + DSPARK.marker + "': a DSpark head on a DFlash 2 draft is not supported");
    }
    const bool said_conf = kv.boolean_or("dflash.has_confidence_head", has_conf);
    hp.sample_from_anchor = kv.boolean_or("dflash.sample_from_anchor", w1 != nullptr && DSPARK.anchor_first);
    if (hp.sample_from_anchor && hp.conv_kernel_size > 0) {
        fail(kv.path(), "an anchor-first block (sample_from_anchor) is not supported for DFlash 2 drafts");
    }
    if (w1 == nullptr) {
        return;
    }
    if (w1->ne[0] < 1 || w1->ne[0] > MAX_EMBD || w1->ne[2] != 1 || w1->ne[3] != 1) {
        fail(kv.path(), std::string("tensor '") + DSPARK.marker + "' has ne[0] = " + std::to_string(w1->ne[0]) +
                        ": expected [markov_rank, n_vocab], the rank in 1.." + std::to_string(MAX_EMBD));
    }
    if (said_conf != has_conf) {
        fail(kv.path(), std::string("'dflash.has_confidence_head' = ") + (said_conf ? "True" : "False") +
                        " but the draft " + (has_conf ? "has" : "has no") + " conf_proj.weight");
    }
    hp.markov_rank         = (int32_t) w1->ne[0];
    hp.has_confidence_head = has_conf;
}

// The variant the keys say (a DFlash 2 key present: DFlash 2, as schema.variant_of_gguf and the
// pinned loop read it) and its keys: all of them or none, the first missing one named as
// schema._variant_refusals names it, each a positive integer; then DSpark's heads.
void read_variant(const gguf_keys & kv, const ggml_context * meta, draft_hparams & hp) {
    bool any = false;
    for (const char * key : DFLASH2.keys) {
        any = any || kv.has(key);
    }
    if (!any) {
        read_dspark(kv, meta, hp);
        return;
    }
    std::string all;
    for (const char * key : DFLASH2.keys) {
        all += (all.empty() ? "" : ", ") + std::string(key);
    }
    for (const char * key : DFLASH2.keys) {
        if (!kv.has(key)) {
            fail(kv.path(), std::string("'") + key + "' missing: a " + DFLASH2.title + " draft needs " + all);
        }
    }
    hp.conv_kernel_size = (int32_t) kv.integer("dflash.conv_kernel_size", 1, INT32_MAX);
    hp.conv_group_size  = (int32_t) kv.integer("dflash.conv_group_size", 1, INT32_MAX);
    hp.selector_rank    = (int32_t) kv.integer("dflash.selector_rank", 1, INT32_MAX);
    hp.selector_top_k   = (int32_t) kv.integer("dflash.selector_top_k", 1, INT32_MAX);
    read_dspark(kv, meta, hp);
}

// A DFlash 2 draft's sizes against the backbone's: whole groups of channels, at most the vocabulary's
// tokens as candidates.
void check_variant_sizes(const gguf_keys & kv, const draft_hparams & hp) {
    if (hp.conv_group_size > 0 && hp.n_embd % hp.conv_group_size != 0) {
        kv.fail("dflash.conv_group_size", std::to_string(hp.conv_group_size),
                "a divisor of dflash.embedding_length (" + std::to_string(hp.n_embd) + ")");
    }
    if (hp.selector_top_k > 0 && hp.n_vocab > 0 && hp.selector_top_k > hp.n_vocab) {
        kv.fail("dflash.selector_top_k", std::to_string(hp.selector_top_k),
                "at most the vocabulary's " + std::to_string(hp.n_vocab) + " tokens");
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

draft_hparams read_hparams(const gguf_context * ctx, const ggml_context * meta, const std::string & path) {
    const gguf_keys kv{ctx, path};

    const std::string arch = kv.string_or("general.architecture", "");
    if (arch != "dflash") {
        fail(path, "general.architecture is '" + display_string(arch) + "', expected 'dflash' (a DFlash draft GGUF)");
    }
    draft_hparams hp;
    refuse_unsupported(kv, path);
    read_variant(kv, meta, hp);

    read_sizes(kv, hp);
    check_variant_sizes(kv, hp);
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

// Every tensor a draft may hold, by the variant head it belongs to (schema.TENSORS); per layer:
// after "blk.N.".
struct known_tensor {
    const char * name;
    draft_head   head;
    bool         per_layer;
};

constexpr known_tensor kKnownTensors[] = {
    { "fc.weight", draft_head::backbone, false }, { "enc.output_norm.weight", draft_head::backbone, false },
    { "output_norm.weight", draft_head::backbone, false },
    { "attn_norm.weight", draft_head::backbone, true }, { "attn_q.weight", draft_head::backbone, true },
    { "attn_k.weight", draft_head::backbone, true }, { "attn_v.weight", draft_head::backbone, true },
    { "attn_output.weight", draft_head::backbone, true }, { "attn_q_norm.weight", draft_head::backbone, true },
    { "attn_k_norm.weight", draft_head::backbone, true }, { "ffn_norm.weight", draft_head::backbone, true },
    { "ffn_gate.weight", draft_head::backbone, true }, { "ffn_up.weight", draft_head::backbone, true },
    { "ffn_down.weight", draft_head::backbone, true },
    { "attn_conv_base", draft_head::conv, true }, { "attn_conv_proj.weight", draft_head::conv, true },
    { "ffn_conv_base", draft_head::conv, true }, { "ffn_conv_proj.weight", draft_head::conv, true },
    { "selector_predecessor.weight", draft_head::selector, false },
    { "selector_successor.weight", draft_head::selector, false },
    { "selector_hidden.weight", draft_head::selector, false },
    { "markov_w1.weight", draft_head::markov, false }, { "markov_w2.weight", draft_head::markov, false },
    { "markov_w2.scale", draft_head::markov, false },
    { "conf_proj.weight", draft_head::confidence, false }, { "conf_proj.bias", draft_head::confidence, false },
};

// The entry of kKnownTensors `name` is (a layer index below n_layer), or nullptr.
const known_tensor * find_known_tensor(const std::string & name, int32_t n_layer) {
    std::string rest = name;
    const bool per_layer = name.rfind("blk.", 0) == 0;
    if (per_layer) {
        const size_t dot = name.find('.', 4);
        const std::string index = dot == std::string::npos ? "" : name.substr(4, dot - 4);
        const bool digits = !index.empty() && index.size() <= 4 && (index.size() == 1 || index[0] != '0') &&
                            index.find_first_not_of("0123456789") == std::string::npos;
        if (!digits || std::stoi(index) >= n_layer) {
            return nullptr;
        }
        rest = name.substr(dot + 1);
    }
    for (const known_tensor & t : kKnownTensors) {
        if (t.per_layer == per_layer && rest == t.name) {
            return &t;
        }
    }
    return nullptr;
}

// Every tensor must be one this runtime reads for the draft's variant: a DSpark or extra per-layer
// tensor, or a DFlash 2 one in a draft without the DFlash 2 keys, changes what llama.cpp computes,
// and ignoring it would be a silent wrong answer. So would a draft's own token_embd, or its own output
// head over the whole vocabulary: llama.cpp uses them, the graph here uses the target's. An own head
// with a d2t is a reduced vocabulary, which the graph reads. Messages as schema.refusals words them.
void refuse_unknown_tensors(const gguf_context * ctx, const draft_hparams & hp, const std::string & path) {
    const bool has_d2t = gguf_find_tensor(ctx, "d2t") >= 0;
    const draft_variant & variant = hp.variant();
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx); ++i) {
        const std::string name = display_string(gguf_get_tensor_name(ctx, i), 200);
        if (name == "token_embd.weight" || (name == "output.weight" && !has_d2t)) {
            fail(path, "tensor '" + name + "': the runtime uses the target's embeddings and head; "
                       "a draft with its own is not supported by this runtime" +
                       std::string(name == "output.weight" ? " (an own head needs a d2t: a reduced vocabulary)" : ""));
        }
        if (name == "d2t" || name == "output.weight") {
            continue;
        }
        const known_tensor * known = find_known_tensor(name, hp.n_layer);
        if (known == nullptr) {
            fail(path, "tensor '" + name + "' is not supported by this runtime (extra per-layer tensors or other heads)");
        }
        if (!variant.has(known->head)) {  // named as schema.refusals names it
            const draft_variant & owner = DFLASH2.has(known->head) ? DFLASH2 : DSPARK;
            std::string lacks;
            for (const char * key : owner.keys) {
                lacks += (lacks.empty() ? "" : " / ") + std::string(key);
            }
            fail(path, "tensor '" + name + "': a " + owner.title + " tensor in a " + variant.title + " draft (no " +
                       (lacks.empty() ? std::string(owner.marker) : lacks) + ")");
        }
    }
}

// `tensors` (null ones skipped) in one buffer of host memory, draft.host_buf; the weights buffer
// allocated after it leaves them there.
void allocate_on_host(draft_model & draft, std::initializer_list<ggml_tensor *> tensors) {
    ggml_backend_buffer_type_t host = ggml_backend_cpu_buffer_type();
    const size_t align = ggml_backend_buft_get_alignment(host);
    size_t size = 0;
    for (ggml_tensor * t : tensors) {
        size += t ? GGML_PAD(ggml_backend_buft_get_alloc_size(host, t), align) : 0;
    }
    if (size == 0) {
        return;
    }
    draft.host_buf = ggml_backend_buft_alloc_buffer(host, size);
    if (draft.host_buf == nullptr) {
        fail(draft.path, "cannot allocate the host-side heads (" + std::to_string(size >> 20) + " MiB)");
    }
    ggml_backend_buffer_set_usage(draft.host_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_tallocr alloc = ggml_tallocr_new(draft.host_buf);
    for (ggml_tensor * t : tensors) {
        if (t != nullptr && ggml_tallocr_alloc(&alloc, t) != GGML_STATUS_SUCCESS) {
            fail(draft.path, std::string("cannot place tensor '") + ggml_get_name(t) + "' in host memory");
        }
    }
}

} // namespace

draft_model::~draft_model() {
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    if (host_buf) {
        ggml_backend_buffer_free(host_buf);
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
    if (std::filesystem::is_directory(path, ec)) {
        fail(path, std::filesystem::exists(std::filesystem::path(path) / "config.json", ec)
                       ? "is a folder, not a GGUF file (a Hugging Face draft? convert it first: "
                         "dflash-llama convert " + path + " -m TARGET.gguf -o DRAFT.gguf)"
                       : "is a directory, not a GGUF file");
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
    draft.hparams = read_hparams(gguf.get(), meta, path);
    const draft_hparams & hp = draft.hparams;

    auto tensor_as = [&](const std::string & name, std::initializer_list<int64_t> shape, tensor_role role) {
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
        check_tensor_type(path, name, (int) t->type, role);
        return t;
    };
    auto tensor = [&](const std::string & name, std::initializer_list<int64_t> shape) {
        return tensor_as(name, shape, name == "d2t" ? tensor_role::index
                                      : shape.size() == 1 ? tensor_role::norm : tensor_role::matrix);
    };
    refuse_unknown_tensors(gguf.get(), hp, path);
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
        if (hp.variant().has(draft_head::conv)) {
            const int64_t k = hp.conv_kernel_size, n_dynamic = 2 * k * hp.conv_groups();
            l.attn_conv_base = tensor_as(p + "attn_conv_base", { n_embd, k, 2 }, tensor_role::taps);
            l.attn_conv_proj = tensor(p + "attn_conv_proj.weight", { n_embd, n_dynamic });
            l.ffn_conv_base  = tensor_as(p + "ffn_conv_base", { n_embd, k, 2 }, tensor_role::taps);
            l.ffn_conv_proj  = tensor(p + "ffn_conv_proj.weight", { n_embd, n_dynamic });
        }
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
        if (hp.selector_top_k > n_draft_vocab) {
            fail(path, "dflash.selector_top_k: " + std::to_string(hp.selector_top_k) + ", expected at most the " +
                       std::to_string(n_draft_vocab) + " rows of the reduced vocabulary (d2t)");
        }
    }

    if (hp.variant().has(draft_head::selector)) {
        // rows by target token: the tokenizer's count, else the file's (checked against the target's)
        const ggml_tensor * a = ggml_get_tensor(meta, "selector_predecessor.weight");
        const int64_t n_vocab = hp.n_vocab > 0 ? hp.n_vocab : a != nullptr ? a->ne[1] : 0;
        const int64_t rank = hp.selector_rank;
        draft.selector_predecessor = tensor_as("selector_predecessor.weight", { rank, n_vocab }, tensor_role::rows);
        draft.selector_successor   = tensor_as("selector_successor.weight", { rank, n_vocab }, tensor_role::rows);
        draft.selector_hidden      = tensor("selector_hidden.weight", { n_embd, rank });
    }
    if (hp.variant().has(draft_head::markov)) {
        // W1 rows by target token, W2 rows by draft token (the whole vocabulary, or a reduced one's
        // rows); both read a row at a time by the host, W2 with its type's dot product; an optional
        // f32 factor on W2's product (markov_w2.scale, llama.cpp's per-tensor scale)
        const int64_t n_vocab = hp.n_vocab > 0 ? hp.n_vocab : ggml_get_tensor(meta, DSPARK.marker)->ne[1];
        const int64_t rank = hp.markov_rank;
        draft.markov_w1 = tensor_as(DSPARK.marker, { rank, n_vocab }, tensor_role::rows);
        draft.markov_w2 = tensor_as("markov_w2.weight", { rank, draft.reduced_vocab() ? draft.d2t->ne[0] : n_vocab },
                                    tensor_role::rows);
        if (const ggml_tensor * s = ggml_get_tensor(meta, "markov_w2.scale"); s != nullptr) {
            if (ggml_nelements(s) != 1) {  // in schema's words
                std::string shape;
                for (int d = 0; d < ggml_n_dims(s); ++d) shape += (d ? ", " : "") + std::to_string(s->ne[d]);
                fail(path, "tensor 'markov_w2.scale' has shape [" + shape + "]: expected [1] (one factor)");
            }
            draft.markov_w2_s = tensor("markov_w2.scale", { 1 });
        }
        if (hp.has_confidence_head) {
            draft.conf_proj   = tensor_as("conf_proj.weight", { n_embd + rank, 1 }, tensor_role::rows);
            draft.conf_proj_b = tensor("conf_proj.bias", { 1 });
        }
        for (const ggml_tensor * t : { draft.markov_w1, draft.markov_w2, draft.conf_proj }) {
            if (t != nullptr && t->ne[0] % ggml_blck_size(t->type) != 0) {
                fail(path, "tensor '" + std::string(ggml_get_name(t)) + "': type " + ggml_type_name(t->type) +
                           " needs rows of a multiple of " + std::to_string(ggml_blck_size(t->type)) + " values, got " +
                           std::to_string(t->ne[0]));
            }
        }
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

    // the selector's codebooks and the DSpark heads go to host memory (only the host reads them), the
    // rest into one buffer of `buft`; then every tensor's bytes are read from the file
    allocate_on_host(draft, { draft.selector_predecessor, draft.selector_successor, draft.markov_w1, draft.markov_w2,
                              draft.markov_w2_s, draft.conf_proj, draft.conf_proj_b });
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
        if (t == draft.markov_w2_s) {
            float scale;
            std::memcpy(&scale, staging.data(), sizeof(scale));
            if (!std::isfinite(scale)) {  // in schema.markov_scale's words
                fail(path, std::string("tensor 'markov_w2.scale' is ") + (std::isnan(scale) ? "nan" : scale > 0 ? "inf" : "-inf") +
                           ": expected a finite factor");
            }
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
    collapse_to_huge_pages(draft.buf);  // read into anonymous memory: huge pages where the kernel can
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
    if (draft.selector_predecessor != nullptr && draft.selector_predecessor->ne[1] != t_vocab) {
        fail(path, "the selector's codebooks have " + std::to_string(draft.selector_predecessor->ne[1]) +
                   " rows, the target's vocabulary " + std::to_string(t_vocab) + " tokens: this draft was made for "
                   "another target");
    }
    if (draft.markov_w1 != nullptr && draft.markov_w1->ne[1] != t_vocab) {
        fail(path, "the Markov head has " + std::to_string(draft.markov_w1->ne[1]) + " rows, the target's vocabulary " +
                   std::to_string(t_vocab) + " tokens: this draft was made for another target");
    }
    if (hp.selector_top_k > t_vocab) {
        fail(path, "dflash.selector_top_k: " + std::to_string(hp.selector_top_k) + ", expected at most the target's " +
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

void host_row(const ggml_tensor * t, int64_t row, float * out) {
    const char * data = (const char *) t->data + (size_t) row * t->nb[1];
    if (t->type == GGML_TYPE_F32) {
        std::memcpy(out, data, (size_t) t->ne[0] * sizeof(float));
    } else {
        ggml_get_type_traits(t->type)->to_float(data, out, t->ne[0]);
    }
}

} // namespace dflash
