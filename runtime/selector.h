// DFlash 2's candidate selector, on the host: per drafted slot s, the top-K tokens of the slot's
// logits (the unary scores, logit_scale and soft-cap applied), then a left-to-right walk from the
// anchor through
//
//   score_s[pred, k] = unary_s[k] + sum_r A[pred, r] * gate_s[r] * B[cand_s[k], r]
//
// (A, B: the predecessor and successor codebooks, rows by token; gate_s: selector_hidden @ the slot's
// result_norm). Greedy: the argmax of the row of the token walked last; sampled: one draw from
// softmax(score row / T) with the loop's sampler (temperature only, as the published model), whose
// distribution over the candidates goes to the lossless rejection step.
//
// Candidates are ordered by unary descending, ties by the smaller token id, and the argmax takes the
// first maximum: a walk is a pure function of the logits and the gate. A reduced vocabulary's head
// rows stand for their target tokens (draft_runner::token_of_row): the candidates are target tokens.
// The codebooks stay in their stored type in host memory (draft_model); each slot dequantises the K
// rows of its candidates and the rows of its predecessors, with ggml's type traits.
#pragma once

#include "draft_graph.h"
#include "draft_model.h"
#include "sampling.h"

#include <cstdint>
#include <vector>

namespace dflash {

// The walk over n drafted slots.
struct selector_walk {
    std::vector<int32_t>              path;        // [n] the walked tokens: the proposals
    std::vector<std::vector<int32_t>> candidates;  // [n][K] each slot's candidates
    std::vector<std::vector<float>>   q;           // sampled only: [n][K] the distribution each token was drawn from
};

class candidate_selector {
public:
    explicit candidate_selector(const draft_runner & draft);

    // The walk from `anchor` over the first n slots of a block forward's output; sampled when
    // `sp` is not greedy (temperature only), drawing with `rng`.
    selector_walk walk(const block_output & out, int32_t anchor, int32_t n, const sampling_params & sp,
                       sampler & rng) const;

    // The greedy walk over every slot of `out`, with what it read, as trace entries in ggml order:
    // selector_unary [K, n], selector_candidates [K, n], selector_scores [K, K, n] (score[slot,
    // pred_index, cand_index]; slot 1's one predecessor, the anchor, repeated in every row) and
    // selector_path [n].
    void trace(const block_output & out, int32_t anchor, draft_trace & trace) const;

    int32_t top_k() const { return k_; }

private:
    struct slot {
        std::vector<int32_t> tokens;  // [K], by unary descending, ties by the smaller token id
        std::vector<float>   unary;   // [K]
        std::vector<float>   succ;    // [K, rank] their successor rows
    };

    slot candidates(const float * logits) const;
    // score[k] of candidate k after `pred` (gated predecessor row `pred_gated`: A[pred] * gate)
    void scores(const std::vector<float> & pred_gated, const slot & s, std::vector<float> & out) const;
    void gated_row(int32_t token, const float * gate, std::vector<float> & out) const;
    void codebook_row(const ggml_tensor * book, int32_t token, float * out) const;

    const draft_runner & draft_;
    const ggml_tensor *  prev_;  // A [rank, n_vocab]
    const ggml_tensor *  next_;  // B [rank, n_vocab]
    int32_t              k_;
    int32_t              rank_;
};

} // namespace dflash
