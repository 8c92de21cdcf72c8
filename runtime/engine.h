// A target and (optionally) a DFlash draft loaded together and checked against each other: what the
// CLI and the Python API drive. Without a draft it decodes autoregressively only.
//
// Threads: with measure_threads (-t not given) the engine measures a plain decode (and with a draft
// a verify of its block: thread_choice::cost) at 1, 2 and all hardware threads before its first
// generation and keeps the fastest (ggml's threads wait for each
// other: when another process holds a core, fewer threads decode faster). When a generation's plain
// steps run kDrift times slower than measured, over kDriftSteps of them or more, it measures again
// before the next generation; only when that picks another count does the adaptive loop measure its
// step costs again and start over (what it learned at the count still in use stays: learning it
// again costs probes, a large share of a short generation). Else target.n_threads as given (0 or -1:
// all hardware threads, as llama.cpp).
#pragma once

#include "draft_graph.h"
#include "draft_model.h"
#include "speculative.h"
#include "target.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dflash {

struct engine_params {
    target_params target;
    std::string   draft_path;  // "" = no draft
    bool          compact_draft_head = true;  // draft proposals through a Q4_0 copy of the target's head
    bool          measure_threads = false;    // choose target.n_threads by measurement (-t not given)
    bool          verbose = false;
};

class engine {
public:
    explicit engine(const engine_params & params);

    bool has_draft() const { return draft_runner_ != nullptr; }
    target_runner &       target()       { return *target_; }
    draft_runner &        draft();
    const dflash::draft_hparams & hparams() const;

    generate_result generate(const std::vector<int32_t> & prompt, const generate_params & params,
                             const token_callback & on_tokens = {});
    generate_result autoregressive(const std::vector<int32_t> & prompt, const generate_params & params,
                                   const token_callback & on_tokens = {});
    // The step costs the adaptive loop measured for a block size (at its first generation of that
    // size); nullptr before.
    const step_costs * measured_step_costs(int32_t block_size) const;
    // Drop what the adaptive loop learned from earlier generations (acceptance, probe waits, costs as
    // it kept them): the next starts as a new engine's first would, from the measured step costs.
    void forget_policy();

    // Plain decoding of many prompts side by side (needs target.n_seq > 1 for any gain).
    std::vector<generate_result> autoregressive_batch(const std::vector<std::vector<int32_t>> & prompts,
                                                      const generate_params & params);

    // Target logits of every token ([n, n_vocab]): in one batched decode, or one token at a time
    // (after a batched prefill of the first `n_prefill` tokens). Equal bit for bit when the build is
    // exact (see CMakeLists.txt: DFLASH_LLAMA_SGEMM).
    std::vector<float> target_logits(const std::vector<int32_t> & tokens, bool one_at_a_time, int32_t n_prefill);

    // Target features of `tokens` at the draft's target layers (or `layer_ids`): [n, n_taps * n_embd].
    std::vector<float> capture(const std::vector<int32_t> & tokens, const std::vector<int32_t> & layer_ids);

    // Every named draft intermediate for given context features ([n_ctx_tokens, n_taps * n_embd]) at
    // positions 0.., and a block at the following positions; for a DFlash 2 draft also the selector's
    // greedy walk from block[0] (selector.h: selector_*), for a DSpark draft its greedy Markov chain
    // from block[0] (markov.h: markov_*, biased_logits, confidence). The draft cache is left empty.
    draft_trace trace_draft(const std::vector<float> & features, int32_t n_ctx_tokens, const std::vector<int32_t> & block);

    // The thread count in use and why (before the first generation: as given, or all CPUs until measured).
    const thread_choice & threads() const { return threads_; }
    // Measure the thread count again before the next generation, as after a drift (no-op when given).
    void remeasure_threads() { threads_due_ = threads_.measured; }

    static constexpr double  kDrift      = 1.5;  // plain steps this much slower than measured: measure again
    static constexpr int32_t kDriftSteps = 8;    // over at least this many plain steps of a generation

private:
    void ensure_threads();                        // measure the thread count when due
    void set_threads(int32_t n_threads);
    void check_drift(double plain_ms, int32_t n_plain);  // after a generation: its plain steps' cost

    thread_choice threads_;
    bool          threads_due_ = false;  // measure before the next generation
    std::map<int32_t, policy_memory> policy_memory_;  // per block size: the adaptive loop's, between generations
    std::unique_ptr<target_runner> target_;
    std::unique_ptr<draft_model>   draft_model_;
    std::unique_ptr<draft_runner>  draft_runner_;
};

} // namespace dflash
