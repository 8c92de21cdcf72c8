"""bench/gpu_check.py, the checks bench/gpu_check.sh runs on a GPU machine: each check on the tiny
pair on the CPU (-ngl 0, what `bench/gpu_check.sh --cpu` runs), and its report."""

from __future__ import annotations

import pytest

from dflash_llama import Runtime
from dflash_llama.bench import gpu_check


def test_device_folder_names(monkeypatch):
    assert gpu_check.slug("GPU 0: NVIDIA H200 (UUID: GPU-1234-abcd)") == "nvidia-h200"
    assert gpu_check.slug("GPU 1: NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    assert gpu_check.devices() == []


def test_the_checks_and_their_report_on_the_cpu(tiny_target_gguf, tiny_draft_gguf):
    rt = Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=1, n_ctx=512)
    tokens = rt.tokenize("def add(a, b):\n    return a + b\n" * 40)[:340]
    logits = gpu_check.verify_logits(rt, tokens)
    assert [(r["prefix"], r["block"]) for r in logits] == [(24, 2), (24, 8), (24, 16), (300, 2), (300, 8), (300, 16)]
    assert all(r["bit_equal"] and r["max_abs_diff"] == 0.0 for r in logits)  # the CPU build: exact by construction
    greedy = gpu_check.greedy_exactness(rt, [("a", "def f(x):"), ("b", "Once upon")], 12, rt.block_size)
    methods = [r["method"] for r in greedy if r["prompt"] == "a"]
    assert methods == ["plain", "dflash-1", "dflash-3", f"dflash-{rt.block_size - 1}", "dflash-auto"]
    assert all(r["exact"] for r in greedy if r["method"] != "plain")
    res = {"argv": "-ngl 0", "started": "now", "devices": [], "gpu_offload": False, "n_gpu_layers": 0,
           "machine": "cpu", "version": "0", "llama_cpp": "x", "target": "t", "draft": "d", "n_predict": 12,
           "build_seconds": None, "check_seconds": 1.0, "bench": {"seconds": 2.0, "returncode": 0},
           "verify_logits": logits, "greedy": greedy}
    md = gpu_check.markdown(res)
    assert "| 300 | 16 | 0 | yes |" in md
    assert "| dflash-auto | 2/2 |" in md and "Outputs that differ" not in md
    greedy[1]["exact"], greedy[1]["first_diff"] = False, 5
    assert "- a, dflash-1: token 5" in gpu_check.markdown(res)


@pytest.mark.parametrize("argv, message", [(["--limit", "0"], "--limit must be at least 1, got 0"),
                                           (["--bench-min", "0"], "--bench-min must be at least 0.5, got 0.0")])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip().endswith(f"error: {message}")
