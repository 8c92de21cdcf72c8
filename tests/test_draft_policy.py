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
    chosen = drive(p, 40, accepted=lambda n: n, **costs)  # the text became predictable
    assert chosen[:6] == [0] * 6 and chosen[6] > 0  # the second probe, 16 steps after the first
    assert all(n > 0 for n in chosen[6:]) and chosen[-30:] == [7] * 30  # it paid: drafting since, soon all 7
    assert p.summary.probes == 2


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
