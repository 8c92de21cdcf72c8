#include "engine.h"

#include "log.h"
#include "markov.h"
#include "selector.h"

#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <thread>

namespace dflash {

engine::engine(const engine_params & params) {
    log_init(params.verbose);
    target_ = std::make_unique<target_runner>(params.target);
    if (params.draft_path.empty()) {
        threads_.n_threads = (int32_t) llama_n_threads(target_->context());
        threads_due_ = params.measure_threads;
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
    // a verify of the last token and up to max_draft drafted ones keeps at least its first
    target_->reserve_rollback(draft_model_->hparams.max_draft(draft_model_->hparams.block_size));
    const int32_t n_threads = params.target.n_threads > 0 ? params.target.n_threads
                                                          : (int32_t) llama_n_threads(target_->context());
    threads_.n_threads = n_threads;
    threads_due_ = params.measure_threads;
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
// and from what the last generation of that size learned (draft_policy::resume).
const step_costs * engine::measured_step_costs(int32_t block_size) const {
    const auto it = policy_memory_.find(block_size);
    return it == policy_memory_.end() || it->second.costs.verify.empty() ? nullptr : &it->second.costs;
}

void engine::forget_policy() {
    for (auto & [block, memory] : policy_memory_) memory.learned.reset();
}

void engine::set_threads(int32_t n_threads) {
    target_->set_threads(n_threads);
    if (draft_runner_) draft_runner_->set_threads(n_threads);
    threads_.n_threads = n_threads;
}

// A plain decode of one token at each candidate count, the best of three after a warm-up, and with
// a draft a verify of its block (its first two logits rows); the count of the lowest thread_choice::cost is kept: a
// plain step plus a verified token's share of a verify. Quiet, two threads may decode one token no
// faster than one yet verify a block of 8 in two thirds of the time; with a core busy, two lose at
// both. The caches are left empty (every generation starts from scratch).
void engine::ensure_threads() {
    if (!threads_due_) return;
    threads_due_ = false;
    const int32_t before = threads_.measured ? threads_.n_threads : 0;  // 0: the first measurement
    const int32_t n_hw = (int32_t) std::max(1u, std::thread::hardware_concurrency());
    std::vector<int32_t> counts = { 1 };
    for (const int32_t c : { 2, n_hw }) {
        if (c <= n_hw && c != counts.back()) counts.push_back(c);
    }
    const int32_t rows = draft_runner_ ? std::min(hparams().block_size, target_->n_batch()) : 0;
    const std::vector<int32_t> tokens(std::max(rows, 1), 0);
    target_->rollback(0);  // a previous generation's tokens stay cached until the next one starts
    target_->set_capture({});
    const auto best_of = [&](int32_t n) {  // the best of three after a warm-up
        double best = 0.0;
        for (int rep = 0; rep < 4; ++rep) {
            const auto t0 = std::chrono::steady_clock::now();
            target_->decode(tokens.data(), n, 0, /*all_logits=*/n > 1);
            // with our output head, the rows a step reads: a plain step's one, a verify's first two
            // (a step's usual yield); the plain time is then what the loop times (check_drift)
            for (int32_t i = 0; i < std::min(n, 2); ++i) target_->logits(i);
            const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
            target_->rollback(0);
            if (rep == 1 || (rep > 1 && t < best)) best = t;
        }
        return best;
    };
    thread_choice t;
    t.counts = counts;
    t.batch_rows = rows > 1 ? rows : 0;
    for (const int32_t c : counts) {
        set_threads(c);
        t.plain_ms.push_back(best_of(1));
        if (t.batch_rows) t.batch_ms.push_back(best_of(rows));
    }
    size_t pick = 0;
    for (size_t i = 1; i < counts.size(); ++i) {
        if (t.cost(i) < t.cost(pick)) pick = i;
    }
    set_threads(counts[pick]);
    if (before != 0 && counts[pick] != before) {  // measured again, and another count won
        for (auto & [block, memory] : policy_memory_) memory = policy_memory{};  // costs learned at the old count
    }
    t.n_threads    = counts[pick];
    t.measured     = true;
    t.measurements = threads_.measurements + 1;
    threads_ = t;
}

void engine::check_drift(double plain_ms, int32_t n_plain) {
    if (!threads_.measured || n_plain < kDriftSteps || plain_ms <= 0.0) return;
    const size_t i = std::find(threads_.counts.begin(), threads_.counts.end(), threads_.n_threads) - threads_.counts.begin();
    if (i < threads_.plain_ms.size() && plain_ms > kDrift * threads_.plain_ms[i]) threads_due_ = true;
}

generate_result engine::generate(const std::vector<int32_t> & prompt, const generate_params & params,
                                 const token_callback & on_tokens) {
    draft();  // no draft: refused before any measuring
    ensure_threads();
    policy_memory * memory = params.adaptive ? &policy_memory_[params.block_size.value_or(hparams().block_size)] : nullptr;
    generate_result res = generate_speculative(*target_, draft(), prompt, params, on_tokens, memory);
    res.threads = threads_;
    if (res.adaptive) check_drift(res.policy.plain_ms, res.policy.plain_steps);
    return res;
}

generate_result engine::autoregressive(const std::vector<int32_t> & prompt, const generate_params & params,
                                       const token_callback & on_tokens) {
    ensure_threads();
    generate_result res = generate_autoregressive(*target_, prompt, params, on_tokens);
    res.threads = threads_;
    const int32_t n_decodes = res.stats.n_generated - 1;  // the first token comes from the prompt's decode
    if (n_decodes > 0) check_drift(res.stats.t_verify_ms / n_decodes, n_decodes);
    return res;
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
        if (d.hparams().variant().has(draft_head::markov)) {  // the greedy chain over the drafted slots
            markov_chain(d).trace(out, block.front(), trace);
        }
    } catch (...) {
        d.crop(0);
        throw;
    }
    d.crop(0);
    return trace;
}

} // namespace dflash
