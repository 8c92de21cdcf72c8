"""The PyTorch DFlash draft against the published package `dflash==0.1.0`, its loaders and tracing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_llama import fixtures
from dflash_llama.reference import (
    DraftConfig,
    default_target_layer_ids,
    load_draft,
    load_draft_for_target,
    read_hf_config,
)
from dflash_llama.schema import DraftHParams

dm = pytest.importorskip("dflash.model")  # the published reference, installed --no-deps

torch.set_num_threads(1)
PROMPT = [1604, 3987, 24, 94, 727, 55, 66, 77, 88, 99, 11, 12]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def published(draft_dir):
    return dm.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def published_logits(model, hf_target, feat, block, start, cache):
    """One draft forward of the published model the way its dflash_generate drives it."""
    b = block.shape[0]
    noise = dm._raw_input_embeddings(
        hf_target, block[None], float(dm._draft_value(model.config, "input_embedding_scale", 1.0)))
    positions = torch.arange(start - feat.shape[0], start + b)[None]
    hidden = model(target_hidden=feat[None], noise_embedding=noise, position_ids=positions,
                   past_key_values=cache, use_cache=True)[:, 1 - b:, :]
    dm._crop_to(cache, start)
    return model.compute_logits(hidden, dm._output_head(hf_target))[0]


@pytest.mark.parametrize("name", ["gqa4_last_layer_tap", "sliding_default_taps",
                                  "noncausal_window_scales", "one_layer_causal", "linear_rope"])
def test_draft_logits_match_published(name, reference_drafts, reference_target):
    ref = published(reference_drafts[name])
    ours = load_draft_for_target(reference_drafts[name], reference_target)
    assert ours.target_layer_ids == ref.target_layer_ids
    assert ours.block_size == ref.block_size
    hf = reference_target.model
    with torch.inference_mode():
        out = hf(torch.tensor([PROMPT]), output_hidden_states=True)
    feats = dm.extract_context_feature(out.hidden_states, ref.target_layer_ids)[0]

    # three steps through the draft cache: 6 prompt tokens, then 3 and 1 newly accepted ones
    ref_cache, our_cache = dm._make_cache(ref.config), ours.new_cache()
    g = torch.Generator().manual_seed(0)
    b, seen = ours.block_size, 0
    for start in (6, 9, 10):
        feat = feats[seen:start]
        block = torch.full((b,), ours.mask_token_id)
        block[0] = int(torch.randint(3, 49152, (1,), generator=g))
        expected = published_logits(ref, hf, feat, block, start, ref_cache)
        got = ours(feat, block, start, our_cache)
        assert got.shape == expected.shape == (b - 1, 49152)
        assert rel(got, expected) <= 1e-5, (name, start)
        assert len(our_cache) == start
        seen = start


def test_config_reading_rules(reference_drafts):
    cfg = load_draft(reference_drafts["noncausal_window_scales"]).config
    assert (cfg.block_size, cfg.embedding_scale, cfg.logit_scale,
            cfg.logit_softcap) == (5, 1.5, 0.7, 4.0)  # dflash_config wins
    assert cfg.causal is False and cfg.sliding_window == 3
    assert [cfg.layer_is_causal(i) for i in range(2)] == [False, False]
    cfg = load_draft(reference_drafts["sliding_default_taps"]).config
    assert cfg.rope_freq_base == 1e6  # from rope_parameters
    assert cfg.target_layer_ids == [1, 1, 1]  # the default rule for 3 draft layers, 4 target
    assert [cfg.layer_is_causal(i) for i in range(3)] == [False, True, False]
    assert [cfg.layer_window(i) for i in range(3)] == [None, 4, None]
    assert load_draft(reference_drafts["one_layer_causal"]).config.target_layer_ids == [2]


def test_default_target_layer_ids_is_the_published_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-8B-DFlash-b16
    for n_target in (4, 12, 28, 36, 64):
        for n_draft in (1, 2, 3, 5, 6, 8):
            assert default_target_layer_ids(n_target, n_draft) == \
                dm.build_target_layer_ids(n_target, n_draft)


def _base_config(**over) -> dict:
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 100, "num_target_layers": 12,
           "dflash_config": {"mask_token_id": 5}}
    cfg.update(over)
    return cfg


def test_sliding_window_needs_use_sliding_window():
    # transformers' Qwen3Config: without use_sliding_window the window is dropped, the layer
    # types stay, so a "sliding" layer is causal with no window (what the published model does)
    cfg = DraftHParams.from_hf_config(_base_config(layer_types=["sliding_attention", "full_attention"],
                                            sliding_window=8))
    assert cfg.sliding_window is None and cfg.layer_is_causal(0) and cfg.layer_window(0) is None
    cfg = DraftHParams.from_hf_config(_base_config(use_sliding_window=True, sliding_window=8,
                                            max_window_layers=1))
    assert cfg.swa_layers == [False, True]
    assert cfg.layer_window(1) == 8


@pytest.mark.parametrize("over, message", [
    ({"dflash_config": {}}, "no mask_token_id"),
    ({"num_target_layers": None}, "neither target_layer_ids nor num_target_layers"),
    ({"architectures": ["DFlash2DraftModel"]}, "a DFlash 2 config needs dflash_config.conv_kernel_size"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for 2 layers"),
    ({"num_key_value_heads": 3}, "4 attention heads are not a multiple of 3 kv heads"),
])
def test_bad_config_errors(over, message, tmp_path):
    cfg = _base_config(**over)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        read_hf_config(tmp_path)


@torch.no_grad()
def test_trace_records_every_intermediate(reference_drafts, reference_target):
    draft = load_draft_for_target(reference_drafts["gqa4_last_layer_tap"], reference_target)
    cfg: DraftConfig = draft.config
    feat = torch.randn(5, cfg.n_taps * cfg.n_embd, generator=torch.Generator().manual_seed(1))
    block = [17, 0, 0, 0]
    plain = draft(feat, block, 5, draft.new_cache())
    trace: dict = {}
    cache = draft.new_cache()
    traced = draft(feat, block, 5, cache, trace=trace)
    assert torch.equal(plain, traced)  # tracing never changes the result

    h, b, n, d = cfg.n_embd, 4, 5, cfg.head_dim
    shapes = {"fc_out": (n, h), "inp_g_embeddings": (n, h), "inp_noise_embd": (b, h),
              "result_norm": (b, h), "result_output": (b, cfg.n_vocab)}
    for il in range(cfg.n_layer):
        shapes.update({f"Kcur_injected-{il}": (n, cfg.n_head_kv, d),
                       f"Vcur_injected-{il}": (n, cfg.n_head_kv, d),
                       f"noise_norm-{il}": (b, h), f"Qcur-{il}": (b, cfg.n_head, d),
                       f"Kcur-{il}": (b, cfg.n_head_kv, d), f"Vcur-{il}": (b, cfg.n_head_kv, d),
                       f"ffn_inp-{il}": (b, h), f"ffn_norm-{il}": (b, h), f"ffn_out-{il}": (b, h),
                       f"l_out-{il}": (b, h)})
    assert {k: tuple(v.shape) for k, v in trace.items()} == shapes

    # the documented relations between the names
    assert torch.equal(trace["inp_g_embeddings"], draft.hidden_norm(trace["fc_out"]))
    assert torch.equal(trace["inp_noise_embd"], reference_target.embed_tokens[block])
    assert torch.equal(trace["l_out-0"], trace["ffn_inp-0"] + trace["ffn_out-0"])
    assert torch.equal(trace["noise_norm-1"], draft.layers[1].input_layernorm(trace["l_out-0"]))
    assert torch.equal(trace["Kcur_injected-1"], cache.keys[1])  # cached K is after norm + RoPE
    assert torch.equal(trace["result_norm"], draft.norm(trace[f"l_out-{cfg.n_layer - 1}"]))
    assert rel(trace["result_output"][1:], plain) < 1e-6  # raw head logits; multiplier 1 here


@torch.no_grad()
def test_rope_is_applied_to_traced_q_and_k(reference_drafts, reference_target):
    """Qcur / Kcur are recorded after RoPE: at position 0 RoPE is the identity."""
    draft = load_draft_for_target(reference_drafts["gqa4_last_layer_tap"], reference_target)
    a = draft.layers[0].self_attn
    feat = torch.zeros(0, draft.config.n_taps * draft.config.n_embd)
    for start, same in ((0, True), (3, False)):
        trace: dict = {}
        draft(feat, [17, 0, 0, 0], start, trace=trace)
        normed = a.q_norm(a.q_proj(trace["noise_norm-0"]).view(4, 8, 8))
        assert torch.equal(trace["Qcur-0"][0], normed[0]) is same


@torch.no_grad()
def test_draft_cache_crop_rolls_back(reference_drafts, reference_target):
    draft = load_draft_for_target(reference_drafts["sliding_default_taps"], reference_target)
    feat = torch.randn(9, draft.config.n_taps * 64, generator=torch.Generator().manual_seed(2))
    block = [5] + [0] * 7
    cache = draft.new_cache()
    draft(feat[:6], block, 6, cache)
    expected = draft(feat[6:], block, 9, cache)
    cache.crop(6)
    assert len(cache) == 6
    assert torch.equal(draft(feat[6:], block, 9, cache), expected)
    assert rel(draft(feat, block, 9), expected) < 1e-6  # no cache: the whole context at once
    with pytest.raises(ValueError, match="holds 9 tokens but the context starts at position 6"):
        draft(feat[6:], block, 9, cache)


@torch.no_grad()
def test_interleaved_rope_checkpoint_is_permuted_to_neox(tiny_draft_hf, reference_target, tmp_path):
    """A checkpoint trained with interleaved RoPE pairs (rope_is_neox_style: false) loads as the
    NeoX-ordered equivalent, as llama.cpp's converter writes it."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "interleaved"
    shutil.copytree(tiny_draft_hf, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_is_neox_style"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(d / "model.safetensors"))
    head_dim = cfg["head_dim"]
    for name, t in list(tensors.items()):
        if name.endswith(("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight")):
            # NeoX halves [x0..x7 | y0..y7] -> interleaved pairs [x0 y0 x1 y1 ...]
            tensors[name] = t.reshape(-1, 2, head_dim // 2, *t.shape[1:]).transpose(1, 2).reshape(
                t.shape).contiguous()
    save_file(tensors, str(d / "model.safetensors"))
    a = load_draft_for_target(tiny_draft_hf, reference_target)
    b = load_draft_for_target(d, reference_target)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


# ---------------------------------------------------------------- errors a user can cause

def test_missing_or_broken_draft_dir(tiny_draft_hf, reference_target, tmp_path):
    with pytest.raises(FileNotFoundError, match="draft .*nowhere does not exist"):
        load_draft(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty is not a DFlash draft directory: no "
                                                "config.json"):
        load_draft(tmp_path / "empty")

    d = tmp_path / "no_weights"
    d.mkdir()
    shutil.copy(tiny_draft_hf / "config.json", d)
    with pytest.raises(FileNotFoundError, match="no_weights has no model.safetensors"):
        load_draft(d)

    (d / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="unreadable safetensors file"):
        load_draft(d)

    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tiny_draft_hf / "model.safetensors"))
    partial = {k: v for k, v in tensors.items() if "mlp.up_proj" not in k}
    save_file(partial, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors layers\.0\.mlp\.up_proj\.weight"):
        load_draft(d)

    tensors["fc.weight"] = tensors["fc.weight"][:, :32].contiguous()
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"fc\.weight has shape \(64, 32\), the config implies "
                                         r"\(64, 64\)"):
        load_draft(d)


def test_draft_for_another_target_is_refused(tiny_target_hf, reference_target, tmp_path):
    # a draft whose config says hidden 32: built for a narrower target
    narrow = tmp_path / "narrow_target"
    narrow.mkdir()
    cfg = json.loads((tiny_target_hf / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    d = fixtures.tiny_draft_hf(tmp_path / "narrow_draft", narrow)
    with pytest.raises(ValueError, match="has hidden size 32 but target .* has 64: the draft was "
                                         "made for another target"):
        load_draft_for_target(d, reference_target)

    (narrow / "config.json").write_text(json.dumps({**cfg, "vocab_size": 32000}))
    d = fixtures.tiny_draft_hf(tmp_path / "vocab_draft", narrow)
    with pytest.raises(ValueError, match="has vocab size 32000 but target .* has 49152"):
        load_draft_for_target(d, reference_target)

    d = fixtures.tiny_draft_hf(tmp_path / "deep_draft", tiny_target_hf,
                               fixtures.TinyDraftConfig(target_layer_ids=[1, 4]))
    with pytest.raises(ValueError, match=r"target layer id 4 is out of range for a target with 4 "
                                         r"layers \(valid: 0\.\.3\)"):
        load_draft_for_target(d, reference_target)
