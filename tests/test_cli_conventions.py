"""One convention for every `dflash-llama` subcommand: llama.cpp's flags with one default each
(dflash_llama.cli_args), one way to resolve a pair (converter.pair.resolve_draft), one-line errors
with exit 2 for usage and input errors."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from dflash_llama import cli, cli_args
from dflash_llama.converter import convert
from dflash_llama.converter.pair import resolve_draft
from dflash_llama.paths import cache_dir

# subcommand -> (takes a target with -m, takes a draft with -md)
TAKES = {"convert": (True, False), "generate": (True, True), "parity": (True, True), "bench": (True, True),
         "train": (True, True), "run": (True, True), "fetch": (False, False)}
# flag -> its one default; parity's -n (tokens per prompt of a short end-to-end check) means another thing
SHARED = {"-t": cli_args.THREADS, "-c": cli_args.CTX_SIZE, "-n": cli_args.N_PREDICT, "-s": cli_args.SEED,
          "--temp": cli_args.TEMP}
OWN_MEANING = {("parity", "-n")}
# the runtime's own decoding leaves -t unset by default: it measures the fastest thread count
MEASURED_THREADS = {"generate", "run"}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    ap, _ = cli.build_parser()
    action = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def option(p: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in p._actions if flag in a.option_strings), None)


def test_every_subcommand_is_routed():
    assert set(subparsers()) == set(cli.SUBCOMMANDS) == set(TAKES)


@pytest.mark.parametrize("name", sorted(TAKES))
def test_model_flags_as_llama_cpp_spells_them(name):
    p = subparsers()[name]
    takes_target, takes_draft = TAKES[name]
    m = option(p, "-m")
    assert (m is not None) == takes_target
    if m is None:  # fetch: names a target, reads no model
        assert option(p, "-md") is None
        return
    assert m.option_strings == ["-m", "--model", "--target"] and m.dest == "target"
    md = option(p, "-md")
    assert (md is not None) == takes_draft
    if md is not None:
        assert md.option_strings[:2] == ["-md", "--model-draft"]
        assert md.option_strings[2] == ("--init" if name == "train" else "--draft")  # the old spelling
    help_text = p.format_help()
    assert "-m TARGET, --model TARGET, --target TARGET" in help_text


def test_convert_takes_the_draft_as_its_input():
    p = subparsers()["convert"]
    positional = [a for a in p._actions if not a.option_strings and a.dest != "help"]
    assert [a.dest for a in positional] == ["draft"] and option(p, "-md") is None
    args = p.parse_args(["d/", "-m", "t.gguf", "-o", "o.gguf"])
    assert (args.draft, args.target, args.outfile) == ("d/", "t.gguf", "o.gguf")


@pytest.mark.parametrize("flag", sorted(SHARED))
def test_shared_flags_have_one_default(flag):
    seen = {}
    for name, p in subparsers().items():
        a = option(p, flag)
        if a is not None and (name, flag) not in OWN_MEANING:
            seen[name] = a.default
    if flag == "-t":
        assert {n: seen.pop(n) for n in MEASURED_THREADS} == dict.fromkeys(MEASURED_THREADS)
    assert seen and set(seen.values()) == {SHARED[flag]}, seen
    long = {"-t": "--threads", "-c": "--ctx-size", "-n": "--n-predict", "-s": "--seed", "--temp": "--temp"}[flag]
    assert all(long in option(p, flag).option_strings for n, p in subparsers().items() if n in seen)


def test_who_takes_which_shared_flag():
    has = {name: {f for f in SHARED if option(p, f) is not None} for name, p in subparsers().items()}
    assert has["run"] == {"-t", "-c", "-n"}  # greedy only: exactness is its check
    assert has["generate"] == set(SHARED)
    assert has["bench"] == {"-t", "-c", "-n"}
    assert has["train"] == {"-t", "-s"}
    assert "-t" in has["parity"] and has["convert"] == set()


def test_generate_defaults_to_the_runtime_engine():
    args = subparsers()["generate"].parse_args(["-m", "t.gguf", "--no-draft", "-p", "x"])
    assert args.engine == "runtime" and args.n_predict == cli_args.N_PREDICT


def dflash(*argv, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_llama.cli", *map(str, argv)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def assert_one_line_error(res: subprocess.CompletedProcess, command: str, rc: int, message: str) -> None:
    assert res.returncode == rc, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith(f"dflash-llama {command}: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert message in res.stderr, res.stderr


@pytest.mark.parametrize("argv, message", [
    (["-n", "0"], "max_new_tokens must be at least 1, got 0"),
    (["-n", "-1"], "max_new_tokens must be at least 1, got -1"),
    (["--block-size", "1"], "block size must be at least 2, got 1"),
    (["--block-size", "0"], "block size must be at least 2, got 0"),
    (["-n", "abc"], "argument -n/--n-predict: invalid int value: 'abc'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_run_usage_errors_exit_2_in_one_line(tiny_target_gguf, tiny_draft_gguf, argv, message):
    res = dflash("run", "-m", tiny_target_gguf, "-md", tiny_draft_gguf, "-t", "1", "--no-check", *argv)
    assert_one_line_error(res, "run", 2, message)
    assert res.stdout == ""  # nothing printed before the runtime refused the request


def test_generate_missing_files_exit_2_in_one_line(tiny_target_gguf, tmp_path):
    res = dflash("generate", "-m", tmp_path / "missing.gguf", "--no-draft", "-p", "x")
    assert_one_line_error(res, "generate", 2, f"{tmp_path / 'missing.gguf'}: no such file")
    res = dflash("generate", "-m", tiny_target_gguf, "-md", tmp_path / "nowhere", "-p", "x")
    assert_one_line_error(res, "generate", 2, f"no DFlash draft at {tmp_path / 'nowhere'}")


def test_generate_runtime_checks_surface_as_one_line(tiny_target_gguf, tiny_draft_gguf):
    res = dflash("generate", "-m", tiny_target_gguf, "-md", tiny_draft_gguf, "-p", "x", "--top-p", "1.5", "-t", "1")
    assert_one_line_error(res, "generate", 2, "top_p must be in (0, 1], got 1.5")
    res = dflash("generate", "-m", tiny_target_gguf, "--no-draft", "-p", "x", "-s", "-3", "-t", "1")
    assert_one_line_error(res, "generate", 2, "seed must be >= 0, got -3")


def test_unknown_flag_on_every_subcommand_is_one_line(capsys):
    for name in TAKES:
        with pytest.raises(SystemExit) as e:
            cli.main([name, "-m", "t.gguf", "--no-such-flag"])
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert err.startswith(f"dflash-llama {name}: error: ") and err.count("\n") == 1, err
        assert "--no-such-flag" in err or "required" in err, err  # convert: its required arguments first


def test_resolve_draft_converts_once_per_content_and_type(tiny_draft_hf, tiny_target_gguf, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("DFLASH_LLAMA_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    f16 = resolve_draft(tiny_draft_hf, tiny_target_gguf)
    f32 = resolve_draft(tiny_draft_hf, tiny_target_gguf, "f32")
    assert f16.parent == f32.parent == tmp_path / "cache" and f16 != f32
    assert f16.name.startswith(f"{tiny_draft_hf.name}-") and f16.name.endswith("-f16.gguf")
    assert f32.read_bytes() == convert(tiny_draft_hf, tiny_target_gguf, tmp_path / "direct.gguf", "f32").read_bytes()
    stamp = f16.stat().st_mtime_ns
    assert resolve_draft(tiny_draft_hf, tiny_target_gguf) == f16 and f16.stat().st_mtime_ns == stamp  # cached
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([f16.name, f32.name])
    assert resolve_draft(f32, tiny_target_gguf) == f32  # a GGUF is itself
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "d.gguf").write_bytes(f16.read_bytes())
    assert resolve_draft(holder, tiny_target_gguf) == holder / "d.gguf"  # a folder holding one GGUF


def test_resolve_draft_errors(tiny_target_gguf, tmp_path):
    with pytest.raises(FileNotFoundError, match="no DFlash draft at"):
        resolve_draft(tmp_path / "nowhere", tiny_target_gguf)
    with pytest.raises(ValueError, match=r"neither a GGUF nor a Hugging Face checkpoint \(no config.json\)"):
        resolve_draft(tmp_path, tiny_target_gguf)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 GGUF files: name the one to use"):
        resolve_draft(tmp_path, tiny_target_gguf)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="expected a .gguf file or a Hugging Face folder"):
        resolve_draft(tmp_path / "notes.txt", tiny_target_gguf)


def test_one_cache_folder(tmp_path, monkeypatch):
    from dflash_llama.parity import registry

    monkeypatch.setenv("DFLASH_LLAMA_CACHE", str(tmp_path))
    assert registry.cache_dir() == cache_dir() / "parity" == tmp_path / "parity"
