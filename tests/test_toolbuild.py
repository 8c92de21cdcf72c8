"""A stock build of the pin's tools (llamafile's sgemm on), relinked from our build."""

from __future__ import annotations

import json

import pytest

from dflash_llama import fixtures, peers, toolbuild
from dflash_llama.converter import convert

pytestmark = pytest.mark.peer


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return toolbuild.stock_tool("llama-speculative-simple", cache=tmp_path_factory.mktemp("stock"))


def test_the_stock_tool_has_sgemm_and_ours_does_not(stock):
    assert stock.name == "llama-speculative-simple" and stock.parent.parent.name == "stock-tools"
    # symbol names: the build's own tool (the installed copy is stripped)
    ours = (toolbuild.build_dir() / "bin" / "llama-speculative-simple").read_bytes()
    assert b"llamafile_sgemm" in stock.read_bytes()
    assert b"llamafile_sgemm" not in ours and b"ggml_compute_forward_mul_mat" in ours
    # the stock ggml-cpu.c is the pinned one, without our multi-column dot products' hook
    assert b"dflash_mul_mat_chunk" not in stock.read_bytes()
    assert b"dflash_mul_mat_chunk" in ours


def test_the_stock_tool_is_cached(stock):
    mtime = stock.stat().st_mtime_ns
    again = toolbuild.stock_tool("llama-speculative-simple", cache=stock.parent.parent.parent)
    assert again == stock and again.stat().st_mtime_ns == mtime


def test_the_stock_tool_decodes_the_default_target(stock):
    target = fixtures.smollm2_gguf()
    ours = peers.speculative_plain(target, "def add(a, b):", 16, threads=1, n_ctx=256)
    theirs = peers.speculative_plain(target, "def add(a, b):", 16, threads=1, n_ctx=256, exe=stock)
    assert theirs.command[0] == str(stock)
    assert theirs.n_tokens >= 16 and theirs.text  # decoded, with its own kernels
    assert ours.command[0] != str(stock)


def test_a_tool_our_build_does_not_make_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="llama-nonexistent is not built by our build"):
        toolbuild.stock_tool("llama-nonexistent", cache=tmp_path)


@pytest.fixture(scope="module")
def native_random_draft(smollm2_gguf, tmp_path_factory):
    """A random 1-layer draft of SmolLM2's shapes that the pinned native graph runs (no tap on the last
    layer: finding U2)."""
    cfg = tmp_path_factory.mktemp("config")
    (cfg / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}))
    hf = fixtures.tiny_draft_hf(tmp_path_factory.mktemp("draft_hf"), cfg, fixtures.TinyDraftConfig(
        layers=1, heads=9, kv_heads=3, head_dim=64, ffn=256, block_size=8, init_std=0.05,
        target_layer_ids=[1, 15, 28]))
    return convert(hf, smollm2_gguf, tmp_path_factory.mktemp("draft") / "draft.gguf", outtype="f16")


@pytest.fixture(scope="module")
def one_row(tmp_path_factory):
    return toolbuild.stock_tool("llama-speculative-simple", cache=tmp_path_factory.mktemp("one-row"),
                                one_row_sgemm=True)


def test_with_one_row_sgemm_native_dflash_is_exact(stock, one_row, native_random_draft):
    """sgemm for one-row matmuls too: a verify of 8 tokens takes the kernels a one-token decode does,
    so the tool's greedy DFlash text is its own plain text (the stock build's is not, docs/upstream_status.md)."""
    assert one_row.parent.name != stock.parent.name and b"llamafile_sgemm" in one_row.read_bytes()
    target = fixtures.smollm2_gguf()
    stock_exact = []
    for prompt in ("def add(a, b):", "from typing import List\n\ndef running_max(xs: List[int]) -> List[int]:\n"):
        for exe in (one_row, stock):
            plain = peers.speculative_plain(target, prompt, 48, threads=2, n_ctx=512, exe=exe)
            spec = peers.speculative(target, prompt, 48, "draft-dflash", threads=2, n_ctx=512,
                                     draft=native_random_draft, n_max=7, exe=exe)
            assert spec.n_drafted > 0
            if exe == one_row:
                assert spec.text.startswith(plain.text), prompt
            else:
                stock_exact.append(spec.text.startswith(plain.text))
    assert False in stock_exact  # the stock build's 8-token verifies leave its plain text


def test_a_pin_without_the_one_row_guard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(toolbuild, "_ONE_ROW_GUARD", "no such guard")
    with pytest.raises(RuntimeError, match="the one-row guard of llamafile_sgemm is not where it was"):
        toolbuild.stock_tool("llama-speculative-simple", cache=tmp_path, one_row_sgemm=True)


def test_the_builds_bench_counts_tokens_time_and_exact_prompts(one_row, native_random_draft):
    from dflash_llama.bench import stock_builds

    res = stock_builds.measure(fixtures.smollm2_gguf(), native_random_draft, ["def add(a, b):"], 16, [4], 2,
                               {"ours": None, "stock, one-row sgemm": one_row})
    assert set(res) == {("ours", 0), ("ours", 4), ("stock, one-row sgemm", 0), ("stock, one-row sgemm", 4)}
    assert all(r["tokens"] >= 16 and r["ms"] > 0 and r["exact"] == 1 for r in res.values())
