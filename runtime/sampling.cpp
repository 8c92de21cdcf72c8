#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <string>

namespace dflash {

namespace {

std::string show(float v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", v);
    return buf;
}

} // namespace

void check_sampling_params(const sampling_params & params) {
    if (!std::isfinite(params.temperature)) {
        throw std::invalid_argument("temperature must be finite, got " + show(params.temperature));
    }
    if (params.temperature < 0.0f) {
        throw std::invalid_argument("temperature must be >= 0, got " + show(params.temperature));
    }
    if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
        throw std::invalid_argument("top_p must be in (0, 1], got " + show(params.top_p));
    }
    if (params.top_k < 0) {
        throw std::invalid_argument("top_k must be >= 0, got " + std::to_string(params.top_k));
    }
}

int32_t argmax(const float * logits, int32_t n_vocab) {
    return (int32_t) (std::max_element(logits, logits + n_vocab) - logits);  // first maximum, as torch
}

void probs_from_logits(const float * logits, int32_t n_vocab, const sampling_params & params, std::vector<float> & probs) {
    // candidate ids, best first when a filter needs the order
    std::vector<int32_t> ids(n_vocab);
    std::iota(ids.begin(), ids.end(), 0);
    int32_t n_keep = n_vocab;
    const auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    if (params.top_k > 0 && params.top_k < n_vocab) {
        n_keep = params.top_k;
        std::partial_sort(ids.begin(), ids.begin() + n_keep, ids.end(), by_logit);
    } else if (params.top_p < 1.0f) {
        std::sort(ids.begin(), ids.end(), by_logit);
    }

    const double inv_t = 1.0 / params.temperature;
    double max_score = -INFINITY;
    for (int32_t i = 0; i < n_keep; ++i) {
        max_score = std::max(max_score, (double) logits[ids[i]] * inv_t);
    }
    std::vector<double> p(n_keep);
    double sum = 0.0;
    for (int32_t i = 0; i < n_keep; ++i) {
        p[i] = std::exp((double) logits[ids[i]] * inv_t - max_score);
        sum += p[i];
    }
    for (double & v : p) v /= sum;

    if (params.top_p < 1.0f) {
        // keep a token while the mass before it is below top_p (the best one always stays)
        double before = 0.0, kept = 0.0;
        int32_t n_p = 0;
        for (; n_p < n_keep; ++n_p) {
            if (before >= params.top_p) break;
            before += p[n_p];
            kept   += p[n_p];
        }
        n_keep = n_p;
        for (int32_t i = 0; i < n_keep; ++i) p[i] /= kept;
    }

    probs.assign(n_vocab, 0.0f);
    for (int32_t i = 0; i < n_keep; ++i) {
        probs[ids[i]] = (float) p[i];
    }
}

int32_t sampler::draw(const std::vector<float> & probs) {
    double total = 0.0;
    for (const float v : probs) total += v;
    const double u = uniform() * total;
    double acc = 0.0;
    int32_t last_nonzero = 0;
    for (int32_t i = 0; i < (int32_t) probs.size(); ++i) {
        if (probs[i] <= 0.0f) continue;
        acc += probs[i];
        last_nonzero = i;
        if (u < acc) return i;
    }
    return last_nonzero;  // rounding: u landed on the total
}

int32_t sampler::accept(const std::vector<int32_t> & drafted, const std::vector<std::vector<float>> & q,
                        const std::vector<std::vector<float>> & p, int32_t & next) {
    const int32_t k = (int32_t) drafted.size();
    for (int32_t i = 0; i < k; ++i) {
        const int32_t d = drafted[i];
        if (uniform() * q[i][d] < p[i][d]) {
            continue;
        }
        std::vector<float> residual(p[i].size());
        double total = 0.0;
        for (size_t j = 0; j < residual.size(); ++j) {
            residual[j] = std::max(0.0f, p[i][j] - q[i][j]);
            total += residual[j];
        }
        next = draw(total > 0.0 ? residual : p[i]);
        return i;
    }
    next = draw(p[k]);
    return k;
}

} // namespace dflash
