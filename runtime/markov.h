// DSpark's Markov chain and confidence head, on the host, after a block forward (draft_graph.h): per
// drafted slot k, left to right from the anchor,
//
//   bias_k       = s * W2 @ W1[prev_k]                               (markov_bias, [n_vocab])
//   biased_k     = the slot's logits + bias_k                        (biased_logits)
//   confidence_k = sigmoid(conf_proj . [result_norm_k ; W1[prev_k]] + conf_proj.bias)   (confidence)
//
// prev_0 = the anchor, prev_k = the token drawn at slot k - 1 (markov_prev); s = markov_w2.scale, 1
// without one. Greedy: the argmax of biased_k (the first maximum); sampled: a draw from the loop's
// sampling distribution of biased_k, which goes to the rejection step as the slot's q. Each slot
// conditions on the token actually drawn, so a walk stays lossless; a confidence threshold cuts it
// before the first slot below it, a choice made from the draft alone (greedy output stays exact,
// sampled output lossless). A reduced vocabulary (d2t): W2's rows, the bias and the slot's logits
// are over the draft's n_head_rows() rows; the chain picks a row and drafts its target token
// (token_of_row), which is the next slot's prev (a W1 row); q is over the target's vocabulary, 0
// outside the draft's tokens; traces are scattered to the target's vocabulary, the bias with 0 and
// the biased logits with -inf elsewhere (as llama.cpp's graph scatters them).
// W1, W2 and the confidence head stay in host memory in their stored type (draft_model): a slot
// dequantises one W1 row and multiplies W2 with it by its type's dot product.
#pragma once

#include "draft_graph.h"
#include "sampling.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace dflash {

class markov_chain {
public:
    explicit markov_chain(const draft_runner & draft);

    // Whether the chain drafts slot i (0-based) of confidence c (the head's; -1 without one).
    using slot_gate = std::function<bool(int32_t i, float c)>;

    // The chain over the first n slots of `out` from `anchor`, appended to `tokens`; it stops before
    // the first slot `keep` refuses (empty: none). With a confidence head, each drafted slot's
    // confidence is appended to `confidences` (when given). Sampled (sp not greedy): q[i] the
    // distribution slot i's token was drawn from (q must hold n rows).
    void walk(const block_output & out, int32_t anchor, int32_t n, const sampling_params & sp, const slot_gate & keep,
              sampler & rng, std::vector<int32_t> & tokens, std::vector<std::vector<float>> & q,
              std::vector<float> * confidences = nullptr) const;
    bool has_confidence() const { return conf_ != nullptr; }

    // The greedy chain over every slot of `out`, with what it read, as trace entries in ggml order:
    // markov_prev [n], markov_bias [n_vocab, n], biased_logits [n_vocab, n] and, with a confidence
    // head, confidence [n].
    void trace(const block_output & out, int32_t anchor, draft_trace & trace) const;

private:
    void w1_row(int32_t token, std::vector<float> & out) const;
    void bias(const std::vector<float> & w1, std::vector<float> & out) const;  // s * W2 @ w1, [n_rows]
    float confidence(const float * hidden, const std::vector<float> & w1) const;

    const draft_runner & draft_;
    const ggml_tensor *  w1_;
    const ggml_tensor *  w2_;
    const ggml_tensor *  conf_;
    float                conf_bias_ = 0.0f;
    const float *        scale_     = nullptr;  // markov_w2.scale, when the draft has one
    int32_t              rank_;
    int32_t              n_rows_;   // the draft's: W2's rows, the logits' per slot
    int32_t              n_vocab_;  // the target's
};

} // namespace dflash
