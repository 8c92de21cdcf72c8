"""What every engine answers with, and how two answers are compared.

`generation_json` builds the `dflash-llama generate --json` object, the one schema of a
generation result (the runtime's `Generation.to_json`, the reference's `GenerationResult.to_json_dict`):

    {"tokens": [generated ids, prompt excluded], "text": str,
     "steps": [{"drafted": [ids], "accepted": a, "produced": p}, ...], "tau": mean produced,
     ...engine-specific fields, "prompt_ids": [ids the engine fed the target] (when given)}

Plain decoding is one step per target decode after the first token (`plain_steps`), nothing drafted.
"""

from __future__ import annotations

from typing import Sequence


def first_mismatch(a: Sequence, b: Sequence) -> int | None:
    """Index of the first position where `a` and `b` differ (tokens or characters); the shorter
    length when one is a prefix of the other; None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def plain_steps(n_tokens: int) -> list[dict]:
    """The steps of plain decoding: the first token comes from the prompt, each later one from a decode."""
    return [{"drafted": [], "accepted": 0, "produced": 1} for _ in range(max(0, n_tokens - 1))]


def generation_json(tokens: Sequence[int], text: str | None, steps: list[dict], tau: float | None = None,
                    *, prompt_ids: Sequence[int] | None = None, **fields) -> dict:
    """The generation result object; `tau` defaults to the mean of the steps' produced tokens (0.0
    without steps); `fields` are an engine's extra keys, after the shared ones."""
    if tau is None:
        tau = sum(s["produced"] for s in steps) / len(steps) if steps else 0.0
    out = {"tokens": list(tokens), "text": text, "steps": steps, "tau": tau, **fields}
    if prompt_ids is not None:
        out["prompt_ids"] = list(prompt_ids)
    return out
