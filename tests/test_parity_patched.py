"""The patches under patches/, applied to a copy of the pinned tree, remove their findings' divergence
(and the pinned tree itself stays untouched)."""

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


def test_u4_and_u5_gone_in_the_patched_copy(tmp_path):
    tree = patched.ROOT / "third_party" / "llama.cpp"
    pinned = [tree / "common" / "speculative.cpp", tree / "src" / "models" / "dflash.cpp"]
    before = [hashlib.sha256(p.read_bytes()).hexdigest() for p in pinned]
    exe = patched.patched_tool([patched.PATCHES / name for name in sorted(patched.SHOW)], tmp_path)

    u5 = patched.show_u5(exe)
    assert u5["pinned"] == {"n_max_7_first_3": [799, 799, 799], "n_max_3": [8856, 8856, 31886], "agree": False}
    assert u5["patched"] == {"n_max_7_first_3": [799, 799, 799], "n_max_3": [799, 799, 799], "agree": True}
    u4 = patched.show_u4(exe)
    assert (u4["published"], u4["raw"], u4["pinned"], u4["patched"]) == (0.114, 0.249, 0.249, 0.114)
    assert u4["fixed"] and u5["fixed"]
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in pinned] == before


def test_patch_that_does_not_apply(tmp_path):
    bad = tmp_path / "bad.patch"
    bad.write_text("--- a/common/speculative.cpp\n+++ b/common/speculative.cpp\n@@ -1,1 +1,1 @@\n-no such line\n+x\n")
    with pytest.raises(RuntimeError, match="bad.patch does not apply to the pinned tree"):
        patched.patched_tool(bad, tmp_path / "w")
