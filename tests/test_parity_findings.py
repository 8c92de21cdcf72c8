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
    known = "U1, U2, U3, U4, U5, U7, U9, U10, U11, U12, U13, U14, U15, U16, U17, U18, U19"
    assert f"unknown finding(s) U99; known: {known}" in capsys.readouterr().err


def test_u18_speculative_simple_drafts_past_n_predict(capsys):
    assert findings.u18_draft_past_n_predict()
    assert "-n 20 --spec-type draft-simple --spec-draft-n-max 16, the target as its own draft: decoded 37 tokens " \
        "(plain decoding stops at 21)" in capsys.readouterr().out


def test_u19_a_block_longer_than_the_ubatch_aborts(capsys):
    assert findings.u19_block_past_ubatch()
    out = capsys.readouterr().out
    assert "(a block of 8): -ub 8 exit code 0; -ub 7 exit code -6: " in out and "n_ubatch >= n_tokens" in out


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


# --- DSpark drafts (docs/variants.md, "The pinned llama.cpp's converter and loop") ---------------------


def test_u12_pinned_converter_takes_the_embeddings_for_the_head(capsys):
    assert findings.u12_dspark_own_head_dropped()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "U12: DeepSpec DSpark draft, untied tiny target: pinned convert_hf_to_gguf.py wrote token_embd.weight True, "
        "output.weight False; draft-dspark drafts equal to the reference's: pinned GGUF 0/63, ours 63/63")


def test_u13_speculators_draft_without_the_key_drafts_in_dflash_layout(capsys):
    assert findings.u13_speculators_layout_guessed()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "U13: speculators DSpark draft without sample_from_anchor: dflash.sample_from_anchor pinned False, ours True; "
        "draft-dspark drafts equal to the anchor-first reference's: pinned GGUF 4/55 (5 a step), ours 63/63 "
        "(6 a step); tau were the reference's drafts the target's: 1.08 vs 5.85")


def test_u14_anchor_first_dflash_drafts_one_slot_late(capsys):
    assert findings.u14_anchor_first_dflash_as_draft_dflash()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "U14: DeepSpec anchor-first DFlash draft (block 6): pinned converter wrote sample_from_anchor True, "
        "markov_w1 False; with no --spec-type the tool auto-detects draft-dflash: True; its drafts equal the "
        "reference's at the same slot 28/55, at the next slot 55/55; --spec-type draft-dspark: 63/63; tau were the "
        "reference's drafts the target's: 1.00 (draft-dflash) vs 5.85 (draft-dspark)")


def test_u15_specforge_gated_head_not_refused_as_one(capsys):
    assert findings.u15_specforge_markov_type_unread()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "U15: markov_head_type 'gated' in SpecForge's dflash_config: pinned convert_hf_to_gguf.py wrote a GGUF; "
        "with a gated head's gate_proj tensors: failed: ValueError: Can not map tensor "
        "'model.markov_head.gate_proj.bias'; the same key at DeepSpec's top level: failed: ValueError: unsupported "
        "markov_head_type 'gated' (only 'vanilla' is supported)")


def test_u16_documented_conf_min_flag_does_not_exist(capsys):
    assert findings.u16_conf_min_flag()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "U16: docs/speculative.md names --spec-draft-conf-min: True; llama-speculative-simple --spec-draft-conf-min "
        "0.5: exit code 1: error: invalid argument: --spec-draft-conf-min; --spec-draft-p-min 0.5: 33 tokens "
        "drafted, 63 without it (the confidence head's cut)")


def test_u17_speculators_dspark_gguf_misses_the_norm_epsilon(capsys):
    assert findings.u17_speculators_dspark_defaults()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "U17: speculators DSpark draft, rms_norm_eps at Qwen3Config's default (left out of the config's diff): "
        "dflash.attention.layer_norm_rms_epsilon pinned None, ours 1.0e-06; llama-speculative-simple on the pinned "
        "GGUF: exit code 1: key not found in model: dflash.attention.layer_norm_rms_epsilon; on ours: 18 tokens "
        "drafted")


def test_s5_markov_bias_applied_at_every_block_the_loop_runs(capsys):
    """Refuted (docs/variants.md): the loop clamps a longer draft to the trained block, and drafts the argmax
    chain at any temperature; the check fails once either stops holding."""
    assert not findings.s5_markov_bias_skipped()
    assert capsys.readouterr().out.splitlines()[-1] == (
        "S5: --spec-draft-n-max 12 on a block-6 DSpark draft: clamped True, 6 drafts a step, equal to the "
        "reference's Markov chain 63/63, to its unbiased drafts 17/63; --temp 0.8: drafts equal to the reference's "
        "greedy chain on the sampled path 63/63")


def test_tool_steps_reads_each_verify():
    """The debug-log reader: the tool's own totals are the sums of the steps it read."""
    _, target, _, draft = findings.dspark_fixture("u12", seed=61)
    steps = findings.tool_steps(target, draft, n_predict=8)
    assert sum(map(len, steps.drafts)) == steps.n_drafted and sum(steps.accepted) == steps.n_accept
    assert len(steps.drafts) == len(steps.last) >= 8 and max(map(len, steps.drafts)) == 6


def test_dspark_converter_patch_fixes_u13_u15_u17(tmp_path):
    """patches/u13-u15-u17-dspark-converter.patch (not in patches/series yet) on a copy of the pinned
    converter: a key-less speculators draft converts anchor-first with its norm epsilon and drafts as the
    reference does; SpecForge's gated Markov head is refused as one."""
    import json
    import shutil
    import subprocess

    from dflash_llama import fixtures, gguf_info
    from dflash_llama.parity import patched

    tree, work = patched.ROOT / "third_party" / "llama.cpp", tmp_path / "llama.cpp"
    work.mkdir()
    shutil.copy(tree / "convert_hf_to_gguf.py", work)
    for folder in ("conversion", "gguf-py"):
        shutil.copytree(tree / folder, work / folder)
    r = subprocess.run(["patch", "-p1", "--forward", "-d", str(work), "-i",
                        str(patched.PATCHES / "u13-u15-u17-dspark-converter.patch")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

    target_hf, target, hf, _ = findings.dspark_fixture("u13", seed=62)
    spec = fixtures.dspark_draft_as(tmp_path / "spec", hf, "speculators")
    config = json.loads((spec / "config.json").read_text())
    del config["sample_from_anchor"]
    (spec / "config.json").write_text(json.dumps(config))

    def convert(src, out):
        fixtures.run_pinned_converter([str(src), "--target-model-dir", str(target_hf), "--outfile", str(out),
                                       "--outtype", "f32"], script=work / "convert_hf_to_gguf.py")
        return out

    info = gguf_info(convert(spec, tmp_path / "spec.gguf"))
    assert info.get("dflash.sample_from_anchor") is True
    assert info.get("dflash.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    steps = findings.tool_steps(target, tmp_path / "spec.gguf")
    assert findings.agreement(steps.drafts, findings.reference_drafts(target, hf, steps)) == (63, 63)

    sf = fixtures.dspark_draft_as(tmp_path / "specforge", hf, "specforge")
    config = json.loads((sf / "config.json").read_text())
    config["dflash_config"]["markov_head_type"] = "gated"
    (sf / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match=r"unsupported markov_head_type 'gated' \(only 'vanilla' is supported\)"):
        convert(sf, tmp_path / "gated.gguf")


def test_u16_docs_patch_applies_to_the_pinned_tree():
    import subprocess

    from dflash_llama.parity import patched

    patch = patched.PATCHES / "u16-dspark-docs-p-min.patch"
    assert patched.touched_files(patch) == ["docs/speculative.md"]
    r = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "-d", str(patched.ROOT / "third_party" / "llama.cpp"),
                        "-i", str(patch)], capture_output=True, text=True)
    assert (r.returncode, r.stdout.strip()) == (0, "checking file docs/speculative.md"), r.stdout + r.stderr
