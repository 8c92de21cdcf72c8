"""The adaptive loop's chooser (runtime/draft_policy.cpp), fed synthetic step costs and acceptances:
what it picks is a pure function of what it observed, so these are exact checks, not timings."""

from __future__ import annotations

import pytest

from dflash_llama import _core


def drive(policy, steps: int, accepted, t_plain: float, t_draft: float, t_verify) -> list[int]:
    """Runs `steps` choices; a drafting step of n accepts accepted(n) and costs t_draft + t_verify(n + 1)."""
    chosen = []
    for _ in range(steps):
        n = policy.choose()
        chosen.append(n)
        if n == 0:
            policy.observe_plain(t_plain)
        else:
            policy.observe_draft(n, accepted(n), t_draft, t_verify(n + 1))
    return chosen


def test_measures_plain_then_drafting_first():
    p = _core.DraftPolicy(7)
    assert p.expected_ms(0) == 0.0  # nothing measured yet
    assert p.choose() == 0
    p.observe_plain(10.0)
    assert p.choose() == 2


# verifies cheap enough that a draft accepted in full would pay, so that there is something to probe for
CHEAP_VERIFY = dict(t_plain=10.0, t_draft=4.0, t_verify=lambda k: 10.0 + 2.0 * (k - 1))


def test_a_draft_that_never_pays_goes_plain_and_probes_less_and_less():
    p = _core.DraftPolicy(7)
    chosen = drive(p, 300, accepted=lambda n: 0, **CHEAP_VERIFY)
    drafted_at = [i for i, n in enumerate(chosen) if n > 0]
    # step 1 measures drafting, step 2 goes plain; then probes after 16 and 64 plain steps (256 next)
    assert drafted_at == [1, 18, 82]
    s = p.summary
    assert (s.plain_steps, s.draft_steps, s.probes) == (297, 3, 2)
    assert s.plain_share == pytest.approx(297 / 300)


def test_probes_back_off_to_at_most_every_256_steps():
    p = _core.DraftPolicy(3)
    chosen = drive(p, 2000, accepted=lambda n: 0, **CHEAP_VERIFY)
    drafted_at = [i for i, n in enumerate(chosen) if n > 0]
    gaps = [b - a for a, b in zip(drafted_at, drafted_at[1:])]
    assert gaps[:3] == [17, 64, 256] and set(gaps[2:]) == {256}


def test_when_not_even_a_perfect_draft_pays_it_probes_once():
    # a verify costs 8 ms a token more: 8 tokens in 4 + 66 ms beat 10 ms a token by 14%, 4 in 4 + 34 by 5%
    p = _core.DraftPolicy(3)
    chosen = drive(p, 1000, accepted=lambda n: n, t_plain=10.0, t_draft=4.0, t_verify=lambda k: 10.0 + 8.0 * (k - 1))
    assert p.perfect_speedup() == pytest.approx(4 * 10.0 / (4.0 + 34.0))
    assert [i for i, n in enumerate(chosen) if n > 0] == [1, 18]  # drafting measured, and one probe
    assert p.summary.probes == 1
    p = _core.DraftPolicy(7)  # the same costs with 8 tokens a step: probed, and it drafts
    chosen = drive(p, 100, accepted=lambda n: n, t_plain=10.0, t_draft=4.0, t_verify=lambda k: 10.0 + 8.0 * (k - 1))
    assert p.perfect_speedup() == pytest.approx(8 * 10.0 / (4.0 + 66.0)) and p.summary.probes >= 1


def test_a_probe_that_pays_ends_plain_mode():
    p = _core.DraftPolicy(7)
    chosen = drive(p, 20, accepted=lambda n: 0, **CHEAP_VERIFY)
    assert chosen[2:18] == [0] * 16 and chosen[18] > 0 and chosen[19:] == [0]  # plain, a probe, plain
    assert p.summary.probes == 1
    chosen = drive(p, 70, accepted=lambda n: n, **CHEAP_VERIFY)  # the text became predictable
    # the second probe, 64 steps after the first, pays: it drafts since, soon all 7
    assert chosen[:62] == [0] * 62 and all(n > 0 for n in chosen[62:]) and chosen[-6:] == [7] * 6
    assert p.summary.probes == 2


def test_a_perfect_draft_with_free_verifies_drafts_the_whole_block():
    p = _core.DraftPolicy(7)
    chosen = drive(p, 40, accepted=lambda n: n, t_plain=10.0, t_draft=2.0, t_verify=lambda k: 10.0 + 0.1 * k)
    assert chosen[:2] == [0, 2]
    assert chosen[10:] == [7] * 30
    assert p.summary.plain_steps == 1


def test_costs_not_seen_are_interpolated_and_extrapolated():
    p = _core.DraftPolicy(7)
    p.choose()
    p.observe_plain(10.0)  # verify of 1 token
    p.choose()
    p.observe_draft(2, 1, 5.0, 20.0)  # a draft forward 5 ms, a verify of 3 tokens 20 ms
    assert p.expected_ms(0) == pytest.approx(10.0)
    assert p.expected_ms(1) == pytest.approx(5.0 + 15.0)  # verify of 2: between 1 and 3
    assert p.expected_ms(2) == pytest.approx(5.0 + 20.0)
    assert p.expected_ms(4) == pytest.approx(5.0 + 30.0)  # verify of 5: the slope of 1..3, 5 ms a token


def test_expected_tokens_from_decayed_acceptance_counts():
    p = _core.DraftPolicy(7)
    p.choose()
    p.observe_plain(10.0)
    p.choose()
    p.observe_draft(2, 1, 5.0, 20.0)  # position 1 accepted, position 2 rejected
    c1 = (1 + 0.5) / (1 + 1)  # prior 0.5 of weight 1
    c2 = (0 + c1) / (1 + 1)  # an unseen position's prior is the previous position's estimate
    assert p.expected_tokens(0) == 1.0
    assert p.expected_tokens(1) == pytest.approx(1 + c1)
    assert p.expected_tokens(2) == pytest.approx(1 + c1 + c1 * c2)
    assert p.expected_tokens(3) == pytest.approx(1 + c1 + c1 * c2 + c1 * c2 * c2)


def _reads(expected_tokens, n):
    """R_i, i = 0..n: the chance that row i of a verify is read (its first i proposals accepted)."""
    return [1.0] + [expected_tokens(i) - expected_tokens(i - 1) for i in range(1, n + 1)]


def _head_ms(reads, b, t_pass, t_row):
    """The expected head time of a verify whose row i is read with chance reads[i]: a first batch of b
    rows, then rows i..2i-1 each time row i is read and not yet computed (the target's doubling)."""
    k = len(reads)
    ms, i = t_pass + t_row * b, b
    while i < k:
        size = min(max(1, i), k - i)
        ms += reads[i] * (t_pass + t_row * size)
        i += size
    return ms


def test_our_head_is_paid_per_row_read():
    """With our output head a verify's decode stops before the head, and each step pays a row per token
    it produces (a verify reads rows up to its first rejection), not per token verified."""
    p = _core.DraftPolicy(3, verify_ms=[0.0, 10.0, 8.0, 9.0, 10.0], draft_ms=[0.0, 2.0, 2.0, 2.0], shadow=True,
                          head_row_ms=3.0)
    for n in (1, 3):  # rows computed: the first, then each batch its reading asks for
        reads = _reads(p.expected_tokens, n)
        head = min(_head_ms(reads, b, 0.0, 3.0) for b in range(1, n + 2))
        assert p.expected_ms(n) == pytest.approx(2.0 + [8.0, 9.0, 10.0][n - 1] + head)
    assert p.expected_ms(1) == pytest.approx(2.0 + 8.0 + 3.0 * p.expected_tokens(1))  # two rows: a row per row read
    ngram_reads = _reads(lambda m: p.expected_ngram_tokens(m, 20), 2)
    assert p.expected_ngram_ms(2, 20) == pytest.approx(9.0 + 3.0 * sum(ngram_reads))  # 3 rows, each computed once read
    assert p.expected_ms(0) == 10.0  # a plain step: its decode and its row, as measured
    p.observe_head(4, 2, 4.0)  # 1 ms a row: the average moves by kCostWeight
    assert p.expected_ngram_ms(2, 20) == pytest.approx(9.0 + (3.0 - 0.2 * 2.0) * sum(ngram_reads))
    with pytest.raises(ValueError, match=r"^draft_policy: 0 head rows in 1 batches in 1\.000000 ms$"):
        p.observe_head(0, 1, 1.0)
    with pytest.raises(ValueError, match=r"^draft_policy: 2 head rows in 3 batches in 1\.000000 ms$"):
        p.observe_head(2, 3, 1.0)


def test_the_head_computes_rows_in_the_batch_of_least_expected_time():
    """A batch of r rows costs t_pass + r * t_row (the weights stream once per batch): a proposal that is
    nearly always accepted has its rows computed in one batch, a draft that is mostly rejected row by
    row; the step's expected time is that batch plan's."""
    t_pass, t_row = 4.0, 3.0
    p = _core.DraftPolicy(7, verify_ms=[0.0, 14.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0],
                          draft_ms=[0.0] + [2.0] * 7, shadow=True, head_row_ms=t_row, head_pass_ms=t_pass)
    p.choose()
    p.observe_plain(14.0)
    for _ in range(30):  # a long match: every proposal accepted in full
        assert p.choose_step(7, 40)[0] == "ngram"
        p.observe_ngram(7, 7, 22.0)
    step = p.choose_step(7, 40)
    assert step == ("ngram", 7)
    assert p.head_batch == 8  # all eight rows at once
    # its expected time: the decode of 8 tokens and one batch of 8 rows
    reads = _reads(lambda m: p.expected_ngram_tokens(m, 40), 7)
    assert min(reads) > 0.9
    assert p.expected_ngram_ms(7, 40) == pytest.approx(22.0 + t_pass + t_row * 8)
    assert _head_ms(reads, 8, t_pass, t_row) < min(_head_ms(reads, b, t_pass, t_row) for b in range(1, 8))

    q = _core.DraftPolicy(7, verify_ms=[0.0, 14.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0],
                          draft_ms=[0.0] + [2.0] * 7, shadow=True, head_row_ms=t_row, head_pass_ms=t_pass)
    q.choose()
    q.observe_plain(14.0)
    for _ in range(30):  # the first drafted token right one time in ten
        q.observe_draft(3, 0, 2.0, 12.0)
        q.observe_draft(3, 1, 2.0, 12.0) if _ % 10 == 0 else None
    c1 = q.expected_tokens(1) - 1.0  # the chance that row 1 is read
    reads = [1.0, c1]
    best = min(range(1, 3), key=lambda b: (_head_ms(reads, b, t_pass, t_row), b))
    assert best == 1
    assert q.expected_ms(1) == pytest.approx(2.0 + 10.0 + _head_ms(reads, 1, t_pass, t_row))


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="the adaptive loop needs a block of at least 2 tokens, got a draft of 0"):
        _core.DraftPolicy(0)
    p = _core.DraftPolicy(3)
    with pytest.raises(ValueError, match="draft_policy: a step of 2 drafted, 3 accepted"):
        p.observe_draft(2, 3, 1.0, 1.0)
    with pytest.raises(ValueError, match="draft_policy: a step of 4 drafted, 0 accepted"):
        p.observe_draft(4, 0, 1.0, 1.0)


# --- measured step costs and shadow probes --------------------------------------------------------

def drive_shadow(policy, steps: int, matched, t_plain: float, t_draft: float, t_verify, accepted=None):
    """Like `drive`, with shadow probes: a probe of n proposals settles `matched(n)` matched after
    min(matched + 1, n) plain steps (when the plain tokens tell), and costs t_draft."""
    chosen, shadow = [], None  # shadow: [n, matched, plain steps still to score it]
    for _ in range(steps):
        n = policy.choose()
        chosen.append(n)
        if n > 0:
            policy.observe_draft(n, (accepted or matched)(n), t_draft, t_verify(n + 1))
            continue
        policy.observe_plain(t_plain)
        if shadow is not None:
            shadow[2] -= 1
            if shadow[2] == 0:
                policy.observe_shadow(shadow[0], shadow[1], True, t_draft)
                shadow = None
        if (k := policy.take_shadow()) > 0:
            chosen[-1] = -k  # a plain step followed by a shadow probe of k proposals
            shadow = [k, matched(k), min(matched(k) + 1, k)]
    return chosen


# a draft accepted in full would pay by 14% at N = 7 (8 tokens in 4 + 66 ms), so it is probed for
COSTS_DEAR_VERIFY = dict(verify_ms=[0.0] + [10.0 + 8.0 * (k - 1) for k in range(1, 9)], draft_ms=[0.0] + [4.0] * 7)
COSTS_CHEAP_VERIFY = dict(verify_ms=[0.0, 10.0, 12.0, 14.0, 16.0], draft_ms=[0.0, 5.0, 5.0, 5.0])


def test_with_measured_costs_a_target_no_draft_can_speed_up_is_probed_once():
    p = _core.DraftPolicy(3, shadow=True, verify_ms=[0.0, 10.0, 30.0, 50.0, 70.0], draft_ms=[0.0, 5.0, 5.0, 5.0])
    assert p.perfect_speedup() == pytest.approx(2 * 10.0 / 35.0)  # N = 1: 2 tokens in 5 + 30 ms
    chosen = drive_shadow(p, 600, matched=lambda n: n, t_plain=10.0, t_draft=5.0, t_verify=lambda k: 10.0 + 20.0 * k)
    assert chosen == [-3] + [0] * 599 and p.summary.probes == 1  # the opening probe only


def test_with_measured_costs_it_starts_plain_and_probes_in_the_shadow_at_once():
    p = _core.DraftPolicy(7, shadow=True, **COSTS_DEAR_VERIFY)
    assert p.expected_ms(0) == 10.0 and p.expected_ms(1) == 4.0 + 18.0  # known before any step
    chosen = drive_shadow(p, 200, matched=lambda n: 0, t_plain=10.0, t_draft=4.0, t_verify=lambda k: 10.0 + 8.0 * k)
    probes_at = [i for i, n in enumerate(chosen) if n < 0]
    assert all(n <= 0 for n in chosen)  # never a verified draft
    assert all(chosen[i] == -7 for i in probes_at)  # a shadow probe scores every position
    # each settles on the next plain step (proposal 1 differs), then 16, 64 (then 256) plain steps
    assert probes_at == [0, 17, 82]
    s = p.summary
    assert (s.probes, s.shadow_probes, s.draft_steps, s.plain_steps) == (3, 3, 0, 200)


def test_a_later_generation_goes_on_where_the_last_one_left_off():
    def run(policy, steps):
        return drive_shadow(policy, steps, matched=lambda n: 0, t_plain=10.0, t_draft=4.0,
                            t_verify=lambda k: 10.0 + 8.0 * k)

    whole = run(_core.DraftPolicy(7, shadow=True, **COSTS_DEAR_VERIFY), 428)
    # probes at 0, 17, 82, 339: waits of 16, 64, 256 plain steps after each probe that did not pay
    assert [i for i, n in enumerate(whole) if n < 0] == [0, 17, 82, 339]
    first = _core.DraftPolicy(7, shadow=True, **COSTS_DEAR_VERIFY)
    assert run(first, 128) == whole[:128] and first.probe_wait == 256
    later = _core.DraftPolicy(7, shadow=True, **COSTS_DEAR_VERIFY)
    later.resume(first)
    # no probe at the start of the second generation: it waits out the first one's wait
    assert run(later, 300) == whole[128:]
    assert later.summary.probes == 1 and first.summary.probes == 3
    with pytest.raises(ValueError, match=r"draft_policy: resuming a policy of 7 drafted tokens as one of 3"):
        _core.DraftPolicy(3, shadow=True, **COSTS_CHEAP_VERIFY).resume(first)


def test_a_shadow_probe_that_would_have_paid_starts_drafting():
    costs = dict(verify_ms=[0.0] + [10.0 + 1.0 * (k - 1) for k in range(1, 9)], draft_ms=[0.0] + [2.0] * 7)
    p = _core.DraftPolicy(7, shadow=True, **costs)
    chosen = drive_shadow(p, 30, matched=lambda n: n, t_plain=10.0, t_draft=2.0, t_verify=lambda k: 10.0 + k)
    assert chosen[0] == -7  # the first step: plain, and a shadow probe of 7
    assert chosen[1:7] == [0] * 6  # the plain steps scoring it: 7 of 7 matched (the 7th is this step's)
    assert chosen[7] == 0 and all(n > 0 for n in chosen[8:]) and chosen[-5:] == [7] * 5
    assert p.summary.shadow_probes == 1


def test_a_shadow_probe_waits_for_its_outcome_before_another():
    p = _core.DraftPolicy(3, shadow=True, **COSTS_CHEAP_VERIFY)
    assert p.choose() == 0
    p.observe_plain(10.0)
    assert p.take_shadow() == 3 and p.take_shadow() == 0  # taken once
    for _ in range(40):  # unanswered: no second probe
        assert p.choose() == 0
        p.observe_plain(10.0)
        assert p.take_shadow() == 0
    p.observe_shadow(3, 1, True, 5.0)
    assert p.summary.probes == 1


def test_shadow_and_cost_values_are_checked():
    with pytest.raises(ValueError, match="draft_policy: step costs need a plain step's time and a draft forward's"):
        _core.DraftPolicy(3, verify_ms=[0.0, 10.0], draft_ms=[], shadow=True)
    p = _core.DraftPolicy(3, shadow=True, verify_ms=[0.0, 10.0, 30.0], draft_ms=[0.0, 5.0])
    with pytest.raises(ValueError, match="draft_policy: a shadow probe of 1 proposals, 0 matched, none asked for"):
        p.observe_shadow(1, 0, True, 5.0)
    p.choose()
    with pytest.raises(ValueError, match="draft_policy: a shadow probe of 3 proposals, 4 matched"):
        p.observe_shadow(3, 4, True, 5.0)


def test_a_shadow_probe_with_no_room_ends_without_a_cost_sample():
    p = _core.DraftPolicy(3, shadow=True, **COSTS_CHEAP_VERIFY)
    assert p.choose() == 0
    p.observe_plain(10.0)
    assert p.take_shadow() == 3
    p.drop_shadow()  # the sequence had no room for it
    assert p.expected_ms(1) == 5.0 + 12.0  # the draft's measured cost, not pulled towards 0
    assert [p.choose() for _ in range(3)] == [0, 0, 0] and p.summary.probes == 1  # plain, counting down again


# --- the n-gram proposal source -------------------------------------------------------------------

def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    ix = _core.NgramIndex()  # n-grams of 4 down to 2 tokens
    ix.add([5, 6, 7, 8, 9, 1, 2, 3, 4, 6, 7, 8, 3])
    assert ix.propose(4) == []  # "8 3" never occurred before: no proposal
    ix.add([1, 2, 3])
    assert len(ix) == 16 and ix.propose(3) == [4, 6, 7]  # "8 3 1 2 3" -> "1 2 3" at 5..7 -> 4 6 7
    ix.add([4, 6, 7])
    assert ix.propose(2) == [8, 3]  # "4 6 7" (4 tokens "3 4 6 7") most recently at 8..11: 8 3, not 8 9
    ix.add([8, 9])
    assert ix.propose(3) == [1, 2, 3]  # "6 7 8 9" at 1..4: the longest match wins over "8 9"'s later one
    loop = _core.NgramIndex()
    loop.add([11, 12, 13, 11, 12])  # a repeat of period 3 runs past the text's end: it keeps repeating
    assert loop.propose(7) == [13, 11, 12, 13, 11, 12, 13] and loop.propose(0) == []
    with pytest.raises(ValueError, match=r"n-gram sizes must satisfy 1 <= min <= max <= 64, got 3..2"):
        _core.NgramIndex(3, 2)


def test_ngram_proposals_say_how_long_their_match_is():
    """The match is measured backwards past the 4-gram that found it, up to 64 tokens."""
    copy = _core.NgramIndex()
    copy.add(list(range(100, 120)) + [1, 2] + list(range(100, 112)))  # 12 tokens of an earlier run again
    assert copy.propose_match(5) == ([112, 113, 114, 115, 116], 12)
    short = _core.NgramIndex()
    short.add([5, 6, 7, 8, 9, 1, 5, 6])
    assert short.propose_match(3) == ([7, 8, 9], 2) and short.propose_match(3)[0] == short.propose(3)
    same = _core.NgramIndex()
    same.add([7] * 100)
    assert same.propose_match(3) == ([7, 7, 7], 64) and _core.NgramIndex().propose_match(3) == ([], 0)


def drive_sources(policy, steps: int, ngram_len, ngram_accepted, draft_accepted, t_verify, t_draft: float = 4.0):
    """Runs `steps` choices with an n-gram proposal of ngram_len(i) tokens at hand; an n-gram step of m
    accepts ngram_accepted(m), a drafting step of n draft_accepted(n); returns the (source, n) chosen."""
    chosen = []
    for i in range(steps):
        source, n = policy.choose_step(ngram_len(i))
        chosen.append((source, n))
        if source == "ngram":
            policy.observe_ngram(n, ngram_accepted(n), t_verify(n + 1))
        elif source == "draft":
            policy.observe_draft(n, draft_accepted(n), t_draft, t_verify(n + 1))
        else:
            policy.observe_plain(t_verify(1))
            if (k := policy.take_shadow()) > 0:  # settled at once: the draft's record is draft_accepted
                policy.observe_shadow(k, draft_accepted(k), True, t_draft)
    return chosen


CHEAP = [0.0] + [10.0 + 1.0 * (k - 1) for k in range(1, 9)]  # verify of k tokens; a draft forward 4 ms


def test_the_loop_chooses_among_plain_draft_and_ngram():
    always, never = (lambda n: n), (lambda n: 0)
    # a good n-gram record with a proposal at hand: n-gram steps of its whole length, no draft forward
    p = _core.DraftPolicy(7, verify_ms=CHEAP, draft_ms=[0.0] + [4.0] * 7, shadow=True)
    chosen = drive_sources(p, 40, lambda i: 5, always, never, lambda k: CHEAP[k])
    assert chosen == [("ngram", 2)] + [("ngram", 5)] * 39  # on its prior (0.5 a position) 2 of 5, then all
    s = p.summary
    assert (s.ngram_steps, s.ngram_drafted, s.ngram_accepted, s.draft_steps, s.plain_steps) == (40, 197, 197, 0, 0)
    assert s.ngram_acceptance == 1.0 and p.expected_ngram_tokens(5) > 5.8
    # with no proposal at hand a draft that pays drafts; with one, the better record wins
    p = _core.DraftPolicy(7, verify_ms=CHEAP, draft_ms=[0.0] + [4.0] * 7, shadow=True)
    chosen = drive_sources(p, 60, lambda i: 0 if i < 30 else 3, never, always, lambda k: CHEAP[k])
    assert chosen[:30] == [("plain", 0)] + [("draft", 7)] * 29  # a shadow probe that pays, then drafting
    # a proposal of 3 verified in 12 ms (prior 0.5 a position) loses to 8 tokens in 4 + 17 ms
    assert chosen[30:] == [("draft", 7)] * 30 and p.summary.ngram_steps == 0
    assert p.summary.draft_tau == pytest.approx(8.0)
    # an n-gram source that is never right stops being verified; the draft side goes on
    p = _core.DraftPolicy(7, verify_ms=CHEAP, draft_ms=[0.0] + [4.0] * 7, shadow=True)
    chosen = drive_sources(p, 60, lambda i: 4, never, always, lambda k: CHEAP[k])
    # its opening probe, then tried while its estimate beats plain decoding; once drafting pays, not
    # even a proposal accepted in full (5 tokens in 14 ms) would beat it (8 in 21 ms): never probed again
    assert chosen[:7] == [("ngram", 2)] + [("ngram", 1)] * 5 + [("plain", 0)]
    assert chosen[7:] == [("draft", 7)] * 53 and p.summary.ngram_accepted == 0
    # plain decoding when neither pays: verifies cost 20 ms a token more, the draft is never right
    dear = [0.0] + [10.0 + 20.0 * (k - 1) for k in range(1, 9)]
    p = _core.DraftPolicy(7, verify_ms=dear, draft_ms=[0.0] + [4.0] * 7, shadow=True)
    chosen = drive_sources(p, 50, lambda i: 4, always, never, lambda k: dear[k])
    assert chosen == [("plain", 0)] * 50  # 1 + 1 tokens in 30 ms < 1 in 10, even accepted in full: no probe
    with pytest.raises(ValueError, match="draft_policy: an n-gram step of 2 proposed, 3 accepted"):
        p.observe_ngram(2, 3, 10.0)
    with pytest.raises(ValueError, match="draft_policy: an n-gram proposal of -1 tokens from a match of 0"):
        p.choose_step(-1)


def test_an_ngram_source_that_does_not_pay_is_probed_less_and_less():
    # a verify of 2 costs 1.7 plain steps: a proposal pays when 70% right, this one never is; drafting never pays
    costs = [0.0] + [10.0 + 7.0 * (k - 1) for k in range(1, 9)]
    p = _core.DraftPolicy(7, verify_ms=costs, draft_ms=[0.0] + [4.0] * 7, shadow=True)
    chosen = drive_sources(p, 120, lambda i: 1, lambda m: 0, lambda n: 0, lambda k: costs[k])
    # the opening probe, then after 16 and 64 proposals passed over (256 next)
    assert [i for i, c in enumerate(chosen) if c[0] == "ngram"] == [0, 17, 82]
    assert p.summary.ngram_steps == 3 and p.summary.draft_steps == 0


def test_long_and_short_matches_are_judged_apart_and_long_ones_verified_past_the_block():
    """Every other proposal comes from a match of 20 tokens and is always right, the others from a match
    of 2 and never are: the short ones stop being verified after their probe, the long ones are verified
    on their prior at once, then at twice the furthest position verified (past the block of 8) up to
    the longest proposal (NGRAM_MAX, 64)."""
    assert _core.NGRAM_MAX == 64
    costs = [0.0] + [10.0 + 7.0 * (k - 1) for k in range(1, 66)]  # a verify of 2 costs 1.7 plain steps
    p = _core.DraftPolicy(7, verify_ms=costs[:9], draft_ms=[0.0] + [4.0] * 7, shadow=True)
    chosen = []
    for i in range(20):
        source, n = p.choose_step(64, 20 if i % 2 else 2)
        chosen.append((source, n))
        if source == "ngram":
            p.observe_ngram(n, n if i % 2 else 0, costs[n + 1])
        else:
            p.observe_plain(costs[1])
            if (k := p.take_shadow()) > 0:
                p.observe_shadow(k, 0, True, 4.0)
    assert chosen[0::2] == [("ngram", 1)] + [("plain", 0)] * 9
    assert [n for _, n in chosen[1::2]] == [1, 2, 4, 8, 16, 32, 64, 64, 64, 64]
    assert (p.summary.ngram_steps, p.summary.ngram_drafted, p.summary.ngram_accepted) == (11, 320, 319)
    # each class has its own record: a match of 6..15 tokens has seen nothing yet (its prior, 0.7)
    assert p.expected_ngram_tokens(7, 20) > 7.8 and p.expected_ngram_tokens(7, 2) < 1.6
    assert p.expected_ngram_tokens(1, 8) == pytest.approx(1.7)
    with pytest.raises(ValueError, match="draft_policy: an n-gram step of 65 proposed, 0 accepted"):
        p.observe_ngram(65, 0, 10.0)


def test_the_confidence_gate_keeps_slots_while_they_pay_and_learns_a_head_that_is_wrong():
    """keep slot i iff P_i * T_{i-1} > E_{i-1} * (t_verify(i + 1) - t_verify(i)), P the chained calibrated
    confidences (at first the bin's centre: the head taken at its word); a verified slot updates its bin, so
    a head confident and always wrong is soon cut at the first slot."""
    verify = [0.0] + [10.0 + (k - 1) for k in range(1, 9)]  # a plain step 10 ms, each verified token 1 ms more
    p = _core.DraftPolicy(7, verify, [0.0] + [5.0] * 7, False)
    assert p.calibrated(0.95) == pytest.approx(0.95) and p.calibrated(0.31) == pytest.approx(0.35)
    p.gate_begin(7)
    assert p.keep_slot(0, 0.95)  # 0.95 * (5 + 10) > 1 * 1
    assert p.keep_slot(1, 0.95)  # 0.9025 * 16 > 1.95 * 1
    assert not p.keep_slot(2, 0.05)  # 0.045 * 17 < 2.85: cut here, with the 4 slots after it
    assert p.summary.confidence_cut == 5
    with pytest.raises(ValueError, match="slot 0 of a gate over 0"):
        p.keep_slot(0, 0.5)  # the gate ended at the cut
    # the two verified slots: the first accepted, the second not
    p.observe_confidence([0.95, 0.95], 1, True, False)
    s = p.summary
    assert (s.confidence_steps, s.confidence_accepted) == (1, 1)
    assert s.confidence_expected == pytest.approx(0.95 + 0.95 ** 2)  # before it learned from this step
    assert s.position_expected == pytest.approx(p.expected_tokens(2) - 1.0)
    assert p.calibrated(0.95) == pytest.approx((1 + 2 * 0.95) / (2 + 2))
    p.observe_confidence([0.95], 0, False, True)  # unsettled: nothing seen, the counts only decay
    assert p.calibrated(0.95) == pytest.approx((0.99 + 2 * 0.95) / (0.99 * 2 + 2))
    assert p.summary.confidence_steps == 1  # shadow probes teach the calibration, not the summary
    for _ in range(100):  # its 0.9 bin, once verified: P = 0.04 < 1 / 15 (one more token's cost / the step's)
        p.observe_confidence([0.97, 0.9], 0, True, False)
    assert p.calibrated(0.96) < 1 / 15
    p.gate_begin(3)
    assert not p.keep_slot(0, 0.96) and p.summary.confidence_cut == 5 + 3
    with pytest.raises(ValueError, match="3 of 2 slots accepted"):
        p.observe_confidence([0.5, 0.5], 3, True, False)
    with pytest.raises(ValueError, match="a confidence gate over 8 slots"):
        p.gate_begin(8)
