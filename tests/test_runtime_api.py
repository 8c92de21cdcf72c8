"""The runtime's capture, its Python API and its errors on bad input."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import dflash_llama
from dflash_llama import paths
from dflash_llama.converter import convert
from dflash_llama.parity.gguf_edit import copy_gguf


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def draft_gguf(tiny_draft_hf, tiny_target_gguf, tmp_path_factory) -> Path:
    return convert(tiny_draft_hf, tiny_target_gguf, tmp_path_factory.mktemp("d") / "draft.gguf", outtype="f32")


@pytest.fixture(scope="module")
def rt(tiny_target_gguf, draft_gguf):
    return dflash_llama.Runtime(tiny_target_gguf, draft_gguf, n_threads=2, n_ctx=256, n_batch=32)


def test_capture_matches_hf_hidden_states(tiny_target_gguf, draft_gguf, tiny_target_hf):
    from transformers import AutoModelForCausalLM

    rt = dflash_llama.Runtime(tiny_target_gguf, draft_gguf, n_threads=2, n_ctx=256, n_batch=32, kv_f32=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_hf, dtype=torch.float32).eval()
    tokens = rt.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3)
    assert len(tokens) > 32  # several prefill chunks
    with torch.no_grad():
        hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    layer_ids = [0, 1, 2, 3]  # 3 is the last layer: Hugging Face reports it after the final norm
    feats = rt.capture(tokens, layer_ids)
    assert feats.shape == (len(tokens), len(layer_ids) * 64)
    for k, lid in enumerate(layer_ids):
        ours = feats[:, k * 64:(k + 1) * 64]
        ref = hidden[lid + 1][0].numpy()
        assert rel_err(ours, ref) < 1e-4, f"layer {lid}"


def test_generation_record(rt):
    out = rt.generate("def fibonacci(n):", 16, draft_max=None)  # the whole block, every step
    assert isinstance(out, dflash_llama.Generation)
    assert out.policy is None
    assert len(out.tokens) == 16 and out.stats.n_generated == 16
    assert out.stop_reason == "max_tokens"
    assert out.tau == pytest.approx(sum(s.produced for s in out.steps) / len(out.steps))
    assert len(out.acceptance_by_position) == rt.block_size - 1
    doc = out.to_json()
    assert set(doc) >= {"tokens", "text", "steps", "tau"}
    assert set(doc["steps"][0]) == {"drafted", "accepted", "produced"}
    assert out.stats.t_total_ms >= out.stats.t_prefill_ms + out.stats.t_verify_ms


@pytest.mark.parametrize("n_new", [24, 3])
def test_adaptive_generation_record(rt, n_new):
    """What the policy reports is the steps taken; greedy, a first generation opens plain with a shadow
    probe (with 3 tokens one of a single proposal: all the room there is)."""
    rt.forget_policy()  # as a new Runtime's first generation (the fixture's has decoded before)
    out = rt.generate("def fibonacci(n):", n_new, ngram=False)  # draft_max="auto" by default
    p = out.policy
    assert isinstance(p, dflash_llama.runtime.Policy)
    assert p.plain_steps + p.draft_steps == len(out.steps) and p.ngram_steps == 0
    plain = [s for s in out.steps if not s.drafted]
    assert len(plain) == p.plain_steps and all(s.produced == 1 and s.accepted == 0 for s in plain)
    assert out.steps[0].drafted == [] and p.shadow_probes >= 1
    drafting = [len(s.drafted) for s in out.steps if s.drafted]
    assert p.mean_draft == pytest.approx(sum(drafting) / len(drafting) if drafting else 0.0)
    assert p.steps_line() == (f"{p.plain_steps} plain, {p.draft_steps} draft (tau {p.draft_tau:.2f}), 0 n-gram "
                              "(acc 0.00)")
    assert p.shadow_probes <= p.probes <= p.shadow_probes + p.draft_steps
    assert out.to_json()["policy"]["plain_steps"] == p.plain_steps
    assert out.tokens == rt.autoregressive("def fibonacci(n):", n_new).tokens
    with pytest.raises(ValueError, match="draft_max must be an integer, None or 'auto', got 'fast'"):
        rt.generate("def fibonacci(n):", 4, draft_max="fast")


def test_ngram_steps_are_counted(rt):
    """A prompt that repeats itself: the n-gram source proposes, and every step is one of the three kinds."""
    text = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2"
    out = rt.generate(text, 24)
    p = out.policy
    assert p.ngram_steps >= 1 and p.plain_steps + p.draft_steps + p.ngram_steps == len(out.steps)
    drafted = sum(len(s.drafted) for s in out.steps)
    assert drafted == round(p.mean_draft * p.draft_steps) + p.ngram_drafted
    assert 0 <= p.ngram_accepted <= p.ngram_drafted and p.ngram_acceptance == p.ngram_accepted / p.ngram_drafted
    assert out.tokens == rt.autoregressive(text, 24).tokens
    assert out.to_json()["policy"]["ngram_steps"] == p.ngram_steps
    with pytest.raises(ValueError, match=r"the n-gram source is a choice of the adaptive loop \(draft_max auto\)"):
        rt.generate(text, 4, draft_max=3, ngram=True)
    assert rt.generate(text, 4, draft_max=3, ngram=False).policy is None


def _kernel_collapses_to_huge_pages() -> bool:
    """Whether this kernel backs private anonymous memory with huge pages on MADV_COLLAPSE (Linux 6.1+,
    transparent huge pages not "never"): probed on 4 MiB of our own."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                  ctypes.c_int, ctypes.c_int, ctypes.c_long]
        size, huge = 6 << 20, 2 << 20
        base = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            return False
        start = (base + huge - 1) & ~(huge - 1)
        ctypes.memset(start, 1, 2 * huge)
        ok = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(2 * huge), 25) == 0  # MADV_COLLAPSE
        libc.munmap(ctypes.c_void_p(base), ctypes.c_size_t(size))
        return ok
    except (OSError, AttributeError):
        return False


def test_target_weights_in_huge_pages_compute_the_same_logits(tiny_target_gguf):
    """The target's weights read into memory and collapsed to huge pages where the kernel can (all but
    the unaligned ends of the weights buffer), the same logits bit for bit as llama.cpp's mmap of the file."""
    import os

    huge = dflash_llama.Runtime(tiny_target_gguf, n_threads=1, n_ctx=128)
    mapped = dflash_llama.Runtime(tiny_target_gguf, n_threads=1, n_ctx=128, huge_pages=False)
    assert mapped.huge_page_bytes == 0
    size = os.path.getsize(tiny_target_gguf)
    if _kernel_collapses_to_huge_pages():
        assert huge.huge_page_bytes % (2 << 20) == 0 and size - (8 << 20) < huge.huge_page_bytes <= size
    else:
        assert huge.huge_page_bytes == 0
    tokens = huge.tokenize("def f(x):\n    return x")
    assert np.array_equal(huge.target_logits(tokens), mapped.target_logits(tokens))
    assert huge.autoregressive("def f(x):", 8).tokens == mapped.autoregressive("def f(x):", 8).tokens


def test_threads_are_measured_unless_given(tiny_target_gguf, tiny_draft_gguf):
    """n_threads None: a plain decode and a verify of the draft's block timed at 1, 2 and all CPUs, the
    count of the least plain step + verified token's share kept (which one is the machine's business:
    only the record is checked); without a draft, the plain decode alone; n_threads N: as given."""
    import os

    rt = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_ctx=128)
    t = rt.generate("def f(x):", 6).threads
    cpus = os.cpu_count()
    assert t.measured and t.measurements == 1 and t.counts == sorted({1, min(2, cpus), cpus})
    assert len(t.plain_ms) == len(t.batch_ms) == len(t.counts) and all(ms > 0 for ms in t.plain_ms + t.batch_ms)
    assert t.batch_rows == rt.block_size == 8
    costs = [p + b / 8 for p, b in zip(t.plain_ms, t.batch_ms)]
    assert t.n_threads == t.counts[costs.index(min(costs))] and [t.cost(i) for i in range(len(costs))] == costs
    times = r"\d+\.\d ms( vs \d+\.\d ms at \d+)*"
    assert re.fullmatch(rf"{t.n_threads} \(measured {times}; a verify of 8: {times}\)", t.line()), t.line()
    plain = dflash_llama.Runtime(tiny_target_gguf, n_ctx=128).autoregressive("def f(x):", 4).threads
    assert plain.measured and plain.batch_rows == 0 and plain.batch_ms == []
    assert plain.n_threads == plain.counts[plain.plain_ms.index(min(plain.plain_ms))]
    assert re.fullmatch(rf"{plain.n_threads} \(measured {times}\)", plain.line()), plain.line()
    assert rt.autoregressive("def f(x):", 6).threads == t  # measured once per Runtime
    assert rt.generate("def f(x):", 6).to_json()["threads"]["n_threads"] == t.n_threads
    given = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=1, n_ctx=128).generate("def f(x):", 4)
    assert (given.threads.n_threads, given.threads.measured, given.threads.line()) == (1, False, "1 (as given)")
    assert "threads" not in given.to_json()


def test_threads_measured_again_keep_what_the_loop_learned_if_the_count_stays(tiny_target_gguf, tiny_draft_gguf):
    """Measured again (as after a drift), the adaptive loop keeps its step costs and what it learned
    when the same count wins, and measures its costs again when another does (which one wins is the
    machine's business: both outcomes are checked for what they must do)."""
    rt = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_ctx=128)
    first = rt.generate("def f(x):", 6)
    costs = rt.step_costs()
    assert first.policy.calibration_ms > 0 and first.threads.measurements == 1
    rt.remeasure_threads()
    again = rt.generate("def f(x):", 6)
    assert again.threads.measurements == 2 and again.tokens == first.tokens
    if again.threads.n_threads == first.threads.n_threads:
        assert again.policy.calibration_ms == 0 and rt.step_costs() == costs
    else:
        assert again.policy.calibration_ms > 0
    assert rt.generate("def f(x):", 6).threads.measurements == 2  # once per request
    given = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=1, n_ctx=128)
    given.remeasure_threads()
    assert given.generate("def f(x):", 4).threads.line() == "1 (as given)"


def test_step_costs_are_measured_once_per_block_size(tiny_target_gguf, tiny_draft_gguf):
    rt = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=1, n_ctx=128)
    assert rt.step_costs() is None  # nothing measured before the first adaptive generation
    first, again = (rt.generate("def f(x):", 6).policy for _ in range(2))
    assert first.calibration_ms > 0 and again.calibration_ms == 0
    costs = rt.step_costs()
    b = rt.block_size
    assert costs["block_size"] == b and len(costs["verify_ms"]) == b + 1 and len(costs["draft_ms"]) == b
    # sizes 1, 2, 3, 4, then half as much again, and the largest: the others are left to interpolate
    sizes = [k for k in range(1, b + 1) if k <= 4 or k in (6, 9, 13) or k == b]
    assert [k for k, ms in enumerate(costs["verify_ms"]) if ms > 0] == sizes
    assert [n for n, ms in enumerate(costs["draft_ms"]) if ms > 0] == [n for n in sizes if n <= b - 1] + (
        [b - 1] if b - 1 not in sizes else [])
    assert rt.step_costs(4) is None
    assert rt.generate("def f(x):", 6, block_size=4).policy.calibration_ms > 0  # another block, other costs
    assert rt.step_costs(4)["block_size"] == 4 and rt.step_costs() == costs
    assert rt.generate("def f(x):", 6, draft_max=None).policy is None  # a fixed length measures nothing
    rt.forget_policy()  # what the greedy generations learned (their probe waits) is dropped; the costs stay
    sampled = rt.generate("def f(x):", 12, temperature=1.0, seed=1).policy
    assert sampled.calibration_ms == 0
    assert sampled.shadow_probes == 0 and sampled.draft_steps >= 1  # sampling probes with verified drafts


def test_trace_draft_names_and_shapes(tiny_target_gguf, draft_gguf):
    # the target's own head for the draft, as the trace computes it (the compact Q4_0 copy proposes
    # other tokens where the tiny model's logits are close)
    rt = dflash_llama.Runtime(tiny_target_gguf, draft_gguf, n_threads=2, n_ctx=256, n_batch=32,
                              compact_draft_head=False)
    tokens = rt.tokenize("def fibonacci(n):")
    gen = rt.generate(tokens, 2 + rt.block_size, draft_max=None)  # the whole block from the first step
    feats = rt.capture(tokens)
    block = [gen.tokens[0]] + [rt.mask_token_id] * (rt.block_size - 1)  # the generation's first block
    tr = rt.trace_draft(feats, block)
    B, n = rt.block_size, len(tokens)
    assert tr["fc_out"].shape == (n, 64)
    assert tr["inp_g_embeddings"].shape == (n, 64)
    assert tr["Kcur_injected-0"].shape == (n, 2, 16)
    assert tr["Vcur_injected-0"].shape == (n, 2, 16)
    assert tr["inp_noise_embd"].shape == (B, 64)
    assert tr["Qcur-0"].shape == (B, 4, 16)
    assert tr["l_out-0"].shape == (B, 64)
    assert tr["result_norm"].shape == (B, 64)
    assert tr["result_output"].shape == (B, rt.n_vocab)
    # tracing does not change the answer: the traced logits pick the generation's first draft
    drafted = gen.steps[0].drafted
    assert len(drafted) == B - 1
    assert [int(np.argmax(row)) for row in tr["result_output"][1:]] == drafted


def test_detokenize_against_the_vocabulary(rt, tiny_target_gguf):
    # byte-level BPE: the vocabulary spells a space as "Ġ" and a newline as "Ċ"
    vocab = dflash_llama.gguf_info(tiny_target_gguf).metadata["tokenizer.ggml.tokens"]
    text = "def fibonacci(n):\n    return n"
    ids = rt.tokenize(text, add_special=False)
    assert rt.detokenize(ids) == "".join(vocab[i] for i in ids).replace("Ġ", " ").replace("Ċ", "\n") == text
    # multi-byte text: the bytes of the whole list are the pieces' bytes, and decode back to the text
    text = "naïve café: 日本語 → ∑ 🙂"
    ids = rt.tokenize(text, add_special=False)
    assert len(ids) > len(text.split())
    assert rt._engine.detokenize(ids) == b"".join(rt._engine.piece(t) for t in ids) == text.encode()
    assert rt.detokenize(ids) == text
    assert rt.detokenize([]) == ""


def test_errors_on_bad_input(rt, tiny_target_gguf, draft_gguf, tmp_path):
    with pytest.raises(ValueError, match=r"nope\.gguf: no such file"):
        dflash_llama.Runtime(tmp_path / "nope.gguf", draft_gguf)
    text = tmp_path / "text.gguf"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"text\.gguf: not a readable GGUF file"):  # pre-checked before llama.cpp
        dflash_llama.Runtime(text, draft_gguf)
    with pytest.raises(ValueError, match=r"text\.gguf: not a readable GGUF file"):
        dflash_llama.Runtime(tiny_target_gguf, text)
    hf = tmp_path / "hf-draft"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"hf-draft: is a folder, not a GGUF file \(a Hugging Face draft\? convert it "
                                         r"first: dflash-llama convert .*hf-draft -m TARGET\.gguf -o DRAFT\.gguf\)"):
        dflash_llama.Runtime(tiny_target_gguf, hf)
    with pytest.raises(ValueError, match=r": is a directory, not a GGUF file"):
        dflash_llama.Runtime(tmp_path, draft_gguf)
    with pytest.raises(ValueError, match=r"the prompt has \d+ tokens but the context holds 256"):
        rt.generate("word " * 400, 4)
    with pytest.raises(ValueError, match=r"smaller than one draft block \(8 tokens\)"):
        dflash_llama.Runtime(tiny_target_gguf, draft_gguf, n_ctx=4)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        rt.generate("hi", 4, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match=r"token 999999 is outside the vocabulary of 49152 tokens"):
        rt.generate([1, 999999], 4)
    with pytest.raises(ValueError, match="this Runtime has no draft"):
        dflash_llama.Runtime(tiny_target_gguf).generate("hi", 4)


def test_draft_for_another_target_is_refused(smollm2_gguf, tiny_target_gguf, draft_gguf, tmp_path):
    with pytest.raises(ValueError, match=r"draft hidden size 64 does not match the target's 576"):
        dflash_llama.Runtime(smollm2_gguf, draft_gguf)
    other_vocab = copy_gguf(draft_gguf, tmp_path / "other-vocab.gguf",
                            kv={"tokenizer.ggml.tokens": [f"t{i}" for i in range(1000)],
                                "tokenizer.ggml.token_type": [1] * 1000, "tokenizer.ggml.merges": None})
    with pytest.raises(ValueError, match=r"draft vocabulary has 1000 tokens, the target's has 49152"):
        dflash_llama.Runtime(tiny_target_gguf, other_vocab)
    too_deep = copy_gguf(draft_gguf, tmp_path / "too-deep.gguf", kv={"dflash.target_layers": [9]})
    with pytest.raises(ValueError, match=r"draft reads target layer 8 but the target has 4 layers"):
        dflash_llama.Runtime(tiny_target_gguf, too_deep)


def test_cli_json_matches_python(rt, tiny_target_gguf, draft_gguf):
    cli = paths.tool("llama-dflash-cli")
    res = subprocess.run([str(cli), "-m", str(tiny_target_gguf), "-md", str(draft_gguf), "-p", "def fibonacci(n):",
                          "-n", "20", "-t", "2", "-c", "256", "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["tokens"] == rt.generate("def fibonacci(n):", 20).tokens
    assert doc["tokens"] == rt.autoregressive("def fibonacci(n):", 20).tokens


def test_cli_bad_arguments(tiny_target_gguf, draft_gguf, tmp_path):
    cli = str(paths.tool("llama-dflash-cli"))
    res = subprocess.run([cli, "-m", str(tiny_target_gguf), "-p", "x"], capture_output=True, text=True)
    assert res.returncode == 2 and "a draft model is required (-md), or pass --no-draft" in res.stderr
    res = subprocess.run([cli, "-m", str(tiny_target_gguf), "-md", str(draft_gguf), "-p", "x", "-n", "abc"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "invalid integer for -n: 'abc'" in res.stderr
    res = subprocess.run([cli, "-m", str(tmp_path / "missing.gguf"), "-md", str(draft_gguf), "-p", "x"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "missing.gguf: no such file" in res.stderr  # an input error, as dflash-llama


def test_cli_draft_max_and_draft_head_values(tiny_target_gguf, draft_gguf):
    cli = str(paths.tool("llama-dflash-cli"))
    base = [cli, "-m", str(tiny_target_gguf), "-md", str(draft_gguf), "-p", "def f(x):", "-n", "6", "-c", "128"]
    for flags, message in ((["--draft-max", "fast"], "invalid integer for --draft-max: 'fast'"),
                           (["--draft-head", "q8"], "--draft-head must be compact or target, got 'q8'"),
                           (["--ngram", "yes"], "--ngram must be on or off, got 'yes'"),
                           (["--draft-max", "3", "--ngram", "on"], "the n-gram source is a choice of the adaptive "
                                                                   "loop (draft_max auto)")):
        res = subprocess.run(base + flags, capture_output=True, text=True)
        assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    runs = {}
    for flags in (["--draft-max", "auto"], ["--draft-max", "3"], ["--draft-head", "target"], ["--no-draft"],
                  ["--ngram", "off"]):
        res = subprocess.run(base + flags + ["--json"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        runs[flags[-1]] = json.loads(res.stdout)
    assert len({tuple(r["tokens"]) for r in runs.values()}) == 1  # the same greedy output every way
    assert "policy" in runs["auto"] and "policy" not in runs["3"]
    assert max(len(s["drafted"]) for s in runs["3"]["steps"]) <= 3
    assert runs["off"]["policy"]["ngram_steps"] == 0
    threads = runs["auto"]["threads"]
    assert threads["measured"] and threads["n_threads"] in threads["counts"]
    assert threads["batch_rows"] == 8 and len(threads["batch_ms"]) == len(threads["counts"])
    res = subprocess.run(base + ["-p", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2", "-n", "16"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    steps = r"\nsteps: +\d+ plain, \d+ draft \(tau \d+\.\d\d\), [1-9]\d* n-gram \(acc \d\.\d\d\)\n"
    assert re.search(steps, res.stderr), res.stderr
    assert re.search(r"\nthreads: +\d+ \(measured [\d.]+ ms", res.stderr), res.stderr


def test_compact_draft_head(tiny_target_gguf, draft_gguf, smollm2_gguf, smollm2_random_draft_gguf):
    # the tiny target's head is f32 and the SmolLM2 file's Q8_0: both are larger than Q4_0
    assert dflash_llama.Runtime(tiny_target_gguf, draft_gguf, n_ctx=128).compact_draft_head is True
    exact = dflash_llama.Runtime(tiny_target_gguf, draft_gguf, n_ctx=128, compact_draft_head=False)
    assert exact.compact_draft_head is False
    assert dflash_llama.Runtime(tiny_target_gguf, n_ctx=128).compact_draft_head is False  # no draft
    rt = dflash_llama.Runtime(smollm2_gguf, smollm2_random_draft_gguf, n_threads=2, n_ctx=512)
    ref = dflash_llama.Runtime(smollm2_gguf, smollm2_random_draft_gguf, n_threads=2, n_ctx=512,
                               compact_draft_head=False)
    assert rt.compact_draft_head is True
    prompt = "def fibonacci(n):"
    a, b = rt.generate(prompt, 24, draft_max=None), ref.generate(prompt, 24, draft_max=None)
    assert a.tokens == b.tokens == ref.autoregressive(prompt, 24).tokens  # exact either way
    # traces use the target's own head whatever generation uses: the parity stages see no difference
    feats = rt.capture(rt.tokenize(prompt))
    block = [a.tokens[0]] + [rt.mask_token_id] * (rt.block_size - 1)
    got, want = rt.trace_draft(feats, block), ref.trace_draft(feats, block)
    assert np.array_equal(got["result_output"], want["result_output"])


def test_every_call_computes_on_the_runtimes_one_thread(rt, tiny_target_gguf):
    """Streaming or not, from any thread: one compute thread for every Runtime of the process (no thread
    per stream or per Runtime: each compute thread has its own OpenMP team, and two teams slow each
    other), the same tokens, errors raised in the caller, and an abandoned stream does not block the
    next call, of this Runtime or another."""
    import threading

    before = threading.active_count()
    other = dflash_llama.Runtime(tiny_target_gguf, n_threads=1, n_ctx=128)
    assert other._compute is rt._compute and threading.active_count() == before
    plain = rt.generate("def f(x):", 12)
    streams = [rt.generate("def f(x):", 12, stream=True) for _ in range(3)]
    for s in streams:
        assert "".join(s) == plain.text and s.result.tokens == plain.tokens
    box = {}
    t = threading.Thread(target=lambda: box.update(g=rt.generate("def f(x):", 12)))
    t.start()
    t.join()
    assert box["g"].tokens == plain.tokens
    abandoned = iter(rt.generate("def f(x):", 12, stream=True))
    next(abandoned)
    assert rt.autoregressive("def f(x):", 12).tokens == plain.tokens  # greedy DFlash = plain greedy
    mid = iter(rt.generate("def f(x):", 12, stream=True))
    first = next(mid)
    assert other.autoregressive("def f(x):", 12).tokens == plain.tokens  # while another Runtime streams
    assert first + "".join(mid) == plain.text
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="the prompt has 300 tokens but the context holds 256"):  # from C++
        rt.generate([1] * 300, 4)
    with pytest.raises(ValueError, match="the prompt has 300 tokens but the context holds 256"):
        "".join(rt.generate([1] * 300, 4, stream=True))
    assert rt.generate("def f(x):", 12).tokens == plain.tokens  # and the thread goes on


def test_an_f16_fc_reads_hidden_states_beyond_the_range_of_f16(tiny_draft_hf, tiny_target_gguf, tmp_path):
    """A backend multiplies an f16 weight with its activations converted to f16, and Gemma 3 270M's
    residual stream reaches 101,960 (f16 stops at 65,504): an f16 `fc` is widened to f32 as the runtime
    reads it, so the draft computes what the same draft with `fc` stored in f32 computes, bit for bit."""
    from dflash_llama import gguf_info

    f16 = convert(tiny_draft_hf, tiny_target_gguf, tmp_path / "d16.gguf", outtype="f16")
    wide = copy_gguf(f16, tmp_path / "d16-fc32.gguf", widen={"fc.weight"})
    types = {p: {t.name: t.type for t in gguf_info(p).tensors} for p in (f16, wide)}
    assert types[f16]["fc.weight"] == "f16" and types[wide]["fc.weight"] == "f32"
    assert types[f16]["blk.0.attn_q.weight"] == types[wide]["blk.0.attn_q.weight"] == "f16"
    info = gguf_info(f16)
    n_in = len(info.get("target_layers")) * int(info.get("embedding_length"))
    feats = np.random.default_rng(0).standard_normal((6, n_in)).astype(np.float32)
    feats[0, 3] = 101_960.0  # as Gemma 3's BOS token in channel 163
    out = [dflash_llama.Runtime(tiny_target_gguf, d, n_threads=1, n_ctx=64).trace_draft(feats, [5, 6, 7, 8])
           for d in (f16, wide)]
    assert np.isfinite(out[0]["fc_out"]).all() and np.isfinite(out[0]["result_output"]).all()
    assert out[0].keys() == out[1].keys()
    for name in out[0]:
        np.testing.assert_array_equal(out[0][name], out[1][name], err_msg=name)
