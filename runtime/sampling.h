// Token choice for target and draft: greedy argmax, or sampling with temperature / top-k / top-p,
// and the rejection step that keeps speculative sampling lossless (the output distribution is
// the target's). Semantics follow the published DFlash reference.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace dflash {

struct sampling_params {
    float    temperature = 0.0f;  // 0: greedy
    float    top_p       = 1.0f;  // (0, 1]
    int32_t  top_k       = 0;     // 0: off
    uint64_t seed        = 0;

    bool greedy() const { return temperature <= 0.0f; }
};

// Throws std::invalid_argument for a negative temperature, top_p outside (0, 1] or top_k < 0.
void check_sampling_params(const sampling_params & params);

int32_t argmax(const float * logits, int32_t n_vocab);

// The sampling distribution of one row of logits: softmax(logits / T) restricted to the top-k,
// then to the smallest prefix of mass >= top_p, renormalised. Dense, n_vocab entries.
void probs_from_logits(const float * logits, int32_t n_vocab, const sampling_params & params, std::vector<float> & probs);

class sampler {
public:
    explicit sampler(uint64_t seed) : rng_(seed) {}

    double  uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }
    int32_t draw(const std::vector<float> & probs);

    // Speculative rejection sampling. q[i] / p[i]: draft / target distributions at block position
    // i (i < k for q, i <= k for p); drafted[i] was drawn from q[i]. Returns the number accepted,
    // and in `next` the token that follows them: the residual draw max(p - q, 0) at the first
    // rejection, or a draw from p[k] when all k are accepted.
    int32_t accept(const std::vector<int32_t> & drafted, const std::vector<std::vector<float>> & q,
                   const std::vector<std::vector<float>> & p, int32_t & next);

private:
    std::mt19937_64 rng_;
};

} // namespace dflash
