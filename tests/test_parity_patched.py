"""The U5 patch, applied to a copy of the pinned tree, removes the divergence (and the pinned tree
itself stays untouched)."""

from __future__ import annotations

import hashlib

import pytest

from dflash_llama.parity import patched


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("DFLASH_LLAMA_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def test_u5_gone_in_the_patched_copy(tmp_path):
    pinned = patched.ROOT / "third_party" / "llama.cpp" / "common" / "speculative.cpp"
    before = hashlib.sha256(pinned.read_bytes()).hexdigest()
    exe = patched.patched_tool(patched.PATCHES / "u5-dflash-full-block.patch", tmp_path)
    result = patched.show_u5(exe)
    assert result["pinned"] == {"n_max_7_first_3": [799, 799, 799], "n_max_3": [8856, 8856, 31886], "agree": False}
    assert result["patched"] == {"n_max_7_first_3": [799, 799, 799], "n_max_3": [799, 799, 799], "agree": True}
    assert hashlib.sha256(pinned.read_bytes()).hexdigest() == before


def test_patch_that_does_not_apply(tmp_path):
    bad = tmp_path / "bad.patch"
    bad.write_text("--- a/common/speculative.cpp\n+++ b/common/speculative.cpp\n@@ -1,1 +1,1 @@\n-no such line\n+x\n")
    with pytest.raises(RuntimeError, match="bad.patch does not apply to the pinned tree"):
        patched.patched_tool(bad, tmp_path / "w")
