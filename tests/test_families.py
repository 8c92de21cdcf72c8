"""Every target family with published DFlash drafts: greedy DFlash output equals plain greedy output.

One tiny target per family (dflash_llama.families: transformers config, random weights from a seed,
the pinned llama.cpp converter), f32, and two random 2-layer drafts with a 16-token block converted by
our converter against the target's GGUF: a DFlash 1 draft and a DFlash 2 one (convolutions and
candidate selector). The block sizes 2, 4, 8 and 16 are the runtime's per-request
`block_size` (the number of positions the draft decodes: the last token and block_size - 1 MASKs,
every drafted token verified when draft_max is None), so one draft per family serves all of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dflash_llama
from dflash_llama import families, fixtures
from dflash_llama._core import NGRAM_MAX
from dflash_llama._gguf import gguf_info
from dflash_llama.converter import convert
from dflash_llama.prompts import humaneval

# family -> the llama.cpp architecture its GGUF declares
GGUF_ARCH = {"qwen3": "qwen3", "llama": "llama", "qwen3moe": "qwen3moe", "gpt-oss": "gpt-oss",
             "gemma3": "gemma3", "qwen35": "qwen35", "qwen35moe": "qwen35moe"}
BLOCK_SIZES = [2, 4, 8, 16]
DRAFT_MAX = [None, "auto"]  # every drafted token verified; the adaptive loop
# (draft_max, ngram): the whole block; the adaptive loop without and with its n-gram source
MODES = [(None, None), ("auto", False), ("auto", True)]
N_NEW = 16
OTHER_PROMPTS = [
    "def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time",
    "# Sort a list in Python\n", "class Stack:\n    def __init__(self):", "1, 2, 3, 4,", "SELECT * FROM",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "for i in range(10):",
]
PROMPTS = [p.text for p in humaneval()[:20]] + OTHER_PROMPTS


def test_the_family_table():
    assert families.NAMES == tuple(GGUF_ARCH)
    assert fixtures.TinyTargetConfig().family == "qwen3"
    with pytest.raises(ValueError, match=r"^unknown target family 'mamba': known families are qwen3, llama, "
                                         r"qwen3moe, gpt-oss, gemma3, qwen35, qwen35moe$"):
        fixtures.tiny_target_hf(Path("/nonexistent/never-written"), fixtures.TinyTargetConfig(family="mamba"))


class Pair:
    def __init__(self, family: str, root: Path):
        self.family = family
        self.hf = fixtures.tiny_target_hf(root / "target-hf", fixtures.TinyTargetConfig(family=family))
        self.target = fixtures.tiny_target_gguf(self.hf, root / "target-f32.gguf", family=family)
        draft_hf = fixtures.tiny_draft_hf(root / "draft-hf", self.hf, fixtures.TinyDraftConfig(
            layers=2, target_layer_ids=[1, 2], block_size=16, seed=41))
        self.draft = convert(draft_hf, self.target, root / "draft-f32.gguf", outtype="f32")
        self.rt = dflash_llama.Runtime(self.target, self.draft, n_threads=1, n_ctx=512, n_batch=64)
        self.root = root
        self._plain: dict[str, object] = {}

    def plain(self, prompt: str | list[int]):
        """Plain greedy decoding of N_NEW tokens (once per prompt: both drafts compare with it)."""
        key = prompt if isinstance(prompt, str) else tuple(prompt)
        if key not in self._plain:
            self._plain[key] = self.rt.autoregressive(prompt, N_NEW)
        return self._plain[key]

    def repeated(self, prompt: str) -> list[int]:
        """The prompt's tokens after pairs [last, t] for the 8 likeliest next tokens t of it, and of each
        such longer prompt in turn (at most 4 rounds, until the likeliest one is among them): the n-gram
        source then has a proposal after the first generated token."""
        base = self.rt.tokenize(prompt)
        covered: list[int] = []
        tokens = base
        for _ in range(4):
            likeliest = [int(t) for t in np.argsort(-self.rt.target_logits(tokens)[-1], kind="stable")[:8]]
            if likeliest[0] in covered:
                break
            covered += [t for t in likeliest if t not in covered]
            tokens = [x for t in covered for x in (base[-1], t)] + base
        return tokens

    def dflash2(self) -> dflash_llama.Runtime:
        """A runtime with a random DFlash 2 draft (kernel 2, groups of 16, rank 16, top-4; block 16)."""
        draft_hf = fixtures.tiny_draft_hf(self.root / "draft2-hf", self.hf, fixtures.TinyDraftConfig(
            variant="dflash2", layers=2, target_layer_ids=[1, 2], block_size=16, seed=42))
        draft = convert(draft_hf, self.target, self.root / "draft2-f32.gguf", outtype="f32")
        return dflash_llama.Runtime(self.target, draft, n_threads=1, n_ctx=512, n_batch=64)

    def dspark(self) -> dflash_llama.Runtime:
        """A runtime with a random DSpark draft (anchor-first, Markov rank 16, a confidence head; block 16)."""
        draft_hf = fixtures.tiny_draft_hf(self.root / "dspark-hf", self.hf, fixtures.TinyDraftConfig(
            variant="dspark", dtype="float32", layers=2, target_layer_ids=[1, 2], block_size=16, markov_rank=16,
            seed=43))
        draft = convert(draft_hf, self.target, self.root / "dspark-f32.gguf", outtype="f32")
        return dflash_llama.Runtime(self.target, draft, n_threads=1, n_ctx=512, n_batch=64)

    def accepting(self) -> tuple[dflash_llama.Runtime, str]:
        """A runtime whose draft always proposes the token the target repeats most often after one
        of OTHER_PROMPTS (fixtures.constant_draft_hf), and that prompt: drafts are accepted, in part."""
        best = []
        for prompt in OTHER_PROMPTS:
            tokens = self.rt.autoregressive(prompt, 48).tokens
            best += [(tokens.count(t), -i, t, prompt) for i, t in enumerate(tokens)]
        for candidate in sorted(best, reverse=True):
            try:
                hf = fixtures.constant_draft_hf(self.root / "constant-hf", self.target, candidate[2],
                                                fixtures.TinyDraftConfig(layers=1, block_size=16))
                break
            except ValueError:  # that token cannot win the draft's head: the next most repeated
                continue
        draft = convert(hf, self.target, self.root / "constant-f32.gguf", outtype="f32")
        return dflash_llama.Runtime(self.target, draft, n_threads=1, n_ctx=512, n_batch=64), candidate[3]


@pytest.fixture(scope="session", params=families.NAMES)
def pair(request, tmp_path_factory) -> Pair:
    return Pair(request.param, tmp_path_factory.mktemp(f"family_{request.param}"))


def assert_same(spec, ar, where: str):
    assert spec.tokens == ar.tokens, f"{where}: speculative output differs from target greedy output"
    assert spec.stop_reason == ar.stop_reason, where
    assert sum(s.produced for s in spec.steps) == len(spec.tokens) - 1, where  # the first token: prefill
    for s in spec.steps:
        assert 0 <= s.accepted <= len(s.drafted) and 1 <= s.produced <= s.accepted + 1, where


def test_the_target_is_its_family(pair):
    config = json.loads((pair.hf / "config.json").read_text())
    assert config["architectures"] == [families.get(pair.family).model_class]
    assert gguf_info(pair.target).architecture == GGUF_ARCH[pair.family]
    assert pair.rt.n_layer == 4 and pair.rt.n_embd == 64 and pair.rt.n_vocab == 49152
    assert pair.rt.block_size == 16 and pair.rt.target_layer_ids == [1, 2]


# families whose graph ends in one matmul of the final norm: our output head computes their logits
OWN_HEAD = {"qwen3", "llama", "qwen3moe", "gpt-oss", "gemma3", "qwen35", "qwen35moe"}


def test_our_output_head_computes_llama_cpps_logits(pair):
    """Our output head (runtime/output_head.h) where the family's graph allows it: its logits are
    llama.cpp's bit for bit, after a batched decode (as a verify) and one token at a time."""
    tokens = pair.rt.tokenize(PROMPTS[0] + " " + OTHER_PROMPTS[0])
    theirs = dflash_llama.Runtime(pair.target, n_threads=1, n_ctx=512, n_batch=64, own_head=False)
    assert theirs.output_head == "llama.cpp"
    batched, stepped = theirs.target_logits(tokens), theirs.target_logits(tokens, one_at_a_time=True, n_prefill=3)
    assert np.array_equal(pair.rt.target_logits(tokens), batched)
    assert np.array_equal(pair.rt.target_logits(tokens, one_at_a_time=True, n_prefill=3), stepped)
    assert pair.rt.output_head == ("ours" if pair.family in OWN_HEAD else "llama.cpp")


def test_the_reference_reads_the_target_gguf(pair):
    """What the trainer and parity read of a GGUF target; a MoE target's FFN width is its shared
    expert's, else one expert's (Qwen3.5 MoE has no feed_forward_length: was a TypeError)."""
    from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

    tw = target_weights_from_gguf(pair.target)
    config = json.loads((pair.hf / "config.json").read_text())
    ffn = config.get("intermediate_size") or config["shared_expert_intermediate_size"]
    assert (tw.n_layers, tw.head_dim, tw.ffn, tuple(tw.embed_tokens.shape)) == (4, 16, ffn, (49152, 64))


def test_greedy_dflash_equals_plain_decoding(pair):
    """30 prompts x block sizes 2, 4, 8, 16, in turn the whole block verified, the adaptive loop
    without its n-gram source, and the adaptive loop with it on the prompt repeated after its plain
    continuation (10 prompts per block size and mode): each generation equals plain greedy decoding
    token for token, and n-gram proposals were verified."""
    assert len(PROMPTS) == 30
    ngram_steps = 0
    for i, text in enumerate(PROMPTS):
        draft_max, ngram = MODES[i % 3]
        prompt = pair.repeated(text) if ngram else text
        ar = pair.plain(prompt)
        assert len(set(ar.tokens)) > 1, f"{pair.family}: prompt {i} repeats one token"  # a live target
        for block in BLOCK_SIZES:
            pair.rt.forget_policy()  # each opens as a first generation: probing the draft, every n-gram class
            spec = pair.rt.generate(prompt, N_NEW, block_size=block, draft_max=draft_max, ngram=ngram)
            where = f"{pair.family}: prompt {i}, block {block}, draft_max {draft_max}, ngram {ngram}"
            assert_same(spec, ar, where)
            assert all(len(s.drafted) <= (block - 1 if s.source == "draft" else NGRAM_MAX) for s in spec.steps)
            if draft_max is None:  # the first verify holds the whole block
                assert len(spec.steps[0].drafted) == block - 1
            elif not ngram:  # the adaptive loop knows its step costs: it starts plain, probing with a shadow draft
                assert spec.steps[0].drafted == [] and spec.policy.shadow_probes >= 1
                assert spec.policy.ngram_steps == 0
            else:
                ngram_steps += spec.policy.ngram_steps
    assert ngram_steps >= 10, f"{pair.family}: {ngram_steps} n-gram proposals verified"


def test_greedy_dflash2_equals_plain_decoding(pair):
    """The same 30 prompts x block sizes 2, 4, 8, 16 through a DFlash 2 draft, the whole block
    verified on even prompts and the adaptive loop on odd ones: each generation equals plain greedy
    decoding token for token."""
    rt = pair.dflash2()
    assert rt.draft_variant.name == "dflash2"
    for i, prompt in enumerate(PROMPTS):
        draft_max = DRAFT_MAX[i % 2]
        for block in BLOCK_SIZES:
            spec = rt.generate(prompt, N_NEW, block_size=block, draft_max=draft_max)
            assert_same(spec, pair.plain(prompt), f"{pair.family}: DFlash 2, prompt {i}, block {block}, "
                                                  f"draft_max {draft_max}")
            assert all(len(s.drafted) <= (block - 1 if s.source == "draft" else NGRAM_MAX) for s in spec.steps)
            if draft_max is None:
                assert len(spec.steps[0].drafted) == block - 1


def test_greedy_dspark_equals_plain_decoding(pair):
    """The same 30 prompts x block sizes 2, 4, 8, 16 through an anchor-first DSpark draft with a confidence
    head, in turn the whole block verified (B drafted tokens), the adaptive loop with its confidence gate,
    and the whole block cut by a confidence threshold: each generation equals plain greedy decoding token
    for token."""
    rt = pair.dspark()
    assert rt.draft_variant.name == "dspark" and rt.sample_from_anchor and rt.has_confidence_head
    for i, prompt in enumerate(PROMPTS):
        draft_max, p_min = ((None, 0.0), ("auto", 0.0), (None, 0.5))[i % 3]
        for block in BLOCK_SIZES:
            spec = rt.generate(prompt, N_NEW, block_size=block, draft_max=draft_max, draft_p_min=p_min)
            assert_same(spec, pair.plain(prompt), f"{pair.family}: DSpark, prompt {i}, block {block}, "
                                                  f"draft_max {draft_max}, p_min {p_min}")
            assert all(len(s.drafted) <= (block if s.source == "draft" else NGRAM_MAX) for s in spec.steps)
            if draft_max is None and p_min == 0.0:  # B drafted, or as many as the N_NEW tokens leave room for
                assert len(spec.steps[0].drafted) == min(block, N_NEW - 1)


def test_accepted_drafts_keep_the_output_exact(pair):
    """Drafts the target accepts, partly: the accept path (and for recurrent targets a rollback to a
    state inside the verified block) leaves the output equal to plain greedy decoding."""
    rt, prompt = pair.accepting()
    ar = rt.autoregressive(prompt, 48)
    accepted = {}
    for block in BLOCK_SIZES:
        for draft_max in DRAFT_MAX:
            spec = rt.generate(prompt, 48, block_size=block, draft_max=draft_max)
            assert_same(spec, ar, f"{pair.family}: constant draft, block {block}, draft_max {draft_max}")
            accepted[block, draft_max] = sum(s.accepted for s in spec.steps)
    assert all(accepted[block, None] > 0 for block in BLOCK_SIZES), accepted
    # a partial accept: some step kept some of its drafted tokens, not all
    spec = rt.generate(prompt, 48, block_size=16, draft_max=None)
    assert any(0 < s.accepted < len(s.drafted) for s in spec.steps)


@pytest.mark.parametrize("draft_max", DRAFT_MAX)
def test_generation_ends_at_the_context_end(pair, draft_max):
    rt = dflash_llama.Runtime(pair.target, pair.draft, n_threads=1, n_ctx=48, n_batch=32)
    prompt = "import numpy as np\nimport torch\n"
    n_prompt = len(rt.tokenize(prompt))
    ar = rt.autoregressive(prompt, 200)
    for block in (4, 16):
        spec = rt.generate(prompt, 200, block_size=block, draft_max=draft_max)
        assert_same(spec, ar, f"{pair.family}: context end, block {block}, draft_max {draft_max}")
        assert spec.stop_reason == "context_full"
        assert n_prompt + len(spec.tokens) == 48


@pytest.mark.parametrize("draft_max", DRAFT_MAX)
def test_generation_ends_at_a_stop_token(pair, draft_max):
    full = pair.rt.autoregressive("Once upon a time", 30)
    stop = full.tokens[9]
    first = full.tokens.index(stop)
    ar = pair.rt.autoregressive("Once upon a time", 30, stop_tokens=[stop])
    assert ar.stop_reason == "stop_token" and ar.tokens == full.tokens[:first + 1]
    for block in (2, 8, 16):
        spec = pair.rt.generate("Once upon a time", 30, stop_tokens=[stop], block_size=block, draft_max=draft_max)
        assert_same(spec, ar, f"{pair.family}: stop token, block {block}, draft_max {draft_max}")
