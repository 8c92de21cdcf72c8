"""Shared, session-scoped fixtures: tiny deterministic models built once per test run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_llama import fixtures
from dflash_llama.converter import convert


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return fixtures.smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_random_draft_gguf(smollm2_gguf, tmp_path_factory) -> Path:
    """A random 1-layer draft with SmolLM2's shapes, converted against the GGUF target only."""
    cfg_dir = tmp_path_factory.mktemp("smollm2_config")
    (cfg_dir / "config.json").write_text(json.dumps(
        {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}))
    hf = fixtures.tiny_draft_hf(tmp_path_factory.mktemp("smollm2_draft_hf"), cfg_dir, fixtures.TinyDraftConfig(
        layers=1, heads=9, kv_heads=3, head_dim=64, ffn=256, block_size=16, init_std=0.05,
        target_layer_ids=[1, 15, 29]))
    out = tmp_path_factory.mktemp("smollm2_draft") / "smollm2-random-draft.gguf"
    return convert(hf, smollm2_gguf, out, outtype="f16")


@pytest.fixture(scope="session")
def tiny_target_hf(tmp_path_factory) -> Path:
    return fixtures.tiny_target_hf(tmp_path_factory.mktemp("tiny_target_hf"))


@pytest.fixture(scope="session")
def tiny_target_gguf(tiny_target_hf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_target_gguf") / "tiny-target-f32.gguf"
    return fixtures.tiny_target_gguf(tiny_target_hf, out, outtype="f32")


@pytest.fixture(scope="session")
def tiny_draft_hf(tiny_target_hf, tmp_path_factory) -> Path:
    return fixtures.tiny_draft_hf(tmp_path_factory.mktemp("tiny_draft_hf"), tiny_target_hf)


@pytest.fixture(scope="session")
def reference_target(tiny_target_hf):
    """The tiny target behind the reference's adapter (f32, transformers)."""
    from dflash_llama.reference import Target

    return Target.load(tiny_target_hf)


def _edit_config(draft_dir: Path, edit) -> Path:
    path = draft_dir / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return draft_dir


@pytest.fixture(scope="session")
def reference_drafts(tiny_target_hf, tmp_path_factory) -> dict[str, Path]:
    """Random published-format drafts for the tiny target covering the configuration space:
    GQA 4:1, several layers, sliding and causal layers, explicit and default target_layer_ids
    (including the last target layer), block sizes 4, 5, 6, 8, 16, f32/f16/bf16 weights,
    rope_parameters (default and linear), and the optional scales in dflash_config."""
    make = lambda name, **kw: fixtures.tiny_draft_hf(  # noqa: E731
        tmp_path_factory.mktemp(f"draft_{name}"), tiny_target_hf, fixtures.TinyDraftConfig(**kw))

    def rope_parameters(cfg):
        del cfg["rope_theta"]
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}

    def linear_rope(cfg):
        del cfg["rope_theta"]
        cfg["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}

    def scales(cfg):  # DFlash keys inside dflash_config win over the top level
        cfg["dflash_config"].update(block_size=5, input_embedding_scale=1.5,
                                    output_multiplier=0.7, final_logit_softcapping=4.0)
        cfg["block_size"] = 16

    return {
        "gqa4_last_layer_tap": make("gqa4", layers=2, heads=8, kv_heads=2, head_dim=8, ffn=96,
                                    block_size=4, target_layer_ids=[0, 3], seed=11),
        "sliding_default_taps": _edit_config(make(
            "sliding", layers=3, heads=4, kv_heads=1, block_size=8, seed=12,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            sliding_window=4), rope_parameters),
        "noncausal_window_scales": _edit_config(make(
            "window", layers=2, heads=4, kv_heads=2, target_layer_ids=[1, 2, 3], seed=13,
            layer_types=["sliding_attention", "sliding_attention"], sliding_window=3,
            dtype="float16", extra_config={"is_causal": False}), scales),
        "one_layer_causal": make("causal", layers=1, heads=4, kv_heads=1, block_size=16,
                                 dtype="float32", extra_config={"is_causal": True}, seed=14),
        "linear_rope": _edit_config(make("linear", layers=2, block_size=6,
                                         target_layer_ids=[2, 0], seed=15), linear_rope),
    }


@pytest.fixture(scope="session")
def pinned_draft_ggufs(reference_drafts, tiny_target_hf, tmp_path_factory) -> dict[str, Path]:
    """Two of `reference_drafts` converted to f32 GGUF by the pinned llama.cpp converter (its
    layout, its keys). Only drafts with explicit target_layer_ids: for the default rule the
    pinned converter writes no dflash.target_layers, and llama.cpp cannot load the result."""
    out = {}
    for name in ("gqa4_last_layer_tap", "noncausal_window_scales"):
        path = tmp_path_factory.mktemp("pinned_gguf") / f"{name}-f32.gguf"
        fixtures.run_pinned_converter([str(reference_drafts[name]), "--target-model-dir",
                                       str(tiny_target_hf), "--outfile", str(path),
                                       "--outtype", "f32"])
        out[name] = path
    return out


@pytest.fixture(scope="session")
def smollm2_constant_draft_hf(smollm2_gguf, tmp_path_factory) -> Path:
    """A draft for SmolLM2 (GGUF only, no HF dir) that always proposes " ha": accepted on "ha ha ha"."""
    return fixtures.constant_draft_hf(tmp_path_factory.mktemp("smollm2_draft") / "ha-draft",
                                      smollm2_gguf, "Ġha")


@pytest.fixture(scope="session")
def tiny_draft_gguf(tiny_draft_hf, tiny_target_gguf, tmp_path_factory) -> Path:
    """`tiny_draft_hf` (block 8, default taps) converted to f32 GGUF by our converter."""
    from dflash_llama.converter import convert

    return convert(tiny_draft_hf, tiny_target_gguf, tmp_path_factory.mktemp("tiny_draft_gguf") / "tiny-draft-f32.gguf",
                   outtype="f32")


@pytest.fixture(scope="session")
def family_targets(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (tiny HF target, its f32 GGUF by the pinned converter), every family of families.py."""
    from dflash_llama import families

    out = {}
    for family in families.NAMES:
        root = tmp_path_factory.mktemp(f"family_target_{family}")
        hf = fixtures.tiny_target_hf(root / "hf", fixtures.TinyTargetConfig(family=family))
        out[family] = hf, fixtures.tiny_target_gguf(hf, root / "target-f32.gguf", family=family)
    return out
