"""The foundation: the pin, the native module, gguf_info, the fetch step, the tiny target."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dflash_llama
from dflash_llama import paths

ROOT = Path(__file__).resolve().parents[1]
FETCH = ROOT / "third_party" / "fetch_llama_cpp.py"


def test_llama_cpp_commit_is_the_pin():
    lock = (ROOT / "third_party" / "llama.cpp.lock").read_text()
    assert "commit = 0c1e570" in lock
    assert dflash_llama.llama_cpp_commit() == "0c1e570"


def test_version_is_set():
    assert dflash_llama.__version__ == "0.1.0"


def test_gguf_info_smollm2(smollm2_gguf):
    info = dflash_llama.gguf_info(smollm2_gguf)
    assert info.architecture == "llama"
    assert info.block_count == 30
    assert info.get("llama.embedding_length") == 576
    assert len(info.tensors) == 272
    assert len(info.metadata["tokenizer.ggml.tokens"]) == 49152
    embd = info.tensor("token_embd.weight")
    assert embd.shape == (576, 49152)
    assert embd.type == "q8_0"  # the file's one q8_0 tensor; the layers are q4_1
    assert info.tensor("blk.0.attn_q.weight").type == "q4_1"
    assert info.tensor("output_norm.weight").type == "f32"


def test_gguf_info_rejects_text_file(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is not a model\n")
    with pytest.raises(ValueError, match=r"notes\.gguf: not a GGUF file"):
        dflash_llama.gguf_info(p)


def test_gguf_info_rejects_truncated_file(smollm2_gguf, tmp_path):
    p = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(50_000_000))
    with pytest.raises(ValueError,
                       match=r"truncated\.gguf: truncated: tensor data needs \d+ bytes but the file has 50000000"):
        dflash_llama.gguf_info(p)


def test_gguf_info_rejects_truncated_header(smollm2_gguf, tmp_path):
    p = tmp_path / "header.gguf"
    with open(smollm2_gguf, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(1000))
    with pytest.raises(ValueError, match=r"header\.gguf: corrupt or truncated GGUF header"):
        dflash_llama.gguf_info(p)


def test_gguf_info_rejects_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.gguf: no such file"):
        dflash_llama.gguf_info(tmp_path / "nope.gguf")


def test_fetch_refuses_a_tampered_hash(tmp_path):
    cache = ROOT / "third_party" / ".cache"
    sdists = list(cache.glob("llama_cpp_python-*.tar.gz"))
    assert sdists, "the fetch step keeps the sdist in third_party/.cache"
    lock = (ROOT / "third_party" / "llama.cpp.lock").read_text()
    good = next(line for line in lock.splitlines() if line.startswith("sha256")).split("=")[1].strip()
    bad = ("0" if good[0] != "0" else "1") + good[1:]
    (tmp_path / "llama.cpp.lock").write_text(lock.replace(good, bad))
    (tmp_path / ".cache").symlink_to(cache)  # reuse the downloaded sdist: no network
    result = subprocess.run([sys.executable, str(FETCH), "--lock", str(tmp_path / "llama.cpp.lock"),
                             "--dest", str(tmp_path / "llama.cpp")], capture_output=True, text=True)
    assert result.returncode == 1
    assert "sha256 mismatch for llama_cpp_python-0.3.36.tar.gz" in result.stderr
    assert f"says {bad}" in result.stderr
    assert not (tmp_path / "llama.cpp").exists()


def test_fetch_is_a_no_op_when_present():
    result = subprocess.run([sys.executable, str(FETCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "llama.cpp 0c1e570 at" in result.stdout


def test_runtime_does_not_import_torch():
    # the base install (numpy, gguf) runs the runtime; torch comes with the reference, train and parity extras
    code = ("import sys, dflash_llama; dflash_llama.Runtime; dflash_llama.gguf_info\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_cli_help_does_not_import_torch():
    # `dflash-llama --help` builds every subcommand's parser: their heavy imports wait for the work itself
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "dflash_llama.cli", "--help"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "convert" in result.stdout and "run" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "dflash_llama.cli_args" in imported  # the import log is read
    assert not imported & {"torch", "transformers", "matplotlib"}


def test_cli_unknown_subcommand_argument_exits_2():
    result = subprocess.run([sys.executable, "-m", "dflash_llama.cli", "convert", "--no-such-flag"],
                            capture_output=True, text=True)
    assert result.returncode == 2


@pytest.mark.peer
def test_tiny_target_gguf_decodes_text(tiny_target_gguf):
    info = dflash_llama.gguf_info(tiny_target_gguf)
    assert info.architecture == "qwen3"
    assert info.get("tokenizer.ggml.pre") == "smollm"
    result = subprocess.run(
        [str(paths.tool("llama-completion")), "-m", str(tiny_target_gguf), "-p", "def fibonacci(n):",
         "-n", "8", "--temp", "0", "-no-cnv", "-t", "2"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("def fibonacci(n):")
    assert len(result.stdout) > len("def fibonacci(n):")
