#include "speculative.h"

#include "markov.h"
#include "ngram.h"
#include "selector.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <utility>

namespace dflash {

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

struct stop_rule {
    const target_runner &        target;
    const generate_params &      params;
    bool operator()(int32_t token) const {
        return (params.stop_at_eog && target.is_eog(token)) ||
               std::find(params.stop_tokens.begin(), params.stop_tokens.end(), token) != params.stop_tokens.end();
    }
};

// prompt + max_new_tokens, in 64 bits: max_new_tokens may be anything up to INT32_MAX
int64_t requested_length(const std::vector<int32_t> & prompt, const generate_params & params) {
    return (int64_t) prompt.size() + params.max_new_tokens;
}

// Checks shared by both loops; returns the total sequence length allowed (prompt + generated).
int32_t check_request(const target_runner & target, const std::vector<int32_t> & prompt, const generate_params & params) {
    check_sampling_params(params.sampling);
    if (prompt.empty()) {
        throw std::invalid_argument("the prompt is empty");
    }
    if (params.max_new_tokens < 1) {
        throw std::invalid_argument("max_new_tokens must be at least 1, got " + std::to_string(params.max_new_tokens));
    }
    if (prompt.size() > (size_t) target.n_ctx()) {
        throw std::invalid_argument("the prompt has " + std::to_string(prompt.size()) + " tokens but the context holds " +
                                    std::to_string(target.n_ctx()) + " (raise n_ctx / -c)");
    }
    for (const int32_t t : prompt) {
        if (t < 0 || t >= target.n_vocab()) {
            throw std::invalid_argument("prompt token " + std::to_string(t) + " is outside the vocabulary of " +
                                        std::to_string(target.n_vocab()) + " tokens");
        }
    }
    // every generated token but the last is decoded by the target, so the whole sequence fits in n_ctx
    return (int32_t) std::min<int64_t>(requested_length(prompt, params), target.n_ctx());
}

// plain decoding drafts nothing: a block size or draft_max given to it would be silently ignored
void check_no_draft_params(const generate_params & params) {
    if (params.block_size || params.draft_max) {
        throw std::invalid_argument("block_size and draft_max need a draft (plain decoding drafts nothing)");
    }
}

int32_t choose(const float * logits, int32_t n_vocab, const sampling_params & sp, sampler & rng) {
    if (sp.greedy()) {
        return argmax(logits, n_vocab);
    }
    std::vector<float> probs;
    probs_from_logits(logits, n_vocab, sp, probs);
    return rng.draw(probs);
}

std::string stop_reason_for(int32_t length, int32_t max_length, bool stopped, const std::vector<int32_t> & prompt,
                            const generate_params & params) {
    if (stopped) return "stop_token";
    if (length >= max_length && max_length < requested_length(prompt, params)) return "context_full";
    return "max_tokens";
}

} // namespace

double generate_result::tau() const {
    if (steps.empty()) return 0.0;
    double produced = 0.0;
    for (const auto & s : steps) produced += s.produced;
    return produced / (double) steps.size();
}

std::vector<double> generate_result::acceptance_by_position() const {
    std::vector<double> drafted, accepted;
    for (const auto & s : steps) {
        if (s.source != step_source::draft) continue;
        if (drafted.size() < s.drafted.size()) {
            drafted.resize(s.drafted.size(), 0.0);
            accepted.resize(s.drafted.size(), 0.0);
        }
        for (size_t i = 0; i < s.drafted.size(); ++i) {
            drafted[i] += 1.0;
            accepted[i] += (int32_t) i < s.accepted ? 1.0 : 0.0;
        }
    }
    for (size_t i = 0; i < drafted.size(); ++i) accepted[i] /= drafted[i];
    return accepted;
}

namespace {

// The block size (the draft's unless asked) and the most tokens one step drafts (the whole block for an
// anchor-first draft, else all but its first position), checked.
std::pair<int32_t, int32_t> block_shape(const target_runner & target, const draft_hparams & hp, const generate_params & params) {
    const int32_t block_size = params.block_size.value_or(hp.block_size);
    if (block_size < 2) {
        throw std::invalid_argument("block size must be at least 2, got " + std::to_string(block_size));
    }
    if (block_size > target.n_ctx()) {
        throw std::invalid_argument("the context (" + std::to_string(target.n_ctx()) + " tokens) is smaller than one block (" +
                                    std::to_string(block_size) + " tokens)");
    }
    if (params.adaptive && params.draft_max) {
        throw std::invalid_argument("draft_max " + std::to_string(*params.draft_max) +
                                    " fixes the draft length, which the adaptive loop chooses: ask for one of them");
    }
    if (!params.adaptive && params.ngram.value_or(false)) {
        throw std::invalid_argument("the n-gram source is a choice of the adaptive loop (draft_max auto); a fixed draft "
                                    "length drafts every step");
    }
    if (params.draft_max && *params.draft_max < 1) {
        throw std::invalid_argument("draft_max must be at least 1, got " + std::to_string(*params.draft_max));
    }
    if (!(params.draft_p_min >= 0.0f && params.draft_p_min <= 1.0f)) {
        throw std::invalid_argument("draft_p_min must be in [0, 1], got " + std::to_string(params.draft_p_min));
    }
    if (params.draft_p_min > 0.0f && !hp.has_confidence_head) {
        throw std::invalid_argument("draft_p_min needs a draft with a confidence head (a DSpark draft's conf_proj)");
    }
    if (params.confidence.value_or(false) && !hp.has_confidence_head) {
        throw std::invalid_argument("the confidence gate needs a draft with a confidence head (a DSpark draft's "
                                    "conf_proj)");
    }
    if (!params.adaptive && params.confidence.value_or(false)) {
        throw std::invalid_argument("the confidence gate is a choice of the adaptive loop (draft_max auto); a fixed "
                                    "draft length verifies every drafted token (draft_p_min cuts by a threshold)");
    }
    const int32_t max_draft = hp.max_draft(block_size);
    return { block_size, std::min(params.draft_max.value_or(max_draft), max_draft) };
}

// Cuts `produced` after its first stop token; true if there was one.
bool cut_at_stop(std::vector<int32_t> & produced, const stop_rule & is_stop) {
    for (size_t i = 0; i < produced.size(); ++i) {
        if (is_stop(produced[i])) {
            produced.resize(i + 1);
            return true;
        }
    }
    return false;
}

} // namespace

namespace {

// Features of tokens decoded by plain steps, injected into the draft cache only when a step drafts
// again (or when kMaxBytes of them pile up, at least kMinRows rows): a run of plain steps costs no
// draft work at all, and a generation that never drafts never injects.
struct pending_features {
    static constexpr size_t  kMaxBytes = 32u << 20;
    static constexpr int32_t kMinRows  = 256;
    std::vector<float> rows;
    int32_t n = 0;

    // the first n_rows rows of `features` (rows of `row` values)
    void add(const std::vector<float> & features, int32_t n_rows, size_t row) {
        rows.insert(rows.end(), features.begin(), features.begin() + (size_t) n_rows * row);
        n += n_rows;
    }
    bool full(size_t row) const {
        return n >= kMinRows && (size_t) n * row * sizeof(float) >= kMaxBytes;
    }
    void flush(draft_runner & draft) {
        if (n == 0) return;
        draft.inject(rows.data(), n, draft.n_cached());
        rows.clear();
        n = 0;
    }
};

// The tokens a block forward drafts for its first n slots and, sampled, the distribution each was
// drawn from, dense over the target's vocabulary (0 elsewhere): per slot the argmax or a draw from its
// logits (DFlash 1), the selector's walk from the anchor (DFlash 2, over its K candidates), or the
// Markov chain from the anchor (DSpark, cut before the first slot `keep` refuses: then fewer than n;
// with a confidence head, each kept slot's confidence in `confidences`).
struct draft_chooser {
    const draft_runner &              draft;
    const int32_t                     n_vocab;
    std::optional<candidate_selector> selector;  // DFlash 2 drafts
    std::optional<markov_chain>       chain;     // DSpark drafts
    std::vector<float>                q_rows;    // a reduced-vocabulary draft's distribution over its own rows

    draft_chooser(const draft_runner & d, int32_t n_vocab) : draft(d), n_vocab(n_vocab) {
        if (d.hparams().variant().has(draft_head::selector)) {
            selector.emplace(d);
        }
        if (d.hparams().variant().has(draft_head::markov)) {
            chain.emplace(d);
        }
    }

    void choose(const block_output & out, int32_t anchor, int32_t n, const sampling_params & sp, sampler & rng,
                std::vector<int32_t> & tokens, std::vector<std::vector<float>> & q,
                const markov_chain::slot_gate & keep = {}, std::vector<float> * confidences = nullptr) {
        q.resize(n);
        if (selector) {
            walk(out, anchor, n, sp, rng, tokens, q);
            return;
        }
        if (chain) {
            chain->walk(out, anchor, n, sp, keep, rng, tokens, q, confidences);
            return;
        }
        const int32_t n_rows = draft.n_head_rows();  // n_vocab, or a reduced vocabulary's size
        for (int32_t i = 0; i < n; ++i) {
            const float * row = out.logits.data() + (size_t) i * n_rows;
            if (sp.greedy()) {
                tokens.push_back(draft.token_of_row(argmax(row, n_rows)));
            } else if (n_rows == n_vocab) {
                probs_from_logits(row, n_vocab, sp, q[i]);
                tokens.push_back(rng.draw(q[i]));
            } else {  // q over the target's vocabulary: 0 outside the draft's
                probs_from_logits(row, n_rows, sp, q_rows);
                q[i].assign(n_vocab, 0.0f);
                for (int32_t r = 0; r < n_rows; ++r) q[i][draft.token_of_row(r)] = q_rows[r];
                tokens.push_back(rng.draw(q[i]));
            }
        }
    }

    void walk(const block_output & out, int32_t anchor, int32_t n, const sampling_params & sp, sampler & rng,
              std::vector<int32_t> & tokens, std::vector<std::vector<float>> & q) {
        const selector_walk w = selector->walk(out, anchor, n, sp, rng);
        tokens.insert(tokens.end(), w.path.begin(), w.path.end());
        for (size_t i = 0; i < w.q.size(); ++i) {
            q[i].assign(n_vocab, 0.0f);
            for (size_t k = 0; k < w.q[i].size(); ++k) q[i][w.candidates[i][k]] = w.q[i][k];
        }
    }
};

// The speculative loop's state between steps.
struct spec_loop {
    target_runner &         target;
    draft_runner &          draft;
    const generate_params & params;
    const stop_rule         is_stop;
    const int32_t           block_size, draft_max, max_length, n_vocab;
    sampler                 rng;
    generate_result &       res;
    pending_features        pending;
    draft_chooser           chooser{ draft, n_vocab };
    block_output            block_out;  // the last block forward's outputs
    std::vector<std::vector<float>> q, p;
    int32_t last = -1, start = 0;  // the newest token and its position (not yet in the target's cache)
    bool    stopped = false;
    const size_t feature_row = (size_t) draft.hparams().n_taps() * draft.hparams().n_embd;
    std::optional<ngram_index> ngrams;  // the prompt and every committed token (the n-gram source on)
    draft_policy *          gate = nullptr;  // the adaptive loop's confidence gate (on: its policy)
    std::vector<float>      confidences;     // of the slots the last propose() kept (a confidence head)
    int32_t                 head_batch = 1;  // the next verify's rows our head computes at once (draft_policy)

    // Draft up to n tokens after `last` in one block forward; they follow `last` in `verify` (fewer
    // when a confidence head cuts the draft). The adaptive loop's block holds only the positions it
    // verifies (n + 1, or n anchor-first): the draft's cost falls with n, and acceptance barely moves
    // (docs/benchmarks.md); a fixed draft length drafts the whole block. Near max_length the block
    // stops at the last position a draft may fill.
    // gated: through the confidence gate (a shadow probe's slots are scored whole, never cut).
    void propose(int32_t n, std::vector<int32_t> & verify, bool gated = true) {
        const int32_t first = draft.hparams().first_draft_slot();
        const int32_t n_block = std::min(params.adaptive ? n + first : block_size, max_length - start - 1 + first);
        std::vector<int32_t> block(n_block, draft.hparams().mask_token_id);
        block[0] = last;
        draft.forward_block(block.data(), n_block, start, block_out, nullptr, n);
        draft_policy * const g = gated ? gate : nullptr;
        if (g != nullptr) g->gate_begin(n);
        const float p_min = params.draft_p_min;
        markov_chain::slot_gate keep;
        if (p_min > 0.0f || g != nullptr) {
            keep = [p_min, g](int32_t i, float c) { return c >= p_min && (g == nullptr || g->keep_slot(i, c)); };
        }
        confidences.clear();
        chooser.choose(block_out, last, n, params.sampling, rng, verify, q, keep, &confidences);
    }

    // The longest prefix of `drafted` the target agrees with; its own next token in `next`.
    int32_t accept(const std::vector<int32_t> & drafted, int32_t & next) {
        const sampling_params & sp = params.sampling;
        const int32_t n = (int32_t) drafted.size();
        int32_t accepted = 0;
        if (sp.greedy()) {
            if (head_batch > 1) target.prefetch_logits(0, std::min(head_batch, n + 1));
            while (accepted < n && drafted[accepted] == argmax(target.logits(accepted), n_vocab)) ++accepted;
            next = argmax(target.logits(accepted), n_vocab);
            return accepted;
        }
        p.resize(n + 1);
        target.prefetch_logits(0, n + 1);  // every row is read: one batch of the head
        for (int32_t i = 0; i <= n; ++i) probs_from_logits(target.logits(i), n_vocab, sp, p[i]);
        return rng.accept(drafted, q, p, next);
    }

    // Appends what a step produced (cut at max_length and at a stop token); returns its length.
    int32_t commit(std::vector<int32_t> produced, const std::vector<int32_t> & drafted, int32_t accepted,
                   step_source source, const token_callback & on_tokens) {
        produced.resize(std::min<size_t>(produced.size(), (size_t) (max_length - start - 1)));
        stopped = cut_at_stop(produced, is_stop);
        const int32_t n_produced = (int32_t) produced.size();
        res.steps.push_back({ drafted, source, accepted, n_produced });
        if (ngrams) ngrams->add(produced);
        res.tokens.insert(res.tokens.end(), produced.begin(), produced.end());
        if (on_tokens) on_tokens(produced);
        last = produced.back();
        return n_produced;
    }

    // What our output head computed for the last verify (rows 0: llama.cpp's head, inside the decode).
    struct head_use {
        int64_t rows    = 0;
        int64_t batches = 0;
        double  ms      = 0.0;
    } head;
    struct head_mark {
        const target_runner & t;
        int64_t rows0, batches0;
        double  ms0;
        explicit head_mark(const target_runner & t)
            : t(t), rows0(t.head_rows()), batches0(t.head_batches()), ms0(t.head_ms()) {}
        head_use since() const { return { t.head_rows() - rows0, t.head_batches() - batches0, t.head_ms() - ms0 }; }
    };

    // N = 0: one target decode of `last`, no draft forward; its features wait in `pending`.
    double plain_step(const token_callback & on_tokens) {
        const auto t0 = clock_type::now();
        target.decode(&last, 1, start, /*all_logits=*/false);
        const float * logits = target.logits(0);  // a plain step's time includes its head row
        const double t_ms = ms_since(t0);
        res.stats.t_verify_ms += t_ms;
        pending.add(target.features(), 1, feature_row);
        const int32_t next = choose(logits, n_vocab, params.sampling, rng);
        start += commit({ next }, {}, 0, step_source::plain, on_tokens);
        flush_if_full();
        return t_ms;
    }

    void flush_if_full() {
        if (pending.full(feature_row)) {
            const auto t0 = clock_type::now();
            pending.flush(draft);
            res.stats.t_draft_ms += ms_since(t0);
        }
    }

    // An n-gram proposal: [last, proposal...] verified in one target decode, no draft forward; the
    // features of the kept tokens wait in `pending` as a plain step's do. Sampled, the proposal is a
    // deterministic draft (q one-hot) through the same rejection step: token t is accepted with
    // probability p(t), else the next token is drawn from p without t. Returns {verify ms, accepted}.
    std::pair<double, int32_t> ngram_step(const std::vector<int32_t> & proposal, const token_callback & on_tokens) {
        std::vector<int32_t> verify = { last };
        verify.insert(verify.end(), proposal.begin(), proposal.end());
        const auto t0 = clock_type::now();
        const head_mark mark(target);
        target.decode(verify.data(), (int32_t) verify.size(), start, /*all_logits=*/true);
        const double t_verify = ms_since(t0);

        if (!params.sampling.greedy()) {
            q.resize(proposal.size());
            for (size_t i = 0; i < proposal.size(); ++i) {
                q[i].assign(n_vocab, 0.0f);
                q[i][proposal[i]] = 1.0f;
            }
        }
        int32_t next = -1;
        const int32_t accepted = accept(proposal, next);
        head = mark.since();
        res.stats.t_verify_ms += t_verify + head.ms;
        std::vector<int32_t> produced(proposal.begin(), proposal.begin() + accepted);
        produced.push_back(next);
        const int32_t n_produced = commit(std::move(produced), proposal, accepted, step_source::ngram, on_tokens);
        target.rollback(start + n_produced);
        pending.add(target.features(), n_produced, feature_row);
        start += n_produced;
        flush_if_full();
        return { t_verify, accepted };
    }

    // A shadow probe (greedy only): n proposals after `last`, never verified; the plain steps that
    // follow score them (`score_shadow`). Returns the draft time (with the injection of what waited).
    struct shadow_probe {
        std::vector<int32_t> proposals;
        std::vector<float>   confidences;  // a confidence head's, for the gate's calibration
        int32_t matched = 0;
        double  t_draft = 0.0;
    };
    std::optional<shadow_probe> shadow;

    void shadow_step(int32_t n) {
        n = std::min(n, max_length - start - 1);
        if (n < 1) return;
        const auto t0 = clock_type::now();
        pending.flush(draft);
        shadow_probe probe;
        propose(n, probe.proposals, /*gated=*/false);
        probe.confidences = confidences;
        probe.t_draft = ms_since(t0);
        res.stats.t_draft_ms += probe.t_draft;
        if (!probe.proposals.empty()) {  // a confidence head may cut the whole probe
            shadow = std::move(probe);
        }
    }

    // Scores the shadow probe against the tokens the last step produced (a plain step's one, an
    // n-gram step's accepted ones and the target's next); true once it is settled.
    bool score_shadow() {
        if (!shadow) return false;
        for (size_t i = res.tokens.size() - res.steps.back().produced; i < res.tokens.size(); ++i) {
            if (shadow->proposals[shadow->matched] != res.tokens[i]) return true;
            if (++shadow->matched == (int32_t) shadow->proposals.size()) return true;
        }
        return false;
    }

    // N >= 1: draft, verify [last, drafted...] in one target decode, keep the accepted prefix and the
    // target's next token, roll back the rest. Returns {draft ms (with the injection), verify ms,
    // drafted (N, or fewer after a confidence cut), accepted}.
    std::tuple<double, double, int32_t, int32_t> draft_step(int32_t n, const token_callback & on_tokens) {
        auto t0 = clock_type::now();
        pending.flush(draft);
        res.stats.t_draft_ms += ms_since(t0);

        t0 = clock_type::now();
        std::vector<int32_t> verify = { last };
        propose(n, verify);
        double t_draft = ms_since(t0);

        t0 = clock_type::now();
        const head_mark mark(target);
        target.decode(verify.data(), (int32_t) verify.size(), start, /*all_logits=*/true);
        const double t_verify = ms_since(t0);

        std::vector<int32_t> drafted(verify.begin() + 1, verify.end());
        int32_t next = -1;
        const int32_t accepted = accept(drafted, next);
        head = mark.since();
        std::vector<int32_t> produced(drafted.begin(), drafted.begin() + accepted);
        produced.push_back(next);
        const int32_t n_produced = commit(std::move(produced), drafted, accepted, step_source::draft, on_tokens);

        // the target keeps the verified tokens it accepted, the draft caches their features
        target.rollback(start + n_produced);
        t0 = clock_type::now();
        draft.inject(target.features().data(), n_produced, start);
        t_draft += ms_since(t0);
        start += n_produced;
        res.stats.t_draft_ms += t_draft;
        res.stats.t_verify_ms += t_verify + head.ms;
        return { t_draft, t_verify, (int32_t) drafted.size(), accepted };
    }
};

} // namespace

// 1, 2, 3, 4, then half as much again each time, and `max`: the sizes measured (the policy
// interpolates between them), so that measuring stays linear in the block size.
static std::vector<int32_t> measured_sizes(int32_t max) {
    std::vector<int32_t> out;
    for (int32_t k = 1; k <= max; k = k < 4 ? k + 1 : k + k / 2) {
        out.push_back(k);
    }
    if (!out.empty() && out.back() != max) {
        out.push_back(max);
    }
    return out;
}

step_costs measure_step_costs(target_runner & target, draft_runner & draft, int32_t block_size) {
    const draft_hparams & hp = draft.hparams();
    const int32_t max_draft = hp.max_draft(block_size), first = hp.first_draft_slot();
    const int32_t max_verify = max_draft + 1;  // the last token and every drafted one
    const std::vector<int32_t> tokens(max_verify, hp.mask_token_id);
    // the faster of two runs, each after `before` (untimed): the loop alternates draft and target,
    // and each evicts the other's weights from the CPU caches, so each is timed after the other
    auto timed = [](auto && before, auto && fn) {
        double best = 0.0;
        for (int rep = 0; rep < 2; ++rep) {
            before();
            const auto t0 = clock_type::now();
            fn();
            const double t = ms_since(t0);
            best = rep == 0 ? t : std::min(best, t);
        }
        return best;
    };
    step_costs costs;
    costs.verify.assign(max_verify + 1, 0.0);
    costs.draft.assign(max_draft + 1, 0.0);
    target.rollback(0);
    draft.crop(0);
    target.set_capture(hp.target_layer_ids);
    target.decode(tokens.data(), max_verify, 0, /*all_logits=*/true);  // warm-up (first touch of the weights)
    const std::vector<float> features = target.features();
    target.rollback(0);
    block_output out;
    auto a_draft_step = [&] {
        draft.inject(features.data(), 1, 0);
        draft.forward_block(tokens.data(), 2, 1, out, nullptr, 1);
        draft.crop(0);
    };
    // a plain step with its head row; a verify's decode alone when our head computes its rows after it
    for (const int32_t k : measured_sizes(max_verify)) {
        costs.verify[k] = timed(a_draft_step, [&] {
            target.decode(tokens.data(), k, 0, /*all_logits=*/k > 1);
            if (k == 1) target.logits(0);
            target.rollback(0);
        });
    }
    if (target.lazy_head()) {  // a batch of one row and one of the block's rows: t_head(r) = pass + row * r
        auto head_batch = [&](int32_t rows) {
            return timed([&] { a_draft_step(); target.rollback(0); target.decode(tokens.data(), max_verify, 0, true); },
                         [&] { target.prefetch_logits(0, rows); });
        };
        const double t1 = head_batch(1), t_all = head_batch(max_verify);
        target.rollback(0);
        costs.head_row  = std::max(t_all - t1, 0.0) / (max_verify - 1);
        costs.head_pass = std::max(t1 - costs.head_row, 0.0);
        if (costs.head_row <= 0.0) {  // a batch no dearer than a row (noise): every row its own share
            costs.head_row  = t_all / max_verify;
            costs.head_pass = 0.0;
        }
    }
    // the draft step as the loop takes it: the injection of a step's tokens (two here), then the
    // block, over a context of kContext positions (attention over it is part of the cost), then the
    // choice of its tokens (a DFlash 2 draft's selector walk, a DSpark draft's Markov chain)
    constexpr int32_t kContext = 64, kInjected = 2;
    const int32_t n_context = std::max(0, std::min(kContext, target.n_ctx() - max_verify - kInjected));
    const size_t row = (size_t) hp.n_taps() * hp.n_embd;
    std::vector<float> context((size_t) (n_context + kInjected) * row);
    for (int32_t i = 0; i < n_context + kInjected; ++i) {
        std::copy_n(features.data() + (size_t) (i % max_verify) * row, row, context.data() + (size_t) i * row);
    }
    draft.inject(context.data(), n_context, 0);
    draft_chooser chooser(draft, target.n_vocab());
    sampler rng(0);
    std::vector<int32_t> proposals;
    std::vector<std::vector<float>> q;
    auto a_target_step = [&] {
        target.decode(tokens.data(), 2, 0, /*all_logits=*/true);
        target.rollback(0);
    };
    for (const int32_t n : measured_sizes(max_draft)) {
        costs.draft[n] = timed(a_target_step, [&] {
            draft.inject(context.data() + (size_t) n_context * row, kInjected, n_context);
            draft.forward_block(tokens.data(), n + first, n_context + kInjected, out, nullptr, n);
            proposals.clear();
            chooser.choose(out, tokens[0], n, sampling_params{}, rng, proposals, q);
            draft.crop(n_context);
        });
    }
    draft.crop(0);
    return costs;
}

generate_result generate_speculative(target_runner & target, draft_runner & draft, const std::vector<int32_t> & prompt,
                                     const generate_params & params, const token_callback & on_tokens,
                                     policy_memory * memory) {
    auto t_start = clock_type::now();
    const int32_t max_length = check_request(target, prompt, params);
    const draft_hparams & hp = draft.hparams();
    const auto [block_size, draft_max] = block_shape(target, hp, params);
    double calibration_ms = 0.0;
    if (memory != nullptr && params.adaptive && memory->costs.verify.empty()) {
        const auto t0 = clock_type::now();
        memory->costs = measure_step_costs(target, draft, block_size);
        calibration_ms = ms_since(t0);
        t_start = clock_type::now();  // once per engine, like a warm-up at load: not this generation's time
    }
    const step_costs * known = params.adaptive && memory != nullptr ? &memory->costs : nullptr;

    generate_result res;
    res.stats.n_prompt = (int32_t) prompt.size();
    res.adaptive = params.adaptive;
    target.rollback(0);
    draft.crop(0);
    target.set_capture(hp.target_layer_ids);
    spec_loop loop{ target, draft, params, stop_rule{ target, params }, block_size, draft_max, max_length,
                    target.n_vocab(), sampler(params.sampling.seed), res };

    // prefill: the prompt through the target; its features seed the draft cache
    auto t0 = clock_type::now();
    target.decode(prompt.data(), (int32_t) prompt.size(), 0, /*all_logits=*/false);
    loop.last = choose(target.logits(0), loop.n_vocab, params.sampling, loop.rng);
    res.stats.t_prefill_ms = ms_since(t0);
    // the prompt's features wait like a plain step's: a generation that never drafts never injects
    loop.pending.add(target.features(), (int32_t) prompt.size(), loop.feature_row);
    if (loop.pending.full(loop.feature_row) || !params.adaptive) {
        t0 = clock_type::now();
        loop.pending.flush(draft);
        res.stats.t_draft_ms += ms_since(t0);
    }

    res.tokens.push_back(loop.last);
    if (on_tokens) on_tokens({ loop.last });
    loop.stopped = loop.is_stop(loop.last);
    loop.start = (int32_t) prompt.size();

    // shadow probes score proposals against plain decoding's tokens: sound for greedy output only
    draft_policy policy(draft_max, known, known != nullptr && params.sampling.greedy());
    if (memory != nullptr && params.adaptive && memory->learned) policy.resume(*memory->learned);
    if (params.adaptive && params.ngram.value_or(true)) {
        loop.ngrams.emplace();
        loop.ngrams->add(prompt);
        loop.ngrams->add(loop.last);
    }
    if (params.adaptive && hp.has_confidence_head && params.confidence.value_or(true)) {
        loop.gate = &policy;
    }
    while (loop.start + 1 < max_length && !loop.stopped) {
        // near max_length the block is shorter (as published), and the last token is a plain step
        const int32_t room = max_length - loop.start - 1;
        if (!params.adaptive) {
            loop.draft_step(std::min(draft_max, room), on_tokens);
            continue;
        }
        // an n-gram proposal may run past the draft's block (draft_policy::kNgramMax)
        const ngram_proposal proposal = loop.ngrams ? loop.ngrams->propose_match(std::min(draft_policy::kNgramMax, room))
                                                    : ngram_proposal{};
        const step_choice choice = policy.choose((int32_t) proposal.tokens.size(), proposal.match);
        loop.head_batch = policy.head_batch();
        const int32_t n = std::min(choice.n, room);
        if (choice.source == step_source::ngram) {
            const auto [t_verify, accepted] =
                loop.ngram_step(std::vector<int32_t>(proposal.tokens.begin(), proposal.tokens.begin() + n), on_tokens);
            policy.observe_ngram(n, accepted, t_verify);
            if (loop.head.rows > 0) policy.observe_head((int32_t) loop.head.rows, (int32_t) loop.head.batches, loop.head.ms);
        } else if (n == 0) {
            policy.observe_plain(loop.plain_step(on_tokens));
        } else {
            const auto [t_draft, t_verify, drafted, accepted] = loop.draft_step(n, on_tokens);
            if (drafted > 0) {
                if (loop.gate != nullptr) policy.observe_confidence(loop.confidences, accepted, true, false);
                policy.observe_draft(drafted, accepted, t_draft, t_verify);
                if (loop.head.rows > 0) policy.observe_head((int32_t) loop.head.rows, (int32_t) loop.head.batches, loop.head.ms);
            } else {  // a confidence head cut the whole draft: the verify was a plain decode
                policy.observe_plain(t_verify + loop.head.ms);
            }
            continue;
        }
        // after a plain or an n-gram step: score a shadow probe, take one asked for
        if (loop.score_shadow()) {
            if (loop.gate != nullptr) {
                policy.observe_confidence(loop.shadow->confidences, loop.shadow->matched, true, true);
            }
            policy.observe_shadow((int32_t) loop.shadow->proposals.size(), loop.shadow->matched, true, loop.shadow->t_draft);
            loop.shadow.reset();
        }
        if (const int32_t n_shadow = policy.take_shadow(); n_shadow > 0 && !loop.stopped) {
            loop.shadow_step(n_shadow);
            if (!loop.shadow) {  // no room left for one: the probe ends with nothing learned
                policy.drop_shadow();
            }
        }
    }
    res.policy = policy.summary();
    res.policy.calibration_ms = calibration_ms;
    res.policy.plain_ms = policy.expected_ms(0);
    if (memory != nullptr && params.adaptive) memory->learned = policy;

    res.stats.n_generated = (int32_t) res.tokens.size();
    res.stop_reason = stop_reason_for(loop.start + 1, max_length, loop.stopped, prompt, params);
    res.stats.t_total_ms = ms_since(t_start);
    res.stats.t_other_ms = res.stats.t_total_ms - res.stats.t_prefill_ms - res.stats.t_draft_ms - res.stats.t_verify_ms;
    return res;
}

generate_result generate_autoregressive(target_runner & target, const std::vector<int32_t> & prompt,
                                        const generate_params & params, const token_callback & on_tokens) {
    const auto t_start = clock_type::now();
    check_no_draft_params(params);
    const int32_t max_length = check_request(target, prompt, params);
    const sampling_params & sp = params.sampling;
    const stop_rule is_stop{target, params};
    const int32_t n_vocab = target.n_vocab();
    sampler rng(sp.seed);

    generate_result res;
    res.stats.n_prompt = (int32_t) prompt.size();
    target.rollback(0);
    target.set_capture({});

    auto t0 = clock_type::now();
    target.decode(prompt.data(), (int32_t) prompt.size(), 0, false);
    int32_t last = choose(target.logits(0), n_vocab, sp, rng);
    res.stats.t_prefill_ms = ms_since(t0);
    res.tokens.push_back(last);
    if (on_tokens) on_tokens({ last });
    bool stopped = is_stop(last);
    int32_t pos = (int32_t) prompt.size();

    while (pos + 1 < max_length && !stopped) {
        t0 = clock_type::now();
        target.decode(&last, 1, pos, false);
        const float * logits = target.logits(0);  // our output head, where it computes it
        res.stats.t_verify_ms += ms_since(t0);
        last = choose(logits, n_vocab, sp, rng);
        res.tokens.push_back(last);
        if (on_tokens) on_tokens({ last });
        stopped = is_stop(last);
        ++pos;
    }

    res.stats.n_generated = (int32_t) res.tokens.size();
    res.stop_reason = stop_reason_for(pos + 1, max_length, stopped, prompt, params);
    res.stats.t_total_ms = ms_since(t_start);
    res.stats.t_other_ms = res.stats.t_total_ms - res.stats.t_prefill_ms - res.stats.t_verify_ms;
    return res;
}

std::vector<generate_result> generate_autoregressive_batch(target_runner & target,
                                                           const std::vector<std::vector<int32_t>> & prompts,
                                                           const generate_params & params) {
    const auto t_start = clock_type::now();
    const int32_t n_vocab = target.n_vocab();
    const stop_rule is_stop{target, params};
    std::vector<generate_result> results(prompts.size());
    std::vector<int32_t> max_length(prompts.size());
    check_no_draft_params(params);
    for (size_t i = 0; i < prompts.size(); ++i) {
        max_length[i] = check_request(target, prompts[i], params);
        results[i].stats.n_prompt = (int32_t) prompts[i].size();
    }
    if (prompts.empty()) return results;
    for (const auto & p : prompts) {
        if ((int32_t) p.size() > target.n_batch()) {
            throw std::invalid_argument("batched generation needs prompts of at most n_batch (" +
                                        std::to_string(target.n_batch()) + ") tokens, got " + std::to_string(p.size()));
        }
    }

    struct slot { int32_t prompt = -1; int32_t pos = 0; bool prefilled = false; sampler rng{0}; };
    std::vector<slot> slots(target.n_seq());
    size_t next_prompt = 0;
    auto fill = [&](slot & s, int32_t seq) {
        s = slot{};
        if (next_prompt < prompts.size()) {
            s.prompt = (int32_t) next_prompt++;
            s.rng = sampler(params.sampling.seed + (uint64_t) s.prompt);
        }
        target.rollback_seq(seq, 0);
    };
    for (int32_t k = 0; k < (int32_t) slots.size(); ++k) fill(slots[k], k);

    std::vector<int32_t> tokens, positions, seqs, owner;
    std::vector<bool> want;
    while (true) {
        // one decode: the whole prompt of each new sequence (while it fits), the last token of the others
        tokens.clear(); positions.clear(); seqs.clear(); want.clear(); owner.clear();
        for (int32_t k = 0; k < (int32_t) slots.size(); ++k) {
            slot & s = slots[k];
            if (s.prompt < 0) continue;
            const auto & p = prompts[s.prompt];
            if (!s.prefilled) {
                if (tokens.size() + p.size() > (size_t) target.n_batch()) continue;  // next round
                for (size_t j = 0; j < p.size(); ++j) {
                    tokens.push_back(p[j]); positions.push_back((int32_t) j); seqs.push_back(k);
                    want.push_back(j + 1 == p.size());
                }
                s.pos = (int32_t) p.size();
            } else {
                if (tokens.size() + 1 > (size_t) target.n_batch()) continue;
                // the newest token sits at position s.pos (right after the sequence so far)
                tokens.push_back(results[s.prompt].tokens.back()); positions.push_back(s.pos);
                seqs.push_back(k); want.push_back(true);
                s.pos += 1;
            }
            owner.push_back(k);
        }
        if (tokens.empty()) break;
        target.decode_multi(tokens, positions, seqs, want);

        for (size_t r = 0; r < owner.size(); ++r) {
            const int32_t k = owner[r];
            slot & s = slots[k];
            s.prefilled = true;
            generate_result & res = results[s.prompt];
            const int32_t next = choose(target.logits((int32_t) r), n_vocab, params.sampling, s.rng);
            res.tokens.push_back(next);
            const int32_t length = res.stats.n_prompt + (int32_t) res.tokens.size();
            const bool stopped = is_stop(next);
            if (stopped || length >= max_length[s.prompt]) {
                res.stats.n_generated = (int32_t) res.tokens.size();
                res.stop_reason = stop_reason_for(length, max_length[s.prompt], stopped, prompts[s.prompt], params);
                fill(s, k);
            }
        }
    }
    const double total = ms_since(t_start);
    for (auto & r : results) r.stats.t_total_ms = total;
    return results;
}

} // namespace dflash
