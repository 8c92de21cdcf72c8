"""Bad arguments and bad prompts on both CLIs and the Python API: one line naming what is wrong, exit 2
for usage and input errors (1 for runtime failures), never a wrap, a traceback or a silent misreading.

One behaviour for prompts that are not UTF-8, in C++ and Python alike: refused by the runtime,
naming the first bad byte (llama.cpp's tokenizer would replace it by U+FFFD without a word)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import dflash_llama
from dflash_llama import cli, paths
from dflash_llama.runtime import utf8_text

INT32 = "[-2147483648, 2147483647]"
NOT_UTF8 = [(b"\xff\xfe", 0, 0xFF), (b"ab\xc3", 2, 0xC3), (b"\xed\xa0\x80", 0, 0xED),  # cut, a surrogate
            (b"x\xc0\x80", 1, 0xC0), (b"ok \xf4\x90\x80\x80", 3, 0xF4)]  # overlong, past U+10FFFF


def utf8_message(offset: int, byte: int) -> str:
    return f"the prompt is not valid UTF-8 (byte 0x{byte:02x} at offset {offset})"


# argv after -m TARGET -md DRAFT -t 1 (a prompt "hi" unless the case gives one), exit code, message
CPP_CASES = [
    (["-n", "4294967297"], 2, f"-n 4294967297 is out of range {INT32}"),
    (["-n", "2147483648"], 2, f"-n 2147483648 is out of range {INT32}"),
    (["-c", "4294967304"], 2, f"-c 4294967304 is out of range {INT32}"),
    (["-t", "99999999999"], 2, f"-t 99999999999 is out of range {INT32}"),
    (["-s", "-3"], 2, "-s -3 is out of range [0, 18446744073709551615]"),
    (["-s", "18446744073709551616"], 2, "-s 18446744073709551616 is out of range [0, 18446744073709551615]"),
    (["-n", "12x"], 2, "invalid integer for -n: '12x'"),
    (["-n", ""], 2, "invalid integer for -n: ''"),
    (["-n", " 4"], 2, "invalid integer for -n: ' 4'"),
    (["-n", "0"], 2, "max_new_tokens must be at least 1, got 0"),
    (["-n", "-1"], 2, "max_new_tokens must be at least 1, got -1"),
    (["--block-size", "0"], 2, "block size must be at least 2, got 0"),
    (["--block-size", "-1"], 2, "block size must be at least 2, got -1"),
    (["--block-size", "1"], 2, "block size must be at least 2, got 1"),
    (["--draft-max", "0"], 2, "draft_max must be at least 1, got 0"),
    (["--draft-max", "-1"], 2, "draft_max must be at least 1, got -1"),
    (["--no-draft", "--block-size", "4"], 2, "block_size and draft_max need a draft"),
    (["--temp", "inf"], 2, "temperature must be finite, got inf"),
    (["--temp", "nan"], 2, "temperature must be finite, got nan"),
    (["--temp", "-1"], 2, "temperature must be >= 0, got -1"),
    (["--temp", "1e99"], 2, "--temp 1e99 is out of range for a 32-bit float"),
    (["--temp", "hot"], 2, "invalid number for --temp: 'hot'"),
    (["--top-p", "0"], 2, "top_p must be in (0, 1], got 0"),
    (["--top-p", "1.5"], 2, "top_p must be in (0, 1], got 1.5"),
    (["--top-p", "nan"], 2, "top_p must be in (0, 1], got nan"),
    (["--top-k", "-1"], 2, "top_k must be >= 0, got -1"),
    (["-t", "-2"], 2, "n_threads must be in [1, 512] (0 or -1: all CPUs), got -2"),
    (["-t", "513"], 2, "n_threads must be in [1, 512] (0 or -1: all CPUs), got 513"),
    (["-c", "0"], 2, "n_ctx must be at least 1, got 0"),
    (["-c", "4"], 2, "the context (4 tokens) is smaller than one draft block (8 tokens)"),
    (["-c", "8", "-p", "word " * 20], 2, "tokens but the context holds 8 (raise n_ctx / -c)"),
    (["-b", "0"], 2, "n_batch must be at least 1, got 0"),
    (["-p", ""], 2, "the prompt is empty"),
    (["-p", "x", "--bogus"], 2, "unknown argument '--bogus'"),
    (["-n"], 2, "missing value for -n"),
    *[(["-p", text], 2, utf8_message(offset, byte)) for text, offset, byte in NOT_UTF8],
]


def cpp_cli(*argv, timeout: float = 120) -> subprocess.CompletedProcess:
    args = [os.fsencode(str(paths.tool("llama-dflash-cli")))] + [a if isinstance(a, bytes) else os.fsencode(str(a))
                                                               for a in argv]
    return subprocess.run(args, capture_output=True, timeout=timeout)


def assert_one_line(stderr: str, prefix: str, message: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert stderr.startswith(prefix) and stderr.count("\n") == 1, stderr
    assert message in stderr, stderr


@pytest.mark.parametrize("argv, rc, message", CPP_CASES, ids=[" ".join(map(repr, c[0]))[:60] for c in CPP_CASES])
def test_llama_dflash_cli_refuses_in_one_line(tiny_target_gguf, tiny_draft_gguf, argv, rc, message):
    prompt = [] if "-p" in argv else ["-p", "hi"]
    res = cpp_cli("-m", tiny_target_gguf, "-md", tiny_draft_gguf, "-t", "1", *prompt, *argv)
    assert res.returncode == rc, res.stderr
    assert_one_line(res.stderr.decode("utf-8", "backslashreplace"), "llama-dflash-cli: error: ", message)
    assert res.stdout == b""  # the prompt is echoed only once the runtime accepted the request


def test_llama_dflash_cli_missing_file_and_bad_prompt_file(tiny_target_gguf, tiny_draft_gguf, tmp_path):
    for argv, message in [(["-m", tmp_path / "missing.gguf", "-md", tiny_draft_gguf, "-p", "x"],
                           f"{tmp_path / 'missing.gguf'}: no such file"),
                          (["-m", tiny_target_gguf, "-md", tiny_draft_gguf, "-f", tmp_path],
                           f"cannot read prompt file '{tmp_path}': a directory"),
                          (["-m", tiny_target_gguf, "-md", tmp_path, "-p", "x"],
                           f"{tmp_path}: is a directory, not a GGUF file"),
                          (["-m", tiny_target_gguf, "-md", tiny_draft_gguf, "-f", tmp_path / "none.txt"],
                           f"cannot read prompt file '{tmp_path / 'none.txt'}'")]:
        res = cpp_cli(*argv)
        assert res.returncode == 2, res.stderr
        assert_one_line(res.stderr.decode(), "llama-dflash-cli: error: ", message)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"def f():\n    return '\xff'\n")
    res = cpp_cli("-m", tiny_target_gguf, "-md", tiny_draft_gguf, "-t", "1", "-f", bad)
    assert res.returncode == 2
    assert_one_line(res.stderr.decode(), "llama-dflash-cli: error: ", utf8_message(21, 0xFF))


def cpp_json(target, draft, *argv) -> dict:
    res = cpp_cli("-m", target, *(["-md", draft] if draft else ["--no-draft"]), "-t", "1", "--json", *argv)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_n_predict_past_the_context_ends_context_full(tiny_target_gguf, tiny_draft_gguf):
    """-n INT32_MAX used to wrap (prompt + n overflowed) and generate one token: now it fills the context."""
    spec = cpp_json(tiny_target_gguf, tiny_draft_gguf, "-p", "def fibonacci(n):", "-n", "2147483647", "-c", "48")
    plain = cpp_json(tiny_target_gguf, None, "-p", "def fibonacci(n):", "-n", "2147483647", "-c", "48")
    n_prompt = spec["stats"]["n_prompt"]
    assert spec["stop_reason"] == plain["stop_reason"] == "context_full"
    assert len(spec["tokens"]) == 48 - n_prompt and spec["tokens"] == plain["tokens"]
    exact = cpp_json(tiny_target_gguf, tiny_draft_gguf, "-p", "def fibonacci(n):", "-n", str(48 - n_prompt),
                     "-c", "48")
    assert exact["stop_reason"] == "max_tokens" and exact["tokens"] == spec["tokens"]


@pytest.mark.parametrize("threads", ["0", "-1"])
def test_threads_zero_and_minus_one_mean_all_as_in_llama_cpp(tiny_target_gguf, tiny_draft_gguf, threads):
    """-t 0 and -t -1 are accepted, documented as "all CPUs" (llama.cpp's meaning), and decode the same tokens;
    -t -2 is refused (CPP_CASES)."""
    usage = cpp_cli("--help")
    assert usage.returncode == 0
    help_line = "-t,  --threads N         CPU threads (0 = all; -1 = all, as llama.cpp; default: measured"
    assert help_line in usage.stdout.decode()
    doc = cpp_json(tiny_target_gguf, tiny_draft_gguf, "-p", "hi", "-n", "3", "-t", threads)
    assert doc["tokens"] == cpp_json(tiny_target_gguf, tiny_draft_gguf, "-p", "hi", "-n", "3")["tokens"]
    rt = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=int(threads), n_ctx=64)
    assert rt.generate("hi", 3).tokens == doc["tokens"]


# dflash-llama run / generate: argv after the subcommand's model flags, exit code, message
RUN_CASES = [
    (["-n", "0"], 2, "max_new_tokens must be at least 1, got 0"),
    (["-n", "-1"], 2, "max_new_tokens must be at least 1, got -1"),
    (["-n", "4294967297"], 2, f"max_new_tokens 4294967297 is out of range {INT32}"),
    (["-c", "4294967304"], 2, f"n_ctx 4294967304 is out of range {INT32}"),
    (["-t", "-2"], 2, "n_threads must be in [1, 512] (0 or -1: all CPUs), got -2"),
    (["--block-size", "1"], 2, "block size must be at least 2, got 1"),
    (["--block-size", "0"], 2, "block size must be at least 2, got 0"),
    (["--block-size", "-3"], 2, "block size must be at least 2, got -3"),
    (["-p", ""], 2, "the prompt is empty"),
    (["-n", "x"], 2, "argument -n/--n-predict: invalid int value: 'x'"),
    *[(["-p", os.fsdecode(text)], 2, utf8_message(offset, byte)) for text, offset, byte in NOT_UTF8[:2]],
]
GENERATE_CASES = [
    (["-p", "hi", "--temp", "inf"], 2, "temperature must be finite, got inf"),
    (["-p", "hi", "--temp", "nan"], 2, "temperature must be finite, got nan"),
    (["-p", "hi", "--top-p", "nan"], 2, "top_p must be in (0, 1], got nan"),
    (["-p", "hi", "-s", str(2**64)], 2, f"seed {2**64} is out of range [0, 18446744073709551615]"),
    (["-p", "hi", "-n", "4294967297"], 2, f"max_new_tokens 4294967297 is out of range {INT32}"),
    (["-p", "hi", "--block-size", "0"], 2, "block size must be at least 2, got 0"),
    (["-p", ""], 2, "the prompt is empty"),
    (["--prompt-ids", "99999999999"], 2, "token 99999999999 is outside the vocabulary of 49152 tokens"),
    *[(["-p", os.fsdecode(text)], 2, utf8_message(offset, byte)) for text, offset, byte in NOT_UTF8],
]


def run_in_process(capsys, argv) -> tuple[int, str, str]:
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, rc, message", RUN_CASES, ids=[" ".join(map(repr, c[0]))[:60] for c in RUN_CASES])
def test_dflash_llama_run_refuses_in_one_line(capsys, tiny_target_gguf, tiny_draft_gguf, argv, rc, message):
    got, out, err = run_in_process(capsys, ["run", "-m", tiny_target_gguf, "-md", tiny_draft_gguf, "-t", "1",
                                            "--no-check", *argv])
    assert (got, out) == (rc, ""), err
    assert_one_line(err, "dflash-llama run: error: ", message)


@pytest.mark.parametrize("argv, rc, message", GENERATE_CASES,
                         ids=[" ".join(map(repr, c[0]))[:60] for c in GENERATE_CASES])
def test_dflash_llama_generate_refuses_in_one_line(capsys, tiny_target_gguf, tiny_draft_gguf, argv, rc, message):
    got, out, err = run_in_process(capsys, ["generate", "-m", tiny_target_gguf, "-md", tiny_draft_gguf, "-t", "1",
                                            *argv])
    assert (got, out) == (rc, ""), err
    assert_one_line(err, "dflash-llama generate: error: ", message)


@pytest.mark.parametrize("argv", [["--temp", "inf"], ["-p", os.fsdecode(b"ab\xc3")]])
def test_the_reference_engine_refuses_alike(capsys, tiny_target_hf, argv):
    prompt = [] if "-p" in argv else ["-p", "hi"]
    got, out, err = run_in_process(capsys, ["generate", "--engine", "reference", "-m", tiny_target_hf, "--no-draft",
                                            *prompt, *argv])
    assert (got, out) == (2, ""), err
    message = "temperature must be finite, got inf" if "--temp" in argv else utf8_message(2, 0xC3)
    assert_one_line(err, "dflash-llama generate: error: ", message)


def test_command_line_bytes_reach_both_clis_alike(tiny_target_gguf, tiny_draft_gguf):
    """Real argv bytes (Python sees surrogate escapes): the same one line from C++ and from dflash-llama."""
    py = subprocess.run([os.fsencode(sys.executable), b"-m", b"dflash_llama.cli", b"run", b"-m",
                         os.fsencode(tiny_target_gguf), b"-md", os.fsencode(tiny_draft_gguf), b"-t", b"1",
                         b"--no-check", b"-p", b"\xff\xfe"], capture_output=True, timeout=300)
    cpp = cpp_cli("-m", tiny_target_gguf, "-md", tiny_draft_gguf, "-t", "1", "-p", b"\xff\xfe")
    assert py.returncode == cpp.returncode == 2
    assert py.stderr.decode() == f"dflash-llama run: error: {utf8_message(0, 0xFF)}\n"
    assert cpp.stderr.decode() == f"llama-dflash-cli: error: {utf8_message(0, 0xFF)}\n"


@pytest.fixture(scope="module")
def rt(tiny_target_gguf, tiny_draft_gguf):
    return dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=1, n_ctx=64)


@pytest.mark.parametrize("text, offset, byte", NOT_UTF8)
def test_runtime_refuses_text_that_is_not_utf8(rt, text, offset, byte):
    message = utf8_message(offset, byte)
    for prompt in (text, os.fsdecode(text)):  # bytes, and argv's surrogate escapes
        with pytest.raises(ValueError) as e:
            rt.generate(prompt, 4)
        assert str(e.value) == message
    with pytest.raises(ValueError, match="not valid UTF-8"):
        rt.tokenize(text)
    with pytest.raises(ValueError) as python_side:  # the reference engine's tokenizer is Python's
        utf8_text(text)
    assert str(python_side.value) == message
    with pytest.raises(ValueError, match="not valid UTF-8"):
        rt.generate("\ud800", 4)  # a lone surrogate in a str is not text either


def test_runtime_takes_utf8_bytes_as_text_never_as_ids(rt):
    text = "def café():"
    assert rt.tokenize(text.encode()) == rt.tokenize(text)
    assert rt.generate(text.encode(), 4).tokens == rt.generate(text, 4).tokens
    assert rt.autoregressive(bytearray(b"hi"), 3).tokens == rt.autoregressive("hi", 3).tokens


@pytest.mark.parametrize("kw, message", [
    ({"n_ctx": 2**40}, f"n_ctx 1099511627776 is out of range {INT32}"),
    ({"n_threads": 2**31}, f"n_threads 2147483648 is out of range {INT32}"),
    ({"n_batch": -2**31 - 1}, f"n_batch -2147483649 is out of range {INT32}"),
    ({"n_threads": -5}, "n_threads must be in [1, 512] (0 or -1: all CPUs), got -5"),
    ({"n_ctx": 2**31 - 1, "n_seq": 2}, "n_ctx * n_seq must be at most 2147483647, got 4294967294"),
])
def test_runtime_arguments_are_converted_without_wrapping(tiny_target_gguf, tiny_draft_gguf, kw, message):
    with pytest.raises(ValueError) as e:
        dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, **kw)
    assert str(e.value) == message


@pytest.mark.parametrize("kw, message", [
    ({"max_new_tokens": 2**31}, f"max_new_tokens 2147483648 is out of range {INT32}"),
    ({"seed": 2**64}, f"seed {2**64} is out of range [0, 18446744073709551615]"),
    ({"seed": -1}, "seed must be >= 0, got -1"),
    ({"block_size": 0}, "block size must be at least 2, got 0"),
    ({"block_size": -1}, "block size must be at least 2, got -1"),
    ({"draft_max": 0}, "draft_max must be at least 1, got 0"),
    ({"top_k": 2**32}, f"top_k 4294967296 is out of range {INT32}"),
    ({"temperature": float("inf")}, "temperature must be finite, got inf"),
    ({"temperature": 1e99}, "temperature must be finite, got inf"),  # no float32 holds it
])
def test_request_values_are_converted_then_checked_in_cpp(rt, kw, message):
    kw = {"max_new_tokens": 4, **kw}
    with pytest.raises(ValueError) as e:
        rt.generate("hi", **kw)
    assert str(e.value) == message


def test_request_types_are_not_misread(rt):
    with pytest.raises(TypeError):
        rt.generate("hi", 4.7)  # not truncated to 4
    with pytest.raises(TypeError):
        rt.generate("hi", True)
    assert rt.generate("hi", 2**31 - 1).stop_reason == "context_full"
    with pytest.raises(ValueError, match="block_size and draft_max need a draft"):
        rt._engine.autoregressive(rt.tokenize("hi"), rt._params(4, 0.0, 1.0, 0, 0, 4, None, (), True), None)


def test_non_utf8_file_names_open(tiny_target_gguf, tiny_draft_gguf, tmp_path):
    target = os.fsdecode(os.fsencode(tmp_path) + b"/t\xff.gguf")
    os.symlink(tiny_target_gguf, target)
    rt = dflash_llama.Runtime(target, tiny_draft_gguf, n_threads=1, n_ctx=64)
    assert rt.generate("hi", 2).tokens
    missing = os.fsdecode(os.fsencode(tmp_path) + b"/none\xfe.gguf")
    with pytest.raises(ValueError, match=r"none\\xfe\.gguf: no such file"):
        dflash_llama.Runtime(missing)


@pytest.mark.parametrize("argv, message", [
    (["train", "-m", "t.gguf", "--lr", "nan"], "argument --lr: expected a finite number, got 'nan'"),
    (["train", "-m", "t.gguf", "--epochs", "inf"], "argument --epochs: expected a finite number, got 'inf'"),
    (["bench", "-m", "t.gguf", "--budget-min=-inf"], "argument --budget-min: expected a finite number, got '-inf'"),
    (["train", "-m", "t.gguf", "--lr", "fast"], "argument --lr: expected a number, got 'fast'"),
])
def test_float_flags_of_the_other_subcommands_are_finite(capsys, argv, message):
    rc, out, err = run_in_process(capsys, argv)
    assert (rc, out) == (2, "")
    assert_one_line(err, f"dflash-llama {argv[0]}: error: ", message)


def test_an_unexpected_exception_is_still_one_line(capsys, monkeypatch):
    from dflash_llama import generate_cli

    def broken(args):
        raise KeyError("no such thing")

    monkeypatch.setattr(generate_cli, "main", broken)
    rc, out, err = run_in_process(capsys, ["generate", "-m", "t.gguf", "--no-draft", "-p", "x"])
    assert (rc, out) == (1, "")
    assert_one_line(err, "dflash-llama generate: error: ", "KeyError: 'no such thing'")
    monkeypatch.setenv("DFLASH_LLAMA_TRACEBACK", "1")
    with pytest.raises(KeyError):
        cli.main(["generate", "-m", "t.gguf", "--no-draft", "-p", "x"])


def test_mmap_loads_as_llama_cpp_and_decodes_the_same(tiny_target_gguf, tiny_draft_gguf):
    """--mmap maps the target's file as llama.cpp's tools do, --no-mmap (the default) reads it into
    memory for huge pages: the same tokens either way."""
    usage = cpp_cli("--help").stdout.decode()
    assert "--mmap, --no-mmap        --mmap: map the target's file as llama.cpp's tools do" in usage
    docs = [cpp_json(tiny_target_gguf, tiny_draft_gguf, "-p", "def f(x):", "-n", "8", *flag)
            for flag in ((), ("--mmap",), ("--no-mmap",))]
    assert docs[0]["tokens"] == docs[1]["tokens"] == docs[2]["tokens"] and len(docs[0]["tokens"]) == 8
