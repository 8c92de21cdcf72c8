"""Loading DFlash GGUFs into the reference: llama.cpp's converter, ours, quantised types."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

from dflash_llama import fixtures
from dflash_llama.converter import convert
from dflash_llama.reference import load_draft, load_draft_for_target

torch.set_num_threads(1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def as_f32(cfg):
    """The config with its float fields rounded to f32, as a GGUF stores them."""
    return dataclasses.replace(cfg, **{
        f.name: float(torch.tensor(getattr(cfg, f.name), dtype=torch.float32))
        for f in dataclasses.fields(cfg) if isinstance(getattr(cfg, f.name), float)})


def assert_same_draft(from_hf, from_gguf):
    """Same config (the GGUF lacks num_target_layers, stores floats as f32), same weights, and
    bit-identical logits."""
    assert from_gguf.config == as_f32(dataclasses.replace(from_hf.config, n_layer_target=None))
    for (name, a), (_, b) in zip(from_hf.named_parameters(), from_gguf.named_parameters()):
        assert torch.equal(a, b), name
    feat = torch.randn(4, from_hf.config.n_taps * 64, generator=torch.Generator().manual_seed(3))
    block = [9] + [0] * (from_hf.block_size - 1)
    assert torch.equal(from_hf(feat, block, 4), from_gguf(feat, block, 4))


@pytest.mark.parametrize("name", ["gqa4_last_layer_tap", "noncausal_window_scales"])
def test_gguf_from_pinned_llama_cpp_converter_matches_hf(name, reference_drafts,
                                                        pinned_draft_ggufs, reference_target):
    """llama.cpp's converter writes q/k unpermuted for this arch and target_layers = ids + 1:
    the f32 GGUF loads to the very same config and weights, so the logits are bit-identical."""
    assert_same_draft(load_draft_for_target(reference_drafts[name], reference_target),
                      load_draft_for_target(pinned_draft_ggufs[name], reference_target))


def test_gguf_q8_0_is_dequantised(reference_drafts, tiny_target_hf, reference_target, tmp_path):
    out = tmp_path / "draft-q8_0.gguf"
    hf_dir = reference_drafts["gqa4_last_layer_tap"]
    fixtures.run_pinned_converter([str(hf_dir), "--target-model-dir", str(tiny_target_hf),
                                   "--outfile", str(out), "--outtype", "q8_0"])
    a = load_draft_for_target(hf_dir, reference_target)
    b = load_draft_for_target(out, reference_target)
    assert b.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert rel(pb, pa) < 1e-2, name  # 8-bit blocks: ~0.5% per matrix
    feat = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    assert rel(b(feat, [9, 0, 0, 0], 4), a(feat, [9, 0, 0, 0], 4)) < 5e-2



def test_gguf_errors(tiny_target_gguf, tmp_path):
    with pytest.raises(ValueError, match="architecture is 'qwen3', not a DFlash draft"):
        load_draft(tiny_target_gguf)
    bare = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(bare), arch="dflash")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="bare.gguf: missing GGUF key 'dflash.embedding_length'"):
        load_draft(bare)
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model\n")
    with pytest.raises(ValueError, match="junk.gguf: not a GGUF file"):
        load_draft(junk)


@pytest.mark.parametrize("name, outtype", [
    ("sliding_default_taps", "f32"),  # default target_layer_ids: the converter writes them
    ("noncausal_window_scales", "f16"),  # f16 weights, is_causal false, scales, sliding pattern
    ("linear_rope", "f32"),
    ("gqa4_last_layer_tap", "bf16"),  # bf16 weights stored as bf16
])
def test_gguf_from_our_converter_matches_hf(name, outtype, reference_drafts, tiny_target_gguf,
                                            reference_target, tmp_path):
    """Our converter, with the target given only as a GGUF, round-trips exactly."""
    out = convert(reference_drafts[name], tiny_target_gguf, tmp_path / f"{name}.gguf", outtype)
    assert_same_draft(load_draft_for_target(reference_drafts[name], reference_target),
                      load_draft_for_target(out, reference_target))
