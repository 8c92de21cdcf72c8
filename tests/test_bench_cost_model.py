"""The cost model on synthetic numbers: acceptance curve, expected tokens, the pick, calibration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_llama.bench import cost_model
from dflash_llama.bench.cost_model import StepCost


def test_survival_pools_steps_by_position():
    # (drafted, accepted): position 0 drafted 4x accepted 3x; position 3 drafted 3x (one short step)
    steps = [(7, 0), (7, 3), (7, 7), (2, 2)]
    assert cost_model.survival(steps) == [3 / 4, 3 / 4, 2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3]


def test_survival_reads_step_objects():
    steps = [SimpleNamespace(drafted=[5, 6, 7], accepted=1), SimpleNamespace(drafted=[5, 6, 7], accepted=2)]
    assert cost_model.survival(steps) == [1.0, 0.5, 0.0]


def test_expected_tokens_and_bad_length():
    assert cost_model.expected_tokens([0.5, 0.25, 0.125], 2) == 1.75
    with pytest.raises(ValueError, match="covers 3 positions, not 4"):
        cost_model.expected_tokens([0.5, 0.25, 0.125], 4)


def test_pick_is_the_hand_computed_argmax():
    surv = [0.9, 0.8, 0.6, 0.3, 0.1]
    # t_step(N) = 5 (draft) + verify(N) + 1 (other); verify grows steeply, as on a CPU
    verify = {1: 14.0, 2: 18.0, 3: 24.0, 4: 32.0, 5: 44.0}
    costs = {n: StepCost(n, 5.0, v, 1.0) for n, v in verify.items()}
    # by hand: E = 1.9, 2.7, 3.3, 3.6, 3.7; t = 20, 24, 30, 38, 50 ms
    # tok/s = 95.0, 112.5, 110.0, 94.74, 74.0  ->  N = 2
    preds = cost_model.predict(surv, costs)
    assert [round(p.tokens_per_second, 2) for p in preds] == [95.0, 112.5, 110.0, 94.74, 74.0]
    pick = cost_model.choose(surv, costs)
    assert (pick.n_draft, round(pick.expected_tokens, 6), pick.step_ms) == (2, 2.7, 24.0)


def test_cheap_verify_picks_the_longest_draft():
    surv = [0.9, 0.8, 0.6, 0.3, 0.1]
    costs = {n: StepCost(n, 5.0, 10.0 + 0.1 * n, 1.0) for n in range(1, 6)}  # a GPU-like flat verify
    assert cost_model.choose(surv, costs).n_draft == 5


def test_tie_goes_to_the_shorter_draft():
    costs = {1: StepCost(1, 0.0, 10.0, 0.0), 2: StepCost(2, 0.0, 10.0, 0.0)}
    assert cost_model.choose([1.0, 0.0], costs).n_draft == 1


def test_predict_needs_overlap():
    with pytest.raises(ValueError, match="no draft length"):
        cost_model.predict([0.5], {3: StepCost(3, 1.0, 1.0, 1.0)})


class FakeRuntime:
    """generate() answers with fixed per-step times that depend on draft_max, and records the order."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt, max_new_tokens, *, block_size=None, draft_max=None, stop_at_eog=True):
        self.calls.append((prompt[0], draft_max))
        steps = [SimpleNamespace(drafted=[1] * draft_max, accepted=min(1, draft_max))] * 4
        stats = SimpleNamespace(t_draft_ms=4 * 2.0, t_verify_ms=4 * (10.0 + draft_max + prompt[0]),
                                t_other_ms=4 * 0.5)
        return SimpleNamespace(steps=steps, stats=stats)


def test_calibrate_takes_medians_and_rotates_the_order():
    rt = FakeRuntime()
    costs, gens = cost_model.calibrate(rt, [[0], [1], [2]], [1, 2, 3], block_size=4, max_new_tokens=8)
    # per prompt the order of N rotates by one
    assert rt.calls == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (1, 1), (2, 3), (2, 1), (2, 2)]
    # verify per step for N is 10 + N + prompt id over prompts 0, 1, 2: median 11 + N
    assert {n: c.verify_ms for n, c in costs.items()} == {1: 12.0, 2: 13.0, 3: 14.0}
    assert {n: c.step_ms for n, c in costs.items()} == {1: 14.5, 2: 15.5, 3: 16.5}
    assert all(c.samples == 3 for c in costs.values()) and len(gens) == 9
