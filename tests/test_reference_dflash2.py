"""The PyTorch DFlash 2 draft (grouped dynamic convolutions, candidate selector) against the published
`dflash==0.1.0`: draft forwards, walks and whole greedy generations; its identity against DFlash 1,
its traces, the sampled walk and lossless acceptance over it; its checkpoint formats and GGUF."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from test_reference_speculative import OracleDraft, chi_square_p, oracle_logits, random_prompts, two_token_marginals

from dflash_llama import fixtures
from dflash_llama.reference import (
    Sampling,
    Target,
    generate_autoregressive,
    generate_speculative,
    load_draft,
    load_draft_for_target,
)

dm = pytest.importorskip("dflash.model")  # the published reference, installed --no-deps

torch.set_num_threads(1)
SLIDING, FULL = "sliding_attention", "full_attention"
D2 = dict(variant="dflash2", identity_conv=False)

# conv_kernel_size 1..4, group size 16 / 32 / 64 (hidden 64), ranks, top-K, blocks 4 / 8 / 16,
# sliding layers causal by the published rule (no is_causal) and one draft with is_causal false
CONFIGS = {
    "k1_g16_block8": fixtures.TinyDraftConfig(
        **D2, conv_kernel_size=1, conv_group_size=16, selector_rank=16, selector_top_k=4, block_size=8,
        target_layer_ids=[1, 3], seed=21),
    "k2_g64_block16_window_not_causal": fixtures.TinyDraftConfig(
        **D2, conv_kernel_size=2, conv_group_size=64, selector_rank=32, selector_top_k=8, block_size=16,
        layers=2, layer_types=[SLIDING, SLIDING], sliding_window=6, target_layer_ids=[0, 2, 3], seed=22,
        extra_config={"is_causal": False, "output_multiplier": 0.7, "final_logit_softcapping": 6.0}),
    "k3_g32_block4_sliding_causal": fixtures.TinyDraftConfig(
        **D2, conv_kernel_size=3, conv_group_size=32, selector_rank=8, selector_top_k=2, block_size=4,
        layers=2, heads=4, kv_heads=1, layer_types=[SLIDING, FULL], sliding_window=3, seed=23),
    "k4_g16_block16": fixtures.TinyDraftConfig(
        **D2, conv_kernel_size=4, conv_group_size=16, selector_rank=4, selector_top_k=5, block_size=16,
        target_layer_ids=[2], seed=24),
}
# (draft, block size override: the published loop's truncation, stop at the k-th target token)
GENERATIONS = {"k1_g16_block8": (None, None), "k2_g64_block16_window_not_causal": (None, 12),
               "k3_g32_block4_sliding_causal": (None, None), "k4_g16_block16": (3, 7)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def drafts(tiny_target_hf, tmp_path_factory) -> dict:
    return {name: fixtures.tiny_draft_hf(tmp_path_factory.mktemp(f"dflash2_{name}"), tiny_target_hf, cfg)
            for name, cfg in CONFIGS.items()}


@pytest.fixture(scope="module")
def loaded(drafts, reference_target) -> dict:
    """Ours and the published model of every draft."""
    return {name: (load_draft_for_target(d, reference_target),
                   dm.DFlash2DraftModel.from_pretrained(d, dtype=torch.float32).eval())
            for name, d in drafts.items()}


@pytest.fixture(scope="module")
def features(reference_target) -> torch.Tensor:
    """Every hidden state of the tiny target over a 12-token prompt."""
    with torch.inference_mode():
        out = reference_target.model(torch.tensor([[1604, 3987, 24, 94, 727, 55, 66, 77, 88, 99, 11, 12]]),
                                     output_hidden_states=True)
    return out.hidden_states


class BoostedDraft(OracleDraft):
    """Our draft whose walk reads `oracle_logits`: the target's own continuation made the favourite
    of the first few slots, so blocks are accepted, partly or wholly (the forward and cache still run)."""

    def propose(self, ctx_feat, block, start, cache=None, **walk):
        y = self.draft.block_states(ctx_feat, block, start, cache)
        logits = oracle_logits(self.draft.block_logits(y), start, self.reference)
        return self.draft.candidate_selector.walk(y[1:], logits, int(block[0]), **walk)


def run_published(model, hf_target, prompt, n, monkeypatch, *, block_size=None, stop=None, reference=None):
    """dflash_generate (greedy), recording the walk of every step (its `propose`)."""
    state, drafted = {}, []
    forward, compute_logits, propose = model.forward, model.compute_logits, model.propose

    def recording_forward(**kw):
        state["start"] = int(kw["position_ids"][0, -1]) - kw["noise_embedding"].shape[1] + 1
        return forward(**kw)

    def oracle_compute_logits(hidden, head):
        logits = compute_logits(hidden, head)
        return logits if reference is None else oracle_logits(logits[0], state["start"], reference)[None]

    def recording_propose(*args):
        tokens, candidates, q = propose(*args)
        drafted.append(tokens[0].tolist())
        return tokens, candidates, q

    monkeypatch.setattr(model, "forward", recording_forward)
    monkeypatch.setattr(model, "compute_logits", oracle_compute_logits)
    monkeypatch.setattr(model, "propose", recording_propose)
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # it syncs CUDA for its stats
    r = dm.dflash_generate(model, hf_target, torch.tensor([prompt]), n, stop, block_size=block_size,
                           return_stats=True)
    return r.output_ids[0, len(prompt):].tolist(), drafted, r.acceptance_lengths


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dflash2_matches_published(name, loaded, features, reference_target, monkeypatch):
    ours, ref = loaded[name]
    assert (ours.block_size, ours.target_layer_ids) == (ref.block_size, ref.target_layer_ids)
    # the sliding layers' mask: causal unless is_causal says otherwise, in both
    assert [(la.is_causal, la.window) for la in ours.layers] == [
        (la.self_attn.is_causal, la.self_attn.sliding_window) for la in ref.layers]
    hf, head = reference_target.model, dm._output_head(reference_target.model)

    # three draft forwards through the caches: logits, candidate sets and walks
    feats = dm.extract_context_feature(features, ref.target_layer_ids)[0]
    ref_cache, our_cache, seen = dm._make_cache(ref.config), ours.new_cache(), 0
    g = torch.Generator().manual_seed(len(name))
    for start in (6, 9, 10):
        block = torch.full((ours.block_size,), ours.mask_token_id)
        block[0] = int(torch.randint(3, 49152, (1,), generator=g))
        with torch.inference_mode():
            noise = dm._raw_input_embeddings(hf, block[None], 1.0)
            positions = torch.arange(seen, start + len(block))[None]
            hidden = ref(target_hidden=feats[None, seen:start], noise_embedding=noise, position_ids=positions,
                         past_key_values=ref_cache, use_cache=True)[:, 1 - len(block):]
            dm._crop_to(ref_cache, start)
            expected_logits = ref.compute_logits(hidden, head)[0]
            expected, candidates, _ = ref.propose(hidden, block[:1], head, 0.0)
            trace: dict = {}
            walk = ours.propose(feats[seen:start], block, start, our_cache, trace=trace)
        assert rel(ours.block_logits(trace["result_norm"]), expected_logits) <= 1e-5, (name, start)
        assert walk.tokens.tolist() == expected[0].tolist(), (name, start)
        assert walk.candidates.sort().values.tolist() == candidates[0].sort().values.tolist()
        seen = start

    # whole greedy generations: a random draft, then one whose walks the target often accepts
    block_size, stop_at = GENERATIONS[name]
    for i, prompt in enumerate(random_prompts(2, seed=len(name))):
        ar = generate_autoregressive(reference_target, prompt, 30).tokens
        reference = prompt + ar if i == 1 else None
        stop = None if stop_at is None else [ar[stop_at]]
        tokens, drafted, lengths = run_published(ref, hf, prompt, 30, monkeypatch, block_size=block_size,
                                                 stop=stop, reference=reference)
        draft = ours if reference is None else BoostedDraft(ours, reference)
        result = generate_speculative(reference_target, draft, prompt, 30, block_size=block_size,
                                      stop_token_ids=stop or ())
        assert result.tokens == tokens == (ar if stop is None else ar[:ar.index(stop[0]) + 1]), (name, i)
        assert [s.drafted for s in result.steps] == drafted
        assert [s.produced for s in result.steps] == lengths
        assert all(len(s.drafted) <= (block_size or ours.block_size) - 1 for s in result.steps)
        if reference is not None:
            assert max(s.accepted for s in result.steps) >= 2


@torch.inference_mode()
def test_identity_convolutions_are_dflash1(tiny_target_hf, reference_target, tmp_path):
    """Identity convolutions (tap 0 one, projections zero): exactly DFlash 1's logits from the same
    backbone, and the walk's candidates are DFlash 1's top-K."""
    from safetensors.torch import load_file, save_file

    cfg = fixtures.TinyDraftConfig(variant="dflash2", identity_conv=True, layers=2, conv_kernel_size=3,
                                   selector_top_k=6, target_layer_ids=[1, 3], seed=25)
    d2 = fixtures.tiny_draft_hf(tmp_path / "dflash2", tiny_target_hf, cfg)
    d1 = tmp_path / "dflash1"
    d1.mkdir()
    config = json.loads((d2 / "config.json").read_text())
    config["architectures"] = ["DFlashDraftModel"]
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        del config["dflash_config"][key]
    (d1 / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in load_file(d2 / "model.safetensors").items()
               if not any(h in k for h in ("attention_conv", "mlp_conv", "candidate_selector"))},
              str(d1 / "model.safetensors"))
    two, one = load_draft_for_target(d2, reference_target), load_draft_for_target(d1, reference_target)
    assert two.candidate_selector is not None and one.candidate_selector is None
    with pytest.raises(ValueError, match="a DFlash 1 draft has no candidate selector: its tokens come from"):
        one.propose(torch.zeros(0, 128), [5, 0], 0)

    feat = torch.randn(9, 128, generator=torch.Generator().manual_seed(3))
    block = [5] + [0] * 7
    c1, c2 = one.new_cache(), two.new_cache()
    for seen, start in ((0, 6), (6, 9)):
        trace: dict = {}
        logits = one(feat[seen:start], block, start, c1)
        assert torch.equal(two(feat[seen:start], block, start, c2, trace=trace), logits)
        assert torch.equal(trace["attn_conv_in-1"], trace["noise_norm-1"])
    walk = two.propose(feat, block, 9)
    assert torch.equal(walk.candidates, logits.topk(6).indices)  # no ties here: topk's order is ours


@torch.inference_mode()
def test_trace_names_the_dflash2_intermediates(loaded):
    draft = loaded["k3_g32_block4_sliding_causal"][0]
    cfg = draft.config
    feat = torch.randn(5, cfg.n_taps * cfg.n_embd, generator=torch.Generator().manual_seed(4))
    block = [17, 0, 0, 0]
    trace: dict = {}
    walk = draft.propose(feat, block, 5, trace=trace)
    assert torch.equal(draft.propose(feat, block, 5).tokens, walk.tokens)  # tracing changes nothing

    h, b, n, k, dyn = cfg.n_embd, 4, 3, cfg.selector_top_k, 2 * cfg.conv_kernel_size * 2
    shapes = {"selector_unary": (n, k), "selector_candidates": (n, k), "selector_gate": (n, cfg.selector_rank),
              "selector_scores": (n, k, k), "selector_path": (n,)}
    for il in range(cfg.n_layer):
        shapes.update({f"{s}_conv_dyn-{il}": (b, dyn) for s in ("attn", "ffn")})
        shapes.update({f"{s}-{il}": (b, h) for s in ("attn_conv_in", "attn_conv_out", "ffn_conv_in", "ffn_conv_out")})
    assert {name: tuple(trace[name].shape) for name in shapes} == shapes

    # the op order: q/k/v read the convolved noise_norm; the output sides feed the residuals
    layer = draft.layers[1]
    conv, a = layer.attention_conv, layer.self_attn
    assert torch.equal(trace["attn_conv_dyn-1"], conv.kernel_projection(trace["noise_norm-1"]))
    assert torch.equal(trace["attn_conv_in-1"], conv(trace["noise_norm-1"], trace["attn_conv_dyn-1"], 0))
    assert torch.equal(trace["Vcur-1"], a.v_proj(trace["attn_conv_in-1"]).view(b, 1, 16))
    assert torch.equal(trace["ffn_inp-1"], trace["l_out-0"] + trace["attn_conv_out-1"])
    assert torch.equal(trace["ffn_conv_out-1"], layer.mlp_conv(trace["ffn_out-1"], trace["ffn_conv_dyn-1"], 1))
    assert torch.equal(trace["l_out-1"], trace["ffn_inp-1"] + trace["ffn_conv_out-1"])
    # the convolution's formula, one channel of the last position written out (3 taps, group 32)
    y, d = trace["ffn_out-1"], trace["ffn_conv_dyn-1"].view(b, 2, 3, 2)
    base = layer.mlp_conv.base_kernel
    c = 40  # group 1
    expected = sum((base[1, t, c] + d[3, 1, t, 1]) * y[3 - t, c] for t in range(3))
    assert float(trace["ffn_conv_out-1"][3, c]) == pytest.approx(float(expected), rel=1e-5)
    # position 0, the anchor, has no predecessor: only tap 0
    assert float(trace["ffn_conv_out-1"][0, c]) == pytest.approx(float((base[1, 0, c] + d[0, 1, 0, 1]) * y[0, c]))

    # the selector: candidates by logit, gate from result_norm, scores, the walk
    unary, cand, scores = trace["selector_unary"], trace["selector_candidates"], trace["selector_scores"]
    logits = draft.block_logits(trace["result_norm"])  # finished, as the walk reads them
    assert torch.allclose(logits, trace["result_output"][1:], rtol=1e-5, atol=1e-5)  # multiplier 1 here
    assert torch.equal(unary, logits.gather(-1, cand)) and (unary[:, :-1] >= unary[:, 1:]).all()
    assert torch.equal(unary[:, -1:], logits.topk(k).values[:, -1:])
    sel = draft.candidate_selector
    assert torch.equal(trace["selector_gate"], sel.hidden_projection(trace["result_norm"][1:]))
    assert (scores[0] == scores[0, :1]).all()  # the anchor's row, repeated
    gate = trace["selector_gate"]
    for slot, pred in ((0, 17), (2, int(cand[1, 1]))):
        row = 0 if slot == 0 else 1
        want = unary[slot] + (sel.predecessor_codebook[pred] * gate[slot]) @ sel.successor_codebook[cand[slot]].T
        assert torch.allclose(scores[slot, row], want, rtol=1e-5, atol=1e-5)
    index = 0
    for slot in range(n):
        index = int(scores[slot, index].argmax())
        assert int(trace["selector_path"][slot]) == int(cand[slot, index])
    assert torch.equal(trace["selector_path"], walk.tokens) and walk.q is None and walk.probs is None


@torch.inference_mode()
def test_sampled_walk_draws_from_its_q_rows(loaded):
    draft = loaded["k2_g64_block16_window_not_causal"][0]
    feat = torch.randn(4, 3 * 64, generator=torch.Generator().manual_seed(5))
    block = [321] + [0] * 15
    trace: dict = {}
    walk = draft.propose(feat, block, 4, temperature=0.8, generator=torch.Generator().manual_seed(7),
                         trace=trace)
    assert walk.q.shape == walk.candidates.shape == (15, 8)
    assert torch.allclose(walk.q.sum(-1), torch.ones(15), atol=1e-6)
    g, index = torch.Generator().manual_seed(7), 0
    for slot in range(15):  # each row is softmax(scores / T) after the token drawn before it
        assert torch.allclose(walk.q[slot], torch.softmax(trace["selector_scores"][slot, index] / 0.8, -1))
        index = int(torch.multinomial(walk.q[slot], 1, generator=g))
        assert int(walk.tokens[slot]) == int(walk.candidates[slot, index])
    assert torch.equal(walk.probs.gather(-1, walk.candidates), walk.q)
    assert torch.allclose(walk.probs.sum(-1), torch.ones(15), atol=1e-6)
    again = draft.propose(feat, block, 4, temperature=0.8, generator=torch.Generator().manual_seed(7))
    assert torch.equal(again.tokens, walk.tokens)
    other = draft.propose(feat, block, 4, temperature=0.8, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(other.tokens, walk.tokens)


@torch.inference_mode()
def test_speculative_sampling_over_the_walk_is_lossless(tmp_path):
    """A 12-token target and a DFlash 2 draft for it: the marginals of tokens 2 and 3 after one verify of
    2 walked tokens match the target's exact ones (temperature, top-k, top-p on)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 initializer_range=0.2, tie_word_embeddings=False)).save_pretrained(tmp_path / "t")
    target = Target.load(tmp_path / "t")
    draft = load_draft_for_target(fixtures.tiny_draft_hf(tmp_path / "d", tmp_path / "t", fixtures.TinyDraftConfig(
        variant="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=3, block_size=3, head_dim=8,
        ffn=64, init_std=0.3, seed=8)), target)
    s = Sampling(temperature=1.5, top_p=0.95, top_k=8)
    prompt = [3, 7, 1]
    p0, marginal1, marginal2 = two_token_marginals(target, prompt, s)

    counts1, counts2 = torch.zeros(12, dtype=torch.long), torch.zeros(12, dtype=torch.long)
    trials, accepted = 800, 0
    for seed in range(trials):
        r = generate_speculative(target, draft, prompt, 3, sampling=Sampling(s.temperature, s.top_p, s.top_k,
                                                                             seed=seed))
        counts1[r.tokens[1]] += 1
        counts2[r.tokens[2]] += 1
        accepted += r.steps[0].accepted
    assert accepted > trials // 10  # the walk's tokens are often kept: acceptance is tested
    assert chi_square_p(counts1, marginal1) > 1e-3
    assert chi_square_p(counts2, marginal2) > 1e-3
    assert chi_square_p(counts1, p0) < 1e-3  # power: a wrong distribution is rejected


@torch.inference_mode()
def test_reduced_vocabulary_walks_its_tokens(drafts, loaded, reference_target):
    """A d2t draft: candidates among its tokens, the walk the full draft takes over logits -inf elsewhere."""
    full = loaded["k1_g16_block8"][0]
    d2t = torch.arange(3, 49152, 7)
    reduced = load_draft(drafts["k1_g16_block8"])
    reduced.set_vocabulary(d2t)
    reduced.attach_target(reference_target.embed_tokens, reference_target.lm_head)
    feat = torch.randn(5, 2 * 64, generator=torch.Generator().manual_seed(6))
    block = [99] + [0] * 7
    walk = reduced.propose(feat, block, 5)
    y = full.block_states(feat, block, 5)
    masked = torch.full((7, 49152), float("-inf"))
    masked[:, d2t] = full.block_logits(y)[:, d2t]
    assert torch.isin(walk.candidates, d2t).all()
    assert torch.equal(walk.tokens, full.candidate_selector.walk(y[1:], masked, 99).tokens)
    with pytest.raises(ValueError, match=r"selector_top_k 4 is larger than the draft vocabulary \(3 tokens\)"):
        reduced.set_vocabulary(torch.tensor([1, 2, 3]))


def _same_parameters(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_checkpoint_formats_load_alike(drafts, loaded, reference_target, tmp_path):
    """The published package's own save (a model built in memory writes its codebooks with
    `.weight`), speculators' format, and a checkpoint with both spellings (refused)."""
    from safetensors.torch import load_file, save_file

    name = "k2_g64_block16_window_not_causal"
    ours, ref = loaded[name]
    fresh = dm.DFlash2DraftModel(ref.config)  # one from from_pretrained saves its loading names back
    fresh.load_state_dict(ref.state_dict())
    fresh.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert "candidate_selector.successor_codebook.weight" in saved
    _same_parameters(load_draft(tmp_path / "saved"), ours)

    # speculators: the Qwen3 fields in transformer_layer_config, the DFlash 2 keys at the top level
    z = json.loads((drafts[name] / "config.json").read_text())
    layer = {k: v for k, v in z.items() if k not in ("dflash_config", "architectures", "block_size",
                                                   "num_target_layers", "is_causal")}
    spec = {"speculators_model_type": "dflash2", "architectures": ["DFlash2DraftModel"],
            "transformer_layer_config": layer, "draft_vocab_size": z["vocab_size"], "block_size": 16,
            "aux_hidden_state_layer_ids": [1, 3, 4], "mask_token_id": 0, "target_hidden_size": 64,
            "conv_kernel_size": 2, "conv_group_size": 64, "selector_rank": 32, "selector_top_k": 8}
    d = tmp_path / "speculators"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(spec))
    shutil.copy(drafts[name] / "model.safetensors", d)
    other = load_draft_for_target(d, reference_target)
    _same_parameters(other, ours)
    assert (other.config.variant.name, other.config.causal, other.target_layer_ids,
            other.config.conv_group_size, other.config.selector_top_k) == ("dflash2", False, [0, 2, 3], 64, 8)
    # output_multiplier / softcap are not speculators fields: compare the backbone before them
    feat = torch.randn(3, 3 * 64, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        assert torch.equal(other.block_states(feat, [5] + [0] * 15, 3), ours.block_states(feat, [5] + [0] * 15, 3))

    saved["candidate_selector.successor_codebook"] = saved["candidate_selector.successor_codebook.weight"].clone()
    save_file(saved, str(tmp_path / "saved" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor candidate_selector\.successor_codebook is there twice "
                                         r"\(also as candidate_selector\.successor_codebook(\.weight)?\)"):
        load_draft(tmp_path / "saved")


@torch.inference_mode()
def test_pinned_converter_gguf_loads_alike(drafts, loaded, tiny_target_hf, tmp_path):
    """A DFlash 2 draft converted by the pinned llama.cpp converter: its names, the same draft."""
    name = "k2_g64_block16_window_not_causal"
    out = tmp_path / "dflash2-f32.gguf"
    fixtures.run_pinned_converter([str(drafts[name]), "--target-model-dir", str(tiny_target_hf),
                                   "--outfile", str(out), "--outtype", "f32"])
    ours = loaded[name][0]
    gguf = load_draft(out, ours.embed_tokens, ours.lm_head)
    _same_parameters(gguf, ours)
    c, h = gguf.config, ours.config
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k, c.causal, c.swa_layers,
            c.sliding_window) == (h.conv_kernel_size, h.conv_group_size, h.selector_rank, h.selector_top_k,
                                  h.causal, h.swa_layers, h.sliding_window)
    assert (c.logit_scale, c.logit_softcap) == pytest.approx((h.logit_scale, h.logit_softcap))  # as float32
    feat = torch.randn(4, 3 * 64, generator=torch.Generator().manual_seed(9))
    block = [77] + [0] * 15
    assert rel(gguf(feat, block, 4), ours(feat, block, 4)) <= 1e-6
    assert torch.equal(gguf.propose(feat, block, 4).tokens, ours.propose(feat, block, 4).tokens)
