"""The reproductions of docs/upstream_status.md run and reproduce on the pinned llama.cpp (when a
finding gets fixed upstream, its test fails: update the document and the registry)."""

from __future__ import annotations

import pytest

from dflash_llama.parity import findings


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("DFLASH_LLAMA_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def test_u1_pinned_converter_drops_default_taps(capsys):
    assert findings.u1_converter_default_layers()
    out = capsys.readouterr().out
    assert "wrote dflash.target_layers: False" in out
    assert "DFlash model requires 'target_layers' in GGUF metadata" in out


def test_u4_logit_scale_and_softcap_not_applied(capsys):
    assert findings.u4_logit_scale_ignored()
    assert "draft-dflash 0.249, published logits 0.114" in capsys.readouterr().out


def test_u5_block_length_changes_drafts(capsys):
    assert findings.u5_block_length()
    assert "l_out-1 at those positions differs by 4.1e-01" in capsys.readouterr().out


def test_u7_gemma3_target_aborts_draft_dflash(capsys):
    assert findings.u7_gemma3_no_layer_inputs()
    assert 'GGML_ASSERT(t_layer_inp[il] != nullptr && "layer input tensor is null") failed' in capsys.readouterr().out


def test_u9_pinned_converter_cannot_read_speculators_dflash2(capsys):
    assert findings.u9_speculators_dflash2()
    assert capsys.readouterr().out == (
        "U9: speculators-format DFlash 2 draft: pinned convert_hf_to_gguf.py failed: KeyError: \"could not find "
        "any of: ['n_layers', 'num_hidden_layers', 'n_layer', 'num_layers']\"; ours gave the z-lab conversion's "
        "bytes: True\n")


def test_u10_dflash2_default_block_drafts_other_tokens(capsys):
    assert findings.u10_dflash2_default_block()
    assert capsys.readouterr().out == (
        "U10: tiny-dflash2-f32 (B = 8, top-K 4), 8 contexts: llama.cpp's drafts against the reference's at B: "
        "n_max 7 agrees at 100% of positions, n_max 3 (default) at 4% (per position 0%/0%/12%); tau were the "
        "reference's drafts the target's: 8.00 vs 1.00 (cap 4)\n")


def test_main_counts_and_refuses_unknown(capsys):
    assert findings.main(["U4", "U5"]) == 2
    assert capsys.readouterr().out.count("REPRODUCED") == 2
    assert findings.main(["U99"]) == 255
    assert "unknown finding(s) U99; known: U1, U2, U3, U4, U5, U7, U9, U10, U11" in capsys.readouterr().err


def test_u5_patch_applies_to_the_pinned_tree():
    import subprocess

    from dflash_llama.parity import patched

    patch = patched.PATCHES / "u5-dflash-full-block.patch"
    assert patched.touched_files(patch) == ["common/speculative.cpp", "src/models/dflash.cpp"]
    r = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "-d", str(patched.ROOT / "third_party" / "llama.cpp"),
                        "-i", str(patch)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # alone too (its dflash.cpp hunk is made after U3's, 3 lines earlier)
    assert r.stdout.strip().splitlines() == ["checking file common/speculative.cpp",
                                             "checking file src/models/dflash.cpp",
                                             "Hunk #1 succeeded at 799 (offset -3 lines)."]
