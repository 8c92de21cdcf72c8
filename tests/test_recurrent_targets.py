"""Targets with a recurrent state, whose rejected draft tokens must be undone exactly.

- qwen35 (Gated DeltaNet layers with one attention layer): llama.cpp keeps per-token snapshots of
  its recurrent state (`n_rs_seq`), sized from the draft's block;
- mamba (recurrent only): llama.cpp keeps no snapshots for it, so each decode saves the state and a
  rollback restores it and decodes the kept tokens again.

Random drafts are rejected at once and roll back whole blocks. To roll back partly accepted blocks
of every length, each target's head is tilted toward " ha" (its row gains a multiple of the mean
last hidden state), so it emits " ha" about half the time, in runs of varying length, and a draft
that proposes " ha" everywhere (`fixtures.constant_draft_hf`) is accepted up to the first other token.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

import dflash_llama
from dflash_llama import fixtures
from dflash_llama.converter import convert

TOKEN = "Ġha"
PROMPTS = [
    "The quick brown fox", "def fib(n):", "Once upon a time", "1 2 3 4 5 6", "Hello hello hello hello",
    "ha ha", "import os", "The capital of France is", "SELECT * FROM", "for i in range(10):",
    "Dear Sir or Madam,", "a b c d e f g", "In 1492 Columbus", "print('hello')", "Question: 2 + 2 =", "ha",
]
DRAFT_MAX = (1, 3, 7, 15, "auto")


def _mamba_hf(out: Path) -> Path:
    """A random Mamba (recurrent only, 4 layers, hidden 64) with SmolLM2's tokenizer."""
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    tok = fixtures._tokenizer_from_smollm2()
    config = MambaConfig(vocab_size=len(tok), hidden_size=64, state_size=8, num_hidden_layers=4, expand=2,
                         conv_kernel=4, initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    MambaForCausalLM(config).float().eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tilt_toward(hf_dir: Path, token: str, strength: float) -> None:
    """Adds `strength` times the unit mean last hidden state (over a fixed text) to the head row
    of `token`, in place: the target then picks `token` wherever its state points that way."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    with torch.no_grad():
        ids = tok("The quick brown fox jumps over the lazy dog", return_tensors="pt").input_ids
        h = model(ids, output_hidden_states=True).hidden_states[-1][0].mean(0)
        model.get_output_embeddings().weight[tok.convert_tokens_to_ids(token)] += strength * h / h.norm()
    model.save_pretrained(hf_dir)


@pytest.fixture(scope="module")
def qwen35_hf(tmp_path_factory) -> Path:
    return fixtures.tiny_target_hf(tmp_path_factory.mktemp("qwen35_hf"), fixtures.TinyTargetConfig(family="qwen35"))


@pytest.fixture(scope="module")
def qwen35_gguf(qwen35_hf, tmp_path_factory) -> Path:
    return fixtures.tiny_target_gguf(qwen35_hf, tmp_path_factory.mktemp("qwen35_gguf") / "target.gguf",
                                     family="qwen35")


@pytest.fixture(scope="module")
def tilted(tmp_path_factory):
    """family -> (target GGUF tilted toward " ha", f32 draft proposing " ha" everywhere, block 16),
    each built once."""
    built = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in built:
            root = tmp_path_factory.mktemp(f"{family}_tilted")
            if family == "mamba":
                hf = _mamba_hf(root / "hf")
            else:
                hf = fixtures.tiny_target_hf(root / "hf", fixtures.TinyTargetConfig(family=family))
            tilt_toward(hf, TOKEN, 12.0)
            target = root / "target-f32.gguf"
            if family == "mamba":
                fixtures.run_pinned_converter([str(hf), "--outfile", str(target), "--outtype", "f32"])
            else:
                fixtures.tiny_target_gguf(hf, target, family=family)
            draft_hf = fixtures.constant_draft_hf(root / "draft_hf", target, TOKEN, fixtures.TinyDraftConfig(
                layers=1, block_size=16, target_layer_ids=[1, 2]))
            built[family] = target, convert(draft_hf, target, root / "draft-f32.gguf", outtype="f32")
        return built[family]

    return get


RECURRENT = ["qwen35", "mamba"]


@pytest.mark.parametrize("family", RECURRENT)
def test_partly_accepted_blocks_roll_back_exactly(tilted, family):
    """Greedy DFlash equals plain decoding on 16 prompts x draft lengths 1, 3, 7, 15 and auto, with
    blocks accepted in part: the recurrent state after each rollback is the one plain decoding has."""
    target, draft = tilted(family)
    rt = dflash_llama.Runtime(target, draft, n_threads=1, n_ctx=256)
    plain = dflash_llama.Runtime(target, n_threads=1, n_ctx=256)
    dropped = Counter()  # tokens rolled back per verify of a partly accepted block
    for prompt in PROMPTS:
        expected = plain.autoregressive(prompt, max_new_tokens=40).tokens
        for draft_max in DRAFT_MAX:
            got = rt.generate(prompt, max_new_tokens=40, draft_max=draft_max)
            assert got.tokens == expected, (family, prompt, draft_max)
            dropped.update(len(s.drafted) - s.accepted for s in got.steps if 0 < s.accepted < len(s.drafted))
    assert sum(dropped.values()) >= 60, dropped  # many partial rollbacks ...
    assert len(dropped) >= 8, dropped  # ... of many lengths


@pytest.mark.parametrize("family", RECURRENT)
def test_a_full_context_and_a_stop_token_end_exactly(tilted, family):
    """Generation that runs into the end of the context, and one cut at a stop token (" ha" made
    a stop token, so the draft's own proposal ends the block), stay equal to plain decoding. A batch
    of 8 is smaller than the block: llama.cpp keeps a block's snapshots in one micro-batch, so the
    runtime raises the batch to the block size + 1 (the pinned llama.cpp asserts otherwise)."""
    target, draft = tilted(family)
    rt = dflash_llama.Runtime(target, draft, n_threads=1, n_ctx=48, n_batch=8)
    plain = dflash_llama.Runtime(target, n_threads=1, n_ctx=48)
    ha = rt.tokenize(" ha")[-1]
    for prompt in PROMPTS[:10]:
        expected = plain.autoregressive(prompt, max_new_tokens=200).tokens
        stopped = plain.autoregressive(prompt, max_new_tokens=40, stop_tokens=[ha]).tokens
        for draft_max in DRAFT_MAX:
            full = rt.generate(prompt, max_new_tokens=200, draft_max=draft_max)
            assert full.tokens == expected, (family, prompt, draft_max)
            assert full.stop_reason == "context_full" and len(rt.tokenize(prompt)) + len(full.tokens) == 48
            assert rt.generate(prompt, max_new_tokens=40, stop_tokens=[ha], draft_max=draft_max).tokens == stopped


def test_the_reference_rolls_back_a_recurrent_cache(qwen35_hf):
    """transformers' crop cuts only the convolution window of a linear-attention layer; the
    reference restores the state before the last forward and runs the kept tokens again."""
    import torch

    from dflash_llama.reference import Target

    target = Target.load(qwen35_hf)
    ids = [5, 6, 7, 8, 9, 10]
    rolled = target.new_cache()
    target.forward(ids[:3], 0, rolled)
    target.forward(ids[3:], 3, rolled)
    target.crop(rolled, 4)
    fresh = target.new_cache()
    target.forward(ids[:4], 0, fresh)
    a, b = (target.forward([11], 4, c).logits for c in (rolled, fresh))
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    with pytest.raises(ValueError, match=re.escape("a recurrent cache rolls back within its last forward "
                                                   "(positions 4..4), not to 2")):
        target.crop(rolled, 2)


def test_the_reference_speculative_loop_is_exact_on_a_hybrid_target(tilted):
    """The reference's own DFlash loop on the tilted qwen35 target (transformers, f32) equals its
    plain greedy decoding, through partly accepted blocks."""
    from dflash_llama.reference import Target, generate_autoregressive, generate_speculative, load_draft_for_target

    target_gguf, draft = tilted("qwen35")
    target = Target.load(target_gguf.parent / "hf")
    d = load_draft_for_target(draft, target)
    partial = 0
    for prompt in PROMPTS[:6]:
        ids = target.tokenizer(prompt).input_ids
        spec = generate_speculative(target, d, ids, 32)
        assert spec.tokens == generate_autoregressive(target, ids, 32).tokens, prompt
        partial += sum(0 < s.accepted < len(s.drafted) for s in spec.steps)
    assert partial >= 5


def test_an_mrope_draft_ropes_as_the_same_draft_without_sections(qwen35_hf, qwen35_gguf, tmp_path):
    """Drafts for M-RoPE targets carry `dflash.rope.dimension_sections` [head_dim/2, 0, 0, 0] (our
    converter writes it for a qwen35 target): every frequency ropes with the temporal position, so
    the draft computes exactly what it computes without the key."""
    import numpy as np

    from dflash_llama import gguf_info
    from dflash_llama.parity.gguf_edit import copy_gguf

    target = qwen35_gguf
    draft_hf = fixtures.tiny_draft_hf(tmp_path / "draft_hf", qwen35_hf, fixtures.TinyDraftConfig(
        layers=2, block_size=8, target_layer_ids=[1, 2], dtype="float32"))
    with_sections = convert(draft_hf, target, tmp_path / "mrope.gguf", outtype="f32")
    assert gguf_info(with_sections).get("rope.dimension_sections") == [8, 0, 0, 0]
    without = copy_gguf(with_sections, tmp_path / "plain.gguf", kv={"dflash.rope.dimension_sections": None})
    assert gguf_info(without).get("rope.dimension_sections") is None

    features = np.random.default_rng(0).standard_normal((5, 2 * 64)).astype(np.float32)
    block = [7, 0, 0, 0, 0, 0, 0, 0]
    traces = [dflash_llama.Runtime(target, d, n_threads=1, n_ctx=64, compact_draft_head=False).trace_draft(
        features, block) for d in (with_sections, without)]
    assert traces[0].keys() == traces[1].keys()
    for name in traces[0]:
        assert np.array_equal(traces[0][name], traces[1][name]), name


def test_a_draft_with_other_mrope_sections_is_refused(qwen35_hf, qwen35_gguf, tmp_path):
    """Sections beyond the temporal one would rope some frequencies with a text token's height,
    width or extra position: the runtime and the reference refuse them, one line."""
    from dflash_llama.parity.gguf_edit import copy_gguf
    from dflash_llama.reference import load_draft

    target = qwen35_gguf
    draft_hf = fixtures.tiny_draft_hf(tmp_path / "draft_hf", qwen35_hf, fixtures.TinyDraftConfig(
        layers=1, block_size=8, target_layer_ids=[1]))
    good = convert(draft_hf, target, tmp_path / "mrope.gguf", outtype="f32")
    bad = copy_gguf(good, tmp_path / "sections.gguf", kv={"dflash.rope.dimension_sections": [4, 2, 2, 0]})
    message = (f"{bad}: 'dflash.rope.dimension_sections' is [4, 2, 2, 0]: only the temporal M-RoPE section is "
               "supported ([n, 0, 0, 0], as drafts for M-RoPE targets carry)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dflash_llama.Runtime(target, bad, n_threads=1, n_ctx=64)
    with pytest.raises(ValueError, match=re.escape("'dflash.rope.dimension_sections' = [4, 2, 2, 0]: only the "
                                                   "temporal M-RoPE section is supported")):
        load_draft(bad)
