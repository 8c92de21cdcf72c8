// The adaptive draft length (`--draft-max auto`): before each step of the speculative loop it picks
// how many drafted tokens the target verifies, N = 0..max_draft, where N = 0 is a plain decode step
// with no draft forward at all. It learns online, on this machine and target, what a step costs (a
// plain decode, a verify of k tokens, a draft forward) and how often each block position is
// accepted, and picks the N of the highest expected speed:
//
//   E(N)     = 1 + sum_{i=1..N} prod_{j<=i} c_j    c_j: acceptance of position j when j-1 was accepted
//   speed(N) = E(N) / (t_draft(N) + t_verify(N+1)),   speed(0) = 1 / t_plain
//
// When plain decoding wins it stays plain, and re-probes drafting after 16, 64, 256 plain steps: the
// wait grows by kProbeGrowth after each probe that does not pay (by kSwitchMargin) and starts again
// at 16 when one does. When not even a draft accepted in full could beat plain decoding by
// kSwitchMargin at any N, there is no probe after the first: drafting cannot pay on this machine and
// target, whatever the text (the first keeps the draft's cost measured in the real context, and
// keeps the loop's drafting path in use).
//
// What one generation learned carries on to the next of the same engine and block size (`resume`,
// policy_memory): the costs as it kept them, every acceptance record and the probe schedule. A draft
// or an n-gram class that did not pay waits out its wait across generations, instead of being probed
// again at the start of each (a probe costs a draft forward or a verify, a large share of a short
// generation); acceptance decays by kDecay a step, so a new text soon speaks for itself.
//
// A second proposal source: an n-gram continuation of the text so far (ngram.h), when there is one.
// It costs no draft forward, only a verify of m + 1 tokens, and has its own acceptance by position:
//
//   speed_ngram(m) = E_ngram(m) / t_verify(m + 1),   m = 1..min(its length, kNgramMax)
//
// An n-gram proposal may run past the draft's block (up to kNgramMax tokens, verify costs beyond the
// measured sizes extrapolated), and its acceptance is kept per class of match length (ngram.h: how
// many tokens of the text's end the found occurrence matches): a short match (under kMatchMedium
// tokens), a medium one, a long one (kMatchLong or more, a copy of earlier text). Each class has its
// own record by position and its own probing, so that a rare long match is verified in full while the
// frequent 2-token matches, often wrong, wait.
//
// Each step the n-gram proposal is verified (cut to its best m) when it is faster than what the draft
// side would do (plain decoding, or drafting N when drafting pays); else the draft side chooses as
// above, and its probes and waits are untouched by the n-gram steps between. An n-gram source that
// does not pay is probed as the draft is: at its first proposal, then after 16, 64, 256 proposals
// passed over.
//
// A third signal: a draft with a confidence head (DSpark) scores each drafted slot before the verify.
// After the draft forward of a drafting step, the chain keeps slot i while the step's expected speed
// rises with it, each slot's chance of acceptance its calibrated confidence (`confidence_calibration`)
// chained over the slots before it, the draft forward paid either way:
//
//   keep slot i  iff  P_i * T_{i-1} > E_{i-1} * (t_verify(i + 1) - t_verify(i))
//   P_i = prod_{j<=i} calibrated(c_j),  E_{i-1} = 1 + sum_{j<i} P_j,  T_{i-1} = t_draft + t_verify(i)
//
// and cuts the rest (all of it: the verify is a plain decode). The calibration learns from every
// verified slot and from shadow probes, whose slots are never cut; the summary sets what it expected
// beside what the position estimate expected and what was accepted.
//
// A target whose output head we compute (output_head.h) pays it per logits row computed, not per
// token verified: a verify reads rows up to the first rejection. Then t_verify(k) is the target's
// decode of k tokens without its head, and the head computes rows in batches: a batch of r rows costs
//
//   t_head(r) = t_pass + t_row * r      (t_pass: streaming the head's weights once, whatever r)
//
// A step computes its first b rows in one batch, then, while its rows are accepted, rows b..2b-1,
// 2b..4b-1, ... (each batch as long as the rows before it). Row i is read with the chance R_i that its
// first i proposals are accepted (R_0 = 1, sum_i R_i = E(N)), so a batch starting at row s is paid
// with chance R_s; the loop takes the b of the least expected head time (head_batch()): a whole batch
// where acceptance is high (one pass over the weights), row by row where it is low. A plain step's
// time is its whole (decode and one row):
//
//   speed(N) = E(N) / (t_draft(N) + t_verify(N+1) + min_b sum_{batches} R_s * t_head(size))
//
// Costs are exponential averages per size; sizes not yet seen are interpolated linearly between
// seen ones. Acceptance counts decay (by kDecay a step, plain steps too) so that they follow the text
// and a probe after a long plain stretch is judged mostly on what it sees.
//
// Two ways to start and to probe:
// - Learning everything online (no step_costs): the first step is plain (it measures t_plain), the
//   second drafts (it measures the rest), and a probe is a drafting step.
// - With step costs measured beforehand (`measure_step_costs`, once per engine) and shadow probes
//   (greedy decoding only): the loop starts plain and probes at once, and a probe is a draft forward
//   whose proposals are never verified: the plain steps that follow score them for free (greedy
//   output is the target's own, so proposal j would have been accepted iff it equals the j-th
//   token that plain decoding then produces). A probe then costs a draft forward, not a verify.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace dflash {

// What steps cost on this machine and target, measured before a generation (ms).
struct step_costs {
    std::vector<double> verify;  // [k]: one target decode of k tokens (k = 1: a plain step), k = 1..
    std::vector<double> draft;   // [n]: a draft forward of n proposals with an injection, n = 1..
    double head_row = 0.0;       // a logits row of our output head after a verify (0: in the decode)
    double head_pass = 0.0;      // ... and each batch of its rows beyond them (t_head(r) = head_pass + head_row * r)
};

// Where the tokens a step verifies after the last one come from.
enum class step_source : int32_t { plain, draft, ngram };
const char * source_name(step_source s);  // "plain", "draft", "ngram"

struct step_choice {
    step_source source = step_source::plain;
    int32_t     n      = 0;  // tokens proposed (0: a plain step)
};

struct policy_summary {
    int32_t plain_steps = 0;        // N = 0: a plain decode, no draft forward
    int32_t draft_steps = 0;        // N >= 1
    int32_t ngram_steps = 0;        // an n-gram proposal verified, no draft forward
    int32_t probes      = 0;        // probes of drafting from plain mode (drafting steps or shadow probes)
    int32_t shadow_probes = 0;      // of them: draft forwards scored by the plain steps after them
    double  calibration_ms = 0.0;   // time spent measuring step_costs for this generation (0: known)
    double  plain_ms    = 0.0;      // a plain step's cost at the end (its running average; 0: unknown)
    int64_t drafted     = 0;        // sum of N over drafting steps
    int64_t draft_accepted = 0;     // drafted tokens accepted
    int64_t ngram_drafted  = 0;     // n-gram tokens verified
    int64_t ngram_accepted = 0;     // of them accepted
    int32_t confidence_steps = 0;   // drafting steps whose draft the confidence gate cut to length
    int64_t confidence_cut   = 0;   // slots it cut
    double  confidence_expected = 0.0;  // over those steps: accepted tokens expected by the calibrated confidences
    double  position_expected   = 0.0;  // ... by the acceptance estimate per position (E(N) - 1)
    int64_t confidence_accepted = 0;    // ... and accepted
    double  predicted_tokens = 0.0; // sum over steps of the expected tokens of the choice
    double  predicted_ms     = 0.0; // sum over steps of its expected time

    double mean_draft() const { return draft_steps > 0 ? (double) drafted / draft_steps : 0.0; }
    double plain_share() const {
        const int32_t n = plain_steps + draft_steps + ngram_steps;
        return n > 0 ? (double) plain_steps / n : 0.0;
    }
    // tokens a drafting step produced on average (accepted + 1)
    double draft_tau() const { return draft_steps > 0 ? 1.0 + (double) draft_accepted / draft_steps : 0.0; }
    double ngram_acceptance() const { return ngram_drafted > 0 ? (double) ngram_accepted / ngram_drafted : 0.0; }
    double predicted_tokens_per_second() const { return predicted_ms > 0.0 ? 1000.0 * predicted_tokens / predicted_ms : 0.0; }
};

// A confidence head's scores, calibrated online: the chance that the target accepts a drafted slot of
// raw confidence c given that every slot before it was accepted (the event the head predicts: its
// Markov predecessor is then the true token), per kBins equal bins of c, a decayed hit rate pulled
// towards the bin's centre (the head taken at its word) with weight kPrior.
class confidence_calibration {
public:
    confidence_calibration();
    double operator()(float c) const;
    // Slots verified in order with these confidences; `accepted` of them were accepted; settled: the
    // slot after the accepted ones was seen to be rejected (else the sequence ended first).
    void observe(const std::vector<float> & conf, int32_t accepted, bool settled);
    double expected_accepted(const std::vector<float> & conf) const;  // sum_i prod_{j<=i} calibrated(c_j)

    static constexpr int32_t kBins  = 10;
    static constexpr double  kPrior = 2.0;
    static constexpr double  kDecay = 0.99;

private:
    static int32_t bin(float c);
    std::vector<double> hits_, tries_;
};

class draft_policy {
public:
    // costs: measured step costs to start from (nullptr: learn them in the first steps); shadow:
    // probe with unverified draft forwards (greedy decoding only).
    explicit draft_policy(int32_t max_draft, const step_costs * costs = nullptr, bool shadow = false);

    // Go on from what an earlier generation's policy (same max_draft) learned: its costs, acceptance
    // records, confidence calibration and probe schedule; a probe it left under way is asked for again.
    // This generation's summary starts empty.
    void resume(const draft_policy & earlier);

    // N for the next step, 0..max_draft (the caller may cut it near the end of the sequence).
    int32_t choose();
    // The next step when an n-gram proposal of ngram_len tokens is at hand (0: none), from a match of
    // `match` tokens: it, cut to its best length, or what choose() picks.
    step_choice choose(int32_t ngram_len, int32_t match = 0);
    // After a plain step: the number of proposals of a shadow probe to draft now (0: none). Its
    // outcome comes back through observe_shadow.
    int32_t take_shadow();
    // What the chosen step cost: a plain decode of one token, or a draft forward of n proposals,
    // a verify of n + 1 tokens and the injection of the accepted ones, `accepted` of n accepted.
    void observe_plain(double t_ms);
    void observe_draft(int32_t n, int32_t accepted, double t_draft_ms, double t_verify_ms);
    // The n-gram proposal chosen, m tokens verified (m + 1 tokens in one target decode), `accepted` of them.
    void observe_ngram(int32_t m, int32_t accepted, double t_verify_ms);
    // After a verify whose logits our output head computed: `rows` rows in `batches` batches in `t_ms`
    // (t_verify_ms above is then the decode alone).
    void observe_head(int32_t rows, int32_t batches, double t_ms);
    // The rows of the chosen step's verify to compute in one batch first (1: row by row, doubling).
    int32_t head_batch() const { return head_batch_; }
    // A shadow probe of n proposals: its first `matched` equal the tokens produced after it; settled:
    // proposal matched + 1 was seen to differ (or all n matched), else the sequence ended first.
    void observe_shadow(int32_t n, int32_t matched, bool settled, double t_draft_ms);
    // The shadow probe asked for could not be drafted (no room left): it ends with nothing observed.
    void drop_shadow();

    // The confidence gate of a drafting step of n (choose()): gate_begin(n) after its draft forward,
    // then keep_slot(i, c) for its slots in order, until one is refused (the rest are cut).
    void gate_begin(int32_t n);
    bool keep_slot(int32_t i, float c);
    // The confidences of the slots a step verified (before observe_draft) or a shadow probe scored
    // (before observe_shadow), and how many were accepted: the calibration learns, the summary counts.
    void observe_confidence(const std::vector<float> & conf, int32_t accepted, bool settled, bool shadow);
    const confidence_calibration & calibration() const { return calibration_; }

    double expected_tokens(int32_t n) const;
    double expected_ms(int32_t n) const;  // 0 while the cost of n cannot be estimated yet
    double expected_ngram_tokens(int32_t m, int32_t match = 0) const;  // from a match of `match` tokens
    double expected_ngram_ms(int32_t m, int32_t match = 0) const;
    // The speed of a draft accepted in full at its best N, in units of plain decoding's (0: unknown).
    double perfect_speedup() const;
    const policy_summary & summary() const { return summary_; }
    int32_t probe_wait() const { return interval_; }  // plain steps from one probe of drafting to the next

    static constexpr double  kDecay        = 0.95;
    static constexpr double  kCostWeight   = 0.2;  // weight of a new time in its average
    static constexpr int32_t kProbeFirst   = 16;  // plain steps after a first probe that would not have paid
    static constexpr int32_t kProbeGrowth  = 4;   // the wait after each further one
    static constexpr int32_t kProbeMax     = 256;
    static constexpr double  kSwitchMargin = 0.1;  // a probe ends plain mode when drafting is this much faster
    static constexpr int32_t kNgramMax     = 64;   // the longest n-gram proposal verified
    static constexpr int32_t kMatchMedium  = 6;    // match lengths of the n-gram classes: short below this,
    static constexpr int32_t kMatchLong    = 16;   // long from this (a copy), medium between
    static int32_t match_class(int32_t match) { return match >= kMatchLong ? 2 : match >= kMatchMedium ? 1 : 0; }
    // The prior acceptance of a class's first position before any of its proposals was verified: a
    // longer match is more often a copy (SmolLM2 on HumanEval: the first token of a match of 2 right
    // 39% of the time, of 6 to 15 tokens 83-91%, of 16 or more 94%).
    static constexpr double kNgramPrior[3] = { 0.5, 0.7, 0.85 };

private:
    struct average { double value = 0.0; bool seen = false; void add(double x); };

    int32_t best(int32_t n_min) const;
    int32_t best_ngram(int32_t max_len, int32_t cls) const;
    double  ngram_tokens(int32_t cls, int32_t m) const;
    std::vector<double> ngram_reads(int32_t cls, int32_t m) const;
    std::vector<double> draft_reads(int32_t n) const;
    double  draft_side_speed() const;  // tokens/ms of what choose() would do now (plain, or drafting that pays)
    bool    pays(int32_t n) const;
    double  verify_ms(int32_t k) const;   // k tokens in one target decode; k = 1 is a plain step
    double  row_ms() const { return row_.seen ? row_.value : 0.0; }
    double  pass_ms() const { return row_.seen ? pass_ : 0.0; }
    struct head_plan {
        int32_t batch = 1;  // rows computed in the first batch
        double  ms    = 0.0;  // expected head time
    };
    // the head's batches for a verify of k rows (-1: reads.size()), row i read with chance reads[i]
    head_plan plan_head(const std::vector<double> & reads, int32_t k = -1) const;
    // a verify of k tokens whose rows are read with chances reads[0..k-1]: the decode and the head's rows
    double  verify_step_ms(int32_t k, const std::vector<double> & reads) const;
    double  ngram_ms(int32_t cls, int32_t m) const;
    double  draft_ms(int32_t n) const;
    void    note_step(int32_t n);
    void    decay();
    static void tally(std::vector<double> & hits, std::vector<double> & tries, int32_t n, int32_t accepted, bool settled);
    static double chained(const std::vector<double> & hits, const std::vector<double> & tries, int32_t n,
                          double prior);
    // R_i, i = 0..n: the chance that the first i proposals are all accepted (chained's terms)
    static std::vector<double> reads(const std::vector<double> & hits, const std::vector<double> & tries, int32_t n,
                                     double prior);
    void    end_probe();

    int32_t max_draft_;
    std::vector<average> verify_;   // [k], k = 1..max(max_draft, kNgramMax) + 1
    std::vector<average> draft_;    // [n], n = 1..max_draft
    average              row_;      // a logits row of our output head (unseen: it is in the decode)
    double               pass_ = 0.0;  // a batch of its rows beyond them (measured beforehand; 0: unknown)
    int32_t              head_batch_ = 1;
    std::vector<double>  hits_, tries_;  // decayed counts per position [j], j = 1..max_draft
    struct ngram_record {           // one class of n-gram proposals (match_class)
        std::vector<double> hits  = std::vector<double>(kNgramMax + 1, 0.0);  // [j], j = 1..kNgramMax
        std::vector<double> tries = std::vector<double>(kNgramMax + 1, 0.0);
        int32_t reach = 0;          // the furthest position verified
        int32_t countdown = 0;      // proposals to pass over before the next probe
        int32_t wait = kProbeFirst / kProbeGrowth;  // the first wait after a probe that does not pay: 16
    };
    ngram_record ngram_[3];
    bool    plain_mode_ = false;
    bool    probed_     = false;   // drafting was probed at least once (this or an earlier generation)
    bool    probing_    = false;
    bool    shadow_     = false;
    int32_t shadow_n_   = 0;   // a shadow probe asked for, not yet taken
    int32_t countdown_  = 0;
    int32_t interval_   = kProbeFirst;
    bool    ngram_probing_   = false;  // the n-gram step under way is a probe
    int32_t ngram_class_     = 0;      // ... and its class
    confidence_calibration calibration_;
    int32_t gate_n_ = 0;        // the drafting step under the gate: its n, the chained chance of its
    double  gate_run_ = 1.0;    // slots kept so far, and their expected tokens (1 + sum of the chain)
    double  gate_tokens_ = 1.0;
    policy_summary summary_;
};

// What the adaptive loop keeps between the generations of one engine (per block size): the step
// costs, measured before the first, and the policy as the last generation left it (resume).
struct policy_memory {
    step_costs                  costs;    // empty: not measured yet
    std::optional<draft_policy> learned;  // none: no generation yet
};

} // namespace dflash
