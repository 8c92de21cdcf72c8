"""The speculative loop: against the published dflash_generate, against the target alone
(greedy), and lossless sampling (chi-square against the target's exact distribution)."""

from __future__ import annotations

import time

import pytest
import torch

from dflash_llama import fixtures
from dflash_llama.reference import (
    Sampling,
    Target,
    generate_autoregressive,
    generate_speculative,
    load_draft_for_target,
)
from dflash_llama.reference.speculative import accept_sampled, sampling_probs

dm = pytest.importorskip("dflash.model")  # the published reference, installed --no-deps

torch.set_num_threads(1)


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 20, (n,), generator=g)
    return [torch.randint(3, 49152, (int(k),), generator=g).tolist() for k in lengths]


def oracle_logits(logits: torch.Tensor, start: int, reference: list[int]) -> torch.Tensor:
    """Make the first k(start) drafted tokens the target's own continuation (k from 0 to all),
    so acceptance, bonus tokens and rollback all get exercised with a random draft."""
    g = logits.shape[0]
    k = (7 * start + 3) % (g + 1)
    out = logits.clone()
    for j in range(k):
        if start + 1 + j < len(reference):
            out[j, reference[start + 1 + j]] = out[j].max() + 10.0
    return out


class OracleDraft:
    """A real draft (its forward and cache still run) whose logits `oracle_logits` overrides."""

    def __init__(self, draft, reference: list[int]):
        self.draft, self.reference = draft, reference

    def __getattr__(self, name):  # block_size, mask_token_id, target_layer_ids, new_cache
        return getattr(self.draft, name)

    def __call__(self, ctx_feat, block, start, cache=None):
        return oracle_logits(self.draft(ctx_feat, block, start, cache), start, self.reference)


def run_published(draft_dir, hf_target, prompt, n, *, block_size=None, stop=None,
                  reference=None):
    """dflash_generate (greedy), recording the drafted tokens of every step."""
    model = dm.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    state, drafted = {}, []
    forward, compute_logits = model.forward, model.compute_logits

    def recording_forward(**kw):
        state["start"] = int(kw["position_ids"][0, -1]) - kw["noise_embedding"].shape[1] + 1
        return forward(**kw)

    def recording_logits(hidden, head):
        logits = compute_logits(hidden, head)
        if reference is not None:
            logits = oracle_logits(logits[0], state["start"], reference)[None]
        drafted.append(logits[0].argmax(-1).tolist())
        return logits

    model.forward, model.compute_logits = recording_forward, recording_logits
    r = dm.dflash_generate(model, hf_target, torch.tensor([prompt]), n, stop,
                           block_size=block_size, return_stats=True)
    return r.output_ids[0, len(prompt):].tolist(), drafted, r.acceptance_lengths


CASES = [  # (draft, block size override, stop at the k-th token of the target's continuation)
    ("gqa4_last_layer_tap", None, None),
    ("sliding_default_taps", None, 17),
    ("noncausal_window_scales", None, None),
    ("one_layer_causal", None, None),
    ("one_layer_causal", 3, 9),
]


@pytest.mark.parametrize("oracle", [False, True], ids=["random_draft", "oracle_draft"])
@pytest.mark.parametrize("name, block_size, stop_at", CASES)
def test_greedy_matches_published_dflash_generate(name, block_size, stop_at, oracle,
                                                  reference_drafts, reference_target, monkeypatch):
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # it syncs CUDA for its stats
    ours = load_draft_for_target(reference_drafts[name], reference_target)
    for prompt in random_prompts(2, seed=len(name)):
        n = 30
        ar = generate_autoregressive(reference_target, prompt, n).tokens
        reference = prompt + ar
        stop = None if stop_at is None else [ar[stop_at]]
        tokens, drafted, lengths = run_published(
            reference_drafts[name], reference_target.model, prompt, n, block_size=block_size,
            stop=stop, reference=reference if oracle else None)
        draft = OracleDraft(ours, reference) if oracle else ours
        result = generate_speculative(reference_target, draft, prompt, n, block_size=block_size,
                                      stop_token_ids=stop or ())
        assert result.tokens == tokens
        assert [s.drafted for s in result.steps] == drafted
        assert [s.produced for s in result.steps] == lengths
        if stop_at is not None:
            assert result.tokens == ar[:ar.index(ar[stop_at]) + 1]
            assert result.stop_reason == "stop_token"
        if oracle:
            assert max(s.accepted for s in result.steps) >= 1


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_speculative_equals_target_greedy(block_size, tiny_draft_hf, reference_target):
    draft = load_draft_for_target(tiny_draft_hf, reference_target)
    n, accepted = 24, 0
    for i, prompt in enumerate(random_prompts(20, seed=block_size)):
        ar = generate_autoregressive(reference_target, prompt, n)
        assert len(ar.tokens) == n and len(ar.steps) == n - 1
        # the oracle makes the draft right part of the time; every 4th prompt runs it as is
        use = draft if i % 4 == 0 else OracleDraft(draft, prompt + ar.tokens)
        spec = generate_speculative(reference_target, use, prompt, n, block_size=block_size)
        assert spec.tokens == ar.tokens, (block_size, i)
        assert sum(s.produced for s in spec.steps) == n - 1  # the first token is the prefill's
        assert all(len(s.drafted) <= block_size - 1 for s in spec.steps)
        accepted += sum(s.accepted for s in spec.steps)
    assert accepted > 0 if block_size > 1 else accepted == 0


@torch.inference_mode()
def test_autoregressive_equals_transformers_generate(reference_target):
    model = reference_target.model
    for prompt in random_prompts(3, seed=99):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert generate_autoregressive(reference_target, prompt, 16).tokens == expected


def test_greedy_tiny_target_is_not_degenerate(reference_target):
    tokens = generate_autoregressive(reference_target, [1604, 3987, 24, 94, 727], 40).tokens
    assert len(set(tokens)) >= 30  # random weights, varied continuation, no single-token loop


def test_max_tokens_limits_the_last_block(tiny_draft_hf, reference_target):
    draft = load_draft_for_target(tiny_draft_hf, reference_target)
    prompt = [1604, 3987, 24, 94]
    ar = generate_autoregressive(reference_target, prompt, 12).tokens
    for n in (1, 2, 5, 12):
        r = generate_speculative(reference_target, OracleDraft(draft, prompt + ar), prompt, n)
        assert r.tokens == ar[:n] and r.stop_reason == "max_tokens"
        produced = 1
        for s in r.steps:  # the verify block never reaches past max_new_tokens
            assert len(s.drafted) <= n - produced
            produced += s.produced
    assert generate_speculative(reference_target, draft, prompt, 1).steps == []


def test_stop_token_at_the_first_token(tiny_draft_hf, reference_target):
    draft = load_draft_for_target(tiny_draft_hf, reference_target)
    prompt = [1604, 3987, 24, 94]
    first = generate_autoregressive(reference_target, prompt, 1).tokens[0]
    r = generate_speculative(reference_target, draft, prompt, 10, stop_token_ids=[first])
    assert (r.tokens, r.steps, r.stop_reason, r.tau) == ([first], [], "stop_token", 0.0)


def test_bad_requests(tiny_draft_hf, reference_target):
    draft = load_draft_for_target(tiny_draft_hf, reference_target)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate_speculative(reference_target, draft, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        generate_speculative(reference_target, draft, [5], 0)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        generate_speculative(reference_target, draft, [5], 4, block_size=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        Sampling(temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        Sampling(temperature=-1)


# ---------------------------------------------------------------- sampling

def test_sampling_probs_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    full = torch.softmax(logits, -1)
    assert torch.allclose(sampling_probs(logits, Sampling(1.0)), full)
    top3 = sampling_probs(logits, Sampling(1.0, top_k=3))
    assert top3[3] == 0 and torch.allclose(top3[:3], torch.softmax(logits[:3], -1))
    # top-p keeps the smallest head whose mass reaches p: 0.644 alone, then 0.644 + 0.237
    assert torch.equal(sampling_probs(logits, Sampling(1.0, top_p=0.5)),
                       torch.tensor([1.0, 0.0, 0.0, 0.0]))
    two = sampling_probs(logits, Sampling(1.0, top_p=0.8))
    assert two[2] == 0 and two[3] == 0 and torch.allclose(two[:2], torch.softmax(logits[:2], -1))
    assert torch.allclose(sampling_probs(logits, Sampling(2.0)), torch.softmax(logits / 2, -1))


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of observed counts against probabilities (cells with an
    expected count under 5 are pooled)."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].sum().double()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def test_rejection_sampling_is_lossless():
    """Drafts from q, rejection sampling against p: the first output token follows p[0], and
    the second, given the first draft token was accepted, follows p[1]."""
    g = torch.Generator().manual_seed(0)
    vocab, gamma, trials = 6, 3, 12000
    q = torch.softmax(torch.randn(gamma, vocab, generator=g) * 1.5, -1)
    p = torch.softmax(torch.randn(gamma + 1, vocab, generator=g) * 1.5, -1)
    first = torch.zeros(vocab, dtype=torch.long)
    second = torch.zeros(vocab, dtype=torch.long)
    accepted_any = 0
    for _ in range(trials):
        drafted = torch.multinomial(q, 1, generator=g)[:, 0]
        a, nxt = accept_sampled(drafted, q, p, g)
        out = drafted[:a].tolist() + [nxt]
        first[out[0]] += 1
        if a >= 1:
            second[out[1]] += 1
            accepted_any += 1
    assert accepted_any > trials // 4
    assert chi_square_p(first, p[0]) > 1e-3
    assert chi_square_p(second, p[1]) > 1e-3
    # the test has power: the draft's own distribution is told apart from the target's
    assert chi_square_p(torch.bincount(torch.multinomial(q[0], trials, replacement=True,
                                                         generator=g), minlength=vocab),
                        p[0]) < 1e-6


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A 12-token target and a draft for it: full distributions cheap to enumerate exactly."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = tmp_path_factory.mktemp("small_vocab")
    torch.manual_seed(5)
    cfg = Qwen3Config(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      initializer_range=0.2, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).save_pretrained(d / "target")
    target = Target.load(d / "target")
    draft_dir = fixtures.tiny_draft_hf(d / "draft", d / "target", fixtures.TinyDraftConfig(
        block_size=4, head_dim=8, ffn=64, init_std=0.3, seed=6))
    return target, load_draft_for_target(draft_dir, target)


@torch.inference_mode()
def test_speculative_sampling_matches_target_distribution(small_vocab_pair):
    """Three tokens per run (prefill + one verify of 2 drafted tokens), many seeds: the
    marginals of tokens 2 and 3 match the target's exact ones (temperature, top-k, top-p on)."""
    target, draft = small_vocab_pair
    s = Sampling(temperature=1.5, top_p=0.95, top_k=8)
    prompt = [3, 7, 1]
    # exact marginals from the target: every (t0, t1) prefix in one batched forward
    pairs = torch.cartesian_prod(torch.arange(12), torch.arange(12))
    ids = torch.cat([torch.tensor(prompt).expand(144, 3), pairs], dim=1)
    logits = target.model(ids).logits
    p0 = sampling_probs(logits[0, 2], s)
    p1 = sampling_probs(logits[::12, 3], s)  # [t0, V]
    p2 = sampling_probs(logits[:, 4], s).reshape(12, 12, 12)  # [t0, t1, V]
    marginal1 = p0 @ p1
    marginal2 = torch.einsum("a,ab,abv->v", p0, p1, p2)

    counts1, counts2 = torch.zeros(12, dtype=torch.long), torch.zeros(12, dtype=torch.long)
    accepted = 0
    trials = 1200
    for seed in range(trials):
        r = generate_speculative(target, draft, prompt, 3, sampling=Sampling(
            s.temperature, s.top_p, s.top_k, seed=seed))
        counts1[r.tokens[1]] += 1
        counts2[r.tokens[2]] += 1
        accepted += r.steps[0].accepted
    assert accepted > trials // 10  # the draft's proposals are often kept: acceptance is tested
    assert chi_square_p(counts1, marginal1) > 1e-3
    assert chi_square_p(counts2, marginal2) > 1e-3
    assert chi_square_p(counts1, p0) < 1e-3  # power: a wrong distribution is rejected


def test_sampling_is_reproducible_by_seed(tiny_draft_hf, reference_target):
    draft = load_draft_for_target(tiny_draft_hf, reference_target)
    prompt = [1604, 3987, 24, 94]
    run = lambda seed: generate_speculative(  # noqa: E731
        reference_target, draft, prompt, 12, sampling=Sampling(0.9, top_k=50, seed=seed)).tokens
    assert run(1) == run(1)
    assert run(1) != run(2)
    ar = lambda seed: generate_autoregressive(  # noqa: E731
        reference_target, prompt, 12, sampling=Sampling(0.9, top_k=50, seed=seed)).tokens
    assert ar(1) == ar(1) != ar(2)


def two_token_marginals(target, prompt: list[int], s, n_vocab: int = 12):
    """The target's exact sampling distributions of the first generated token given the prompt (p0 [V])
    and the marginals of the first two (over every pair of a vocabulary of n_vocab) [V] each."""
    from dflash_llama.reference.speculative import sampling_probs

    v, n = n_vocab, len(prompt)
    pairs = torch.cartesian_prod(torch.arange(v), torch.arange(v))
    logits = target.model(torch.cat([torch.tensor(prompt).expand(v * v, n), pairs], dim=1)).logits
    p0 = sampling_probs(logits[0, n - 1], s)
    p1 = sampling_probs(logits[::v, n], s)  # [t0, V]
    p2 = sampling_probs(logits[:, n + 1], s).reshape(v, v, v)  # [t0, t1, V]
    return p0, p0 @ p1, torch.einsum("a,ab,abv->v", p0, p1, p2)
