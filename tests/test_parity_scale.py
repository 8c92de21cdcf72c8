"""The scale run's builder (parity/scale.py): a published shape's random target written straight to
GGUF, deterministically, with Qwen's tokenizer; and how a run is measured and reported."""

from __future__ import annotations

import hashlib
import math

import pytest

from dflash_llama.parity import scale

SMALL = scale.Shape(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, tied=False, draft_layers=1,
                    draft_taps=(0, 1))


def test_a_random_target_of_a_shape_is_deterministic_and_runs(tmp_path):
    from dflash_llama import Runtime, gguf_info

    a = scale.write_target(tmp_path / "a.gguf", SMALL, "q8_0", seed=0, log=lambda m: None)
    b = scale.write_target(tmp_path / "b.gguf", SMALL, "q8_0", seed=0, log=lambda m: None)
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    info = gguf_info(a)
    assert info.architecture == "qwen3" and info.get("attention.key_length") == 64
    types = {t.name: t.type for t in info.tensors}
    assert len(types) == 2 + 1 + 2 * 11 and types["token_embd.weight"] == types["blk.1.ffn_down.weight"] == "q8_0"
    assert types["blk.0.attn_q_norm.weight"] == "f32"
    assert SMALL.params == sum(math.prod(t.shape) for t in info.tensors)
    rt = Runtime(a, n_threads=1, n_ctx=256)
    assert rt.n_vocab == scale.VOCAB == 151936
    assert rt.tokenize("def fib(n):") == [750, 15801, 1445, 1648]  # Qwen2/Qwen3's tokenizer
    assert len(rt.autoregressive("def fib(n):", 4).tokens) == 4
    with pytest.raises(KeyError):
        scale.write_target(tmp_path / "c.gguf", SMALL, "q3_k", seed=0)


def test_the_record_of_a_run():
    stderr = ("\tMaximum resident set size (kbytes): 2097152\n"
              "\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02:03.5\n")
    assert scale._time_v(stderr) == {"peak_rss_bytes": 2 << 30, "wall_s": 3723.5}
    assert scale.SHAPES["qwen3-8b"].params == 8_190_735_360  # Qwen3-8B's published count
    built = {"params": 8_190_735_360, "target_bytes": 8 << 30, "draft_bytes": 2 << 30, "target_build_s": 400.0,
             "draft_build_s": 100.0}
    run = {"command": ["-v", "dflash-llama", "parity", "-m", "T"], "peak_rss_bytes": 15 << 30, "wall_s": 3000.0,
           "budget_bytes": 16 << 30, "within_budget": True, "within_time": True, "passed": True,
           "stages": {"capture": "pass"}, "resources": {"phases": [
               {"phase": "converter", "seconds": 60.0, "peak_rss_bytes": 1 << 30, "children_peak_rss_bytes": None}]}}
    md = scale.markdown({"shape": "qwen3-8b", "type": "q8_0", "built": built, "run": run, "machine": "x86_64"})
    assert "8.19 B parameters, GGUF 8.00 GiB" in md
    assert "Whole run: 50.0 min (limit 60), peak resident memory 15.00 GiB" in md
    assert "| converter | 1.0 min | 1.00 GiB | - |" in md
