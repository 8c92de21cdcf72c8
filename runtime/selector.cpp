#include "selector.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace dflash {

candidate_selector::candidate_selector(const draft_runner & draft)
    : draft_(draft), prev_(draft.model().selector_predecessor), next_(draft.model().selector_successor),
      k_(draft.hparams().selector_top_k), rank_(draft.hparams().selector_rank) {
    if (prev_ == nullptr || next_ == nullptr || prev_->data == nullptr || next_->data == nullptr) {
        throw std::logic_error("a candidate selector needs a loaded DFlash 2 draft");
    }
}

// Row `token` of a codebook as f32 (the codebooks live in host memory, in their stored type).
void candidate_selector::codebook_row(const ggml_tensor * book, int32_t token, float * out) const {
    host_row(book, token, out);
}

// The slot's K candidates: its head rows of the highest logits (NaN counts as -inf), as target
// tokens, by logit descending and then token ascending; with their successor rows.
candidate_selector::slot candidate_selector::candidates(const float * logits) const {
    using entry = std::pair<float, int32_t>;  // (logit, token)
    const auto better = [](const entry & a, const entry & b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    std::vector<entry> best;  // best first, at most K
    best.reserve((size_t) k_ + 1);
    for (int32_t r = 0; r < draft_.n_head_rows(); ++r) {
        const entry e{ std::isnan(logits[r]) ? -INFINITY : logits[r], draft_.token_of_row(r) };
        if ((int32_t) best.size() == k_ && !better(e, best.back())) {
            continue;
        }
        best.insert(std::upper_bound(best.begin(), best.end(), e, better), e);
        if ((int32_t) best.size() > k_) {
            best.pop_back();
        }
    }
    slot s;
    s.succ.resize((size_t) best.size() * rank_);
    for (size_t k = 0; k < best.size(); ++k) {
        s.unary.push_back(best[k].first);
        s.tokens.push_back(best[k].second);
        codebook_row(next_, best[k].second, s.succ.data() + k * rank_);
    }
    return s;
}

// A[token] * gate: the predecessor's side of the bilinear score.
void candidate_selector::gated_row(int32_t token, const float * gate, std::vector<float> & out) const {
    out.resize(rank_);
    codebook_row(prev_, token, out.data());
    for (int32_t r = 0; r < rank_; ++r) {
        out[r] *= gate[r];
    }
}

void candidate_selector::scores(const std::vector<float> & pred_gated, const slot & s, std::vector<float> & out) const {
    out.resize(s.tokens.size());
    for (size_t k = 0; k < s.tokens.size(); ++k) {
        const float * succ = s.succ.data() + k * rank_;
        double dot = 0.0;
        for (int32_t r = 0; r < rank_; ++r) {
            dot += (double) pred_gated[r] * succ[r];
        }
        out[k] = s.unary[k] + (float) dot;
    }
}

selector_walk candidate_selector::walk(const block_output & out, int32_t anchor, int32_t n, const sampling_params & sp,
                                       sampler & rng) const {
    const size_t n_rows = (size_t) draft_.n_head_rows();
    if (n < 0 || out.logits.size() < (size_t) n * n_rows || out.gate.size() < (size_t) n * rank_) {
        throw std::logic_error("selector walk over " + std::to_string(n) + " slots of a shorter block output");
    }
    sampling_params temperature_only;  // the published selector samples with the temperature alone
    temperature_only.temperature = sp.temperature;
    selector_walk w;
    std::vector<float> gated, row;
    int32_t pred = anchor;
    for (int32_t i = 0; i < n; ++i) {
        slot s = candidates(out.logits.data() + i * n_rows);
        gated_row(pred, out.gate.data() + (size_t) i * rank_, gated);
        scores(gated, s, row);
        int32_t chosen = 0;
        if (sp.greedy()) {
            chosen = argmax(row.data(), (int32_t) row.size());
        } else {
            w.q.emplace_back();
            probs_from_logits(row.data(), (int32_t) row.size(), temperature_only, w.q.back());
            chosen = rng.draw(w.q.back());
        }
        pred = s.tokens[chosen];
        w.path.push_back(pred);
        w.candidates.push_back(std::move(s.tokens));
    }
    return w;
}

void candidate_selector::trace(const block_output & out, int32_t anchor, draft_trace & trace) const {
    const int32_t n = rank_ > 0 ? (int32_t) (out.gate.size() / rank_) : 0;
    const size_t n_rows = (size_t) draft_.n_head_rows();
    traced_tensor & unary = trace["selector_unary"], & cands = trace["selector_candidates"];
    traced_tensor & scored = trace["selector_scores"], & path = trace["selector_path"];
    unary.shape = cands.shape = { k_, n };
    scored.shape = { k_, k_, n };
    path.shape = { n };
    std::vector<float> gated, row;
    std::vector<int32_t> preds = { anchor };
    size_t walked = 0;  // the row of the token walked last among preds
    for (int32_t i = 0; i < n; ++i) {
        slot s = candidates(out.logits.data() + i * n_rows);
        std::vector<float> rows;  // [pred, cand], slot 1's one predecessor in every row
        for (int32_t p = 0; p < k_; ++p) {
            gated_row(preds[std::min<size_t>(p, preds.size() - 1)], out.gate.data() + (size_t) i * rank_, gated);
            scores(gated, s, row);
            rows.insert(rows.end(), row.begin(), row.end());
        }
        const size_t chosen = argmax(rows.data() + walked * k_, k_);
        unary.data.insert(unary.data.end(), s.unary.begin(), s.unary.end());
        for (const int32_t t : s.tokens) {
            cands.data.push_back((float) t);
        }
        scored.data.insert(scored.data.end(), rows.begin(), rows.end());
        path.data.push_back((float) s.tokens[chosen]);
        preds = s.tokens;
        walked = chosen;
    }
}

} // namespace dflash
