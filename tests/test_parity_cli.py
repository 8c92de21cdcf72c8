"""`dflash-llama parity`: arguments, exit codes, the registry and `--all`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from parity_helpers import tiny_draft

from dflash_llama import cli
from dflash_llama.parity import faults, registry


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_target_hf, tiny_target_gguf):
    return tiny_draft(tmp_path_factory, tiny_target_hf, tiny_target_gguf, name="cli")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text(json.dumps({"id": "p0", "prompt": "def add(a, b):\n    return"}) + "\n")
    return path


def test_missing_arguments(capsys):
    assert cli.main(["parity", "--target", "t.gguf"]) == 2
    assert "dflash-llama parity: error: -md --out required (or --all)" in capsys.readouterr().err


def test_counts_must_be_positive(tmp_path, capsys, pair):
    for flag in ("--prompt-tokens", "--n-predict"):
        assert cli.main(["parity", "-m", "t.gguf", "-md", str(pair[1]), "--out", str(tmp_path / "r"), flag, "0"]) == 2
        assert f"dflash-llama parity: error: {flag} must be at least 1, got 0\n" == capsys.readouterr().err


def test_quant_study_arguments(tmp_path, capsys):
    assert cli.main(["parity", "--quant-study"]) == 2
    assert "dflash-llama parity: error: --quant-study needs --out" in capsys.readouterr().err
    assert cli.main(["parity", "--quant-study", "-m", "t.gguf", "--out", str(tmp_path / "q")]) == 2
    assert "--quant-study needs both -m and --draft-hf (or neither)" in capsys.readouterr().err


def test_missing_file(tmp_path, capsys, pair):
    assert cli.main(["parity", "--target", str(tmp_path / "none.gguf"), "--draft", str(pair[1]),
                     "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert f"--target {tmp_path / 'none.gguf'}: no such file" in capsys.readouterr().err


def test_missing_file_with_patched_is_reported_before_the_build(tmp_path, capsys, pair, monkeypatch):
    monkeypatch.setenv("DFLASH_LLAMA_CACHE", str(tmp_path / "cache"))
    assert cli.main(["parity", "--patched", "--target", str(tmp_path / "none.gguf"), "--draft", str(pair[1]),
                     "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert f"--target {tmp_path / 'none.gguf'}: no such file" in capsys.readouterr().err
    assert not (tmp_path / "cache" / "patched").exists()  # nothing was built


def test_unknown_registry_pair(capsys):
    assert cli.main(["parity", "--all", "--only", "tiny-f32,nope"]) == 2
    assert "--only: no registry pair named nope" in capsys.readouterr().err


def test_registry_is_well_formed():
    pairs, defaults = registry.load()
    names = [p.name for p in pairs]
    assert names[:2] == ["tiny-f32", "tiny-f16-gqa"]
    assert {"smollm2-default-f32", "smollm2-default-f16", "smollm2-default-q8_0"} <= set(names)
    assert all(p.finding for p in pairs if p.expect == "fail")
    from dflash_llama.fixtures import TinyDraftConfig

    for p in pairs:
        if p.kind == "fixture":
            TinyDraftConfig(**p.draft_cfg)  # every key is a fixture field
            assert p.outtype in ("f32", "f16", "bf16", "q8_0")
    assert defaults["draft_dir"] == "smollm2-135m-dflash"
    published = next(p for p in pairs if p.kind == "files")
    res = registry.resolve(published, defaults)
    assert res.skip is not None and res.skip.startswith("not on disk: ")


def test_bad_registry(tmp_path):
    bad = tmp_path / "r.toml"
    bad.write_text('[[pair]]\nname = "a"\nkind = "weird"\n')
    with pytest.raises(ValueError, match="pair 0 needs a name and kind = fixture, default or files"):
        registry.load(bad)
    bad.write_text('[[pair]]\nname = "a"\nkind = "files"\n[[pair]]\nname = "a"\nkind = "files"\n')
    with pytest.raises(ValueError, match=r"pair names must be unique, repeated: \['a'\]"):
        registry.load(bad)


def test_fault_exits_one_and_names_the_intermediate(pair, tiny_target_gguf, prompt_file, tmp_path, capsys):
    bad = faults.swap_tensors(pair[1], tmp_path / "swap.gguf", "blk.0.ffn_norm.weight", "output_norm.weight")
    out = tmp_path / "report"
    rc = cli.main(["parity", "--target", str(tiny_target_gguf), "--draft", str(bad), "--draft-hf", str(pair[0]),
                   "--prompts", str(prompt_file), "--graph-prompts", "1", "--no-end-to-end", "--quiet",
                   "--out", str(out)])
    assert rc == 1
    captured = capsys.readouterr()
    printed = captured.out
    assert "de-quantizing" not in captured.err and "it/s" not in captured.err  # --quiet: no bar, transformers' too
    assert "parity report: FAIL" in printed
    assert "first divergence: ffn_norm-0 (draft layer 0): reference/runtime relative error" in printed
    md = (out / "parity.md").read_text()
    assert "First divergence: ffn_norm-0 (draft layer 0)" in md
    data = json.loads((out / "parity.json").read_text())
    assert data["first_divergence"]["name"] == "ffn_norm-0" and data["name"] == "report"
    assert data["stages"]["end_to_end"] == {"status": "skipped", "reason": "--no-end-to-end"}


def test_all_fails_when_an_expected_failure_passes(pair, tiny_target_gguf, tiny_target_hf, prompt_file,
                                                   tmp_path, capsys):
    reg = tmp_path / "registry.toml"
    reg.write_text(f'[[pair]]\nname = "clean"\nkind = "files"\ntarget = "{tiny_target_gguf}"\n'
                   f'draft = "{pair[1]}"\ndraft_hf = "{pair[0]}"\ntarget_hf = "{tiny_target_hf}"\n'
                   f'expect = "fail"\nfinding = "U0: pretend"\n'
                   f'[[pair]]\nname = "absent"\nkind = "files"\ntarget = "/nonexistent/t.gguf"\n'
                   f'draft = "/nonexistent/d.gguf"\n')
    rc = cli.main(["parity", "--all", "--registry", str(reg), "--out", str(tmp_path / "all"),
                   "--prompts", str(prompt_file), "--graph-prompts", "1", "--no-end-to-end", "--no-native",
                   "--quiet"])
    assert rc == 1
    printed = capsys.readouterr().out
    assert "parity absent: skipped (not on disk: /nonexistent/t.gguf, /nonexistent/d.gguf)" in printed
    summary = json.loads((tmp_path / "all" / "summary.json").read_text())
    assert summary[0]["result"] == "UNEXPECTED pass: expected to fail (U0: pretend); update the registry"
    assert summary[1]["result"] == "skipped"
    report = json.loads((tmp_path / "all" / "clean" / "parity.json").read_text())
    assert report["passed"] and report["stages"]["graph"]["missing"] == {}
    assert set(report["stages"]["graph"]["errors"]) == {"reference/runtime"}  # --no-native
