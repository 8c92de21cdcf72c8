"""The DFlash speculative loop (paper / published semantics) and plain autoregressive decoding.

`generate_speculative` reads top to bottom: prefill, then per step draft a block, verify it with
the target, accept the longest agreeing prefix plus one target token, roll the target cache back.
Greedy is exact (same tokens as the target alone); sampling uses rejection sampling, which keeps
the target's distribution. A DFlash 2 draft proposes the walk of its candidate selector (greedy:
the best path; sampled: a path drawn with the loop's generator, at the sampling temperature only),
and its draws are accepted against their distributions over the candidates (zero elsewhere). A
DSpark-family draft proposes its Markov chain (`DFlashDraft.draft_chain`: every slot of an anchor-first
block, so up to B tokens; each drawn from its Markov-biased logits with the loop's sampler), cut
before the first slot whose confidence is below `confidence_threshold` (0: never), and its draws
are accepted against those biased distributions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from dflash_llama.results import generation_json


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 and top_p 1 = off."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator | None:
        return None if self.greedy else torch.Generator().manual_seed(self.seed)


def sampling_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k, then top-p (the smallest head of the
    sorted distribution whose mass reaches top_p)."""
    scores = logits.float() / s.temperature
    vocab = scores.shape[-1]
    indices = None
    if 0 < s.top_k < vocab:
        scores, indices = torch.topk(scores, s.top_k, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if s.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < s.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if indices is not None:
        probs = torch.zeros(*logits.shape, dtype=probs.dtype).scatter(-1, indices, probs)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of probs [..., V] -> ids [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def accept_sampled(drafted: torch.Tensor, draft_probs: torch.Tensor,
                   target_probs: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """Rejection sampling over one block: (accepted count a, the token after them).

    drafted [g] were sampled from draft_probs [g, V]; target_probs [g+1, V] are the target's
    distributions at block positions 0..g. Token i is kept while u * q(d_i) < p(d_i); the first
    rejected position is resampled from max(p - q, 0); if all are kept the bonus comes from p[g].
    """
    g = drafted.shape[0]
    rows = torch.arange(g)
    q = draft_probs[rows, drafted]
    p = target_probs[rows, drafted]
    u = torch.rand(g, generator=generator)
    a = int((u * q < p).int().cumprod(0).sum())
    if a == g:
        return a, int(sample(target_probs[g], generator))
    residual = (target_probs[a] - draft_probs[a]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else target_probs[a]  # p == q: any draw from p
    return a, int(sample(residual, generator))


@dataclass
class Step:
    drafted: list[int]  # the draft's tokens (DFlash: for block positions 1..B-1; anchor-first: up to B)
    accepted: int  # how many of them the target accepted
    produced: int  # tokens this step added to the output (accepted + 1, less at a limit)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]  # generated ids, prompt excluded
    steps: list[Step] = field(default_factory=list)
    stop_reason: str = "max_tokens"  # or "stop_token"

    @property
    def tau(self) -> float:
        """Mean tokens produced per target verify (0.0 before the first step)."""
        return sum(s.produced for s in self.steps) / len(self.steps) if self.steps else 0.0

    def to_json_dict(self, text: str | None = None, prompt_ids: Sequence[int] | None = None) -> dict:
        """The `dflash-llama generate --json` object (`results.generation_json`)."""
        return generation_json(self.tokens, text, [asdict(s) for s in self.steps], self.tau,
                               prompt_ids=prompt_ids)


def _check_request(prompt_ids, max_new_tokens: int) -> list[int]:
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return prompt_ids


@torch.inference_mode()
def generate_speculative(target, draft, prompt_ids, max_new_tokens: int, *,
                         block_size: int | None = None, sampling: Sampling = Sampling(),
                         stop_token_ids=(), confidence_threshold: float = 0.0) -> GenerationResult:
    """DFlash speculative decoding of up to max_new_tokens after prompt_ids.

    target: `target.Target`; draft: `model.DFlashDraft` (or anything with its forward,
    new_cache, block_size, mask_token_id and target_layer_ids; and propose when its
    candidate_selector is not None; and draft_chain and config when it is of the DSpark family).
    Stops after a stop token (kept in the output) or at max_new_tokens. confidence_threshold: a
    DSpark draft's drafts stop before the first slot whose confidence is below it.
    """
    prompt_ids = _check_request(prompt_ids, max_new_tokens)
    block_size = draft.block_size if block_size is None else block_size
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    stop = set(int(t) for t in stop_token_ids)
    gen = sampling.generator()
    layers = draft.target_layer_ids
    walks = getattr(draft, "candidate_selector", None) is not None  # DFlash 2
    config = getattr(draft, "config", None)
    chains = config is not None and (config.markov_rank > 0 or config.sample_from_anchor)  # the DSpark family
    anchor_first = chains and config.sample_from_anchor
    if not 0 <= confidence_threshold <= 1:
        raise ValueError(f"confidence_threshold must be in [0, 1], got {confidence_threshold}")
    if confidence_threshold > 0 and getattr(draft, "confidence_head", None) is None:
        raise ValueError("confidence_threshold needs a draft with a confidence head")

    def pick(logits):  # [n, V] -> [n] ids, and their probabilities when sampling
        if sampling.greedy:
            return logits.argmax(-1), None
        probs = sampling_probs(logits, sampling)
        return sample(probs, gen), probs

    def pick_one(logits):  # a chain's slot: [V] -> id, and its distribution when sampling
        token, probs = pick(logits[None])
        return int(token[0]), None if probs is None else probs[0]

    # prefill: the target reads the prompt and gives the first token and the first context
    target_cache, draft_cache = target.new_cache(), draft.new_cache()
    out = target.forward(prompt_ids, 0, target_cache, feature_layers=layers, logits_to_keep=1)
    tokens = [int(pick(out.logits[-1:])[0][0])]
    ctx_feat, start = out.features, len(prompt_ids)  # start: position of the last output token
    result = GenerationResult(prompt_ids, tokens)
    if tokens[0] in stop:
        result.stop_reason = "stop_token"
        return result

    while len(tokens) < max_new_tokens:
        # anchor-first: the draft's block is [anchor, MASK...] and all of it drafts, one more token
        remaining = max_new_tokens - len(tokens)
        verify_size = min(block_size, remaining) + 1 if anchor_first else min(block_size, remaining + 1)
        block = torch.full((verify_size,), draft.mask_token_id, dtype=torch.long)
        block[0] = tokens[-1]

        # draft: one forward proposes block positions 1..verify_size-1
        draft_probs = None
        if chains and verify_size > 1:
            chain = draft.draft_chain(ctx_feat, block[:-1] if anchor_first else block, start, draft_cache,
                                      pick=pick_one)
            kept = _confident_prefix(chain.confidence, confidence_threshold)
            block = torch.cat([block[:1], chain.tokens[:kept]])
            draft_probs = None if chain.probs is None else chain.probs[:kept]
        elif verify_size > 1 and walks:
            walk = draft.propose(ctx_feat, block, start, draft_cache,
                                 temperature=sampling.temperature, generator=gen)
            block[1:], draft_probs = walk.tokens, walk.probs
        elif verify_size > 1:
            draft_logits = draft(ctx_feat, block, start, draft_cache)
            block[1:], draft_probs = pick(draft_logits)

        # verify: the target scores the whole block in one forward
        out = target.forward(block, start, target_cache, feature_layers=layers)

        # accept: the longest prefix the target agrees with, plus one token of the target's own
        if sampling.greedy:
            posterior = out.logits.argmax(-1)
            agree = (block[1:] == posterior[:-1]).int().cumprod(0)
            accepted = int(agree.sum())
            bonus = int(posterior[accepted])
        elif len(block) > 1:
            accepted, bonus = accept_sampled(block[1:], draft_probs,
                                             sampling_probs(out.logits, sampling), gen)
        else:
            accepted, bonus = 0, int(sample(sampling_probs(out.logits[-1], sampling), gen))
        new = (block[1:accepted + 1].tolist() + [bonus])[:max_new_tokens - len(tokens)]
        for i, t in enumerate(new):
            if t in stop:
                new = new[:i + 1]
                result.stop_reason = "stop_token"
                break
        tokens.extend(new)
        result.steps.append(Step(block[1:].tolist(), accepted, len(new)))

        # roll back: keep the target cache and the next context up to the last output token
        start += len(new)
        target.crop(target_cache, start)
        ctx_feat = out.features[:len(new)]
        if result.stop_reason == "stop_token":
            break
    return result


def _confident_prefix(confidence: torch.Tensor | None, threshold: float) -> int | None:
    """How many drafted tokens to verify: up to the first slot whose confidence is below threshold
    (DeepSpec's per-slot rule, not a running product); None: all of them."""
    if confidence is None or threshold <= 0:
        return None
    low = (confidence < threshold).nonzero()
    return int(low[0]) if len(low) else None


@torch.inference_mode()
def generate_autoregressive(target, prompt_ids, max_new_tokens: int, *,
                            sampling: Sampling = Sampling(), stop_token_ids=()) -> GenerationResult:
    """Plain decoding with the target alone: one forward per token. Each step after the prefill
    is recorded as drafting nothing and producing one token."""
    prompt_ids = _check_request(prompt_ids, max_new_tokens)
    stop = set(int(t) for t in stop_token_ids)
    gen = sampling.generator()

    def pick(logits):  # [V] -> id
        if sampling.greedy:
            return int(logits.argmax())
        return int(sample(sampling_probs(logits, sampling), gen))

    cache = target.new_cache()
    out = target.forward(prompt_ids, 0, cache, logits_to_keep=1)
    tokens = [pick(out.logits[-1])]
    result = GenerationResult(prompt_ids, tokens)
    start = len(prompt_ids)
    while tokens[-1] not in stop and len(tokens) < max_new_tokens:
        out = target.forward([tokens[-1]], start, cache)
        tokens.append(pick(out.logits[-1]))
        result.steps.append(Step([], 0, 1))
        start += 1
    if tokens[-1] in stop:
        result.stop_reason = "stop_token"
    return result
