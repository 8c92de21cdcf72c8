#include "ngram.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace dflash {

ngram_index::ngram_index(int32_t n_min, int32_t n_max) : n_min_(n_min), n_max_(n_max) {
    if (n_min < 1 || n_max < n_min || n_max > 64) {
        throw std::invalid_argument("n-gram sizes must satisfy 1 <= min <= max <= 64, got " + std::to_string(n_min) +
                                    ".." + std::to_string(n_max));
    }
    next_.resize(n_max - n_min + 1);
}

uint64_t ngram_index::key(int32_t end, int32_t n) const {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t) n;
    for (int32_t i = end - n; i < end; ++i) {
        h ^= (uint32_t) tokens_[i];
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 33;
    }
    return h;
}

bool ngram_index::same(int32_t end_a, int32_t end_b, int32_t n) const {
    return std::equal(tokens_.begin() + end_a - n, tokens_.begin() + end_a, tokens_.begin() + end_b - n);
}

// Token i is the follower of the n-grams that end just before it.
void ngram_index::add(int32_t token) {
    const int32_t i = size();
    tokens_.push_back(token);
    for (int32_t n = n_min_; n <= std::min(n_max_, i); ++n) {
        next_[n - n_min_][key(i, n)] = i;
    }
}

void ngram_index::add(const std::vector<int32_t> & tokens) {
    for (const int32_t t : tokens) add(t);
}

ngram_proposal ngram_index::propose_match(int32_t max_len) const {
    ngram_proposal out;
    const int32_t end = size();
    for (int32_t n = std::min(n_max_, end - 1); n >= n_min_ && max_len > 0; --n) {
        const auto & map = next_[n - n_min_];
        const auto it = map.find(key(end, n));
        if (it == map.end() || !same(it->second, end, n)) continue;  // none, or a hash collision
        const int32_t from = it->second, period = end - from;
        for (int32_t j = 0; j < max_len; ++j) {
            out.tokens.push_back(from + j < end ? tokens_[from + j] : out.tokens[j - period]);
        }
        out.match = n;
        while (out.match < kMaxMatch && from - out.match - 1 >= 0 &&
               tokens_[from - out.match - 1] == tokens_[end - out.match - 1]) {
            ++out.match;
        }
        break;
    }
    return out;
}

} // namespace dflash
