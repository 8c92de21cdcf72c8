"""How many drafted tokens to verify: the pick that maximises expected tokens per second.

With the draft's block of B tokens, a step drafts B-1 tokens in one draft forward (its cost does
not depend on how many we verify) and verifies the first N of them with the last token in one
target decode of N+1 tokens. If s_i is the fraction of steps whose drafted token i (0-based) was
accepted (the runtime's `acceptance_by_position`: accepting token i needs tokens 0..i-1 accepted
too, so s is non-increasing), a step with N verified drafts produces on average

    E[tokens](N) = 1 + s_0 + ... + s_{N-1}

(the accepted prefix plus the target's own next token), and costs

    t_step(N) = t_draft + t_verify(N + 1) + t_other.

Expected speed is E[tokens](N) / t_step(N); the pick is its argmax over N = 1..B-1. On a CPU the
verify of N+1 tokens costs far more than one decode step (no spare compute to hide the extra
rows), so the pick is often small: measure t_verify on the machine that will decode.

`calibrate` measures t_step(N) with the runtime itself (short greedy generations with
draft_max=N, their own time split), `survival` pools the acceptance curve of many generations,
and `choose` does the arithmetic. `auto_draft_max` strings them together for a caller who only
wants the number to pass as `draft_max`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Mapping, Sequence


@dataclass(frozen=True)
class StepCost:
    """Median time of one speculative step verifying `n_draft` drafted tokens, by part (ms)."""
    n_draft: int
    draft_ms: float
    verify_ms: float
    other_ms: float
    samples: int = 1  # generations the medians come from

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.other_ms


@dataclass(frozen=True)
class Prediction:
    n_draft: int
    expected_tokens: float  # per step
    step_ms: float
    tokens_per_second: float


def survival(steps: Iterable[Sequence[int] | object]) -> list[float]:
    """Pooled acceptance by position from speculative steps: s_i = (steps accepting drafted token i) /
    (steps that drafted a token i). `steps` are `Step`s (or (n_drafted, accepted) pairs)."""
    drafted: list[int] = []
    accepted: list[int] = []
    for s in steps:
        n, a = (len(s.drafted), s.accepted) if hasattr(s, "drafted") else (int(s[0]), int(s[1]))
        if len(drafted) < n:
            drafted += [0] * (n - len(drafted))
            accepted += [0] * (n - len(accepted))
        for i in range(n):
            drafted[i] += 1
            accepted[i] += i < a
    return [a / d for a, d in zip(accepted, drafted)]


def expected_tokens(surv: Sequence[float], n_draft: int) -> float:
    if n_draft > len(surv):
        raise ValueError(f"the acceptance curve covers {len(surv)} positions, not {n_draft}")
    return 1.0 + float(sum(surv[:n_draft]))


def predict(surv: Sequence[float], costs: Mapping[int, StepCost]) -> list[Prediction]:
    """Expected speed for every N that has both a cost and acceptance data, by increasing N."""
    out = []
    for n in sorted(costs):
        if 1 <= n <= len(surv):
            e = expected_tokens(surv, n)
            t = costs[n].step_ms
            out.append(Prediction(n, e, t, 1000.0 * e / t if t > 0 else float("inf")))
    if not out:
        raise ValueError("no draft length has both a measured cost and acceptance data")
    return out


def choose(surv: Sequence[float], costs: Mapping[int, StepCost]) -> Prediction:
    """The N with the highest expected tokens per second (the smaller N on a tie)."""
    preds = predict(surv, costs)
    return max(preds, key=lambda p: (p.tokens_per_second, -p.n_draft))


def calibrate(runtime, prompts: Sequence[Sequence[int]], n_drafts: Sequence[int], *, block_size: int | None = None,
              max_new_tokens: int = 32, rounds: int = 1,
              on_run: Callable[[int], None] | None = None) -> tuple[dict[int, StepCost], list]:
    """Time speculative steps for each N in `n_drafts` on this machine.

    Runs greedy generations of `max_new_tokens` (end of generation ignored, so every run has the
    same length) for every prompt and N, in an order that rotates between prompts and rounds, so
    machine noise spreads over all N alike. Returns the median per-step cost for each N and the
    generations (their steps also carry acceptance data)."""
    if not n_drafts:
        raise ValueError("calibrate needs at least one draft length")
    per_n: dict[int, list[tuple[float, float, float]]] = {n: [] for n in n_drafts}
    generations = []
    k = 0
    for r in range(rounds):
        for p, prompt in enumerate(prompts):
            shift = (p + r) % len(n_drafts)
            for n in list(n_drafts)[shift:] + list(n_drafts)[:shift]:
                g = runtime.generate(prompt, max_new_tokens, block_size=block_size, draft_max=n, stop_at_eog=False)
                generations.append((n, g))
                steps = len(g.steps)
                if steps:
                    s = g.stats
                    # the draft time includes the prompt's feature injection, amortised over the steps
                    # as in the decode time a benchmark measures
                    per_n[n].append((s.t_draft_ms / steps, s.t_verify_ms / steps, s.t_other_ms / steps))
                k += 1
                if on_run:
                    on_run(k)
    costs = {}
    for n, samples in per_n.items():
        if samples:
            costs[n] = StepCost(n, statistics.median(x[0] for x in samples),
                                statistics.median(x[1] for x in samples),
                                statistics.median(x[2] for x in samples), len(samples))
    return costs, generations


def autoregressive_step_ms(runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32) -> float:
    """Median time of one plain decode step (the N = 0 point of the model)."""
    times = []
    for prompt in prompts:
        g = runtime.autoregressive(prompt, max_new_tokens, stop_at_eog=False)
        if g.stats.n_generated > 1:
            times.append(g.stats.t_verify_ms / (g.stats.n_generated - 1))
    if not times:
        raise ValueError("autoregressive_step_ms needs generations of at least 2 tokens")
    return statistics.median(times)


def auto_draft_max(runtime, prompts: Sequence[Sequence[int]], *, block_size: int | None = None,
                   max_new_tokens: int = 32) -> Prediction:
    """Measure and choose `draft_max` for `runtime` on these prompts (token lists)."""
    b = block_size or runtime.block_size
    costs, gens = calibrate(runtime, prompts, list(range(1, b)), block_size=b, max_new_tokens=max_new_tokens)
    full = [s for n, g in gens if n == b - 1 for s in g.steps]
    return choose(survival(full), costs)


def to_json(costs: Mapping[int, StepCost], preds: Sequence[Prediction], pick: Prediction) -> dict:
    return {
        "costs": [dict(asdict(c), step_ms=c.step_ms) for c in (costs[n] for n in sorted(costs))],
        "predictions": [asdict(p) for p in preds],
        "pick": asdict(pick),
    }
