"""Drafts converted by us run in the pinned llama.cpp: `llama-speculative-simple --spec-type
draft-dflash` gives exactly the text of plain greedy decoding (`llama-completion`)."""

from __future__ import annotations

import re
import subprocess

import pytest

from dflash_llama import fixtures, gguf_info, paths, schema as L
from dflash_llama.converter import convert

pytestmark = pytest.mark.peer

SEED = "42"


def speculative(target, draft, prompt: str, n: int) -> tuple[bytes, dict[str, int]]:
    """Greedy speculative decoding with the native DFlash path: (output bytes, statistics).

    Bytes, not text: a random target can stop in the middle of a UTF-8 sequence."""
    result = subprocess.run(
        [str(paths.tool("llama-speculative-simple")), "-m", str(target), "-md", str(draft),
         "--spec-type", "draft-dflash", "--spec-draft-n-max", "7", "-p", prompt, "-n", str(n),
         "--temp", "0", "-s", SEED, "-t", "2"],
        capture_output=True, timeout=300)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 0, stderr[-3000:]
    stats = {key: int(value) for key, value in
             re.findall(r"(n_drafted|n_accept|decoded)\s*=?\s*(\d+)", stderr)}
    return result.stdout.strip(), stats


def completion(target, prompt: str, n: int) -> bytes:
    """Plain greedy decoding of the target alone."""
    result = subprocess.run(
        [str(paths.tool("llama-completion")), "-m", str(target), "-p", prompt, "-n", str(n),
         "--temp", "0", "-s", SEED, "-no-cnv", "-t", "2"],
        capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-3000:]
    return result.stdout.strip()


def assert_same_as_plain_decoding(target, draft, prompt: str) -> dict[str, int]:
    text, stats = speculative(target, draft, prompt, 32)
    # the speculative loop may run past -n by the tokens of its last accepted block: decode as many
    assert stats["decoded"] >= 32
    assert text == completion(target, prompt, stats["decoded"])
    assert text.startswith(prompt.encode()) and len(text) > len(prompt) + 16
    assert stats["n_drafted"] > 0
    return stats


@pytest.fixture(scope="module")
def gqa_draft(tiny_target_hf, tmp_path_factory):
    # no tap on the last target layer: the pinned llama.cpp aborts on that (see test_converter_errors)
    cfg = fixtures.TinyDraftConfig(layers=2, heads=8, kv_heads=2, target_layer_ids=[0, 1, 2], seed=2)
    return fixtures.tiny_draft_hf(tmp_path_factory.mktemp("gqa") / "gqa-draft", tiny_target_hf, cfg)


def test_tiny_gqa_draft_runs_and_matches_plain_decoding(gqa_draft, tiny_target_gguf, tmp_path):
    draft = convert(gqa_draft, tiny_target_gguf, tmp_path / "draft-q8_0.gguf", "q8_0")
    assert_same_as_plain_decoding(tiny_target_gguf, draft, "def fibonacci(n):")


def test_tiny_default_ids_draft_runs(tiny_draft_hf, tiny_target_gguf, tmp_path):
    # the pinned converter's file for this draft has no dflash.target_layers and cannot load
    draft = convert(tiny_draft_hf, tiny_target_gguf, tmp_path / "draft.gguf", "f32")
    assert_same_as_plain_decoding(tiny_target_gguf, draft, "Once upon a time")


def test_llama_quantize_outtype(gqa_draft, tiny_target_gguf, tmp_path):
    draft = convert(gqa_draft, tiny_target_gguf, tmp_path / "draft-q4_0.gguf", "q4_0")
    info = gguf_info(draft)
    assert info.get(L.GENERAL_FILE_TYPE) == 2  # MOSTLY_Q4_0
    assert info.get(L.TARGET_LAYERS) == [1, 2, 3]
    assert info.get(L.MASK_TOKEN_ID) == 0
    assert info.tensor("blk.0.attn_q.weight").type == "q4_0"
    assert info.tensor("blk.0.attn_q_norm.weight").type == "f32"
    assert [p.name for p in tmp_path.iterdir()] == ["draft-q4_0.gguf"]  # no f32 temporary left
    assert_same_as_plain_decoding(tiny_target_gguf, draft, "def fibonacci(n):")


def test_smollm2_draft_is_accepted_and_output_unchanged(smollm2_constant_draft_hf, smollm2_gguf, tmp_path):
    """A real target given as GGUF only; a draft that always proposes " ha" gets accepted."""
    draft = convert(smollm2_constant_draft_hf, smollm2_gguf, tmp_path / "ha-draft.gguf", "f16")
    stats = assert_same_as_plain_decoding(smollm2_gguf, draft, "ha ha ha ha ha ha")
    assert stats["n_accept"] >= stats["n_drafted"] // 2  # measured: 33 of 40
