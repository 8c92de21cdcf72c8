// The DFlash speculative loop (draft a block, verify it in one target decode, keep the longest
// accepted prefix plus one token, roll back) and plain autoregressive decoding, side by side.
#pragma once

#include "draft_graph.h"
#include "draft_policy.h"
#include "sampling.h"
#include "target.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace dflash {

struct generate_params {
    int32_t max_new_tokens = 128;
    sampling_params sampling;
    std::optional<int32_t> block_size;  // unset: the draft's trained block size
    // adaptive: each step verifies the N = 0..max drafted tokens of the highest expected speed
    // (draft_policy.h; N = 0 is a plain decode with no draft forward). Else every step verifies
    // draft_max drafted tokens (unset: max). max: block_size - 1, or block_size for an anchor-first
    // draft (draft_hparams::max_draft).
    bool                   adaptive = true;
    std::optional<int32_t> draft_max;
    // a draft with a confidence head (DSpark): each draft stops before its first slot whose confidence
    // is below this (0: never; llama.cpp's --spec-draft-p-min), so a step may verify none
    float                  draft_p_min = 0.0f;
    // the adaptive loop's n-gram proposal source (ngram.h; unset: on); a fixed draft length drafts
    // every step, so asking for it there is refused
    std::optional<bool>    ngram;
    // the adaptive loop's confidence gate (draft_policy.h; unset: on where the draft has a confidence
    // head): after each draft forward it cuts the draft where the calibrated confidences stop paying
    std::optional<bool>    confidence;
    std::vector<int32_t> stop_tokens;  // in addition to the vocabulary's end-of-generation tokens
    bool    stop_at_eog = true;
};

struct step_record {
    std::vector<int32_t> drafted;   // tokens the target verified (after --draft-max); empty: a plain step
    step_source source = step_source::draft;  // where `drafted` came from (plain: none)
    int32_t accepted = 0;           // drafted tokens the target agreed with
    int32_t produced = 0;           // tokens this step added to the output (accepted + 1, or fewer at a stop)
};

struct generate_stats {
    int32_t n_prompt    = 0;
    int32_t n_generated = 0;
    double  t_prefill_ms = 0.0;
    double  t_draft_ms   = 0.0;  // draft graph (inject + block) and choosing drafted tokens
    double  t_verify_ms  = 0.0;  // target decode of the blocks (AR: of each token)
    double  t_other_ms   = 0.0;  // everything else: acceptance, sampling, bookkeeping
    double  t_total_ms   = 0.0;  // whole call, prefill included

    double tokens_per_second() const {  // generation speed, prefill excluded
        const double t = t_total_ms - t_prefill_ms;
        return t > 0.0 ? 1000.0 * n_generated / t : 0.0;
    }
};

// How many CPU threads decoded, and why (engine.h: measured when not given).
struct thread_choice {
    int32_t n_threads = 0;       // in use
    bool    measured  = false;   // chosen by measurement (-t not given), else as given
    std::vector<int32_t> counts;    // the counts measured
    std::vector<double>  plain_ms;  // a plain decode at each, the best of a few (ms)
    int32_t batch_rows = 0;         // with a draft: the rows of a verify of its block (0: not measured)
    std::vector<double>  batch_ms;  // ... such a verify at each count, the best of a few (ms)
    int32_t measurements = 0;    // times measured; more than 1: measured again after a drift

    // What a count is judged by: a plain step plus a verified token's share of a block's verify
    // (the adaptive loop spends its time on both).
    double cost(size_t i) const { return plain_ms[i] + (batch_rows > 0 ? batch_ms[i] / batch_rows : 0.0); }
};

struct generate_result {
    std::vector<int32_t>     tokens;       // generated tokens, prompt excluded
    std::vector<step_record> steps;        // one per target verify (empty for autoregressive)
    std::string              stop_reason;  // "max_tokens", "stop_token" or "context_full"
    generate_stats           stats;
    bool                     adaptive = false;  // the steps were chosen by the adaptive loop
    policy_summary           policy;            // what it chose (adaptive only)
    thread_choice            threads;           // filled by the engine

    // mean tokens produced per target verify (plain steps included: one each)
    double tau() const;
    // per block position i: accepted / drafted over all draft steps that drafted position i (the
    // draft's acceptance: n-gram steps are in the policy summary)
    std::vector<double> acceptance_by_position() const;
};

// Called with the tokens each step adds, as soon as they are final.
using token_callback = std::function<void(const std::vector<int32_t> & tokens)>;

// The target's and the draft's state is reset at the start: every call is a fresh sequence.
// memory: what the adaptive loop keeps between generations, owned by the caller: its step costs
// are measured here (after the request's checks) when empty, the time that took reported in the
// policy summary, and its probe wait is carried on; nullptr: the loop learns the costs in its first
// steps (see draft_policy.h).
generate_result generate_speculative(target_runner & target, draft_runner & draft, const std::vector<int32_t> & prompt,
                                     const generate_params & params, const token_callback & on_tokens = {},
                                     policy_memory * memory = nullptr);

// What a plain step, a verify of k = 2..max+1 tokens and a draft forward of n = 1..max proposals
// (max = draft_hparams::max_draft(block_size)) cost on this machine, target and draft: each the faster of two runs, after a warm-up,
// on a scratch sequence (both caches are left empty); sizes 1, 2, 3, 4, 6, 9, ... and the largest
// (0 for the others, which the policy interpolates). For block 8, about 40 plain decodes of time.
step_costs measure_step_costs(target_runner & target, draft_runner & draft, int32_t block_size);

generate_result generate_autoregressive(target_runner & target, const std::vector<int32_t> & prompt,
                                        const generate_params & params, const token_callback & on_tokens = {});

// Plain decoding of many prompts, target.n_seq() of them side by side (continuous batching: a
// finished sequence's slot takes the next prompt). Sequence i samples with seed params.seed + i.
// Results in prompt order; steps are empty and only the total time is measured.
std::vector<generate_result> generate_autoregressive_batch(target_runner & target,
                                                           const std::vector<std::vector<int32_t>> & prompts,
                                                           const generate_params & params);

} // namespace dflash
