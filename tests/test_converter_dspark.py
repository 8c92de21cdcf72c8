"""DSpark drafts through the converter: DeepSpec's, SpecForge's and speculators' formats (and
DeepSpec's anchor-first "DFlash") to one GGUF each, the target as GGUF or HF directory, the heads and
the block layout always written, the GGUF drafting as the checkpoint does in the reference; the own
head kept when it is not the target's; input errors as one line; the runtime reading the file's
heads and layout; what the pinned converter writes instead (findings for the parity session)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_converter_errors import fails

import dflash_llama
from dflash_llama import fixtures, gguf_info, schema as L
from dflash_llama.converter import convert
from dflash_llama.reference import load_draft, load_draft_for_target

DS = dict(variant="dspark", target_layer_ids=[1, 3], dtype="float32")  # copies: exactly the target's
DRAFTS = {
    "anchor_first_conf": fixtures.TinyDraftConfig(**DS, markov_rank=8, block_size=6, seed=41),
    "dflash_layout": fixtures.TinyDraftConfig(**DS, markov_rank=8, block_size=6, confidence_head=False,
                                              sample_from_anchor=False, layers=2, seed=42),
    "deepspec_dflash": fixtures.TinyDraftConfig(**DS, markov_rank=0, block_size=6, seed=43),
}
HEAD_TENSORS = {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias"}


@pytest.fixture(scope="module")
def drafts(tiny_target_hf, tmp_path_factory) -> dict:
    out = {name: fixtures.tiny_draft_hf(tmp_path_factory.mktemp(name) / "draft", tiny_target_hf, cfg)
           for name, cfg in DRAFTS.items()}
    for fmt in ("specforge", "speculators"):
        out[fmt] = fixtures.dspark_draft_as(tmp_path_factory.mktemp(fmt) / "draft", out["anchor_first_conf"], fmt)
    return out


def chain_tokens(draft, seed: int) -> list[list[int]]:
    feat = torch.randn(7, 128, generator=torch.Generator().manual_seed(seed))
    cache, block = draft.new_cache(), [77] + [0] * (draft.config.block_size - 1)
    with torch.inference_mode():
        return [draft.draft_chain(feat[:4], block, 4, cache).tokens.tolist(),
                draft.draft_chain(feat[4:], block, 7, cache).tokens.tolist()]


@pytest.mark.parametrize("name", ["anchor_first_conf", "dflash_layout", "deepspec_dflash", "specforge", "speculators"])
def test_each_format_converts_and_drafts_alike(name, drafts, tiny_target_hf, tiny_target_gguf, reference_target,
                                               tmp_path):
    target = tiny_target_hf if name in ("dflash_layout", "speculators") else tiny_target_gguf
    out = convert(drafts[name], target, tmp_path / "draft.gguf", "f32")
    info = gguf_info(out)
    cfg = DRAFTS.get(name, DRAFTS["anchor_first_conf"])
    assert (info.get(L.SAMPLE_FROM_ANCHOR), info.get(L.HAS_CONFIDENCE_HEAD)) == (
        cfg.sample_from_anchor, cfg.confidence_head and cfg.markov_rank > 0)  # always written
    names = {t.name for t in info.tensors}
    assert "token_embd.weight" not in names and "output.weight" not in names  # copies of the target's: dropped
    assert names & HEAD_TENSORS == ({"markov_w1.weight", "markov_w2.weight"} if cfg.markov_rank else set()) | (
        {"conf_proj.weight", "conf_proj.bias"} if cfg.confidence_head and cfg.markov_rank else set())
    if cfg.markov_rank:
        assert info.tensor("markov_w1.weight").shape == (8, 49152)  # ggml order: [rank, n_vocab]
    hf, gguf = load_draft_for_target(drafts[name], reference_target), load_draft_for_target(out, reference_target)
    fields = lambda c: (c.variant, c.markov_rank, c.has_confidence_head, c.sample_from_anchor,  # noqa: E731
                        c.block_size, c.target_layer_ids, c.n_layer)
    assert fields(gguf.config) == fields(hf.config)
    assert chain_tokens(gguf, len(name)) == chain_tokens(hf, len(name))
    # the runtime reads the same heads and layout
    rt = dflash_llama.Runtime(tiny_target_gguf, out, n_threads=1, n_ctx=64)
    assert (rt.draft_variant, rt.sample_from_anchor, rt.has_confidence_head) == (
        gguf.config.variant, cfg.sample_from_anchor, gguf.config.has_confidence_head)


def test_an_own_head_is_kept_and_other_embeddings_refused(drafts, tiny_target_hf, tiny_target_gguf, reference_target,
                                                          tmp_path):
    """A head that is not the target's (an untied target's head, trained, ...) is the draft's output.weight
    (with --draft-vocab, its rows of the kept tokens, as W2's); embeddings that are not the target's are
    refused, as a gated Markov head and confidence tensors the config does not announce, one line each."""
    import shutil

    d = shutil.copytree(drafts["anchor_first_conf"], tmp_path / "own" / "draft")
    tensors = load_file(d / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 1.5
    save_file(tensors, str(d / "model.safetensors"))
    out = convert(d, tiny_target_hf, tmp_path / "own.gguf", "f32")
    info = gguf_info(out)
    np.testing.assert_array_equal(info.read("output.weight"), tensors["lm_head.weight"].numpy())
    hf, gguf = load_draft_for_target(d, reference_target), load_draft(out)
    gguf.attach_target(reference_target.embed_tokens, reference_target.lm_head)  # the own head stays
    assert torch.equal(gguf.lm_head, hf.lm_head) and chain_tokens(gguf, 1) == chain_tokens(hf, 1)

    reduced = gguf_info(convert(d, tiny_target_gguf, tmp_path / "reduced.gguf", "f32", draft_vocab=64))
    ids = reduced.read(L.D2T)
    assert len(ids) == 64 and "lm_head.weight" not in {t.name for t in reduced.tensors}
    for name, hf_name in (("output.weight", "lm_head.weight"), ("markov_w2.weight", "markov_head.markov_w2.weight")):
        np.testing.assert_array_equal(reduced.read(name), tensors[hf_name].numpy()[ids])
    save_file({**tensors, "embed_tokens.weight": tensors["embed_tokens.weight"] + 1.0}, str(d / "model.safetensors"))
    fails(d, tiny_target_hf, tmp_path, r"draft: tensor 'embed_tokens\.weight' differs from the target's token "
                                       r"embeddings: a draft with embeddings of its own is not supported$")
    save_file(tensors, str(d / "model.safetensors"))
    config = json.loads((d / "config.json").read_text())
    for key, value, message in (
            ("markov_head_type", "gated", r"markov_head_type = 'gated' is not supported \(only vanilla"),
            ("enable_confidence_head", False, r"tensor 'confidence_head\.proj\.bias' is a confidence head's, but "
                                              r"config\.json says the draft has none \(enable_confidence_head\)$")):
        (d / "config.json").write_text(json.dumps({**config, key: value}))
        fails(d, tiny_target_hf, tmp_path, message)


def test_a_checkpoints_own_reduced_vocabulary_and_scale(drafts, tiny_target_hf, tiny_target_gguf, tmp_path):
    """speculators' reduced vocabulary for a DSpark draft (draft_vocab_size, d2t offsets, t2d, its own
    head and W2 over the d2t's rows, here not in id order) converts to the file --draft-vocab makes for
    the same tokens; a [1] markov_head.markov_w2.scale is written as markov_w2.scale, a NaN one refused."""
    full = drafts["speculators"]
    want = gguf_info(convert(full, tiny_target_gguf, tmp_path / "want.gguf", "f32", draft_vocab=64))
    ids = torch.from_numpy(want.read(L.D2T)).flip(0)  # the checkpoint's rows: descending ids
    tensors = load_file(full / "model.safetensors")
    _, head = fixtures._target_embeddings_and_head(tiny_target_hf)
    t2d = torch.zeros(head.shape[0], dtype=torch.bool)
    t2d[ids] = True
    tensors.update({"d2t": ids - torch.arange(len(ids)), "t2d": t2d, "lm_head.weight": head[ids].clone(),
                    "markov_head.markov_w2.weight": tensors["markov_head.markov_w2.weight"][ids].clone(),
                    "markov_head.markov_w2.scale": torch.tensor([0.5])})
    own = full.parent.parent / "spec_d2t"
    own.mkdir()
    config = json.loads((full / "config.json").read_text())
    (own / "config.json").write_text(json.dumps({**config, "draft_vocab_size": len(ids)}))
    save_file(tensors, str(own / "model.safetensors"))
    got = gguf_info(convert(own, tiny_target_gguf, tmp_path / "got.gguf", "f32"))
    for name in (L.D2T, "output.weight", "markov_w2.weight", "markov_w1.weight"):
        np.testing.assert_array_equal(got.read(name), want.read(name))
    assert got.read(L.MARKOV_SCALE).tolist() == [0.5] and got.tensor(L.MARKOV_SCALE).type == "f32"
    save_file({**tensors, "markov_head.markov_w2.scale": torch.tensor([float("nan")])}, str(own / "model.safetensors"))
    fails(own, tiny_target_gguf, tmp_path, r"spec_d2t: tensor 'markov_w2\.scale' is nan: expected a finite factor$")


def test_what_the_pinned_converter_writes(drafts, tiny_target_hf, tmp_path):
    """Findings for the parity session, reproduced: the pinned converter drops a DeepSpec draft's head
    and keeps its embedding copy (llama.cpp then uses the embeddings as the head: right only for tied
    targets; the tiny target is untied); it reads a speculators DSpark draft without sample_from_anchor
    as DFlash's layout, where speculators' default is anchor-first; DeepSpec's "DFlash" gets
    sample_from_anchor true and no markov_w1, which llama.cpp runs as draft-dflash, ignoring the key."""
    out = tmp_path / "pinned.gguf"
    fixtures.run_pinned_converter([str(drafts["anchor_first_conf"]), "--target-model-dir", str(tiny_target_hf),
                                   "--outfile", str(out), "--outtype", "f32"])
    info = gguf_info(out)
    names = {t.name for t in info.tensors}
    assert "token_embd.weight" in names and "output.weight" not in names
    assert (info.get(L.SAMPLE_FROM_ANCHOR), info.get(L.HAS_CONFIDENCE_HEAD)) == (True, True)
    target = load_file(tiny_target_hf / "model.safetensors")
    assert not torch.equal(target["lm_head.weight"], target["model.embed_tokens.weight"])  # untied

    spec = drafts["speculators"]
    config = json.loads((spec / "config.json").read_text())
    del config["sample_from_anchor"]
    (spec.parent / "nokey").mkdir()
    (spec.parent / "nokey" / "config.json").write_text(json.dumps(config))
    (spec.parent / "nokey" / "model.safetensors").symlink_to(spec / "model.safetensors")
    fixtures.run_pinned_converter([str(spec.parent / "nokey"), "--target-model-dir", str(tiny_target_hf),
                                   "--outfile", str(tmp_path / "nokey.gguf"), "--outtype", "f32"])
    assert gguf_info(tmp_path / "nokey.gguf").get(L.SAMPLE_FROM_ANCHOR) is False
    assert L.DraftHParams.from_hf_config(config).sample_from_anchor is True  # ours: speculators' default
