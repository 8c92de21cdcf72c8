#include "target_check.h"

#include "gguf_info.h"

#include "ggml.h"
#include "gguf.h"
#include "llama-model.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <unordered_set>

namespace dflash {

namespace {

constexpr int64_t MAX_LAYERS = 512, MAX_EXPERTS = 1024;  // LLAMA_MAX_LAYERS, LLAMA_MAX_EXPERTS

// Architectures whose llama.cpp graph asserts that RoPE rotates the whole head (src/models/*.cpp:
// GGML_ASSERT(n_embd_head == n_rot)).
const char * const FULL_ROPE_ARCHS[] = {
    "apertus", "arcee", "arctic", "baichuan", "chameleon", "codeshell", "cogvlm", "cohere2moe", "dbrx", "deci",
    "deepseek", "dots1", "dream", "ernie4_5", "ernie4_5-moe", "exaone-moe", "exaone", "exaone4", "falcon",
    "granite_swa", "graniteswitch", "granite", "grok", "grovemoe", "hunyuan-moe", "hunyuan_vl", "hy_v3",
    "internlm2", "jais2", "llada-moe", "llada", "llama", "llama4", "maincoder", "mellum", "minimax-01",
    "minimax-m2", "mistral3", "nemotron", "olmo", "olmo2", "olmoe", "orion", "paddleocr", "plamo", "pockettts",
    "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe", "qwen3vl", "qwen3vlmoe", "rnd1", "seed_oss",
    "smallthinker", "smollm3", "starcoder2", "talkie", "xverse",
};

[[noreturn]] void refuse_non_causal(const std::string & path, const std::string & arch, const std::string & why) {
    throw std::invalid_argument(path + ": " + display_string(arch) + ": " + why + ", expected a causal target "
                                "(the verify would let each drafted token see the ones after it, so speculative "
                                "output would differ from plain decoding)");
}

// The first entry of a scalar-or-per-layer integer key (llama.cpp's get_key_or_arr), -1 if absent.
int64_t first_of(const gguf_keys & kv, const std::string & key, int64_t n_layer) {
    const int64_t id = kv.find(key);
    if (id < 0) {
        return -1;
    }
    if (gguf_get_kv_type(kv.ctx(), id) == GGUF_TYPE_ARRAY) {
        const auto v = kv.integers(key, (size_t) n_layer, 0, INT32_MAX);
        return v.empty() ? -1 : v[0];
    }
    return kv.integer(key, 0, INT32_MAX);
}

void check_experts(const gguf_keys & kv, const std::string & a, int64_t n_layer) {
    const int64_t n_expert = kv.integer_or(a + "expert_count", 0, 0, MAX_EXPERTS);
    const int64_t groups   = kv.integer_or(a + "expert_group_count", 0, 0, n_expert > 0 ? n_expert - 1 : 0);
    int64_t used = 0;
    if (kv.has(a + "expert_used_count")) {
        const int64_t id = kv.find(a + "expert_used_count");
        const bool arr = gguf_get_kv_type(kv.ctx(), id) == GGUF_TYPE_ARRAY;
        for (const int64_t u : arr ? kv.integers(a + "expert_used_count", (size_t) n_layer, 0, n_expert)
                                   : std::vector<int64_t>{ kv.integer(a + "expert_used_count", 0, n_expert) }) {
            used = std::max(used, u);
        }
        if (n_expert > 0 && used == 0) {
            kv.fail(a + "expert_used_count", "0", "at least 1 in some layer (a mixture of experts routes a token)");
        }
    } else if (n_expert > 0) {
        kv.missing(a + "expert_used_count", "a mixture of experts routes at least one expert per token");
    }
    if (groups > 1) {
        if (n_expert % groups != 0) {
            kv.fail(a + "expert_group_count", std::to_string(groups),
                    "a divisor of " + a + "expert_count (" + std::to_string(n_expert) + ")");
        }
        kv.integer(a + "expert_group_used_count", 1, groups - 1);
    }
}

void check_attention(const gguf_keys & kv, const std::string & arch, int64_t n_layer) {
    const std::string a = arch + ".";
    if (!kv.boolean_or(a + "attention.causal", true)) {
        refuse_non_causal(kv.path(), arch, a + "attention.causal is false");
    }
    for (const char * eps : { "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon" }) {
        kv.number_or(a + eps, 0.0, 0.0, 1.0);
    }
    const std::string scaling = kv.string_or(a + "rope.scaling.type", "linear");
    if (scaling != "none" && scaling != "linear" && scaling != "yarn" && scaling != "longrope") {
        kv.fail(a + "rope.scaling.type", "'" + display_string(scaling) + "'", "none, linear, yarn or longrope");
    }
    if (std::find_if(std::begin(FULL_ROPE_ARCHS), std::end(FULL_ROPE_ARCHS),
                     [&](const char * n) { return arch == n; }) == std::end(FULL_ROPE_ARCHS)) {
        return;
    }
    const int64_t n_embd = kv.integer_or(a + "embedding_length", 0, 0, INT32_MAX);
    const int64_t n_head = first_of(kv, a + "attention.head_count", n_layer);
    if (n_head <= 0 || !kv.has(a + "rope.dimension_count")) {
        return;
    }
    const int64_t head = kv.integer_or(a + "attention.key_length", n_embd / n_head, 0, INT32_MAX);
    const int64_t n_rot = kv.integer(a + "rope.dimension_count", 0, INT32_MAX);
    if (n_rot != head) {
        kv.fail(a + "rope.dimension_count", std::to_string(n_rot),
                "the head size " + std::to_string(head) + " (llama.cpp's " + display_string(arch) +
                " graph rotates whole heads)");
    }
}

// llama.cpp's vocabulary asserts that every token string maps to one id.
void check_tokens(const gguf_keys & kv) {
    const std::string key = "tokenizer.ggml.tokens";
    if (!kv.has(key)) {
        return;
    }
    const size_t n = kv.n_strings(key);
    const int64_t id = kv.find(key);
    std::unordered_set<std::string_view> seen;
    seen.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        const char * s = gguf_get_arr_str(kv.ctx(), id, i);
        if (!seen.insert(std::string_view(s)).second) {
            kv.fail(key + "[" + std::to_string(i) + "]", "'" + display_string(s) + "'",
                    "each token string once (it is also an earlier token)");
        }
    }
}

void check_tensors(const gguf_context * ctx, const std::string & path) {
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx); ++i) {
        const std::string name = gguf_get_tensor_name(ctx, i);
        const int64_t * ne = gguf_get_tensor_ne(ctx, i);
        const bool one_dim = ne[1] == 1 && ne[2] == 1 && ne[3] == 1;
        const bool norm = name.find("norm") != std::string::npos;
        check_tensor_type(path, name, (int) gguf_get_tensor_type(ctx, i),
                          one_dim || norm ? tensor_role::norm : tensor_role::matrix);
    }
}

} // namespace

void check_target_gguf(const std::string & path) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
        throw std::invalid_argument(path + ": is a directory, not a GGUF file");
    }
    std::string why;
    std::unique_ptr<gguf_context, void (*)(gguf_context *)> ctx(open_gguf(path, nullptr, why), &gguf_free);
    if (!ctx) {
        throw std::invalid_argument(path + ": not a readable GGUF file (bad magic, corrupt or truncated header)" +
                                    (why.empty() ? "" : ": " + why));
    }
    const gguf_keys kv{ctx.get(), path};
    if (!kv.has("general.architecture")) {
        kv.missing("general.architecture", "is this a GGUF model?");
    }
    const std::string arch = kv.string_or("general.architecture", "");
    const int64_t n_layer = kv.integer(arch + ".block_count", 1, MAX_LAYERS);
    kv.integer_or(arch + ".nextn_predict_layers", 0, 0, n_layer);
    check_experts(kv, arch + ".", n_layer);
    check_attention(kv, arch, n_layer);
    check_tokens(kv);
    check_tensors(ctx.get(), path);
    check_tensors_in_file(ctx.get(), path);  // llama.cpp's loader would fail without saying which
}

void check_target_causal(const llama_model * model, const std::string & path) {
    if (!model->hparams.causal_attn) {
        char arch[128] = "";
        llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch));
        refuse_non_causal(path, arch, "llama.cpp runs this architecture with bidirectional attention");
    }
}

} // namespace dflash
