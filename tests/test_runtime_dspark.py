"""DSpark drafts in the C++ runtime: greedy output equals the target's own token for token (both block
layouts, with and without the confidence head, on the qwen3, llama and gemma3 tiny targets), the
traced Markov chain and confidences are the reference's, the confidence threshold cuts the draft
where the trace says, sampled output follows the target's distribution, a scaled Markov head
(markov_w2.scale) and a reduced vocabulary (d2t) run as the reference runs them, and a broken DSpark
file is refused in one line.

The drafts are random tiny DSpark heads in DeepSpec's format (fixtures.tiny_draft_hf, variant
"dspark"), converted by our converter."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as V
from test_families import NGRAM_MAX, assert_same
from test_runtime_exactness import (
    OTHER_PROMPTS,
    chi2_goodness_of_fit,
    exact_two_token_distribution,
    sample_two_tokens,
    sampling_setup,
)
from test_runtime_robust import refused, rewrite, tensor_data

import dflash_llama
from dflash_llama import fixtures, schema as S
from dflash_llama.converter import convert
from dflash_llama.parity.gguf_edit import copy_gguf

DS = dict(variant="dspark", dtype="float32")  # f32 copies of the target's embeddings and head: dropped
# name -> draft of the tiny qwen3 target: the two layouts, with and without the confidence head, and
# DeepSpec's anchor-first "DFlash" (no Markov head)
DRAFTS = {
    "anchor_first_conf": fixtures.TinyDraftConfig(**DS, target_layer_ids=[1, 3], markov_rank=16, block_size=8,
                                                  seed=51),
    "anchor_first": fixtures.TinyDraftConfig(**DS, target_layer_ids=[2], markov_rank=8, block_size=4, layers=2,
                                             confidence_head=False, seed=52),
    "dflash_layout_conf": fixtures.TinyDraftConfig(**DS, target_layer_ids=[0, 3], markov_rank=32, block_size=6,
                                                   sample_from_anchor=False, seed=53),
    "deepspec_dflash": fixtures.TinyDraftConfig(**DS, target_layer_ids=[1, 3], markov_rank=0, block_size=8, seed=54),
}
BLOCK_SIZES = [2, 4, 8, 16]
PROMPTS = OTHER_PROMPTS
N_NEW = 20


K = 512  # a reduced vocabulary's size (convert --draft-vocab)


def dspark_gguf(root: Path, target_hf: Path, target_gguf: Path, cfg: fixtures.TinyDraftConfig,
                draft_vocab: int = 0) -> Path:
    hf = fixtures.tiny_draft_hf(root / "hf", target_hf, cfg)
    return convert(hf, target_gguf, root / "draft.gguf", "f32", draft_vocab=draft_vocab)


@pytest.fixture(scope="module")
def drafts(tiny_target_hf, tiny_target_gguf, tmp_path_factory) -> dict[str, Path]:
    return {name: dspark_gguf(tmp_path_factory.mktemp(f"dspark_{name}"), tiny_target_hf, tiny_target_gguf, cfg)
            for name, cfg in DRAFTS.items()}


@pytest.fixture(scope="module")
def reduced(tiny_target_hf, tiny_target_gguf, tmp_path_factory) -> Path:
    """anchor_first_conf's draft converted with a reduced vocabulary of K tokens (d2t; W2 cut to its rows)."""
    return dspark_gguf(tmp_path_factory.mktemp("dspark_d2t"), tiny_target_hf, tiny_target_gguf,
                       DRAFTS["anchor_first_conf"], draft_vocab=K)


def runtime(target: Path, draft: Path) -> dflash_llama.Runtime:
    return dflash_llama.Runtime(target, draft, n_threads=2, n_ctx=512, n_batch=64, compact_draft_head=False)


def first_block(rt: dflash_llama.Runtime, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    """The prompt's features and the block of the first draft step after it (the whole block)."""
    first = rt.autoregressive(prompt, 1).tokens[0]
    return rt.capture(prompt), [first] + [rt.mask_token_id] * (rt.block_size - 1)


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_greedy_dspark_equals_plain_decoding(family, family_targets, tmp_path):
    """5 prompts x block sizes 2, 4, 8, 16 through an anchor-first DSpark draft with a confidence head
    and one in DFlash's layout without, the whole block verified (anchor-first: B tokens), at most 3, or
    the adaptive loop in turn; on the anchor-first draft every other prompt also with a confidence
    threshold: each generation equals plain greedy decoding token for token."""
    hf, target = family_targets[family]
    ids = [1, 2]
    rts = {layout: runtime(target, dspark_gguf(tmp_path / layout, hf, target, fixtures.TinyDraftConfig(
        **DS, target_layer_ids=ids, markov_rank=8, block_size=8, confidence_head=conf, sample_from_anchor=first,
        seed=61))) for layout, conf, first in (("anchor_first", True, True), ("dflash_layout", False, False))}
    assert rts["anchor_first"].sample_from_anchor and rts["anchor_first"].has_confidence_head
    assert not rts["dflash_layout"].sample_from_anchor and not rts["dflash_layout"].has_confidence_head
    plain = rts["anchor_first"]
    for i, prompt in enumerate(PROMPTS[:5]):
        ar = plain.autoregressive(prompt, N_NEW)
        for layout, rt in rts.items():
            first = rt.sample_from_anchor
            for j, block in enumerate(BLOCK_SIZES):
                draft_max = (None, 3, "auto")[(i + j) % 3]
                p_min = 0.5 if first and i % 2 else 0.0
                spec = rt.generate(prompt, N_NEW, block_size=block, draft_max=draft_max, draft_p_min=p_min)
                assert_same(spec, ar, f"{family}: {layout}, prompt {i}, block {block}, draft_max {draft_max}, "
                                      f"p_min {p_min}")
                most = block if first else block - 1
                assert all(len(s.drafted) <= (most if s.source == "draft" else NGRAM_MAX) for s in spec.steps)
                if draft_max is None and p_min == 0.0:  # anchor-first: the block of B drafts B
                    assert len(spec.steps[0].drafted) == most


def repeating_markov_head(draft_dir: Path, token: int) -> Path:
    """The draft's Markov head made to add 1000 to `token`'s logit after any token (every W1 row e_0,
    W2's row of `token` 1000 e_0): every slot drafts `token`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(draft_dir / "model.safetensors")
    w1, w2 = tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"]
    w1.zero_()[:, 0] = 1.0
    w2.zero_()[token, 0] = 1000.0
    save_file(tensors, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    return draft_dir


@pytest.mark.parametrize("anchor_first", [True, False])
def test_accepted_drafts_keep_the_output_exact(anchor_first, tiny_target_hf, tiny_target_gguf, tmp_path):
    """A DSpark draft whose Markov head always drafts the token the target repeats most after one of
    the prompts: its drafts are accepted, in part, at every block size (anchor-first: from the slot of
    the anchor itself), and the output equals plain greedy decoding."""
    plain = dflash_llama.Runtime(tiny_target_gguf, n_threads=2, n_ctx=512)
    best = max((g.tokens.count(t), t, p) for p in PROMPTS for g in [plain.autoregressive(p, 32)] for t in g.tokens)
    _, token, prompt = best
    hf = fixtures.tiny_draft_hf(tmp_path / "hf", tiny_target_hf, fixtures.TinyDraftConfig(
        **DS, target_layer_ids=[1, 3], markov_rank=8, block_size=8, sample_from_anchor=anchor_first, seed=55))
    rt = runtime(tiny_target_gguf, convert(repeating_markov_head(hf, token), tiny_target_gguf, tmp_path / "d.gguf",
                                           "f32"))
    ar = rt.autoregressive(prompt, 32)
    for block in BLOCK_SIZES:
        for draft_max in (None, "auto"):
            spec = rt.generate(prompt, 32, block_size=block, draft_max=draft_max, ngram=False)
            assert_same(spec, ar, f"anchor_first {anchor_first}, block {block}, draft_max {draft_max}")
            assert all(set(s.drafted) <= {token} for s in spec.steps)
            if draft_max is None:
                assert sum(s.accepted for s in spec.steps) > 0, (block, draft_max)
    spec = rt.generate(prompt, 32, block_size=8, draft_max=None)
    assert any(0 < s.accepted < len(s.drafted) for s in spec.steps)  # a partial accept


@pytest.mark.parametrize("name", DRAFTS)
def test_drafts_and_trace_are_the_references(name, drafts, tiny_target_gguf, reference_target):
    """The runtime's greedy chain over the first block (trace_draft, and what the first step of a
    generation verifies) is the reference's draft_chain on the same features; its biased logits, Markov
    biases and confidences agree with the reference's to within 1e-5 of their scale; a fixed draft
    length keeps the chain's first tokens; greedy generations equal plain decoding."""
    torch = pytest.importorskip("torch")
    from dflash_llama.reference import load_draft_for_target

    cfg = DRAFTS[name]
    rt = runtime(tiny_target_gguf, drafts[name])
    markov = cfg.markov_rank > 0
    conf = markov and cfg.confidence_head
    assert rt.draft_variant is (S.DSPARK if markov else S.DFLASH1)
    assert (rt.sample_from_anchor, rt.has_confidence_head) == (cfg.sample_from_anchor, conf)
    n = cfg.block_size if cfg.sample_from_anchor else cfg.block_size - 1
    assert rt.max_draft == n

    prompt = rt.tokenize("def fibonacci(n): return")
    feats, block = first_block(rt, prompt)
    trace = rt.trace_draft(feats, block)
    draft = load_draft_for_target(drafts[name], reference_target)
    seen = {}
    with torch.inference_mode():
        chain = draft.draft_chain(torch.tensor(feats), block, len(prompt), trace=seen)
    assert len(chain.tokens) == n
    if markov:
        shapes = {"markov_prev": (n,), "markov_bias": (n, 49152), "biased_logits": (n, 49152)}
        shapes.update({"confidence": (n,)} if conf else {})
        assert {k: trace[k].shape for k in shapes} == shapes and ("confidence" in trace) == conf
        for key in shapes:
            ours, theirs = trace[key], seen[key].numpy()
            assert np.abs(ours - theirs).max() <= 1e-5 * max(np.abs(theirs).max(), 1.0), key
        path = trace["markov_prev"].astype(int).tolist()[1:] + [int(np.argmax(trace["biased_logits"][-1]))]
        assert path == chain.tokens.tolist()
        unbiased = trace["biased_logits"] - trace["markov_bias"]
        assert unbiased.argmax(-1).tolist() != chain.tokens.tolist()  # the Markov head matters
    first_step = rt.generate(prompt, 40, draft_max=None).steps[0].drafted
    assert first_step == chain.tokens.tolist()
    assert rt.generate(prompt, 40, draft_max=2).steps[0].drafted == chain.tokens.tolist()[:2]
    for text in PROMPTS[:4]:
        assert_same(rt.generate(text, N_NEW, draft_max=None), rt.autoregressive(text, N_NEW), f"{name}: {text!r}")


def chain_against_reference(rt, path: Path, reference_target, text: str) -> tuple[dict, list[int]]:
    """The runtime's traced chain over the first block after `text` and the reference's draft_chain
    (the draft read from `path`) on the same features: every Markov trace within 1e-5 of its scale, -inf
    (a reduced vocabulary's logits outside its tokens) at the same places; (the trace, the tokens)."""
    import torch

    from dflash_llama.reference import load_draft_for_target

    prompt = rt.tokenize(text)
    feats, block = first_block(rt, prompt)
    trace, seen = rt.trace_draft(feats, block), {}
    with torch.inference_mode():
        chain = load_draft_for_target(path, reference_target).draft_chain(torch.tensor(feats), block, len(prompt),
                                                                           trace=seen)
    for key in ("markov_prev", "markov_bias", "biased_logits", "confidence"):
        ours, theirs = trace[key], seen[key].numpy()
        finite = np.isfinite(theirs)
        assert np.array_equal(np.isfinite(ours), finite), key
        assert np.abs(ours[finite] - theirs[finite]).max() <= 1e-5 * max(np.abs(theirs[finite]).max(), 1.0), key
    assert trace["markov_prev"].astype(int).tolist()[1:] == chain.tokens.tolist()[:-1]
    return trace, chain.tokens.tolist()


def test_a_scaled_markov_head(drafts, tiny_target_gguf, reference_target, tmp_path):
    """markov_w2.scale (a GGUF's factor on the bias, 0.5 here): the runtime's traced bias from the anchor
    is exactly half the unscaled draft's, its chain is the reference's (which reads the factor from the
    GGUF), and greedy output stays plain decoding's."""
    plain = drafts["anchor_first_conf"]
    scaled = rewrite(plain, tmp_path / "scaled.gguf", tensors={S.MARKOV_SCALE: np.array([0.5], np.float32)})
    text = "def fibonacci(n): return"
    traces = {}
    for name, path in (("plain", plain), ("scaled", scaled)):
        rt = runtime(tiny_target_gguf, path)
        traces[name], tokens = chain_against_reference(rt, path, reference_target, text)
    assert np.array_equal(traces["scaled"]["markov_bias"][0], 0.5 * traces["plain"]["markov_bias"][0])
    assert rt.generate(text, 40, draft_max=None).steps[0].drafted == tokens
    for text in PROMPTS[:3]:
        assert_same(rt.generate(text, N_NEW, draft_max=None), rt.autoregressive(text, N_NEW), f"scaled: {text!r}")


def test_a_reduced_vocabulary(reduced, drafts, tiny_target_gguf, reference_target):
    """convert --draft-vocab K on a DSpark draft: d2t, W2 its rows of those tokens; the runtime's chain
    and traces are the reference's (the whole vocabulary's draft given the d2t too, as the parity
    harness builds it), every drafted token is one of the d2t's, and greedy output equals plain decoding
    at every block size, fixed and adaptive."""
    import torch

    from dflash_llama.reference import load_draft_for_target
    from dflash_llama.reference.checkpoint import read_draft_gguf

    info = dflash_llama.gguf_info(reduced)
    d2t = info.read(S.D2T)
    assert info.tensor("markov_w2.weight").shape == (DRAFTS["anchor_first_conf"].markov_rank, K)
    np.testing.assert_array_equal(info.read("markov_w2.weight"),
                                  dflash_llama.gguf_info(drafts["anchor_first_conf"]).read("markov_w2.weight")[d2t])
    rt = runtime(tiny_target_gguf, reduced)
    text = "def fibonacci(n): return"
    trace, tokens = chain_against_reference(rt, reduced, reference_target, text)
    assert set(tokens) <= set(d2t.tolist()) and rt.generate(text, 40, draft_max=None).steps[0].drafted == tokens
    whole = load_draft_for_target(drafts["anchor_first_conf"], reference_target)
    whole.set_vocabulary(*read_draft_gguf(reduced)[2])
    feats, block = first_block(rt, rt.tokenize(text))
    with torch.inference_mode():
        assert whole.draft_chain(torch.tensor(feats), block, len(rt.tokenize(text))).tokens.tolist() == tokens
    for i, text in enumerate(PROMPTS[:4]):
        ar = rt.autoregressive(text, N_NEW)
        for j, block in enumerate(BLOCK_SIZES):
            draft_max = (None, "auto")[(i + j) % 2]
            spec = rt.generate(text, N_NEW, block_size=block, draft_max=draft_max, ngram=False)
            assert_same(spec, ar, f"d2t: {text!r}, block {block}, draft_max {draft_max}")
            assert {t for s in spec.steps for t in s.drafted} <= set(d2t.tolist())


def test_llama_cpps_graph_scales_and_scatters_the_bias_alike(reduced, tiny_target_gguf, tmp_path):
    """The reduced-vocabulary draft with a markov_w2.scale of 0.5, run by llama.cpp's own graph (the parity
    harness's peer, which reads its bias as the graph's last node: scaled, then scattered through d2t with
    0 elsewhere): the same chain, biases and biased logits as the runtime's."""
    from dflash_llama.parity.graph import rel_err
    from dflash_llama.parity.native import NativeDraft

    draft = rewrite(reduced, tmp_path / "scaled.gguf", tensors={S.MARKOV_SCALE: np.array([0.5], np.float32)})
    rt = dflash_llama.Runtime(tiny_target_gguf, draft, n_threads=2, n_ctx=256, kv_f32=True)
    tokens = rt.tokenize(PROMPTS[0])
    feats, block = rt.capture(tokens[:-1]), [tokens[-1]] + [rt.mask_token_id] * (rt.block_size - 1)
    ours, native = rt.trace_draft(feats, block), NativeDraft(rt, draft, n_ctx=256, n_threads=2).trace(feats, block)
    assert np.asarray(native["markov_prev"]).tolist() == ours["markov_prev"].tolist()
    for key in ("markov_bias", "biased_logits"):
        assert rel_err(ours[key], np.asarray(native[key]).reshape(ours[key].shape)) < 1e-5, key


def test_the_confidence_threshold_cuts_the_draft(drafts, tiny_target_gguf):
    """draft_p_min cuts each draft before its first slot whose confidence is below it, as the trace's
    confidences say (p_min between two of them); p_min 1 drafts nothing, so every step is a plain
    decode; greedy output stays plain decoding's. A draft without a confidence head refuses it, as
    does a p_min outside [0, 1]."""
    rt = runtime(tiny_target_gguf, drafts["anchor_first_conf"])
    prompt = rt.tokenize("import numpy as np\n")
    feats, block = first_block(rt, prompt)
    trace = rt.trace_draft(feats, block)
    confidence, chain = trace["confidence"], trace["markov_prev"].astype(int).tolist()[1:]
    cut = next(k for k in range(1, len(confidence)) if confidence[k] < confidence[:k].min())
    p_min = float((confidence[cut] + confidence[:cut].min()) / 2)
    spec = rt.generate(prompt, 40, draft_max=None, draft_p_min=p_min)
    assert cut > 1 and spec.steps[0].drafted == chain[:cut]
    ar = rt.autoregressive(prompt, 40)
    assert_same(spec, ar, f"p_min {p_min}")
    nothing = rt.generate(prompt, 40, draft_max=None, draft_p_min=1.0)
    assert_same(nothing, ar, "p_min 1")
    assert all(s.drafted == [] for s in nothing.steps) and len(nothing.steps) == 39
    assert_same(rt.generate(prompt, 40, draft_p_min=p_min), ar, f"adaptive, p_min {p_min}")
    # the adaptive loop's confidence gate: on by default with a confidence head, exact either way
    ungated = rt.generate(prompt, 40, confidence=False)
    assert_same(ungated, ar, "adaptive, no confidence gate")
    assert (ungated.policy.confidence_steps, ungated.policy.confidence_cut) == (0, 0)
    assert_same(rt.generate(prompt, 40, confidence=True), ar, "adaptive, confidence gate")
    with pytest.raises(ValueError, match=r"^the confidence gate is a choice of the adaptive loop \(draft_max auto\)"):
        rt.generate(prompt, 4, draft_max=3, confidence=True)

    other = runtime(tiny_target_gguf, drafts["anchor_first"])
    with pytest.raises(ValueError, match=r"^draft_p_min needs a draft with a confidence head \(a DSpark draft's "
                                         r"conf_proj\)$"):
        other.generate(prompt, 4, draft_p_min=0.5)
    with pytest.raises(ValueError, match=r"^the confidence gate needs a draft with a confidence head"):
        other.generate(prompt, 4, confidence=True)
    assert_same(other.generate(prompt, 40, confidence=False), other.autoregressive(prompt, 40), "no head, gate off")
    with pytest.raises(ValueError, match=r"^draft_p_min must be in \[0, 1\], got 1\.5"):
        rt.generate(prompt, 4, draft_p_min=1.5)


def test_the_clis_run_dspark_drafts(drafts, tiny_target_gguf, capsys):
    """llama-dflash-cli and `dflash-llama generate` (runtime and reference engines) decode with a DSpark
    draft and a confidence threshold: the target's greedy tokens, the steps the threshold cuts as the
    Python API's (the CLI through the target's own head) and the reference's (--kv-f32) are."""
    import subprocess

    from dflash_llama import cli, paths

    draft, prompt, p_min = drafts["anchor_first_conf"], "import numpy as np\n", 0.77
    rt = runtime(tiny_target_gguf, draft)
    api = rt.generate(prompt, 16, draft_max=8, draft_p_min=p_min)
    assert api.tokens == rt.autoregressive(prompt, 16).tokens and any(len(s.drafted) < 8 for s in api.steps)
    res = subprocess.run([str(paths.tool("llama-dflash-cli")), "-m", str(tiny_target_gguf), "-md", str(draft), "-p",
                          prompt, "-n", "16", "-t", "2", "--draft-max", "8", "--draft-p-min", str(p_min),
                          "--draft-head", "target", "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["tokens"] == api.tokens and [s["drafted"] for s in doc["steps"]] == [s.drafted for s in api.steps]
    steps = {}
    for engine in ("runtime", "reference"):
        rc = cli.main(["generate", "--engine", engine, "-m", str(tiny_target_gguf), "-md", str(draft), "-p", prompt,
                       "-n", "16", "--draft-max", "8", "--draft-p-min", str(p_min), "--kv-f32", "--json"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        assert out["tokens"] == api.tokens, engine
        steps[engine] = [s["drafted"] for s in out["steps"]]
    assert steps["runtime"] == steps["reference"] and any(len(s) < 8 for s in steps["runtime"])


def add_dspark_heads(draft_dir: Path, rank: int, scale: float, seed: int) -> Path:
    """A DFlash checkpoint (z-lab's format) made a SpecForge DSpark draft in DFlash's layout: a random
    Markov head of `rank` (W2 times `scale`) and confidence head."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((draft_dir / "config.json").read_text())
    config["architectures"] = [S.DSPARK.architecture]
    config["dflash_config"].update(markov_rank=rank, markov_head_type="vanilla", enable_confidence_head=True,
                                   confidence_head_with_markov=True, sample_from_anchor=False)
    (draft_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(draft_dir / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    dtype = tensors["fc.weight"].dtype
    n_vocab, n_embd = config["vocab_size"], config["hidden_size"]
    tensors.update({"markov_head.markov_w1.weight": torch.randn(n_vocab, rank, generator=g).to(dtype),
                    "markov_head.markov_w2.weight": (torch.randn(n_vocab, rank, generator=g) * scale).to(dtype),
                    "confidence_head.proj.weight": torch.randn(1, n_embd + rank, generator=g).to(dtype),
                    "confidence_head.proj.bias": torch.zeros(1).to(dtype)})
    save_file(tensors, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    return draft_dir


@pytest.mark.parametrize("reduced_vocab", [False, True])
def test_sampling_is_lossless(reduced_vocab, tiny_target_gguf, tmp_path):
    """Temperature 1, top-k 3: the first two tokens of DSpark sampling follow the target's exact joint
    distribution (chi-square goodness of fit over 2000 sequences), as tests/test_runtime_exactness.py
    checks it for DFlash 1. The draft (DFlash's layout) favours the target's likeliest second token
    (fixtures.constant_draft_hf); its Markov head, conditioned on the sampled first token, moves some
    proposals elsewhere (its own top-k sampling alone proposes k tokens); both the accept and the reject
    path run. reduced_vocab: the tokens up to that one kept (d2t; q is 0 outside them), every
    proposal one of them."""
    import gguf

    k = 3
    target, prompt, exact, proposal = sampling_setup(tiny_target_gguf, k)
    hf = fixtures.constant_draft_hf(tmp_path / "d", tiny_target_gguf, proposal,
                                    fixtures.TinyDraftConfig(block_size=4, target_layer_ids=[2]))
    add_dspark_heads(hf, rank=8, scale=0.1, seed=5)
    kept = gguf.GGUFReader(tiny_target_gguf).get_field("tokenizer.ggml.tokens").contents().index(proposal) + 1
    draft = convert(hf, tiny_target_gguf, tmp_path / "d.gguf", "f32", draft_vocab=kept if reduced_vocab else 0)
    rt = dflash_llama.Runtime(tiny_target_gguf, draft, n_threads=1, n_ctx=128)
    assert rt.draft_variant is S.DSPARK and not rt.sample_from_anchor

    counts, acceptance, proposed = sample_two_tokens(rt, prompt, k)  # the second token: a verify
    assert 0.05 < acceptance < 0.95, f"acceptance {acceptance:.2f}: both paths must be exercised"
    assert len(proposed) > k, "the Markov head moves some proposals out of the head's own top k"
    if reduced_vocab:
        assert proposed <= set(dflash_llama.gguf_info(draft).read(S.D2T).tolist())
    _, dof, p = chi2_goodness_of_fit(counts, exact)
    assert dof == k * k - 1 and p > 1e-3, f"DSpark sampling differs from target sampling (p = {p:.2e})"
    _, _, p_power = chi2_goodness_of_fit(counts, exact_two_token_distribution(target, prompt, k, 0.5))
    assert p_power < 1e-6, f"the test cannot tell temperature 0.5 from 1 (p = {p_power:.2e})"


def loader_case(case: str, draft: Path, dst: Path) -> tuple[Path, str]:
    """A broken DSpark file made from `draft` (anchor_first_conf, rank 16, without its tokenizer) and
    the message after '<file>: '."""
    if case == "W2 of another rank":
        w2 = tensor_data(draft, "markov_w2.weight")[:, :8].copy()
        return (rewrite(draft, dst, tensors={"markov_w2.weight": w2}),
                "tensor 'markov_w2.weight' has ne[0] = 8, expected 16")
    if case == "confidence bias missing":
        return rewrite(draft, dst, drop=("conf_proj.bias",)), "missing tensor 'conf_proj.bias'"
    if case == "confidence head the key denies":
        return (rewrite(draft, dst, kv={S.HAS_CONFIDENCE_HEAD: (False, V.BOOL)}),
                f"'{S.HAS_CONFIDENCE_HEAD}' = False but the draft has conf_proj.weight")
    if case == "layout as a number":
        return (rewrite(draft, dst, kv={S.SAMPLE_FROM_ANCHOR: (1, V.UINT32)}),
                f"{S.SAMPLE_FROM_ANCHOR}: u32 1, expected a bool")
    if case == "a Markov scale of nan":
        return (rewrite(draft, dst, tensors={S.MARKOV_SCALE: np.array([np.nan], np.float32)}),
                f"tensor '{S.MARKOV_SCALE}' is nan: expected a finite factor")
    if case == "a Markov scale of two values":
        return (rewrite(draft, dst, tensors={S.MARKOV_SCALE: np.ones(2, np.float32)}),
                f"tensor '{S.MARKOV_SCALE}' has shape [2]: expected [1] (one factor)")
    if case == "a DeepSeek-V4 backbone":
        return (rewrite(draft, dst, kv={S.HYPER_CONNECTION_COUNT: (4, V.UINT32)}),
                f"'{S.HYPER_CONNECTION_COUNT}': DSpark drafts on a DeepSeek-V4 backbone are not supported")
    if case == "a confidence head without the Markov head":
        return (rewrite(draft, dst, drop=("markov_w1.weight", "markov_w2.weight")),
                "tensor 'conf_proj.bias': a DSpark tensor in a DFlash 1 draft (no markov_w1.weight)")
    if case == "a Markov head of another vocabulary":
        heads = {name: tensor_data(draft, name)[:1000].copy() for name in ("markov_w1.weight", "markov_w2.weight")}
        return rewrite(draft, dst, tensors=heads), ("the Markov head has 1000 rows, the target's vocabulary 49152 "
                                                    "tokens: this draft was made for another target")
    raise AssertionError(case)


LOADER_CASES = ["W2 of another rank", "confidence bias missing", "confidence head the key denies",
                "layout as a number", "a Markov scale of nan", "a Markov scale of two values", "a DeepSeek-V4 backbone",
                "a confidence head without the Markov head", "a Markov head of another vocabulary"]


def test_a_broken_dspark_draft_is_one_line(drafts, tiny_target_gguf, tmp_path):
    """Each case: Runtime raises ValueError('<file>: <message>') and llama-dflash-cli prints that one
    line; the schema refuses what it reads (and the reference what it loads) in the same words."""
    from gguf import GGUFReader

    full = drafts["anchor_first_conf"]
    tokenizer = [k for k in GGUFReader(str(full)).fields if k.startswith("tokenizer.") and k != S.MASK_TOKEN_ID]
    draft = copy_gguf(full, tmp_path / "bare.gguf", kv=dict.fromkeys(tokenizer))
    dflash_llama.Runtime(tiny_target_gguf, draft, n_threads=1, n_ctx=64)  # the unbroken file loads
    for i, case in enumerate(LOADER_CASES):
        bad, message = loader_case(case, draft, tmp_path / f"bad{i}.gguf")
        refused(f"{bad}: {message}", tiny_target_gguf, bad)
        if case == "a confidence head without the Markov head":
            reader = GGUFReader(str(bad))
            kv = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
            assert message in S.refusals(kv, [t.name for t in reader.tensors])
        if case.startswith("a Markov scale"):  # the reference reads the file with its tokenizer
            from dflash_llama.reference import load_draft

            bad, message = loader_case(case, full, tmp_path / f"full{i}.gguf")
            with pytest.raises(ValueError, match=f"^{re.escape(f'{bad}: {message}')}$"):
                load_draft(bad)
