"""DFlash 2 drafts through the converter: z-lab's format byte-identical to the pinned llama.cpp
converter, speculators' format (vLLM) giving the same file (the pinned converter cannot read it:
finding U9, tests/test_parity_findings.py), the default-taps warning, input errors, and the result
drafting in the pinned llama.cpp."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_converter_errors import edit_config, fails
from test_converter_llama_cpp import completion, speculative

from dflash_llama import fixtures, gguf_info, schema as L
from dflash_llama.converter import convert

# what speculators can say too: sliding layer 0 (window 4), non-causal, explicit taps
DFLASH2 = fixtures.TinyDraftConfig(variant="dflash2", layers=2, target_layer_ids=[0, 1, 2], seed=5,
                                   layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                   extra_config={"is_causal": False})
# as the published heads are: logits scaled and soft-capped (in dflash_config), codebooks saved with
# `.weight` (dflash 0.1.0's save_pretrained); other sizes, block 16
PUBLISHED = fixtures.TinyDraftConfig(variant="dflash2", layers=2, target_layer_ids=[1, 2], conv_kernel_size=3,
                                     conv_group_size=32, selector_rank=8, block_size=16, seed=6)
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def edit_tensors(draft_dir, rename=lambda name: name, drop=(), **add) -> None:
    """Rewrite a draft's safetensors: names renamed, some dropped, some added or replaced."""
    tensors = {rename(k): v for k, v in load_file(draft_dir / "model.safetensors").items() if k not in drop}
    save_file(dict(sorted({**tensors, **add}.items())), str(draft_dir / "model.safetensors"),
              metadata={"format": "pt"})


@pytest.fixture(scope="module")
def dflash2_draft(tiny_target_hf, tmp_path_factory):
    return fixtures.tiny_draft_hf(tmp_path_factory.mktemp("zlab") / "draft", tiny_target_hf, DFLASH2)


@pytest.fixture(scope="module")
def published_draft(tiny_target_hf, tmp_path_factory):
    draft = fixtures.tiny_draft_hf(tmp_path_factory.mktemp("published") / "draft", tiny_target_hf, PUBLISHED)
    config = json.loads((draft / "config.json").read_text())
    edit_config(draft, dflash_config={**config["dflash_config"], "output_multiplier": 0.5,
                                      "final_logit_softcapping": 20.0})
    edit_tensors(draft, rename=lambda k: k + ".weight" if k in CODEBOOKS else k)
    return draft


def pinned(draft, target_hf, out, outtype="f32"):
    fixtures.run_pinned_converter([str(draft), "--target-model-dir", str(target_hf), "--outtype", outtype,
                                   "--outfile", str(out)])
    return out


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_zlab_draft_is_byte_identical_to_pinned(published_draft, tiny_target_hf, tiny_target_gguf, tmp_path,
                                                outtype):
    ours = convert(published_draft, tiny_target_gguf, tmp_path / "ours.gguf", outtype)
    assert ours.read_bytes() == pinned(published_draft, tiny_target_hf, tmp_path / "pinned.gguf", outtype).read_bytes()
    info = gguf_info(ours)
    assert [(k, info.get(k)) for k in (*L.DFLASH2_KEYS, L.LOGIT_SCALE, L.FINAL_LOGIT_SOFTCAPPING, L.BLOCK_SIZE,
                                       L.TARGET_LAYERS)] == [
        (L.CONV_KERNEL_SIZE, 3), (L.CONV_GROUP_SIZE, 32), (L.SELECTOR_RANK, 8), (L.SELECTOR_TOP_K, 4),
        (L.LOGIT_SCALE, 0.5), (L.FINAL_LOGIT_SOFTCAPPING, 20.0), (L.BLOCK_SIZE, 16), (L.TARGET_LAYERS, [2, 3])]
    types = {t.name: t.type for t in info.tensors}
    assert len(types) == 3 + 2 * (11 + 4) + 3
    assert types["blk.1.attn_conv_base"] == types["blk.0.ffn_conv_base"] == "f32"  # no `.weight`: stays f32
    if outtype == "q8_0":  # codebook rows of 8 (the rank) are no multiple of 32: f16, as pinned
        assert (types["selector_successor.weight"], types["blk.0.ffn_conv_proj.weight"]) == ("f16", "q8_0")
        return
    src = load_file(published_draft / "model.safetensors")  # the bf16 checkpoint, widened
    for hf_name, value in src.items():
        name, _ = L.gguf_tensor_name(hf_name)
        t = info.tensor(name)
        assert t.shape == tuple(reversed(value.shape))
        np.testing.assert_array_equal(info.read(name).reshape(value.shape), value.float().numpy())
    # z-lab's own spelling of the codebooks (no `.weight`) is the same file
    plain = shutil.copytree(published_draft, tmp_path / "plain" / "draft")
    edit_tensors(plain, rename=lambda k: k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k)
    assert convert(plain, tiny_target_gguf, tmp_path / "plain.gguf", "f32").read_bytes() == ours.read_bytes()


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_speculators_format_gives_the_same_gguf(dflash2_draft, tiny_target_hf, tiny_target_gguf, tmp_path,
                                                variant):
    zlab = dflash2_draft if variant == "dflash2" else fixtures.tiny_draft_hf(
        tmp_path / "zlab" / "draft", tiny_target_hf, fixtures.TinyDraftConfig(layers=2, target_layer_ids=[0, 2]))
    spec = fixtures.speculators_draft_hf(tmp_path / "spec" / "draft", zlab)
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == variant
    assert "rms_norm_eps" not in config["transformer_layer_config"]  # a diff: Qwen3Config's default fills it
    # the verifier's frozen copies speculators may save: dropped, the draft borrows the target's
    edit_tensors(spec, **{"embed_tokens.weight": torch.ones(49152, 64), "lm_head.weight": torch.ones(49152, 64),
                         "verifier_norm.weight": torch.ones(64)})
    want = convert(zlab, tiny_target_gguf, tmp_path / "zlab.gguf", "f32").read_bytes()
    assert convert(spec, tiny_target_gguf, tmp_path / "spec.gguf", "f32").read_bytes() == want


def test_qwen3_defaults_are_the_installed_transformers():
    import inspect

    from transformers import Qwen3Config

    params = inspect.signature(Qwen3Config).parameters
    assert {k: params[k].default for k in L.QWEN3_DEFAULTS} == L.QWEN3_DEFAULTS


def test_speculators_reduced_vocabulary_keeps_its_own_head(tiny_target_hf, tiny_target_gguf, tmp_path):
    """DFlash 1 with draft_vocab_size < vocab: d2t offsets, a t2d mask (checked, dropped) and the head
    speculators saves over those rows, written as output.weight (not the target's rows)."""
    zlab = fixtures.tiny_draft_hf(tmp_path / "zlab", tiny_target_hf, fixtures.TinyDraftConfig(target_layer_ids=[1]))
    ids = torch.tensor([0, 2, 3, 7, 100, 4000, 49151])
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[ids] = True
    head = torch.randn(len(ids), 64, generator=torch.Generator().manual_seed(0))
    spec = fixtures.speculators_draft_hf(tmp_path / "spec", zlab, {"draft_vocab_size": len(ids)})
    edit_tensors(spec, **{"d2t": ids - torch.arange(len(ids)), "t2d": t2d, "lm_head.weight": head})
    info = gguf_info(convert(spec, tiny_target_gguf, tmp_path / "reduced.gguf", "f32"))
    assert info.read(L.D2T).tolist() == ids.tolist()
    np.testing.assert_array_equal(info.read("output.weight").reshape(len(ids), 64), head.numpy())
    assert "t2d" not in {t.name for t in info.tensors}
    t2d[5] = True
    edit_tensors(spec, t2d=t2d)
    fails(spec, tiny_target_hf, tmp_path, r"spec: tensor 't2d' \(shape \[49152\]\) must mark exactly the 7 "
                                            r"tokens of the 'd2t' among the target's 49152$")


def test_default_target_layers_and_a_small_hidden_size_warn(tiny_target_hf, tiny_target_gguf, tmp_path, caplog):
    cfg = fixtures.TinyDraftConfig(variant="dflash2", layers=2, selector_top_k=8)  # no target_layer_ids
    draft = fixtures.tiny_draft_hf(tmp_path / "draft", tiny_target_hf, cfg)
    with caplog.at_level(logging.WARNING, logger="dflash_llama.converter"):
        out = convert(draft, tiny_target_gguf, tmp_path / "draft.gguf", "f32")
    assert caplog.messages == [
        f"no target_layer_ids in {draft / 'config.json'}: the published default rule chose target layers [1, 1] "
        "(written as dflash.target_layers [2, 2]); z-lab, SGLang and lmdeploy now require the key, since only "
        "the training knows the layers: add dflash_config.target_layer_ids to be sure",
        "selector_top_k 8 needs hidden_size >= 72 in the pinned llama.cpp, which refuses this file "
        "(\"DFlash2 hidden size is too small for the selector lattice\")"]
    assert gguf_info(out).get(L.TARGET_LAYERS) == [2, 2]


def _group_size(draft):
    edit_config(draft, dflash_config={**json.loads((draft / "config.json").read_text())["dflash_config"],
                                      "conv_group_size": 24})


def _as_dflash1(draft):
    config = json.loads((draft / "config.json").read_text())
    edit_config(draft, architectures=["DFlashDraftModel"],
                dflash_config={k: v for k, v in config["dflash_config"].items() if k not in SIZES})


def _speculators(**changes):
    def edit(draft):
        spec = fixtures.speculators_draft_hf(draft.with_name("spec"), draft)
        config = json.loads((spec / "config.json").read_text())
        edit_config(spec, **{k: (v(config) if callable(v) else v) for k, v in changes.items()})
        return spec
    return edit


ERRORS = {
    "group size not dividing hidden": (_group_size, r"config\.json: conv_group_size 24 does not divide the hidden "
                                                    r"size 64$"),
    "missing selector tensor": (lambda d: edit_tensors(d, drop=["candidate_selector.hidden_projection.weight"]),
                                r"missing tensor 'candidate_selector\.hidden_projection\.weight' "
                                r"\(selector_hidden\.weight\)$"),
    "DFlash 2 tensor in a DFlash 1 checkpoint": (_as_dflash1, r"tensor 'candidate_selector\.hidden_projection\."
                                                              r"weight' belongs to a DFlash 2 draft, but config\.json "
                                                              r"describes a DFlash 1 draft"),
    "codebook rows": (lambda d: edit_tensors(d, **{CODEBOOKS[1]: torch.zeros(1000, 16)}),
                      r"tensor 'candidate_selector\.successor_codebook' has shape \[1000, 16\], config\.json implies "
                      r"\[49152, 16\] \(one row per token of the target's vocabulary\)$"),
    "codebook spelled twice": (lambda d: edit_tensors(d, **{CODEBOOKS[0] + ".weight": torch.zeros(49152, 16)}),
                               r"tensors 'candidate_selector\.predecessor_codebook' and 'candidate_selector\."
                               r"predecessor_codebook\.weight' are one tensor \(selector_predecessor\.weight\): "
                               r"keep one$"),
    "speculators dspark": (_speculators(speculators_model_type="dspark"),
                           r"spec: tensor 'candidate_selector\.hidden_projection\.weight' belongs to a DFlash 2 draft, "
                           r"but config\.json describes a DSpark draft \(architectures, dflash_config\)$"),
    "speculators sample_from_anchor": (_speculators(sample_from_anchor=True),
                                       r"config\.json: sample_from_anchor = true \(an anchor-first block, as DSpark "
                                       r"drafts\) is not supported for DFlash 2 drafts$"),
    "speculators llama layers": (_speculators(transformer_layer_config=lambda c: {**c["transformer_layer_config"],
                                                                                  "model_type": "llama"}),
                                 r"config\.json: transformer_layer_config\.model_type = 'llama' is not supported "
                                 r"\(only qwen3, the class speculators' DFlash drafts are built with\)$"),
    "speculators without taps": (_speculators(aux_hidden_state_layer_ids=None),
                                 r"config\.json: no aux_hidden_state_layer_ids: a speculators draft lists the target "
                                 r"hidden states it was trained on$"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_input_errors_are_one_line(dflash2_draft, tiny_target_hf, tmp_path, case):
    draft = shutil.copytree(dflash2_draft, tmp_path / "draft")
    edit, message = ERRORS[case]
    draft = edit(draft) or draft
    fails(draft, tiny_target_hf, tmp_path, message)  # an HF target: its config.json, read in milliseconds


@pytest.mark.peer
def test_pinned_llama_cpp_loads_and_drafts_with_it(dflash2_draft, tiny_target_gguf, tmp_path):
    """llama-speculative-simple --spec-type draft-dflash with our DFlash 2 file: it loads, drafts through
    its selector, and its greedy text is the target's own."""
    draft = convert(dflash2_draft, tiny_target_gguf, tmp_path / "dflash2.gguf", "f32")
    prompt = "Once upon a time"
    text, stats = speculative(tiny_target_gguf, draft, prompt, 16)
    assert stats["n_drafted"] > 0 and stats["decoded"] >= 16
    assert text == completion(tiny_target_gguf, prompt, stats["decoded"])
    assert text.startswith(prompt.encode()) and len(text) > len(prompt) + 8
