#include "markov.h"

#include "ggml-cpu.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace dflash {

markov_chain::markov_chain(const draft_runner & draft)
    : draft_(draft), w1_(draft.model().markov_w1), w2_(draft.model().markov_w2), conf_(draft.model().conf_proj),
      rank_(draft.hparams().markov_rank), n_rows_(draft.n_head_rows()), n_vocab_(draft.n_vocab()) {
    if (w1_ == nullptr || w2_ == nullptr || w1_->data == nullptr || w2_->data == nullptr ||
        w2_->ne[1] != n_rows_ || w1_->ne[1] != n_vocab_) {
        throw std::logic_error("a Markov chain needs a loaded DSpark draft: W1 over the target's vocabulary, W2 "
                               "over the draft's head rows");
    }
    if (conf_ != nullptr) {
        std::memcpy(&conf_bias_, draft.model().conf_proj_b->data, sizeof(float));
    }
    if (draft.model().markov_w2_s != nullptr) {
        scale_ = (const float *) draft.model().markov_w2_s->data;
    }
}

void markov_chain::w1_row(int32_t token, std::vector<float> & out) const {
    out.resize(rank_);
    host_row(w1_, token, out.data());
}

void markov_chain::bias(const std::vector<float> & w1, std::vector<float> & out) const {
    // W2's rows times w1 in W2's own dot product (w1 converted to its operand type, as a matmul does)
    const auto * cpu = ggml_get_type_traits_cpu(w2_->type);
    const ggml_type operand = cpu->vec_dot_type;
    std::vector<uint8_t> x(ggml_row_size(operand, rank_));
    if (operand == GGML_TYPE_F32) {
        std::memcpy(x.data(), w1.data(), (size_t) rank_ * sizeof(float));
    } else {
        ggml_get_type_traits_cpu(operand)->from_float(w1.data(), x.data(), rank_);
    }
    out.resize(n_rows_);
    for (int32_t v = 0; v < n_rows_; ++v) {
        cpu->vec_dot(rank_, &out[v], 0, (const char *) w2_->data + (size_t) v * w2_->nb[1], 0, x.data(), 0, 1);
    }
    if (scale_ != nullptr) {  // after the product, as llama.cpp's graph scales it
        for (float & b : out) b *= *scale_;
    }
}

float markov_chain::confidence(const float * hidden, const std::vector<float> & w1) const {
    const int32_t n_embd = draft_.hparams().n_embd;
    std::vector<float> w((size_t) n_embd + rank_);
    host_row(conf_, 0, w.data());
    double z = conf_bias_;
    for (int32_t j = 0; j < n_embd; ++j) z += (double) w[j] * hidden[j];
    for (int32_t r = 0; r < rank_; ++r) z += (double) w[n_embd + r] * w1[r];
    return (float) (1.0 / (1.0 + std::exp(-z)));
}

void markov_chain::walk(const block_output & out, int32_t anchor, int32_t n, const sampling_params & sp,
                        const slot_gate & keep, sampler & rng, std::vector<int32_t> & tokens,
                        std::vector<std::vector<float>> & q, std::vector<float> * confidences) const {
    const int32_t n_embd = draft_.hparams().n_embd;
    if (n < 0 || out.logits.size() < (size_t) n * n_rows_ || (conf_ != nullptr &&
        out.hidden.size() < (size_t) n * n_embd) || (!sp.greedy() && q.size() < (size_t) n)) {
        throw std::logic_error("Markov chain over " + std::to_string(n) + " slots of a shorter block output");
    }
    std::vector<float> w1, b, row(n_rows_), q_rows;
    int32_t prev = anchor;
    for (int32_t i = 0; i < n; ++i) {
        w1_row(prev, w1);
        const float c = conf_ != nullptr ? confidence(out.hidden.data() + (size_t) i * n_embd, w1) : -1.0f;
        if (keep && !keep(i, c)) {
            return;  // the draft stops before its first slot the gate refuses
        }
        if (confidences != nullptr && conf_ != nullptr) confidences->push_back(c);
        bias(w1, b);
        const float * logits = out.logits.data() + (size_t) i * n_rows_;
        for (int32_t v = 0; v < n_rows_; ++v) row[v] = logits[v] + b[v];
        if (sp.greedy()) {
            prev = draft_.token_of_row(argmax(row.data(), n_rows_));
        } else if (n_rows_ == n_vocab_) {
            probs_from_logits(row.data(), n_vocab_, sp, q[i]);
            prev = rng.draw(q[i]);
        } else {  // q over the target's vocabulary: 0 outside the draft's tokens
            probs_from_logits(row.data(), n_rows_, sp, q_rows);
            q[i].assign(n_vocab_, 0.0f);
            for (int32_t r = 0; r < n_rows_; ++r) q[i][draft_.token_of_row(r)] = q_rows[r];
            prev = rng.draw(q[i]);
        }
        tokens.push_back(prev);
    }
}

void markov_chain::trace(const block_output & out, int32_t anchor, draft_trace & trace) const {
    const int32_t n = (int32_t) (out.logits.size() / n_rows_), n_embd = draft_.hparams().n_embd;
    traced_tensor & prev_t = trace["markov_prev"], & bias_t = trace["markov_bias"], & biased = trace["biased_logits"];
    prev_t.shape = { n };
    bias_t.shape = biased.shape = { n_vocab_, n };
    bias_t.data.assign((size_t) n * n_vocab_, 0.0f);  // the target's vocabulary: a reduced one's rows scattered
    biased.data.assign((size_t) n * n_vocab_, -INFINITY);
    traced_tensor * conf_t = conf_ != nullptr ? &trace["confidence"] : nullptr;
    if (conf_t != nullptr) conf_t->shape = { n };
    std::vector<float> w1, b, row(n_rows_);
    int32_t prev = anchor;
    for (int32_t i = 0; i < n; ++i) {
        w1_row(prev, w1);
        bias(w1, b);
        prev_t.data.push_back((float) prev);
        if (conf_t != nullptr) conf_t->data.push_back(confidence(out.hidden.data() + (size_t) i * n_embd, w1));
        const float * logits = out.logits.data() + (size_t) i * n_rows_;
        for (int32_t r = 0; r < n_rows_; ++r) {
            row[r] = logits[r] + b[r];
            const size_t at = (size_t) i * n_vocab_ + draft_.token_of_row(r);
            bias_t.data[at] = b[r];
            biased.data[at] = row[r];
        }
        prev = draft_.token_of_row(argmax(row.data(), n_rows_));
    }
}

} // namespace dflash
