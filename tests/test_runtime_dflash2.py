"""DFlash 2 drafts in the C++ runtime: greedy output equals the target's own token for token, sampled
output follows the target's distribution, the traced convolutions and selector walk are the published
model's (dflash 0.1.0), and a broken DFlash 2 file is refused in one line.

The drafts are random tiny DFlash 2 heads for the tiny qwen3 target in z-lab's format
(fixtures.tiny_draft_hf), converted by the pinned llama.cpp converter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType as V
from test_families import NGRAM_MAX, assert_same
from test_runtime_exactness import (
    OTHER_PROMPTS,
    chi2_goodness_of_fit,
    exact_two_token_distribution,
    humaneval_prompts,
    sample_two_tokens,
    sampling_setup,
)
from test_runtime_robust import refused, rewrite, tensor_data

import dflash_llama
from dflash_llama import fixtures, schema as S
from dflash_llama.parity.gguf_edit import copy_gguf

# name -> (draft, outtype): other kernel, group, rank and top-K sizes, a sliding layer, blocks 8 and 16,
# a tap on the target's last layer, f16 weights (codebooks dequantised on the host)
DRAFTS = {
    "k2_g16_sliding": (fixtures.TinyDraftConfig(
        variant="dflash2", layers=2, target_layer_ids=[1, 2], block_size=8, seed=21,
        layer_types=["sliding_attention", "full_attention"], sliding_window=4), "f32"),
    "k3_g8_r32_top8": (fixtures.TinyDraftConfig(
        variant="dflash2", layers=1, target_layer_ids=[0, 3], block_size=16, seed=22,
        conv_kernel_size=3, conv_group_size=8, selector_rank=32, selector_top_k=8), "f32"),
    "k4_g32_r8_top2_f16": (fixtures.TinyDraftConfig(
        variant="dflash2", layers=2, target_layer_ids=[2], block_size=16, seed=23,
        conv_kernel_size=4, conv_group_size=32, selector_rank=8, selector_top_k=2), "f16"),
}
PROMPTS = humaneval_prompts(8) + OTHER_PROMPTS
N_NEW = 24


def pinned_gguf(hf: Path, target_hf: Path, out: Path, outtype: str = "f32") -> Path:
    fixtures.run_pinned_converter([str(hf), "--target-model-dir", str(target_hf), "--outfile", str(out),
                                   "--outtype", outtype])
    return out


@pytest.fixture(scope="module")
def dflash2_drafts(tiny_target_hf, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (HF directory, GGUF)."""
    out = {}
    for name, (cfg, outtype) in DRAFTS.items():
        root = tmp_path_factory.mktemp(f"dflash2_{name}")
        hf = fixtures.tiny_draft_hf(root / "hf", tiny_target_hf, cfg)
        out[name] = hf, pinned_gguf(hf, tiny_target_hf, root / f"{name}.gguf", outtype)
    return out


@pytest.mark.parametrize("name", DRAFTS)
def test_greedy_dflash2_equals_plain_decoding(name, dflash2_drafts, tiny_target_gguf):
    """18 prompts, each through the whole block and through one of block sizes 2, 4, 8, 16 with
    --draft-max none, auto or 3; the first step drafts the selector's walk as trace_draft reports it,
    and --draft-max 3 keeps the first 3 slots of that walk."""
    _, gguf = dflash2_drafts[name]
    rt = dflash_llama.Runtime(tiny_target_gguf, gguf, n_threads=2, n_ctx=512, n_batch=64, compact_draft_head=False)
    assert rt.draft_variant is S.DFLASH2 and rt.block_size == DRAFTS[name][0].block_size
    for i, prompt in enumerate(PROMPTS):
        ar = rt.autoregressive(prompt, N_NEW)
        whole = rt.generate(prompt, N_NEW, draft_max=None)
        assert_same(whole, ar, f"{name}: prompt {i}, the whole block")
        block, draft_max = (2, 4, 8, 16)[i % 4], (None, "auto", 3)[i % 3]
        spec = rt.generate(prompt, N_NEW, block_size=block, draft_max=draft_max)
        assert_same(spec, ar, f"{name}: prompt {i}, block {block}, draft_max {draft_max}")
        assert all(len(s.drafted) <= (block - 1 if s.source == "draft" else NGRAM_MAX) for s in spec.steps)
    prompt = rt.tokenize(PROMPTS[0])
    first = rt.autoregressive(prompt, 1).tokens[0]
    walk = rt.trace_draft(rt.capture(prompt), [first] + [rt.mask_token_id] * (rt.block_size - 1))["selector_path"]
    assert rt.generate(prompt, N_NEW, draft_max=None).steps[0].drafted == walk.astype(int).tolist()
    assert rt.generate(prompt, N_NEW, draft_max=3).steps[0].drafted == walk.astype(int).tolist()[:3]


def test_trace_is_the_published_models(dflash2_drafts, tiny_target_hf, tiny_target_gguf):
    """Every DFlash 2 intermediate is traced with its shape; the convolutions, the final norm, the gate,
    the unary scores and the selector's scores agree with dflash 0.1.0's DFlash2DraftModel on the same
    context features (float32) to within 1e-5 of their scale, and both walk the same path over the same
    candidates. The selector does reorder the unary ranking."""
    torch = pytest.importorskip("torch")
    from dflash.model import DFlash2DraftModel
    from transformers import AutoModelForCausalLM

    hf, gguf = dflash2_drafts["k2_g16_sliding"]
    cfg = DRAFTS["k2_g16_sliding"][0]
    rt = dflash_llama.Runtime(tiny_target_gguf, gguf, n_threads=2, n_ctx=128, compact_draft_head=False)
    context = rt.tokenize("def fibonacci(n): return")
    feats = rt.capture(context)
    block = [rt.tokenize(" x")[0]] + [rt.mask_token_id] * 7
    trace = rt.trace_draft(feats, block)
    n, k, groups = len(block) - 1, cfg.selector_top_k, 64 // cfg.conv_group_size
    shapes = {"selector_gate": (n, cfg.selector_rank), "selector_unary": (n, k), "selector_candidates": (n, k),
              "selector_scores": (n, k, k), "selector_path": (n,)}
    for il in range(cfg.layers):
        for side in ("attn", "ffn"):
            shapes[f"{side}_conv_dyn-{il}"] = (len(block), 2 * cfg.conv_kernel_size * groups)
            shapes.update({f"{side}_conv_{s}-{il}": (len(block), 64) for s in ("in", "out")})
    assert {name: trace[name].shape for name in shapes} == shapes

    target = AutoModelForCausalLM.from_pretrained(tiny_target_hf, dtype=torch.float32)
    draft = DFlash2DraftModel.from_pretrained(hf, dtype=torch.float32).eval()
    seen = {}
    for il, layer in enumerate(draft.layers):  # what each convolution gives, as the runtime names it
        record(layer.attention_conv, f"attn_conv_{{}}-{il}", seen)
        record(layer.mlp_conv, f"ffn_conv_{{}}-{il}", seen)
    with torch.no_grad():
        hidden = draft(position_ids=torch.arange(len(context) + len(block))[None],
                       target_hidden=torch.tensor(feats)[None],
                       noise_embedding=target.get_input_embeddings().weight[torch.tensor(block)][None])
        seen["result_norm"] = hidden[0]
        drafted = hidden[:, 1:]
        logits = draft.compute_logits(drafted, target.get_output_embeddings())
        path, candidates, _ = draft.candidate_selector.select(drafted, logits, torch.tensor(block[:1]), 0.0)
        selector = draft.candidate_selector
        gate = selector.hidden_projection(drafted)[0]
        seen["selector_gate"] = gate
        ids = torch.tensor(trace["selector_candidates"].astype(np.int64))
        seen["selector_unary"] = logits[0].gather(-1, ids)
        preds = torch.cat([torch.full((1, k), block[0]), ids[:-1]])  # slot 1: the anchor in every row
        a, b = selector.predecessor_codebook.weight, selector.successor_codebook.weight
        seen["selector_scores"] = seen["selector_unary"][:, None, :] + torch.einsum(
            "spr,sr,skr->spk", a[preds], gate, b[ids])
    for name, value in seen.items():
        ours, theirs = trace[name], value.numpy()
        assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max(), name
    assert trace["selector_path"].astype(int).tolist() == path[0].tolist()
    assert [set(row) for row in trace["selector_candidates"].astype(int).tolist()] == [
        set(row) for row in candidates[0].tolist()]
    unary = trace["selector_unary"]
    assert all(np.all(np.diff(row) <= 0) for row in unary)  # ordered by unary, descending
    assert trace["selector_path"].tolist() != trace["selector_candidates"][:, 0].tolist()  # the selector matters


def record(conv, name: str, seen: dict) -> None:
    """Keep what a dflash GroupedDynamicCausalConv's input side ("in") and output side ("out") give."""
    prepare, finish = conv.prepare, conv.finish

    def prepared(hidden):
        out, dynamic = prepare(hidden)
        seen[name.format("in")] = out[0]
        return out, dynamic

    def finished(hidden, dynamic):
        out = finish(hidden, dynamic)
        seen[name.format("out")] = out[0]
        return out

    conv.prepare, conv.finish = prepared, finished


def scale_tensor(draft_dir: Path, name: str, factor: float) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(draft_dir / "model.safetensors")
    tensors[name] = tensors[name] * factor
    save_file(tensors, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})


def test_sampling_is_lossless(tiny_target_hf, tiny_target_gguf, tmp_path):
    """Temperature 1, top-k 3 (the target's; the selector samples its K candidates with the temperature
    alone): the first two tokens of DFlash 2 sampling follow the target's exact joint distribution
    (chi-square goodness of fit over 2000 sequences), as tests/test_runtime_exactness.py checks it for
    DFlash 1. The draft's head favours the target's likeliest second token (fixtures.constant_draft_hf),
    its selector (gate scaled down: unary scores about 1 apart, pairwise terms of about 0.2) spreads the
    proposals over its four candidates; both the accept and the reject path run."""
    k = 3
    target, prompt, exact, proposal = sampling_setup(tiny_target_gguf, k)
    hf = fixtures.constant_draft_hf(tmp_path / "d", tiny_target_gguf, proposal,
                                    fixtures.TinyDraftConfig(variant="dflash2", block_size=4,
                                                             target_layer_ids=[2]))
    scale_tensor(hf, "candidate_selector.hidden_projection.weight", 0.1)  # the pairwise terms: a nudge
    rt = dflash_llama.Runtime(tiny_target_gguf, pinned_gguf(hf, tiny_target_hf, tmp_path / "d.gguf"),
                              n_threads=1, n_ctx=128)

    counts, acceptance, proposed = sample_two_tokens(rt, prompt, k)  # the second token: a verify
    assert 0.05 < acceptance < 0.95, f"acceptance {acceptance:.2f}: both paths must be exercised"
    assert len(proposed) > 2, "the selector's sampled walk proposes several tokens"
    _, dof, p = chi2_goodness_of_fit(counts, exact)
    assert dof == k * k - 1 and p > 1e-3, f"DFlash 2 sampling differs from target sampling (p = {p:.2e})"
    _, _, p_power = chi2_goodness_of_fit(counts, exact_two_token_distribution(target, prompt, k, 0.5))
    assert p_power < 1e-6, f"the test cannot tell temperature 0.5 from 1 (p = {p_power:.2e})"


def loader_case(case: str, draft: Path, dst: Path) -> tuple[Path, str]:
    """A broken DFlash 2 file made from `draft` (k2_g16_sliding without its tokenizer) and the message
    after '<file>: '."""
    if case == "missing tensor":
        return rewrite(draft, dst, drop=("blk.1.ffn_conv_proj.weight",)), "missing tensor 'blk.1.ffn_conv_proj.weight'"
    if case == "group not dividing the hidden size":
        return (rewrite(draft, dst, kv={S.CONV_GROUP_SIZE: (48, V.UINT32)}),
                "dflash.conv_group_size: 48, expected a divisor of dflash.embedding_length (64)")
    if case == "top-K of 0":
        return (rewrite(draft, dst, kv={S.SELECTOR_TOP_K: (0, V.UINT32)}),
                "dflash.selector_top_k: u32 0, expected an integer in 1..2147483647")
    if case == "a key missing":
        return copy_gguf(draft, dst, kv={S.SELECTOR_RANK: None}), (
            f"'{S.SELECTOR_RANK}' missing: a DFlash 2 draft needs {', '.join(S.DFLASH2_KEYS)}")
    if case == "DFlash 2 tensors without the keys":
        return copy_gguf(draft, dst, kv=dict.fromkeys(S.DFLASH2_KEYS)), (
            f"tensor 'selector_hidden.weight': a DFlash 2 tensor in a DFlash 1 draft (no {' / '.join(S.DFLASH2_KEYS)})")
    if case == "f16 taps":
        taps = tensor_data(draft, "blk.0.attn_conv_base").astype(np.float16)
        return (rewrite(draft, dst, tensors={"blk.0.attn_conv_base": taps}),
                "tensor 'blk.0.attn_conv_base': type f16, expected f32 (convolution taps)")
    if case == "codebook of another rank":
        book = tensor_data(draft, "selector_successor.weight")[:, :8].copy()
        return (rewrite(draft, dst, tensors={"selector_successor.weight": book}),
                "tensor 'selector_successor.weight' has ne[0] = 8, expected 16")
    if case == "codebooks of another vocabulary":
        books = {name: tensor_data(draft, name)[:1000].copy()
                 for name in ("selector_predecessor.weight", "selector_successor.weight")}
        return rewrite(draft, dst, tensors=books), ("the selector's codebooks have 1000 rows, the target's "
                                                    "vocabulary 49152 tokens: this draft was made for another target")
    raise AssertionError(case)


LOADER_CASES = ["missing tensor", "group not dividing the hidden size", "top-K of 0", "a key missing",
                "DFlash 2 tensors without the keys", "f16 taps", "codebook of another rank",
                "codebooks of another vocabulary"]


def test_a_broken_dflash2_draft_is_one_line(dflash2_drafts, tiny_target_gguf, tmp_path):
    """Each case: Runtime raises ValueError('<file>: <message>') and llama-dflash-cli prints that one
    line; a DFlash 2 tensor without the keys is refused in the schema's words. (The files are made from
    the draft without its tokenizer, which the runtime does not need: seconds faster to rewrite.)"""
    _, full = dflash2_drafts["k2_g16_sliding"]
    tokenizer = [k for k in GGUFReader(str(full)).fields if k.startswith("tokenizer.") and k != S.MASK_TOKEN_ID]
    draft = copy_gguf(full, tmp_path / "bare.gguf", kv=dict.fromkeys(tokenizer))
    dflash_llama.Runtime(tiny_target_gguf, draft, n_threads=1, n_ctx=64)  # the unbroken file loads
    for i, case in enumerate(LOADER_CASES):
        bad, message = loader_case(case, draft, tmp_path / f"bad{i}.gguf")
        refused(f"{bad}: {message}", tiny_target_gguf, bad)
        if case == "DFlash 2 tensors without the keys":
            reader = GGUFReader(str(bad))
            kv = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
            assert S.refusals(kv, [t.name for t in reader.tensors])[0] == message
