"""The PyTorch DSpark draft (Markov head, confidence head, both block layouts) against the published
`speculators==0.9.0` DSpark heads; its chain and traces, whole greedy generations equal to the
target's, the confidence cut-off, lossless sampling over the Markov-biased distributions, and a zero
Markov head in DFlash's layout giving DFlash 1's drafts.

speculators 0.9.0 does not import beside our pins: `speculators/__init__.py` imports its trainer
(openai, datasets, loguru, pydantic_settings, hs_connectors, ...), and it pins transformers <= 5.19
and torchvision / torchaudio. Its DSpark heads (`models/dspark/model_definitions.py`: MarkovHead,
ConfidenceHead) need torch only: that file is loaded by path from the installed distribution, and
the published training forward's use of them (`models/dspark/core.py`: teacher-forced predecessors,
`[hidden ; W1 row]` features) is followed here with the chain's own drafts as the teacher."""

from __future__ import annotations

import json
from importlib import metadata, util

import pytest
import torch
from test_reference_speculative import OracleDraft, chi_square_p, random_prompts, two_token_marginals

from dflash_llama import fixtures
from dflash_llama.reference import (
    Sampling,
    Target,
    generate_autoregressive,
    generate_speculative,
    load_draft_for_target,
)

torch.set_num_threads(1)
DS = dict(variant="dspark", target_layer_ids=[1, 3])
# rank, block size, confidence head, block layout, depth: four random drafts
CONFIGS = {
    "r16_block8_conf_anchor_first": fixtures.TinyDraftConfig(**DS, markov_rank=16, block_size=8, seed=31),
    "r8_block4_anchor_first": fixtures.TinyDraftConfig(**DS, markov_rank=8, block_size=4, confidence_head=False,
                                                       layers=2, seed=32),
    "r32_block6_conf_dflash_layout": fixtures.TinyDraftConfig(**DS, markov_rank=32, block_size=6,
                                                              sample_from_anchor=False, seed=33),
    "r4_block16_dflash_layout": fixtures.TinyDraftConfig(**DS, markov_rank=4, block_size=16, confidence_head=False,
                                                         sample_from_anchor=False, seed=34),
}


def published_heads():
    """speculators 0.9.0's MarkovHead and ConfidenceHead (its dspark/model_definitions.py)."""
    try:
        dist = metadata.distribution("speculators")
    except metadata.PackageNotFoundError:
        pytest.skip("speculators==0.9.0 is not installed (./setup.sh installs it --no-deps)")
    assert dist.version == "0.9.0"
    spec = util.spec_from_file_location("published_dspark_heads",
                                        dist.locate_file("speculators/models/dspark/model_definitions.py"))
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def loaded(tiny_target_hf, reference_target, tmp_path_factory) -> dict:
    """Ours and the published heads (their own weights, from the checkpoint) of every draft."""
    from safetensors.torch import load_file

    heads = published_heads()
    out = {}
    for name, cfg in CONFIGS.items():
        d = fixtures.tiny_draft_hf(tmp_path_factory.mktemp(f"dspark_{name}"), tiny_target_hf, cfg)
        weights = load_file(d / "model.safetensors")
        markov = heads.MarkovHead(verifier_vocab_size=49152, draft_vocab_size=49152, markov_rank=cfg.markov_rank,
                                  hidden_size=64)
        markov.load_state_dict({k.removeprefix("markov_head."): v.float() for k, v in weights.items()
                                if k.startswith("markov_head.")})
        conf = None
        if cfg.confidence_head:
            conf = heads.ConfidenceHead(64 + cfg.markov_rank)
            conf.load_state_dict({k.removeprefix("confidence_head."): v.float() for k, v in weights.items()
                                  if k.startswith("confidence_head.")})
        # DeepSpec's drafts score with their own copy of the target's head (here bf16-rounded)
        out[name] = load_draft_for_target(d, reference_target), markov.eval(), conf, weights["lm_head.weight"].float()
    return out


@torch.inference_mode()
def published_block(markov, conf, hidden, base, block_tokens, anchor_first):
    """The published forward's heads over one block: its predecessors from the block's tokens
    (anchor-first: slot k after block token k; else after token k - 1, slot 0 after the anchor),
    the biased logits and the confidences (sigmoid of its logit)."""
    prev = block_tokens if anchor_first else torch.cat([block_tokens[:1], block_tokens[:-1]])
    prev_emb = markov.prev_embeddings(prev[None])
    logits = base[None] + markov.block_bias(prev_token_ids=prev[None], hidden_states=hidden[None], prev_emb=prev_emb)
    confidence = None if conf is None else torch.sigmoid(conf(torch.cat([hidden[None], prev_emb], -1)))[0]
    return logits[0], confidence


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.inference_mode()
def test_dspark_matches_published(name, loaded, reference_target, monkeypatch):
    ours, markov, conf, head = loaded[name]
    cfg = ours.config
    assert (cfg.markov_rank, cfg.has_confidence_head, cfg.sample_from_anchor) == (
        CONFIGS[name].markov_rank, CONFIGS[name].confidence_head, CONFIGS[name].sample_from_anchor)
    feat = torch.randn(10, 2 * 64, generator=torch.Generator().manual_seed(len(name)))
    cache, seen = ours.new_cache(), 0
    for start in (5, 8, 10):  # three drafts through the cache
        block = torch.full((cfg.block_size,), cfg.mask_token_id)
        block[0] = 1000 + 37 * start
        trace: dict = {}
        chain = ours.draft_chain(feat[seen:start], block, start, cache, trace=trace)
        seen = start
        hidden = trace["result_norm"]  # every block position
        # the published heads, teacher-forced with the chain's drafts as the block's tokens
        tokens = torch.cat([block[:1], chain.tokens])[:cfg.block_size]
        logits, confidence = published_block(markov, conf, hidden, hidden @ head.T, tokens, cfg.sample_from_anchor)
        slots = slice(0 if cfg.sample_from_anchor else 1, None)
        assert chain.tokens.shape == (cfg.n_drafted,)
        assert rel(chain.logits, logits[slots]) <= 1e-5, (name, start)
        assert torch.equal(logits[slots].argmax(-1), chain.tokens), (name, start)  # the same greedy drafts
        if conf is not None:
            assert float((chain.confidence - confidence[slots]).abs().max()) <= 1e-6
        assert (chain.logits.argmax(-1) != ours.block_logits(hidden, first=slots.start).argmax(-1)).any() or \
            name == "r4_block16_dflash_layout"  # the bias moves some slot's argmax

    # whole greedy generations: the target's own tokens, a random chain and one often accepted
    for i, prompt in enumerate(random_prompts(2, seed=len(name))):
        ar = generate_autoregressive(reference_target, prompt, 24).tokens
        draft = ours if i == 0 else BoostedChain(ours, prompt + ar)
        result = generate_speculative(reference_target, draft, prompt, 24)
        assert result.tokens == ar, (name, i)
        assert all(len(s.drafted) <= cfg.n_drafted for s in result.steps)
        if i == 1:
            assert max(s.accepted for s in result.steps) >= 2 and cfg.n_drafted in [len(s.drafted) for s in
                                                                                    result.steps]
            if cfg.sample_from_anchor:  # an anchor-first step can produce B + 1 tokens
                assert max(s.produced for s in result.steps) <= cfg.block_size + 1
        if conf is not None:  # the confidence cut-off: shorter drafts, the same tokens
            cut = generate_speculative(reference_target, draft, prompt, 24, confidence_threshold=0.8)
            assert cut.tokens == ar
            assert sum(len(s.drafted) for s in cut.steps) < sum(len(s.drafted) for s in result.steps)


class BoostedChain(OracleDraft):
    """Our DSpark draft whose chain favours the target's own continuation for its first k slots (k
    from 0 to all, by position), so blocks are accepted, partly or wholly; the heads still run."""

    def draft_chain(self, ctx_feat, block, start, cache=None, *, pick, trace=None):
        cfg = self.draft.config
        n = len(block) if cfg.sample_from_anchor else len(block) - 1
        k, slot = (7 * start + 3) % (n + 1), iter(range(n))

        def boosted(row):
            j = next(slot)
            if j < k and start + 1 + j < len(self.reference):
                row = row.clone()
                row[self.reference[start + 1 + j]] = row.max() + 10.0
            return pick(row)

        return self.draft.draft_chain(ctx_feat, block, start, cache, pick=boosted, trace=trace)


@torch.inference_mode()
def test_trace_names_the_dspark_intermediates(loaded):
    """The chain written out for one slot: markov_bias, biased_logits and confidence by the
    paper's formulas (eqs. 4, 5, 7), slot by slot after the token drafted before it."""
    ours = loaded["r16_block8_conf_anchor_first"][0]
    feat = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    block = [321] + [0] * 7
    trace: dict = {}
    chain = ours.draft_chain(feat, block, 4, trace=trace)
    assert torch.equal(ours.draft_chain(feat, block, 4).tokens, chain.tokens)  # tracing changes nothing
    n, v = 8, 49152
    assert {k: tuple(trace[k].shape) for k in ("markov_prev", "markov_bias", "biased_logits", "confidence")} == {
        "markov_prev": (n,), "markov_bias": (n, v), "biased_logits": (n, v), "confidence": (n,)}
    assert trace["markov_prev"].tolist() == [321] + chain.tokens[:-1].tolist()
    w1, w2 = ours.markov_head.markov_w1.weight, ours.markov_head.markov_w2.weight
    proj = ours.confidence_head.proj
    h = trace["result_norm"]
    for k in (0, 5):
        prev = int(trace["markov_prev"][k])
        bias = w2 @ w1[prev]
        assert torch.allclose(trace["markov_bias"][k], bias, rtol=1e-5, atol=1e-5)
        assert torch.allclose(trace["biased_logits"][k], trace["result_output"][k] + bias, rtol=1e-5, atol=1e-5)
        assert int(trace["biased_logits"][k].argmax()) == int(chain.tokens[k])
        c = 1 / (1 + torch.exp(-(proj.weight[0, :64] @ h[k] + proj.weight[0, 64:] @ w1[prev] + proj.bias[0])))
        assert float(trace["confidence"][k]) == pytest.approx(float(c), rel=1e-5)


@torch.inference_mode()
def test_zero_markov_head_in_dflash_layout_is_dflash1(tiny_target_hf, reference_target, tmp_path):
    """A DSpark draft whose Markov head adds nothing, in DFlash's layout: exactly DFlash 1's drafts
    from the same backbone, step by step through a whole generation."""
    from safetensors.torch import load_file, save_file

    cfg = fixtures.TinyDraftConfig(**DS, zero_markov=True, sample_from_anchor=False, block_size=6, seed=35,
                                   dtype="float32")  # its copies of the target's head: exactly the target's
    dspark = load_draft_for_target(fixtures.tiny_draft_hf(tmp_path / "dspark", tiny_target_hf, cfg), reference_target)
    d1 = tmp_path / "dflash1"
    d1.mkdir()
    config = dspark.config.to_hf_config()
    config.update(architectures=["DFlashDraftModel"], dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 3]})
    (d1 / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in load_file(tmp_path / "dspark" / "model.safetensors").items()
               if k.split(".")[0] in ("fc", "hidden_norm", "norm", "layers")}, str(d1 / "model.safetensors"))
    dflash1 = load_draft_for_target(d1, reference_target)
    assert dflash1.config.variant.name == "dflash" and not dflash1.config.sample_from_anchor
    prompt = random_prompts(1, seed=9)[0]
    a = generate_speculative(reference_target, dspark, prompt, 20)
    b = generate_speculative(reference_target, dflash1, prompt, 20)
    assert [s.drafted for s in a.steps] == [s.drafted for s in b.steps] and a.tokens == b.tokens
    assert len(a.steps[0].drafted) == 5  # B - 1: DFlash's layout


@torch.inference_mode()
def test_speculative_sampling_over_the_chain_is_lossless(tmp_path):
    """A 12-token target and an anchor-first DSpark draft of block 2: the marginals of output
    tokens 2 and 3 after one verify of the chain's 2 tokens match the target's exact ones."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(7)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 initializer_range=0.2, tie_word_embeddings=False)).save_pretrained(tmp_path / "t")
    target = Target.load(tmp_path / "t")
    draft = load_draft_for_target(fixtures.tiny_draft_hf(tmp_path / "d", tmp_path / "t", fixtures.TinyDraftConfig(
        variant="dspark", markov_rank=4, block_size=2, head_dim=8, ffn=64, init_std=0.3, seed=8)), target)
    s = Sampling(temperature=1.5, top_p=0.95, top_k=8)
    prompt = [3, 7, 1]
    p0, marginal1, marginal2 = two_token_marginals(target, prompt, s)

    counts1, counts2 = torch.zeros(12, dtype=torch.long), torch.zeros(12, dtype=torch.long)
    trials, accepted = 800, 0
    for seed in range(trials):
        r = generate_speculative(target, draft, prompt, 3, sampling=Sampling(s.temperature, s.top_p, s.top_k,
                                                                             seed=seed))
        assert len(r.steps[0].drafted) == 2  # anchor-first: the block of 2 drafts 2
        counts1[r.tokens[1]] += 1
        counts2[r.tokens[2]] += 1
        accepted += r.steps[0].accepted
    assert accepted > trials // 10
    assert chi_square_p(counts1, marginal1) > 1e-3
    assert chi_square_p(counts2, marginal2) > 1e-3
    assert chi_square_p(counts1, p0) < 1e-3  # power: a wrong distribution is rejected
