#include "engine.h"

#include "log.h"
#include "selector.h"

#include "ggml-backend.h"

#include <algorithm>
#include <stdexcept>

namespace dflash {

engine::engine(const engine_params & params) {
    log_init(params.verbose);
    target_ = std::make_unique<target_runner>(params.target);
    if (params.draft_path.empty()) {
        return;
    }
    draft_model_ = std::make_unique<draft_model>();
    ggml_backend_dev_t device = draft_device(target_->model());  // the GPU of an offloaded target, or the CPU
    load_draft(*draft_model_, params.draft_path,
               device ? ggml_backend_dev_buffer_type(device) : ggml_backend_cpu_buffer_type());
    check_draft_fits_target(*draft_model_, target_->model());
    if (draft_model_->hparams.block_size > target_->n_ctx()) {
        throw std::invalid_argument("the context (" + std::to_string(target_->n_ctx()) + " tokens) is smaller than one draft block (" +
                                    std::to_string(draft_model_->hparams.block_size) + " tokens): raise n_ctx / -c");
    }
    // a verify of up to block_size tokens keeps at least its first: at most block_size - 1 are rolled back
    target_->reserve_rollback(draft_model_->hparams.block_size - 1);
    const int32_t n_threads = params.target.n_threads > 0 ? params.target.n_threads
                                                          : (int32_t) llama_n_threads(target_->context());
    draft_runner_ = std::make_unique<draft_runner>(*draft_model_, target_->model(), target_->n_ctx(), n_threads,
                                                   params.compact_draft_head, device);
}

draft_runner & engine::draft() {
    if (!draft_runner_) {
        throw std::logic_error("no draft model was loaded");
    }
    return *draft_runner_;
}

const draft_hparams & engine::hparams() const {
    if (!draft_model_) {
        throw std::logic_error("no draft model was loaded");
    }
    return draft_model_->hparams;
}

// The adaptive loop starts from step costs measured once per block size (the first adaptive
// generation pays for it, as llama.cpp's warm-up decode at load; its time is in the policy summary)
// and from the probe wait the last generation of that size left.
const step_costs * engine::measured_step_costs(int32_t block_size) const {
    const auto it = policy_memory_.find(block_size);
    return it == policy_memory_.end() || it->second.costs.verify.empty() ? nullptr : &it->second.costs;
}

generate_result engine::generate(const std::vector<int32_t> & prompt, const generate_params & params,
                                 const token_callback & on_tokens) {
    policy_memory * memory = params.adaptive ? &policy_memory_[params.block_size.value_or(hparams().block_size)] : nullptr;
    return generate_speculative(*target_, draft(), prompt, params, on_tokens, memory);
}

generate_result engine::autoregressive(const std::vector<int32_t> & prompt, const generate_params & params,
                                       const token_callback & on_tokens) {
    return generate_autoregressive(*target_, prompt, params, on_tokens);
}

std::vector<generate_result> engine::autoregressive_batch(const std::vector<std::vector<int32_t>> & prompts,
                                                          const generate_params & params) {
    return generate_autoregressive_batch(*target_, prompts, params);
}

std::vector<float> engine::target_logits(const std::vector<int32_t> & tokens, bool one_at_a_time, int32_t n_prefill) {
    const int32_t n = (int32_t) tokens.size();
    if (n == 0) {
        throw std::invalid_argument("target_logits of an empty token list");
    }
    const size_t n_vocab = (size_t) target_->n_vocab();
    std::vector<float> out((size_t) n * n_vocab);
    target_->rollback(0);
    target_->set_capture({});
    if (!one_at_a_time) {
        target_->decode(tokens.data(), n, 0, /*all_logits=*/true);
        for (int32_t i = 0; i < n; ++i) {
            std::copy_n(target_->logits(i), n_vocab, out.data() + (size_t) i * n_vocab);
        }
    } else {
        n_prefill = std::max(1, std::min(n_prefill, n));
        target_->decode(tokens.data(), n_prefill, 0, /*all_logits=*/true);
        for (int32_t i = 0; i < n_prefill; ++i) {
            std::copy_n(target_->logits(i), n_vocab, out.data() + (size_t) i * n_vocab);
        }
        for (int32_t i = n_prefill; i < n; ++i) {
            target_->decode(&tokens[i], 1, i, false);
            std::copy_n(target_->logits(0), n_vocab, out.data() + (size_t) i * n_vocab);
        }
    }
    target_->rollback(0);
    return out;
}

std::vector<float> engine::capture(const std::vector<int32_t> & tokens, const std::vector<int32_t> & layer_ids) {
    if (tokens.empty()) {
        throw std::invalid_argument("capture of an empty token list");
    }
    target_->rollback(0);
    target_->set_capture(layer_ids);
    target_->decode(tokens.data(), (int32_t) tokens.size(), 0, false);
    std::vector<float> out = target_->features();
    target_->rollback(0);
    return out;
}

draft_trace engine::trace_draft(const std::vector<float> & features, int32_t n_ctx_tokens, const std::vector<int32_t> & block) {
    draft_runner & d = draft();
    const size_t row = (size_t) d.hparams().n_taps() * d.hparams().n_embd;
    if (n_ctx_tokens < 0 || features.size() != (size_t) n_ctx_tokens * row) {
        throw std::invalid_argument("features must be [" + std::to_string(n_ctx_tokens) + ", " + std::to_string(row) +
                                    "], got " + std::to_string(features.size()) + " values");
    }
    for (const int32_t t : block) {
        if (t < 0 || t >= d.n_vocab()) {
            throw std::invalid_argument("block token " + std::to_string(t) + " is outside the vocabulary");
        }
    }
    draft_trace trace;
    block_output out;
    d.crop(0);
    try {
        d.inject(features.data(), n_ctx_tokens, 0, &trace);
        d.forward_block(block.data(), (int32_t) block.size(), n_ctx_tokens, out, &trace);
        if (d.hparams().variant().has(draft_head::selector)) {  // the greedy walk over the drafted slots
            candidate_selector(d).trace(out, block.front(), trace);
        }
    } catch (...) {
        d.crop(0);
        throw;
    }
    d.crop(0);
    return trace;
}

} // namespace dflash
