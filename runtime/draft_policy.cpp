#include "draft_policy.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

namespace dflash {

namespace {
constexpr double kFirstAcceptance = 0.5;  // prior of c_1 before any draft was verified
constexpr double kPriorWeight     = 1.0;  // its weight, in drafting steps
constexpr double kPriorSlope      = 0.5;  // extra cost of each verified token, in plain steps, until measured
constexpr int32_t kFirstDraft     = 2;    // N of the first drafting step
}

const char * source_name(step_source s) {
    switch (s) {
        case step_source::plain: return "plain";
        case step_source::draft: return "draft";
        case step_source::ngram: return "ngram";
    }
    return "?";
}

void draft_policy::average::add(double x) {
    value = seen ? value + kCostWeight * (x - value) : x;
    seen  = true;
}

draft_policy::draft_policy(int32_t max_draft, const step_costs * costs, bool shadow)
    : max_draft_(max_draft), verify_(std::max(max_draft, kNgramMax) + 2), draft_(max_draft + 1), hits_(max_draft + 1, 0.0),
      tries_(max_draft + 1, 0.0), shadow_(shadow) {
    if (max_draft < 1) {
        throw std::invalid_argument("the adaptive loop needs a block of at least 2 tokens, got a draft of " +
                                    std::to_string(max_draft));
    }
    if (costs == nullptr) {
        return;
    }
    for (size_t k = 1; k < costs->verify.size() && k <= (size_t) max_draft + 1; ++k) {
        if (costs->verify[k] > 0.0) verify_[k].add(costs->verify[k]);
    }
    for (size_t n = 1; n < costs->draft.size() && n <= (size_t) max_draft; ++n) {
        if (costs->draft[n] > 0.0) draft_[n].add(costs->draft[n]);
    }
    if (costs->head_row > 0.0) {
        row_.add(costs->head_row);
        pass_ = std::max(costs->head_pass, 0.0);
    }
    if (!verify_[1].seen || std::none_of(draft_.begin(), draft_.end(), [](const average & a) { return a.seen; })) {
        throw std::invalid_argument("draft_policy: step costs need a plain step's time and a draft forward's");
    }
    plain_mode_ = true;  // start plain and probe at once: the costs are known, acceptance is not;
    // that opening probe failing waits kProbeFirst steps
    interval_ = kProbeFirst / kProbeGrowth;
}

void draft_policy::resume(const draft_policy & earlier) {
    if (earlier.max_draft_ != max_draft_) {
        throw std::invalid_argument("draft_policy: resuming a policy of " + std::to_string(earlier.max_draft_) +
                                    " drafted tokens as one of " + std::to_string(max_draft_));
    }
    verify_      = earlier.verify_;
    draft_       = earlier.draft_;
    row_         = earlier.row_;
    pass_        = earlier.pass_;
    hits_        = earlier.hits_;
    tries_       = earlier.tries_;
    std::copy(std::begin(earlier.ngram_), std::end(earlier.ngram_), std::begin(ngram_));
    calibration_ = earlier.calibration_;
    plain_mode_  = earlier.plain_mode_;
    probed_      = earlier.probed_;
    interval_    = earlier.interval_;
    countdown_   = earlier.probing_ ? 0 : earlier.countdown_;  // a probe never scored: ask again
}

// E(n) = 1 + sum_{i<=n} prod_{j<=i} c_j, each c_j the decayed hit rate of position j pulled towards
// the estimate of position j - 1 (of position 1: kFirstAcceptance) with weight kPriorWeight.
std::vector<double> draft_policy::reads(const std::vector<double> & hits, const std::vector<double> & tries, int32_t n,
                                        double prior) {
    std::vector<double> r((size_t) n + 1, 1.0);
    double c = prior;
    for (int32_t i = 1; i <= n; ++i) {
        c = (hits[i] + kPriorWeight * c) / (tries[i] + kPriorWeight);
        r[i] = r[i - 1] * c;
    }
    return r;
}

double draft_policy::chained(const std::vector<double> & hits, const std::vector<double> & tries, int32_t n,
                             double prior) {
    const std::vector<double> r = reads(hits, tries, n, prior);
    return std::accumulate(r.begin(), r.end(), 0.0);
}

std::vector<double> draft_policy::draft_reads(int32_t n) const { return reads(hits_, tries_, n, kFirstAcceptance); }

std::vector<double> draft_policy::ngram_reads(int32_t cls, int32_t m) const {
    return reads(ngram_[cls].hits, ngram_[cls].tries, m, kNgramPrior[cls]);
}

double draft_policy::expected_tokens(int32_t n) const { return chained(hits_, tries_, n, kFirstAcceptance); }

double draft_policy::expected_ngram_tokens(int32_t m, int32_t match) const {
    return ngram_tokens(match_class(match), std::min(m, kNgramMax));
}

double draft_policy::ngram_tokens(int32_t cls, int32_t m) const {
    return chained(ngram_[cls].hits, ngram_[cls].tries, m, kNgramPrior[cls]);
}

// Seen sizes as they are; others on the line through the nearest seen sizes around them (beyond the
// largest, the slope of the two largest, or kPriorSlope plain steps per token if only one is seen).
double draft_policy::verify_ms(int32_t k) const {
    if (verify_[k].seen) return verify_[k].value;
    int32_t lo = k - 1, hi = k + 1;
    while (lo >= 1 && !verify_[lo].seen) --lo;
    const int32_t top = (int32_t) verify_.size() - 1;
    while (hi <= top && !verify_[hi].seen) ++hi;
    const bool has_hi = hi <= top;
    if (lo >= 1 && has_hi) {
        const double f = (double) (k - lo) / (hi - lo);
        return verify_[lo].value + f * (verify_[hi].value - verify_[lo].value);
    }
    if (lo >= 1) {
        int32_t lo2 = lo - 1;
        while (lo2 >= 1 && !verify_[lo2].seen) --lo2;
        const double slope = lo2 >= 1 ? (verify_[lo].value - verify_[lo2].value) / (lo - lo2)
                                      : kPriorSlope * verify_[lo].value / lo;
        return verify_[lo].value + std::max(slope, 0.0) * (k - lo);
    }
    return has_hi ? verify_[hi].value * k / hi : 0.0;
}

// A draft forward costs much the same whatever its number of proposals: the nearest seen one, else
// a plain step's time.
double draft_policy::draft_ms(int32_t n) const {
    for (int32_t d = 0; d <= max_draft_; ++d) {
        if (n - d >= 1 && draft_[n - d].seen) return draft_[n - d].value;
        if (n + d <= max_draft_ && draft_[n + d].seen) return draft_[n + d].value;
    }
    return verify_ms(1);
}

// Each first batch b = 1..k against the rows' chances of being read; then the target's doubling
// (target_runner::logits: rows i..2i-1 when row i is read and not computed).
draft_policy::head_plan draft_policy::plan_head(const std::vector<double> & reads, int32_t k) const {
    k = k < 0 ? (int32_t) reads.size() : std::min(k, (int32_t) reads.size());
    head_plan plan;
    if (!row_.seen || k == 0) {
        return plan;
    }
    auto batch_ms = [this](int32_t rows) { return pass_ms() + row_ms() * rows; };
    for (int32_t b = 1; b <= k; ++b) {
        double ms = batch_ms(b);
        for (int32_t i = b; i < k; i += std::max(1, i)) {
            ms += reads[i] * batch_ms(std::min(std::max(1, i), k - i));
        }
        if (b == 1 || ms < plan.ms) {
            plan = { b, ms };
        }
    }
    return plan;
}

double draft_policy::verify_step_ms(int32_t k, const std::vector<double> & reads) const {
    const double t = verify_ms(k);
    return t > 0.0 ? t + plan_head(reads, k).ms : 0.0;
}

double draft_policy::expected_ms(int32_t n) const {
    const double t1 = verify_ms(1);
    if (t1 <= 0.0) return 0.0;
    return n == 0 ? t1 : draft_ms(n) + verify_step_ms(n + 1, draft_reads(n));
}

double draft_policy::ngram_ms(int32_t cls, int32_t m) const { return verify_step_ms(m + 1, ngram_reads(cls, m)); }

double draft_policy::expected_ngram_ms(int32_t m, int32_t match) const {
    return ngram_ms(match_class(match), std::min(m, kNgramMax));
}

int32_t draft_policy::best(int32_t n_min) const {
    int32_t pick = n_min;
    double  top  = -1.0;
    for (int32_t n = n_min; n <= max_draft_; ++n) {
        const double ms = expected_ms(n);
        const double speed = ms > 0.0 ? expected_tokens(n) / ms : 0.0;
        if (speed > top) {
            top  = speed;
            pick = n;
        }
    }
    return pick;
}

// The step taken (the caller may cut the choice near the end), predicted from the costs before it.
void draft_policy::note_step(int32_t n) {
    (n == 0 ? summary_.plain_steps : summary_.draft_steps) += 1;
    summary_.drafted += n;
    const double ms = expected_ms(n);
    if (ms > 0.0) {
        summary_.predicted_tokens += expected_tokens(n);
        summary_.predicted_ms     += ms;
    }
}

// Up to the draft's block, or twice the furthest position the class has verified: a position never
// verified inherits the estimate of the one before it, which a single lucky step can inflate.
int32_t draft_policy::best_ngram(int32_t max_len, int32_t cls) const {
    const int32_t reach = std::max(max_draft_, 2 * ngram_[cls].reach);
    const int32_t longest = std::min({ max_len, reach, kNgramMax });
    const std::vector<double> r = ngram_reads(cls, std::max(longest, 1));  // every m's rows: a prefix of these
    int32_t pick = 1;
    double  top  = -1.0;
    double  tokens = r[0];
    for (int32_t m = 1; m <= longest; ++m) {
        tokens += r[m];  // ngram_tokens(cls, m)
        const double ms = verify_step_ms(m + 1, r);  // ngram_ms(cls, m): the first m + 1 reads
        const double speed = ms > 0.0 ? tokens / ms : 0.0;
        if (speed > top) {
            top  = speed;
            pick = m;
        }
    }
    return pick;
}

double draft_policy::draft_side_speed() const {
    const double plain = expected_ms(0);
    double speed = plain > 0.0 ? 1.0 / plain : 0.0;
    const bool drafting = !plain_mode_ && std::any_of(draft_.begin(), draft_.end(), [](const average & a) { return a.seen; });
    if (drafting && pays(best(1))) {
        speed = std::max(speed, expected_tokens(best(1)) / expected_ms(best(1)));
    }
    return speed;
}

// The n-gram side is verified when it is faster than the draft side, and probed otherwise: at its
// first proposal of the generation, then after kProbeFirst, kProbeFirst * kProbeGrowth, ... (at
// most kProbeMax) proposals passed over, the wait starting again at kProbeFirst after a probe that
// leaves it paying: its acceptance is learned only by verifying it. No probe when not even a
// proposal accepted in full would be faster.
step_choice draft_policy::choose(int32_t ngram_len, int32_t match) {
    if (ngram_len < 0 || match < 0) {
        throw std::invalid_argument("draft_policy: an n-gram proposal of " + std::to_string(ngram_len) + " tokens from a "
                                    "match of " + std::to_string(match));
    }
    if (ngram_len > 0 && verify_[1].seen) {  // the n-gram side needs a plain step's time to compare with
        const int32_t cls = match_class(match);
        ngram_record & r = ngram_[cls];
        const int32_t m  = best_ngram(ngram_len, cls);
        const double  ms = ngram_ms(cls, m);
        const double rival = draft_side_speed();
        const bool faster = ms > 0.0 && ngram_tokens(cls, m) / ms > rival;
        bool could = false;  // a proposal accepted in full would be faster: worth a probe
        for (int32_t k = 1; k <= std::min(ngram_len, max_draft_) && !could; ++k) {
            const double full = verify_step_ms(k + 1, std::vector<double>((size_t) k + 1, 1.0));
            could = full > 0.0 && (k + 1) / full > rival;
        }
        if (faster || (could && r.countdown == 0)) {
            ngram_probing_ = !faster;
            ngram_class_   = cls;
            head_batch_    = plan_head(ngram_reads(cls, m)).batch;
            return { step_source::ngram, m };
        }
        r.countdown -= could && r.countdown > 0 ? 1 : 0;
    }
    const int32_t n = choose();
    return { n == 0 ? step_source::plain : step_source::draft, n };
}

int32_t draft_policy::choose() {
    int32_t n = 0;
    if (!verify_[1].seen) {
        n = 0;  // the first step measures plain decoding
    } else if (std::none_of(draft_.begin(), draft_.end(), [](const average & a) { return a.seen; })) {
        n = std::min(kFirstDraft, max_draft_);  // the second measures drafting
    } else if (plain_mode_ && (countdown_ > 0 || probing_)) {
        countdown_ -= countdown_ > 0 ? 1 : 0;  // a shadow probe being scored: wait for its outcome
    } else if (plain_mode_ && probed_ && perfect_speedup() <= 1.0 + kSwitchMargin) {
        countdown_ = kProbeMax - 1;  // no draft could pay: look again only once the costs may have moved
    } else if (plain_mode_) {
        probing_ = probed_ = true;
        ++summary_.probes;
        if (shadow_) {
            ++summary_.shadow_probes;
            shadow_n_ = max_draft_;  // every position scored at once
        } else {
            n = best(1);
        }
    } else {
        n = pays(best(1)) ? best(1) : 0;
        if (n == 0) {
            plain_mode_ = true;
            countdown_  = interval_ - 1;
        }
    }
    head_batch_ = n > 0 ? plan_head(draft_reads(n)).batch : 1;
    return n;
}

// Drafting n beats plain decoding by kSwitchMargin: a step that only just pays on paper loses to the
// noise of its estimates.
bool draft_policy::pays(int32_t n) const {
    const double ms = expected_ms(n), plain = expected_ms(0);
    return ms > 0.0 && plain > 0.0 && expected_tokens(n) / ms > (1.0 + kSwitchMargin) / plain;
}

double draft_policy::perfect_speedup() const {
    const double plain = expected_ms(0);
    double top = 0.0;
    for (int32_t n = 1; n <= max_draft_ && plain > 0.0; ++n) {
        const double ms = draft_ms(n) + verify_step_ms(n + 1, std::vector<double>((size_t) n + 1, 1.0));
        if (verify_ms(n + 1) > 0.0) top = std::max(top, (n + 1) * plain / ms);
    }
    return top;
}

int32_t draft_policy::take_shadow() {
    const int32_t n = shadow_n_;
    shadow_n_ = 0;
    return n;
}

void draft_policy::decay() {
    for (int32_t j = 1; j <= max_draft_; ++j) {
        hits_[j]  *= kDecay;
        tries_[j] *= kDecay;
    }
    for (ngram_record & r : ngram_) {
        for (int32_t j = 1; j <= kNgramMax; ++j) {
            r.hits[j]  *= kDecay;
            r.tries[j] *= kDecay;
        }
    }
}

void draft_policy::observe_plain(double t_ms) {
    note_step(0);
    verify_[1].add(t_ms);
    decay();
}

void draft_policy::observe_draft(int32_t n, int32_t accepted, double t_draft_ms, double t_verify_ms) {
    if (n < 1 || n > max_draft_ || accepted < 0 || accepted > n) {
        throw std::invalid_argument("draft_policy: a step of " + std::to_string(n) + " drafted, " + std::to_string(accepted) +
                               " accepted");
    }
    note_step(n);
    summary_.draft_accepted += accepted;
    draft_[n].add(t_draft_ms);
    verify_[n + 1].add(t_verify_ms);
    decay();
    tally(hits_, tries_, n, accepted, true);
    if (probing_) {
        end_probe();
    }
}

void draft_policy::observe_ngram(int32_t m, int32_t accepted, double t_verify_ms) {
    if (m < 1 || m > kNgramMax || accepted < 0 || accepted > m) {
        throw std::invalid_argument("draft_policy: an n-gram step of " + std::to_string(m) + " proposed, " +
                                    std::to_string(accepted) + " accepted");
    }
    summary_.ngram_steps += 1;
    summary_.ngram_drafted += m;
    summary_.ngram_accepted += accepted;
    ngram_record & r = ngram_[ngram_class_];
    if (const double ms = ngram_ms(ngram_class_, m); ms > 0.0) {
        summary_.predicted_tokens += ngram_tokens(ngram_class_, m);
        summary_.predicted_ms     += ms;
    }
    verify_[m + 1].add(t_verify_ms);
    decay();
    tally(r.hits, r.tries, m, accepted, true);
    r.reach = std::max(r.reach, std::min(accepted + 1, m));
    if (ngram_probing_) {
        ngram_probing_ = false;
        const int32_t best = best_ngram(kNgramMax, ngram_class_);
        const bool pays = ngram_tokens(ngram_class_, best) / ngram_ms(ngram_class_, best) > draft_side_speed();
        r.wait = pays ? kProbeFirst : std::min(kProbeGrowth * r.wait, kProbeMax);
        r.countdown = r.wait;
    }
}

void draft_policy::observe_head(int32_t rows, int32_t batches, double t_ms) {
    if (rows < 1 || batches < 1 || batches > rows || t_ms < 0.0) {
        throw std::invalid_argument("draft_policy: " + std::to_string(rows) + " head rows in " + std::to_string(batches) +
                                    " batches in " + std::to_string(t_ms) + " ms");
    }
    row_.add(std::max(0.0, t_ms - pass_ * batches) / rows);
}

void draft_policy::observe_shadow(int32_t n, int32_t matched, bool settled, double t_draft_ms) {
    if (!probing_ || n < 1 || n > max_draft_ || matched < 0 || matched > n) {
        throw std::invalid_argument("draft_policy: a shadow probe of " + std::to_string(n) + " proposals, " +
                                    std::to_string(matched) + " matched" + (probing_ ? "" : ", none asked for"));
    }
    draft_[n].add(t_draft_ms);
    summary_.predicted_ms += t_draft_ms;  // its cost, with no tokens of its own
    tally(hits_, tries_, n, matched, settled || matched == n);
    end_probe();
}

void draft_policy::drop_shadow() {
    if (probing_ && shadow_) {
        end_probe();
    }
}

// Position j of n was tried when every position before it was accepted; `accepted` were.
void draft_policy::tally(std::vector<double> & hits, std::vector<double> & tries, int32_t n, int32_t accepted, bool settled) {
    for (int32_t j = 1; j <= std::min(accepted + (settled ? 1 : 0), n); ++j) {
        tries[j] += 1.0;
        hits[j]  += j <= accepted ? 1.0 : 0.0;
    }
}

// A probe from plain mode: stay plain (and wait longer) unless drafting now pays by a margin (one
// probe is thin evidence: a switch that only just pays loses to noise).
void draft_policy::end_probe() {
    probing_ = false;
    if (!pays(best(1))) {
        interval_  = std::min(kProbeGrowth * interval_, kProbeMax);
        countdown_ = interval_ - 1;
    } else {
        plain_mode_ = false;
        interval_   = kProbeFirst;
    }
}

confidence_calibration::confidence_calibration() : hits_(kBins, 0.0), tries_(kBins, 0.0) {}

int32_t confidence_calibration::bin(float c) {
    return std::clamp((int32_t) (c * kBins), 0, kBins - 1);
}

double confidence_calibration::operator()(float c) const {
    const int32_t b = bin(c);
    return (hits_[b] + kPrior * (b + 0.5) / kBins) / (tries_[b] + kPrior);
}

double confidence_calibration::expected_accepted(const std::vector<float> & conf) const {
    double run = 1.0, sum = 0.0;
    for (const float c : conf) {
        run *= (*this)(c);
        sum += run;
    }
    return sum;
}

void confidence_calibration::observe(const std::vector<float> & conf, int32_t accepted, bool settled) {
    const int32_t n = (int32_t) conf.size();
    if (accepted < 0 || accepted > n) {
        throw std::invalid_argument("confidence_calibration: " + std::to_string(accepted) + " of " + std::to_string(n) +
                                    " slots accepted");
    }
    for (int32_t b = 0; b < kBins; ++b) {
        hits_[b]  *= kDecay;
        tries_[b] *= kDecay;
    }
    for (int32_t i = 0; i < std::min(accepted + (settled ? 1 : 0), n); ++i) {
        tries_[bin(conf[i])] += 1.0;
        hits_[bin(conf[i])]  += i < accepted ? 1.0 : 0.0;
    }
}

void draft_policy::gate_begin(int32_t n) {
    if (n < 1 || n > max_draft_) {
        throw std::invalid_argument("draft_policy: a confidence gate over " + std::to_string(n) + " slots");
    }
    gate_n_ = n;
    gate_run_ = gate_tokens_ = 1.0;
}

bool draft_policy::keep_slot(int32_t i, float c) {
    if (i < 0 || i >= gate_n_) {
        throw std::invalid_argument("draft_policy: slot " + std::to_string(i) + " of a gate over " + std::to_string(gate_n_));
    }
    const double run = gate_run_ * calibration_(c);
    // the head's rows: one per token the step is expected to produce, the slot adding `run` of them
    // (its rows taken as one batch)
    const double t_before = draft_ms(gate_n_) + verify_ms(i + 1) + pass_ms() + row_ms() * gate_tokens_;
    const double extra    = verify_ms(i + 2) - verify_ms(i + 1) + row_ms() * run;
    if (extra > 0.0 && run * t_before <= gate_tokens_ * extra) {
        summary_.confidence_cut += gate_n_ - i;
        gate_n_ = 0;
        return false;
    }
    gate_run_ = run;
    gate_tokens_ += run;
    return true;
}

void draft_policy::observe_confidence(const std::vector<float> & conf, int32_t accepted, bool settled, bool shadow) {
    if (!shadow && !conf.empty()) {
        summary_.confidence_steps += 1;
        summary_.confidence_expected += calibration_.expected_accepted(conf);
        summary_.position_expected   += expected_tokens((int32_t) conf.size()) - 1.0;
        summary_.confidence_accepted += accepted;
    }
    calibration_.observe(conf, accepted, settled);
}

} // namespace dflash
