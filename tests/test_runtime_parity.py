"""The runtime's draft graph against the PyTorch reference, on identical features and blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import dflash_llama
from dflash_llama.converter import convert
from dflash_llama.reference.checkpoint import load_draft
from dflash_llama.reference.gguf_tensors import target_weights_from_gguf

BOUND = {"f32": 1e-4, "f16": 1e-2, "bf16": 1e-2}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def target_weights(tiny_target_gguf):
    return target_weights_from_gguf(tiny_target_gguf)


@pytest.fixture(scope="module")
def draft_ggufs(reference_drafts, tiny_target_gguf, tmp_path_factory) -> dict[tuple[str, str], Path]:
    out = {}
    for name, hf in reference_drafts.items():
        for dtype in BOUND:
            path = tmp_path_factory.mktemp("parity") / f"{name}-{dtype}.gguf"
            out[name, dtype] = convert(hf, tiny_target_gguf, path, outtype=dtype)
    return out


def reference_trace(gguf: Path, tw, feats: np.ndarray, block: list[int]) -> dict[str, np.ndarray]:
    draft = load_draft(gguf, tw.embed_tokens, tw.lm_head)
    trace = {}
    with torch.no_grad():
        draft(torch.from_numpy(feats), block, start=feats.shape[0], cache=None, trace=trace)
    return {k: v.float().numpy() for k, v in trace.items()}


@pytest.mark.parametrize("dtype", list(BOUND))
def test_every_intermediate_within_bound(draft_ggufs, reference_drafts, tiny_target_gguf, target_weights, dtype):
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    for name in reference_drafts:
        gguf = draft_ggufs[name, dtype]
        rt = dflash_llama.Runtime(tiny_target_gguf, gguf, n_threads=2, n_ctx=256, kv_f32=True)
        tokens = rt.tokenize(prompt)
        feats = rt.capture(tokens)
        block = [tokens[-1]] + [rt.mask_token_id] * (rt.block_size - 1)
        ours = rt.trace_draft(feats, block)
        ref = reference_trace(gguf, target_weights, feats, block)
        assert set(ref) == set(ours), f"{name}: names differ: {set(ref) ^ set(ours)}"
        for key, want in ref.items():
            assert ours[key].shape == want.shape, f"{name} {key}"
            err = rel_err(ours[key], want)
            assert err <= BOUND[dtype], f"{name} ({dtype}): {key} relative error {err:.2e} > {BOUND[dtype]}"


def test_drafted_tokens_identical_at_every_step(draft_ggufs, reference_drafts, tiny_target_gguf, target_weights):
    """f32: replay each step of a runtime generation through the reference draft."""
    for name in reference_drafts:
        gguf = draft_ggufs[name, "f32"]
        rt = dflash_llama.Runtime(tiny_target_gguf, gguf, n_threads=2, n_ctx=256, kv_f32=True,
                                  compact_draft_head=False)  # the reference's head
        draft = load_draft(gguf, target_weights.embed_tokens, target_weights.lm_head)
        prompt = rt.tokenize("class Stack:\n    def push(self, item):")
        gen = rt.generate(prompt, 40, draft_max=None)  # the whole block every step, as replayed
        produced = 1  # the first token comes from the prefill
        for i, step in enumerate(gen.steps):
            seq = prompt + gen.tokens[:produced - 1]
            last = gen.tokens[produced - 1]
            feats = rt.capture(seq)
            block = [last] + [rt.mask_token_id] * (len(step.drafted) and rt.block_size - 1)
            block = block[:min(rt.block_size, len(prompt) + 40 - len(seq))]
            with torch.no_grad():
                logits = draft(torch.from_numpy(feats), block, start=len(seq))
            want = logits.argmax(-1).tolist()[:len(step.drafted)]
            assert step.drafted == want, f"{name}: step {i} drafted {step.drafted}, reference {want}"
            produced += step.produced
