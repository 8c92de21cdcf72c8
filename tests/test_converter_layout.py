"""The layout table (dflash_llama/schema.py) against the pinned llama.cpp's own names and the docs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_llama import paths, schema as L
from dflash_llama.schema import default_target_layer_ids

DOC = Path(__file__).resolve().parents[1] / "docs" / "gguf_layout.md"

# runs with the pinned gguf-py (not the one installed here), in its own process
PINNED_NAMES = """
import json, sys
sys.path.insert(0, sys.argv[1])
import gguf
from gguf.constants import Keys
keys = set()
for group in vars(Keys).values():
    for value in vars(group).values() if isinstance(group, type) else []:
        if isinstance(value, str):
            keys.add(value.replace("{arch}", "dflash"))
        elif isinstance(value, type):
            keys.update(v.replace("{arch}", "dflash") for v in vars(value).values() if isinstance(v, str))
tensors = [gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.DFLASH]]
print(json.dumps({"keys": sorted(keys), "tensors": tensors, "arch": gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DFLASH]}))
"""


@pytest.fixture(scope="module")
def pinned_names():
    gguf_py = paths.llama_cpp_dir() / "gguf-py"
    result = subprocess.run([sys.executable, "-c", PINNED_NAMES, str(gguf_py)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_every_key_is_a_pinned_key(pinned_names):
    assert pinned_names["arch"] == L.ARCH == "dflash"
    ours = {k.key for k in L.KEYS}
    assert len(ours) == len(L.KEYS) == 38
    assert sorted(ours - set(pinned_names["keys"])) == []


def test_every_tensor_is_a_pinned_dflash_tensor(pinned_names):
    for spec in L.TENSORS:
        base = spec.gguf.removesuffix(".weight").removesuffix(".bias").removesuffix(".scale")  # the pin's suffixes
        assert base in pinned_names["tensors"], spec.gguf


def test_names_map_both_ways():
    assert L.gguf_tensor_name("layers.3.self_attn.k_norm.weight")[0] == "blk.3.attn_k_norm.weight"
    assert L.gguf_tensor_name("model.layers.0.mlp.down_proj.weight")[0] == "blk.0.ffn_down.weight"
    assert L.gguf_tensor_name("hidden_norm.weight")[0] == "enc.output_norm.weight"
    assert L.gguf_tensor_name("layers.0.mlp.conv.weight") is None
    for spec in L.TENSORS:
        gguf_name, hf_name = spec.gguf.format(bid=12), spec.hf.format(bid=12)
        assert L.gguf_tensor_name(hf_name) == (gguf_name, spec)
        assert L.hf_tensor_name(gguf_name) == (hf_name, spec)


def test_shapes_and_f32_rule():
    dims = {"n_embd": 64, "n_taps": 3, "n_head": 8, "n_head_kv": 2, "head_dim": 16, "n_ff": 128,
            "n_vocab": 100, "conv_k": 2, "conv_groups": 4, "selector_rank": 16, "markov_rank": 8,
            "n_vocab_draft": 100}
    shape = {s.gguf: L.expected_shape(s, dims) for s in L.TENSORS}
    assert shape["fc.weight"] == (192, 64)
    assert shape["blk.{bid}.attn_conv_base"] == (64, 2, 2)  # {n_embd, K, 2}, as the pinned loader creates it
    assert shape["blk.{bid}.ffn_conv_proj.weight"] == (64, 16)  # {n_embd, 2 K G}
    assert shape["selector_successor.weight"] == (16, 100)
    assert shape["selector_hidden.weight"] == (64, 16)
    assert L.stays_f32("blk.0.attn_conv_base", 3)  # no .weight: the pinned converter keeps it f32
    assert shape["blk.{bid}.attn_k.weight"] == (64, 32)
    assert shape["blk.{bid}.attn_output.weight"] == (128, 64)
    assert shape["blk.{bid}.ffn_down.weight"] == (128, 64)
    assert L.stays_f32("blk.0.attn_q_norm.weight", 1)
    assert L.stays_f32("enc.output_norm.weight", 1)
    assert not L.stays_f32("fc.weight", 2)
    assert L.stays_f32("fc.scale", 2)


def test_target_layers_and_default_ids():
    assert L.target_layers_from_ids([1, 9, 17, 25, 33]) == [2, 10, 18, 26, 34]
    assert L.target_layer_ids_from_gguf([2, 10]) == [1, 9]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-8B-DFlash-b16
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(4, 2) == [1, 1]


def test_doc_lists_every_key_and_tensor():
    doc = DOC.read_text()
    for spec in L.KEYS:
        assert f"`{spec.key}`" in doc, spec.key
    for spec in L.TENSORS:
        assert f"`{spec.gguf.replace('{bid}', 'N')}" in doc, spec.gguf
        assert f"`{spec.hf.replace('{bid}', 'N')}`" in doc, spec.hf
