"""The one generation result object and the one first-mismatch rule (dflash_llama.results)."""

from __future__ import annotations

from dflash_llama.reference.speculative import GenerationResult, Step as ReferenceStep
from dflash_llama.results import first_mismatch, generation_json, plain_steps
from dflash_llama.runtime import Generation, Stats, Step


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 9, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2  # a prefix differs where the shorter one ends
    assert first_mismatch("abc def", "abc") == 3
    assert first_mismatch([], []) is None and first_mismatch([], [5]) == 0


def test_generation_json_fields_and_tau():
    steps = [{"drafted": [4, 5], "accepted": 2, "produced": 3}, {"drafted": [6], "accepted": 0, "produced": 1}]
    out = generation_json([1, 2, 3, 4, 5], "text", steps, prompt_ids=(7, 8), stop_reason="max_tokens")
    assert list(out) == ["tokens", "text", "steps", "tau", "stop_reason", "prompt_ids"]
    assert out["tau"] == 2.0 and out["prompt_ids"] == [7, 8]
    assert generation_json([1], None, [])["tau"] == 0.0
    assert plain_steps(4) == [{"drafted": [], "accepted": 0, "produced": 1}] * 3 and plain_steps(1) == []


def _generation(tokens, steps, tau):
    return Generation(tokens=tokens, text="t", steps=steps, tau=tau, stop_reason="max_tokens",
                      acceptance_by_position=[0.5], stats=Stats(3, len(tokens), 1.0, 2.0, 3.0, 0.5, 7.0, 100.0))


def test_runtime_and_reference_write_the_same_object():
    ours = _generation([1, 2, 3, 4], [Step([2, 9], 1, 2), Step([4], 1, 1)], 1.5).to_json(prompt_ids=[5])
    ref = GenerationResult([5], [1, 2, 3, 4], [ReferenceStep([2, 9], 1, 2), ReferenceStep([4], 1, 1)])
    theirs = ref.to_json_dict(text="t", prompt_ids=[5])
    assert {k: ours[k] for k in theirs} == theirs
    assert set(ours) - set(theirs) == {"stop_reason", "acceptance_by_position", "stats"}
    assert ours["stats"]["n_generated"] == 4


def test_runtime_plain_decoding_is_one_step_per_decode():
    # the runtime's autoregressive decoding keeps no steps (tau 0); its JSON is the reference's
    out = _generation([1, 2, 3], [], 0.0).to_json()
    assert out["steps"] == [{"drafted": [], "accepted": 0, "produced": 1}] * 2 and out["tau"] == 1.0
    one = _generation([1], [], 0.0).to_json()
    assert one["steps"] == [] and one["tau"] == 0.0
