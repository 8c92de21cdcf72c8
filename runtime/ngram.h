// The n-gram proposal source of the adaptive loop: a continuation looked up in the text so far (the
// prompt and the tokens generated since), at no model cost. Given the text's last n tokens, for n
// from n_max down to n_min, it finds the most recent earlier occurrence of those n tokens and
// proposes the tokens that followed it. Where the continuation runs into the end of the text (a
// repeat with a period shorter than the proposal) it keeps repeating that period.
//
// With the proposal comes the length of the match: the found occurrence and the text's end compared
// backwards beyond n, up to kMaxMatch tokens. A long match is a copy of earlier text (a repeated
// line, a name list, an example) and far more often right than a match of 2 tokens: the adaptive
// loop keeps its record of acceptance per class of match length (draft_policy.h).
//
// One hash map per n, from an n-gram to the index of the token that followed its latest
// occurrence: O(n_max^2) work per token added, whatever the text's length. Only committed tokens
// are added, so there is nothing to roll back.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace dflash {

struct ngram_proposal {
    std::vector<int32_t> tokens;  // what followed the match
    int32_t match = 0;            // tokens the match spans (n_min..kMaxMatch; 0: no proposal)
};

class ngram_index {
public:
    static constexpr int32_t kMinN     = 2;
    static constexpr int32_t kMaxN     = 4;
    static constexpr int32_t kMaxMatch = 64;  // a match is measured up to this many tokens

    // Throws std::invalid_argument unless 1 <= n_min <= n_max <= 64.
    explicit ngram_index(int32_t n_min = kMinN, int32_t n_max = kMaxN);

    void add(int32_t token);
    void add(const std::vector<int32_t> & tokens);

    // Up to max_len tokens that would follow the text, from the most recent earlier occurrence of its
    // longest matching suffix; empty when no suffix of n_min tokens or more occurred before.
    std::vector<int32_t> propose(int32_t max_len) const { return propose_match(max_len).tokens; }
    // The same with the length of the match it came from.
    ngram_proposal propose_match(int32_t max_len) const;

    int32_t size() const { return (int32_t) tokens_.size(); }

private:
    uint64_t key(int32_t end, int32_t n) const;  // hash of tokens_[end - n, end)
    bool     same(int32_t end_a, int32_t end_b, int32_t n) const;

    int32_t n_min_, n_max_;
    std::vector<int32_t> tokens_;
    std::vector<std::unordered_map<uint64_t, int32_t>> next_;  // [n - n_min]: n-gram -> index of its follower
};

} // namespace dflash
