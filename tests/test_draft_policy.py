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


def test_a_draft_that_never_pays_goes_plain_and_probes_less_and_less():
    p = _core.DraftPolicy(7)
    chosen = drive(p, 300, accepted=lambda n: 0, t_plain=10.0, t_draft=8.0, t_verify=lambda k: 10.0 + 8.0 * (k - 1))
    drafted_at = [i for i, n in enumerate(chosen) if n > 0]
    # step 1 measures drafting; then probes after 8, 16, 32, 64 and 128 plain steps
    assert drafted_at == [1, 10, 26, 58, 122, 250]
    s = p.summary
    assert (s.plain_steps, s.draft_steps, s.probes) == (294, 6, 5)
    assert s.plain_share == pytest.approx(294 / 300)


def test_probes_back_off_to_at_most_every_256_steps():
    p = _core.DraftPolicy(3)
    chosen = drive(p, 2000, accepted=lambda n: 0, t_plain=10.0, t_draft=8.0, t_verify=lambda k: 10.0 * k)
    drafted_at = [i for i, n in enumerate(chosen) if n > 0]
    gaps = [b - a for a, b in zip(drafted_at, drafted_at[1:])]
    assert gaps[:6] == [9, 16, 32, 64, 128, 256] and set(gaps[5:]) == {256}


def test_a_perfect_draft_with_free_verifies_drafts_the_whole_block():
    p = _core.DraftPolicy(7)
    chosen = drive(p, 40, accepted=lambda n: n, t_plain=10.0, t_draft=2.0, t_verify=lambda k: 10.0 + 0.1 * k)
    assert chosen[:2] == [0, 2]
    assert chosen[10:] == [7] * 30
    assert p.summary.plain_steps == 1


def test_a_probe_that_pays_ends_plain_mode():
    p = _core.DraftPolicy(7)
    costs = dict(t_plain=10.0, t_draft=4.0, t_verify=lambda k: 10.0 + 2.0 * (k - 1))
    chosen = drive(p, 20, accepted=lambda n: 0, **costs)
    assert chosen[2:10] == [0] * 8 and chosen[10] > 0 and chosen[11:] == [0] * 9  # plain, a probe, plain
    assert p.summary.probes == 1
    chosen = drive(p, 70, accepted=lambda n: n, **costs)  # the text became predictable
    assert chosen[:6] == [0] * 6 and chosen[6] == 1  # the second probe, 16 steps after the first
    # one accepted token after a run of rejections does not beat plain decoding by the switching
    # margin: plain for 32 more steps; the third probe does, and it drafts since, soon all 7
    assert chosen[7:38] == [0] * 31 and all(n > 0 for n in chosen[38:]) and chosen[-30:] == [7] * 30
    assert p.summary.probes == 3


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


COSTS_NEVER_PAY = dict(verify_ms=[0.0] + [10.0 + 8.0 * (k - 1) for k in range(1, 9)], draft_ms=[0.0] + [4.0] * 7)


def test_with_measured_costs_it_starts_plain_and_probes_in_the_shadow_at_once():
    p = _core.DraftPolicy(7, shadow=True, **COSTS_NEVER_PAY)
    assert p.expected_ms(0) == 10.0 and p.expected_ms(1) == 4.0 + 18.0  # known before any step
    chosen = drive_shadow(p, 200, matched=lambda n: 0, t_plain=10.0, t_draft=4.0, t_verify=lambda k: 10.0 + 8.0 * k)
    probes_at = [i for i, n in enumerate(chosen) if n < 0]
    assert all(n <= 0 for n in chosen)  # never a verified draft
    assert all(chosen[i] == -7 for i in probes_at)  # a shadow probe scores every position
    # each settles on the next plain step (proposal 1 differs), then 8, 16, 32 ... plain steps
    assert probes_at == [0, 9, 26, 59, 124]
    s = p.summary
    assert (s.probes, s.shadow_probes, s.draft_steps, s.plain_steps) == (5, 5, 0, 200)


def test_a_shadow_probe_that_would_have_paid_starts_drafting():
    costs = dict(verify_ms=[0.0] + [10.0 + 1.0 * (k - 1) for k in range(1, 9)], draft_ms=[0.0] + [2.0] * 7)
    p = _core.DraftPolicy(7, shadow=True, **costs)
    chosen = drive_shadow(p, 30, matched=lambda n: n, t_plain=10.0, t_draft=2.0, t_verify=lambda k: 10.0 + k)
    assert chosen[0] == -7  # the first step: plain, and a shadow probe of 7
    assert chosen[1:7] == [0] * 6  # the plain steps scoring it: 7 of 7 matched (the 7th is this step's)
    assert chosen[7] == 0 and all(n > 0 for n in chosen[8:]) and chosen[-5:] == [7] * 5
    assert p.summary.shadow_probes == 1


def test_a_shadow_probe_waits_for_its_outcome_before_another():
    p = _core.DraftPolicy(3, shadow=True, verify_ms=[0.0, 10.0, 30.0, 50.0, 70.0], draft_ms=[0.0, 5.0, 5.0, 5.0])
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
    p = _core.DraftPolicy(3, shadow=True, verify_ms=[0.0, 10.0, 30.0, 50.0, 70.0], draft_ms=[0.0, 5.0, 5.0, 5.0])
    assert p.choose() == 0
    p.observe_plain(10.0)
    assert p.take_shadow() == 3
    p.drop_shadow()  # the sequence had no room for it
    assert p.expected_ms(1) == 5.0 + 30.0  # the draft's measured cost, not pulled towards 0
    assert [p.choose() for _ in range(3)] == [0, 0, 0] and p.summary.probes == 1  # plain, counting down again
