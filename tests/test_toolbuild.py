"""A stock build of the pin's tools (llamafile's sgemm on), relinked from our build."""

from __future__ import annotations

import pytest

from dflash_llama import fixtures, paths, peers, toolbuild

pytestmark = pytest.mark.peer


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return toolbuild.stock_tool("llama-speculative-simple", cache=tmp_path_factory.mktemp("stock"))


def test_the_stock_tool_has_sgemm_and_ours_does_not(stock):
    assert stock.name == "llama-speculative-simple" and stock.parent.parent.name == "stock-tools"
    assert b"llamafile_sgemm" in stock.read_bytes()
    assert b"llamafile_sgemm" not in paths.tool("llama-speculative-simple").read_bytes()


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
