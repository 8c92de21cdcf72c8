"""The trainer: prompts without HumanEval, a dataset captured by the runtime, training that learns,
resumes, and writes a checkpoint every loader reads."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import dflash_llama
from dflash_llama.converter import convert
from dflash_llama.converter.pair import resolve_draft
from dflash_llama.reference.checkpoint import load_draft
from dflash_llama.train.data import (
    SELF_OPENER,
    DatasetSpec,
    _humaneval_docstring,
    build_dataset,
    code_prompts,
    iter_sequences,
    self_prompts,
    signature_line,
    storage_features,
)
from dflash_llama.train.trainer import (
    TrainConfig,
    block_hidden,
    make_batch,
    position_weights,
    replay_anchors,
    replay_tau,
    target_weights_from_gguf,
    train,
)

LAYERS = [1, 3]


def test_prompts_are_humaneval_shaped_and_exclude_humaneval():
    from dflash_llama.prompts import humaneval

    prompts = code_prompts(limit=300, seed=3)
    assert len(prompts) == 300
    held_out = {p.text for p in humaneval()}
    assert not held_out & set(prompts)
    for p in prompts:
        assert p.startswith(("def ", "async def ")) and '    """' in p and p.endswith("\n")
        compile(p + "    pass\n", "<prompt>", "exec")  # a complete, valid function once a body is added
    assert code_prompts(limit=300, seed=3) == prompts  # deterministic


def test_prompts_with_examples_show_doctests():
    prompts = code_prompts(limit=40, seed=0, with_examples=True)
    assert len(prompts) == 40 and all(">>> " in p for p in prompts)
    assert not code_prompts(stdlib=False)  # no packages, no standard library: nothing


def test_humaneval_style_keeps_the_summary_and_three_examples():
    doc = ("Add two numbers.\n\nParameters\n----------\na, b : int\n\nExamples\n--------\n"
           ">>> add(1, 2)\n3\n>>> add(\n...     2, 2)\n4\n\nMore prose.\n\n>>> add(0, 0)\n0\n>>> add(5, 5)\n10\n")
    assert _humaneval_docstring(doc) == ("Add two numbers.\n>>> add(1, 2)\n3\n>>> add(\n...     2, 2)\n4\n"
                                         ">>> add(0, 0)\n0")
    assert _humaneval_docstring("Only prose.\n\nNo example.") is None
    prompts = code_prompts(limit=40, seed=0, style="humaneval")
    assert len(prompts) == 40
    for p in prompts:
        assert p.startswith(("\ndef ", "\nasync def ")) and ">>> " in p and "\n\n    >>>" not in p
        compile(p + "    pass\n", "<prompt>", "exec")
    with pytest.raises(ValueError, match="prompt style 'chat': expected one of docstring, humaneval"):
        code_prompts(style="chat")


def test_signature_line_takes_only_a_whole_signature():
    assert signature_line(" is_even(n: int) -> bool:\n    return n % 2 == 0") == "is_even(n: int) -> bool:"
    assert signature_line("\nsum_list(xs):") == "sum_list(xs):"
    assert signature_line("2020_density(data):") is None  # not an identifier
    assert signature_line("main():  # entry") is None  # no closing colon
    assert signature_line("x = [1, 2, 3]") is None  # no parameter list
    assert signature_line("") is None


class _WritingRuntime:
    """Stands in for Runtime.autoregressive_batch: sample i of a call seeded s is script[(s + i) % len]."""

    n_vocab = 3

    def __init__(self, script):
        self.script, self.seeds = script, []

    def detokenize(self, tokens):
        return {0: "def", 1: ":\n", 2: " x"}[tokens[0]]

    def autoregressive_batch(self, prompts, n, *, temperature, top_p, seed, stop_tokens):
        assert all(p == SELF_OPENER for p in prompts) and n == 32 and temperature == 0.8 and top_p == 0.95
        assert stop_tokens == [1]  # a sample stops at its first line break
        self.seeds.append(seed)
        return [type("G", (), {"text": self.script[(seed + i) % len(self.script)]})() for i in range(len(prompts))]


def test_self_prompts_open_a_docstring_after_each_new_signature():
    rt = _WritingRuntime([" add(a, b):\n    return a + b", "junk", " add(a, b):", " rev(s: str) -> str:\n"])
    prompts = self_prompts(rt, 2, seed=5, batch=2, progress=False)
    assert prompts == [f'{SELF_OPENER}add(a, b):\n    """', f'{SELF_OPENER}rev(s: str) -> str:\n    """']
    assert rt.seeds == [5, 7]  # seeds 5, 6 (junk, add), then 7, 8 (rev; a second add is dropped)
    compile(prompts[1] + 'Reverse."""\n', "<prompt>", "exec")
    with pytest.raises(ValueError, match="the target wrote 0 distinct function signatures, not 3"):
        self_prompts(_WritingRuntime(["junk"]), 3, batch=4, progress=False)


class _DocstringRuntime:
    """Stands in for the target writing docstrings: `write(prompt)` is a prompt's continuation; every
    call's (prompt count, token limit, seed, stop tokens) is recorded."""

    def __init__(self, write):
        self.write, self.calls = write, []

    def tokenize(self, text, add_special=True):
        return {'"""': [7], ' """': [8]}[text]

    def autoregressive_batch(self, prompts, n, *, temperature, top_p, seed, stop_tokens=()):
        self.calls.append((len(prompts), n, seed, tuple(stop_tokens)))
        return [type("G", (), {"text": self.write(p)})() for p in prompts]


def test_close_docstrings_closes_each_and_adds_examples_to_every_second():
    from dflash_llama.train.data import close_docstrings

    docs = {"add": 'Add two numbers."""', "rev": 'Reverse s.\n    """', "bad": 'Ünïcode."""', "odd": "Is n odd?"}
    examples = {"rev": "'ab')\n    'ba'\n    \"\"\" text after the quotes", "odd": "3)\n    True"}

    def write(prompt):
        name = prompt[len(SELF_OPENER):].split("(", 1)[0]
        return examples[name] if prompt.endswith(f">>> {name}(") else docs[name]

    rt = _DocstringRuntime(write)
    opened = [f'{SELF_OPENER}{sig}\n    """' for sig in ("add(a, b):", "rev(s):", "bad(x):", "odd(n):")]
    closed = close_docstrings(rt, opened, seed=10, max_tokens=50)
    # add: closed as written; rev (second): reopened for examples; bad: not ASCII; odd: never closes
    assert closed == [f'{SELF_OPENER}add(a, b):\n    """Add two numbers."""\n',
                      f'{SELF_OPENER}rev(s):\n    """Reverse s.\n    >>> rev(\'ab\')\n    \'ba\'\n    """\n']
    assert rt.calls == [(4, 50, 10, (7, 8)), (1, 50, 1_000_010, (7, 8))]
    for c in closed:
        compile(c + "    pass\n", "<prompt>", "exec")


def test_self_prompts_in_humaneval_style_end_after_the_docstring():
    signatures = _WritingRuntime([" add(a, b):", " rev(s: str) -> str:"])

    def write(prompt):
        if prompt == SELF_OPENER:
            raise AssertionError("signatures come from the other stand-in")
        return "'x')\n    'x'\n    \"\"\"" if prompt.endswith(">>> rev(") else 'Do it."""'

    rt = _DocstringRuntime(write)
    rt.n_vocab, rt.detokenize = signatures.n_vocab, signatures.detokenize
    sample = rt.autoregressive_batch
    rt.autoregressive_batch = lambda prompts, n, **kw: (
        signatures.autoregressive_batch(prompts, n, **kw) if prompts[0] == SELF_OPENER else sample(prompts, n, **kw))
    prompts = self_prompts(rt, 2, seed=4, batch=2, style="humaneval", progress=False)
    assert prompts == [f'{SELF_OPENER}add(a, b):\n    """Do it."""\n',
                       f'{SELF_OPENER}rev(s: str) -> str:\n    """Do it.\n    >>> rev(\'x\')\n    \'x\'\n    """\n']
    with pytest.raises(ValueError, match="prompt style 'chat': expected one of docstring, humaneval"):
        self_prompts(rt, 1, style="chat", progress=False)


@pytest.fixture(scope="module")
def dataset(tiny_target_gguf, tmp_path_factory):
    rt = dflash_llama.Runtime(tiny_target_gguf, n_threads=2, n_ctx=256)
    out = tmp_path_factory.mktemp("train_data")
    spec = DatasetSpec(target=str(tiny_target_gguf), layer_ids=LAYERS, max_new_tokens=24, shard_size=3, n_ctx=256)
    prompts = code_prompts(limit=8, seed=1)
    build_dataset(rt, prompts, out, spec, progress=False)
    return out, rt, prompts


def test_dataset_holds_the_targets_own_responses_and_features(dataset):
    out, rt, prompts = dataset
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompts_done"] == 8 and len(manifest["shards"]) == 3  # shards of 3, 3, 2
    seqs = list(iter_sequences(out))
    assert len(seqs) == 8
    for (tokens, prompt_len, feats), prompt in zip(seqs, prompts):
        ptoks = rt.tokenize(prompt)
        assert prompt_len == len(ptoks) and list(tokens[:prompt_len]) == ptoks
        assert list(tokens[prompt_len:]) == rt.autoregressive(ptoks, 24).tokens  # greedy response
        assert feats.dtype == np.float16 and feats.shape == (len(tokens), 2 * 64)
        np.testing.assert_array_equal(feats, rt.capture(list(tokens), LAYERS).astype(np.float16))


def test_features_too_large_for_float16_are_stored_as_captured():
    fits = np.array([[1.5, -65000.0], [0.25, 3.0]], dtype=np.float32)
    assert storage_features(fits).dtype == np.float16
    np.testing.assert_array_equal(storage_features(fits), fits.astype(np.float16))
    big = fits.copy()
    big[0, 1] = -101960.664  # Gemma 3 270M's residual stream at the BOS token, layer 13
    stored = storage_features(big)
    assert stored.dtype == np.float32 and np.isfinite(stored).all()
    np.testing.assert_array_equal(stored, big)


def test_a_rerun_resumes_instead_of_redoing(dataset, tmp_path):
    out, rt, prompts = dataset
    before = (out / "manifest.json").read_text()
    spec = DatasetSpec(target="x", layer_ids=LAYERS, max_new_tokens=24, shard_size=3, n_ctx=256)
    build_dataset(rt, prompts, out, spec, progress=False)
    assert (out / "manifest.json").read_text() == before
    with pytest.raises(ValueError, match="holds a dataset with other settings"):
        build_dataset(rt, prompts, out, DatasetSpec(target="x", layer_ids=[0], max_new_tokens=24), progress=False)


def test_batches_follow_the_recipe():
    import random

    tokens = np.arange(100, 140, dtype=np.int32)
    feats = np.zeros((40, 8), dtype=np.float16)
    b = make_batch(tokens, 10, feats, block_size=4, n_anchors=5, rng=random.Random(0))
    assert len(b.anchors) == 5 and all(10 <= a < 39 for a in b.anchors.tolist())
    for a, t in zip(b.anchors.tolist(), b.targets.tolist()):  # position k predicts token a + k, -1 past the end
        assert t == [int(tokens[a + k]) if a + k < 40 else -1 for k in range(1, 4)]
    assert torch.allclose(position_weights(8, 4.0), torch.exp(-torch.arange(7) / 4.0))


def test_training_learns_resumes_and_writes_a_loadable_checkpoint(dataset, tiny_target_gguf, tiny_target_hf,
                                                                 tmp_path):
    out_data, rt, prompts = dataset
    cfg = TrainConfig(target_layer_ids=LAYERS, layers=1, block_size=4, heads=4, kv_heads=2, head_dim=16, ffn=64,
                      epochs=12.0, batch=2, anchors=8, heldout=2, eval_every=12, lr=5e-3, vocab_subset=512,
                      mask_token_id=0, seed=0)
    ckpt = tmp_path / "draft"
    log = train(out_data, tiny_target_gguf, ckpt, cfg, progress=False, threads=2)
    assert log.steps[-1] == 36  # 12 epochs of 6 training sequences, 2 per step
    assert np.mean(log.loss[-4:]) < 0.8 * np.mean(log.loss[:4]), log.loss  # measured: 6.27 -> 4.53
    # resumable: a longer run continues from the saved step
    cfg.epochs = 14.0
    log2 = train(out_data, tiny_target_gguf, ckpt, cfg, progress=False, threads=2)
    assert log2.steps[0] == 1 and log2.steps[-1] == 42 and log2.loss[:36] == log.loss[:36]

    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": LAYERS}
    # the reference, our converter + runtime, and the published package all read it
    from dflash.model import DFlashDraftModel

    published = DFlashDraftModel.from_pretrained(str(ckpt), dtype=torch.float32)
    assert published.target_layer_ids == LAYERS and published.block_size == 4
    ours = load_draft(ckpt)
    assert ours.config.target_layer_ids == LAYERS
    gguf = convert(ckpt, tiny_target_gguf, tmp_path / "draft.gguf", outtype="f32")
    spec = dflash_llama.Runtime(tiny_target_gguf, gguf, n_threads=2, n_ctx=256,
                                compact_draft_head=False)  # the replay's head
    g = spec.generate("def add(a, b):", 24)
    assert g.tokens == spec.autoregressive("def add(a, b):", 24).tokens
    # replayed on the stored responses, the loop takes the runtime's verify steps exactly
    steps = produced = 0
    for p in prompts:
        g = spec.generate(p, 24, block_size=4, draft_max=None)  # the whole block, as replayed
        steps, produced = steps + len(g.steps), produced + len(g.tokens) - 1
    t = target_weights_from_gguf(tiny_target_gguf)
    tau, replay_steps = replay_tau(load_draft(ckpt, t.embed_tokens, t.lm_head), iter_sequences(out_data))
    assert (replay_steps, tau) == (steps, pytest.approx(produced / steps))


def test_replay_anchors_each_block_after_the_accepted_tokens_and_the_targets():
    accepted = [9, 9, 2, 0, 0, 3, 1, 1, 0, 0, 0]  # per position; the prompt is the first 2
    assert replay_anchors(accepted, 2) == [2, 5, 9]  # 2 accepts 2 (+1): 5 accepts 3 (+1): 9
    assert replay_anchors([0, 0, 0, 0], 1) == [1, 2]  # nothing accepted: one token per step
    assert replay_anchors([0, 5], 1) == []  # no token left to produce


@pytest.fixture(scope="module")
def small_draft(dataset, tiny_target_gguf, tmp_path_factory):
    """A 1-layer draft trained for 2 epochs, and its config: the start of the --init tests."""
    cfg = TrainConfig(target_layer_ids=LAYERS, layers=1, block_size=4, heads=4, kv_heads=2, head_dim=16, ffn=64,
                      epochs=2.0, batch=2, anchors=8, heldout=2, eval_every=100, lr=5e-3, vocab_subset=512, seed=0)
    first = tmp_path_factory.mktemp("small_draft")
    train(dataset[0], tiny_target_gguf, first, cfg, progress=False, threads=2)
    return first, cfg


def test_training_can_start_from_a_checkpoint(dataset, small_draft, tiny_target_gguf, tmp_path):
    out_data, _, _ = dataset
    first, cfg = small_draft
    # zero steps from --init: the saved weights are exactly the init checkpoint's
    cfg0 = TrainConfig(**{**cfg.__dict__, "epochs": 0.0, "seed": 7})
    again = tmp_path / "again"
    train(out_data, tiny_target_gguf, again, cfg0, progress=False, threads=2, init=first)
    a, b = load_draft(first).state_dict(), load_draft(again).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"its block_size is 4, this training's is 8"):
        train(out_data, tiny_target_gguf, tmp_path / "bad", TrainConfig(**{**cfg.__dict__, "block_size": 8}),
              progress=False, threads=2, init=first)


def test_a_checkpoint_grows_into_a_deeper_draft_that_computes_the_same(dataset, small_draft, tiny_target_gguf,
                                                                       tmp_path):
    out_data, _, _ = dataset
    first, cfg = small_draft
    grown_dir = tmp_path / "grown"
    train(out_data, tiny_target_gguf, grown_dir, TrainConfig(**{**cfg.__dict__, "layers": 3, "epochs": 0.0}),
          progress=False, threads=2, init=first)
    t = target_weights_from_gguf(tiny_target_gguf)
    small, grown = (load_draft(d, t.embed_tokens, t.lm_head) for d in (first, grown_dir))
    assert grown.config.n_layer == 3
    new = grown.layers[2].state_dict()
    assert torch.count_nonzero(new["self_attn.o_proj.weight"]) == 0
    assert torch.count_nonzero(new["mlp.down_proj.weight"]) == 0
    assert torch.equal(new["self_attn.q_proj.weight"], small.layers[0].state_dict()["self_attn.q_proj.weight"])
    tokens, prompt_len, feats = next(iter(iter_sequences(out_data)))
    b = make_batch(tokens, prompt_len, feats, 4, 4, random.Random(0))
    with torch.no_grad():
        assert torch.equal(block_hidden(small, b.feats, b.tokens, b.anchors),
                           block_hidden(grown, b.feats, b.tokens, b.anchors))
    from dflash_llama.train.model_card import write_model_card

    card = write_model_card(grown_dir, [out_data]).read_text()
    assert card.startswith("# tiny-target-f32 DFlash draft (dflash-llama)\n")
    assert "3 layers, hidden" in card and "up to 24 tokens each" in card
    mask = json.loads((grown_dir / "config.json").read_text())["dflash_config"]["mask_token_id"]
    token = dflash_llama.gguf_info(tiny_target_gguf).metadata["tokenizer.ggml.tokens"][mask]
    assert f"mask token {mask} (`{token}`)," in card  # the target's own text for it, not a fixed one
    assert f"| {out_data.name} | `?` | 8 |" in card
    with pytest.raises(ValueError, match=r"it has 3 layers, this training's draft 1 \(a draft can grow, not shrink\)"):
        train(out_data, tiny_target_gguf, tmp_path / "shrunk", cfg, progress=False, threads=2, init=grown_dir)


@pytest.mark.parametrize("extra, rc, message", [
    (["--init", "/nonexistent-draft"], 2, "--init /nonexistent-draft: no draft checkpoint there (config.json)"),
    (["--eval-only", "--eval-engines", "bogus"], 2, "--eval-engines takes runtime, native, published; got 'bogus'"),
    (["--eval-only"], 2, "no checkpoint in"),
    (["--eval-only", "--extra-data", "/nonexistent-set"], 2, "/nonexistent-set: not a dataset (no manifest.json)"),
    (["--target-layer-ids", "1,99"], 2, "target layer 99 is outside the target's 4 layers"),
    (["--distill", "1.5"], 2, "--distill is a weight between 0 and 1, got 1.5"),
    (["--gamma", "-1"], 2, "--gamma must be positive (0: the published value), got -1.0"),
    (["--prompt-source", "self"], 2, "--prompt-source self needs --prompts N"),
])
def test_cli_refuses_bad_arguments_before_any_work(capsys, tiny_target_gguf, tmp_path, extra, rc, message):
    from dflash_llama import cli

    got = cli.main(["train", "--target", str(tiny_target_gguf), "--out", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert got == rc and message in err, err
    assert not (tmp_path / "out").exists()  # nothing built, nothing lost


def test_cli_will_not_extend_a_dataset_with_other_prompts(capsys, tiny_target_gguf, tmp_path):
    from dflash_llama import cli

    data = tmp_path / "data"
    data.mkdir()
    theirs = "code_prompts(seed=0, packages=['numpy'], stdlib=False, with_examples=True)[0:8]"
    manifest = json.dumps({"target": str(tiny_target_gguf), "layer_ids": LAYERS, "max_new_tokens": 24,
                           "prompts_done": 8, "shards": [], "n_tokens": 0, "n_response_tokens": 0, "source": theirs})
    (data / "manifest.json").write_text(manifest)
    got = cli.main(["train", "--target", str(tiny_target_gguf), "--out", str(tmp_path / "out"), "--data", str(data),
                    "--target-layer-ids", "1,3"])
    err = capsys.readouterr().err
    assert got == 2, err
    assert f"holds the responses to {theirs}, not to this command's code_prompts(seed=0, packages=[], " \
           "stdlib=True, with_examples=False)[0:]" in err
    assert (data / "manifest.json").read_text() == manifest  # untouched


def test_training_refuses_a_dataset_of_other_target_layers(dataset, tiny_target_gguf, tmp_path):
    out_data, _, _ = dataset
    cfg = TrainConfig(target_layer_ids=[1, 2], layers=1, block_size=4, heads=4, kv_heads=2, head_dim=16, ffn=64)
    with pytest.raises(ValueError, match=r"holds features of target layers \[1, 3\], not \[1, 2\]: build it with "
                                         r"the same --target-layer-ids \(the default depends on --layers\)"):
        train(out_data, tiny_target_gguf, tmp_path / "out", cfg, progress=False, threads=1)
    assert not (tmp_path / "out" / "config.json").exists()


def test_an_evaluation_of_some_engines_keeps_the_other_scores(tmp_path):
    from dflash_llama.train.eval import DraftEvaluation, EngineScore, _keep_other_engines

    def score(engine, prompts, accepted):
        return EngineScore(engine, prompts, tokens=10 * prompts, steps=5 * prompts, drafted=35 * prompts,
                           accepted=accepted, seconds=1.0)

    first = DraftEvaluation("ckpt", "target", 8, 128, [score("dflash-llama runtime", 164, 800),
                                                         score("llama.cpp draft-dflash", 164, 700)])
    (tmp_path / "eval.json").write_text(json.dumps(first.to_json()))
    again = DraftEvaluation("ckpt", "target", 8, 128, [score("dflash-llama runtime (first 20)", 20, 90),
                                                         score("llama.cpp draft-dflash", 164, 710)])
    _keep_other_engines(again, tmp_path / "eval.json")
    assert [(s.engine, s.accepted) for s in again.scores] == [
        ("dflash-llama runtime", 800), ("dflash-llama runtime (first 20)", 90), ("llama.cpp draft-dflash", 710)]
    native = EngineScore("llama.cpp draft-dflash", 164, 1000, 0, 700, 63, 1.0)
    assert "| llama.cpp draft-dflash | 164 | n/a | 0.090 |" in DraftEvaluation("c", "t", 8, 128, [native]).markdown()


@pytest.mark.parametrize("tap", [0, 1])  # after layer 1: the target's layers 2 and 3 run; after layer 3: none
def test_target_tail_gives_back_the_targets_greedy_tokens(dataset, tiny_target_gguf, tap):
    from dflash_llama.reference.target_tail import TargetTail

    out_data, _, _ = dataset
    t = target_weights_from_gguf(tiny_target_gguf)
    tail = TargetTail(tiny_target_gguf, LAYERS[tap] + 1, t.lm_head)
    assert len(tail.layers) == (2, 0)[tap]
    hidden = t.lm_head.shape[1]
    for tokens, prompt_len, feats in iter_sequences(out_data):
        final = tail.hidden(torch.from_numpy(feats[:, tap * hidden:(tap + 1) * hidden].astype(np.float32)))
        greedy = (final[prompt_len - 1:-1] @ t.lm_head.T).argmax(-1)
        assert greedy.tolist() == tokens[prompt_len:].tolist()  # the response is the target's greedy output


def test_distillation_mixes_kl_to_the_target_into_the_loss(dataset, small_draft, tiny_target_gguf):
    from dflash_llama.reference.target_tail import TargetTail
    from dflash_llama.train.trainer import attach_teacher, batch_loss

    out_data, _, _ = dataset
    first, cfg = small_draft
    t = target_weights_from_gguf(tiny_target_gguf)
    draft = load_draft(first, t.embed_tokens, t.lm_head)
    tokens, prompt_len, feats = next(iter(iter_sequences(out_data)))
    b = make_batch(tokens, prompt_len, feats, 4, 6, random.Random(0))
    w = position_weights(4, 2.0)
    with torch.no_grad():
        ce = batch_loss(draft, b, w, None, None)
        # a teacher that is the draft itself: KL 0, so the loss is the cross-entropy's share alone
        b.teacher = block_hidden(draft, b.feats, b.tokens, b.anchors)[:, 1:]
        assert torch.allclose(batch_loss(draft, b, w, None, None, distill=0.25), 0.75 * ce, rtol=1e-5)
        assert torch.allclose(batch_loss(draft, b, w, None, None, distill=1.0), torch.tensor(0.0), atol=1e-5)
        # the real teacher: the target's distribution at the position before each target
        attach_teacher(b, TargetTail(tiny_target_gguf, LAYERS[0] + 1, t.lm_head), slice(0, t.lm_head.shape[1]))
        assert b.teacher.shape == (6, 3, t.lm_head.shape[1])
        greedy = (b.teacher @ t.lm_head.T).argmax(-1)
        valid = b.targets >= 0
        assert torch.equal(greedy[valid], b.targets[valid])  # its greedy tokens are the targets
        kl = batch_loss(draft, b, w, None, None, distill=1.0)
        assert kl > 0.1 and torch.isfinite(kl)


def test_model_card_says_how_each_stage_was_trained(tmp_path):
    from dflash_llama.train.model_card import write_model_card

    ckpt, data = tmp_path / "draft", tmp_path / "data"
    ckpt.mkdir()
    data.mkdir()
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 128, "block_size": 8, "num_target_layers": 4,
              "dflash_config": {"mask_token_id": 0, "target_layer_ids": LAYERS}}
    (ckpt / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(64, 128)}, str(ckpt / "model.safetensors"))
    recorded = {"source": "code_prompts(seed=0)[0:10]", "target": "t.gguf", "max_new_tokens": 128, "sequences": 10,
                "response_tokens": 70, "tokens": 150}
    old = {"command": "dflash-llama train A", "steps": 10, "config": {"batch": 8, "anchors": 32, "lr": 6e-4},
           "datasets": [{"name": "gone", **recorded}, {"name": "data", **recorded}]}
    new = {"command": "dflash-llama train B -t 1", "steps": 5, "init": old,
           "config": {"batch": 8, "anchors": 32, "lr": 3e-4, "gamma": 1.5, "bf16": False, "heldout_measure": "replay"}}
    (ckpt / "train_log.json").write_text(json.dumps(new))
    # tau from the counts: (16451 - 164) / 8295 = 1.96347, though its stored rounding 1.9635 would print 1.964
    (ckpt / "eval.json").write_text(json.dumps({"block_size": 8, "n_predict": 128, "scores": [
        {"engine": "dflash-llama runtime", "prompts": 164, "tokens": 16451, "steps": 8295, "drafted": 57116,
         "accepted": 8088, "seconds": 1.0, "exact": True, "note": "", "tau": 1.9635, "acceptance_rate": 0.1416},
        {"engine": "llama.cpp", "prompts": 164, "tokens": 16655, "steps": 0, "drafted": 58171, "accepted": 8212,
         "seconds": 1.0, "exact": None, "note": "", "tau": 0.0, "acceptance_rate": 0.1412}]}))
    (data / "manifest.json").write_text(json.dumps({
        "target": "t.gguf", "layer_ids": LAYERS, "max_new_tokens": 192, "prompts_done": 4, "shards": [],
        "n_tokens": 100, "n_response_tokens": 60, "source": "self_prompts(seed=0, style='humaneval')[0:4]"}))
    card = write_model_card(ckpt, [data]).read_text()
    stage1, stage2 = card.split("1. from random weights")[1].split("2. then")
    assert "(bf16 autocast)" in stage1 and "held-out teacher-forced tau" in stage1 and "--gamma" not in stage1
    assert "(f32)" in stage2 and "held-out replayed tau" in stage2
    assert "min wall time (bf16" in stage1 and "min wall time at 1 thread (f32)" in stage2
    assert "| dflash-llama runtime | 164 | 1.963 | 0.142 | yes |\n| llama.cpp | 164 | n/a | 0.141 |  |" in card
    assert "position weights exp(-(k-1)/1.5) (`--gamma 1.5`)" in stage2
    assert "followed by a docstring it sampled too" in card and "each prompt opening a docstring" not in card
    # an earlier stage's dataset, gone from disk, is shown from its record; one given is read anew
    assert "| gone | `code_prompts(seed=0)[0:10]` | 10 | 70 |\n| data | `self_prompts(" in card
    assert "| all | | 14 | 130 (250 with prompts) |" in card and "up to 128 or 192 tokens each" in card


def test_a_reduced_vocabulary_is_trained_saved_converted_and_run(dataset, tiny_target_gguf, tmp_path, monkeypatch):
    """--draft-vocab K: the K most frequent response tokens and the end-of-generation ones, saved as
    published checkpoints save a d2t (offsets); the converter, the runtime and the reference read it."""
    from safetensors.torch import load_file, save_file

    from dflash_llama import gguf_info, schema as L
    from dflash_llama.converter import ConversionError

    cfg = TrainConfig(target_layer_ids=LAYERS, layers=1, block_size=4, heads=4, kv_heads=2, head_dim=16, ffn=64,
                      epochs=1.0, batch=2, anchors=8, heldout=2, eval_every=100, lr=5e-3, draft_vocab=64, seed=0)
    ckpt = tmp_path / "draft"
    train(dataset[0], tiny_target_gguf, ckpt, cfg, progress=False, threads=2)
    config = json.loads((ckpt / "config.json").read_text())
    state = load_file(str(ckpt / "model.safetensors"))
    ids = torch.arange(64) + state["d2t"]
    assert config[L.DRAFT_VOCAB_SIZE] == 64 and state["d2t"].dtype == torch.int64
    assert (ids.diff() > 0).all()
    meta = gguf_info(tiny_target_gguf).metadata
    assert meta["tokenizer.ggml.eos_token_id"] in ids.tolist()
    counts = response_counts(dataset[0])  # the responses' most frequent tokens are kept
    assert max(counts, key=counts.get) in ids.tolist()

    gguf = convert(ckpt, tiny_target_gguf, tmp_path / "draft.gguf", outtype="f32")
    assert gguf_info(gguf).read(L.D2T).tolist() == ids.tolist()
    # `dflash-llama run` and `bench` (draft_vocab None): the draft's own vocabulary, not DECODE_DRAFT_VOCAB's
    monkeypatch.setenv("DFLASH_LLAMA_CACHE", str(tmp_path / "cache"))
    assert gguf_info(resolve_draft(ckpt, tiny_target_gguf, "f32", None)).read(L.D2T).tolist() == ids.tolist()
    rt = dflash_llama.Runtime(tiny_target_gguf, gguf, n_threads=2, n_ctx=256)
    g = rt.generate("def add(a, b):", 24, draft_max=None)
    assert g.tokens == rt.autoregressive("def add(a, b):", 24).tokens
    assert {t for s in g.steps for t in s.drafted} <= set(ids.tolist())
    t = target_weights_from_gguf(tiny_target_gguf)
    ref = load_draft(ckpt, t.embed_tokens, t.lm_head)
    assert ref.d2t.tolist() == ids.tolist() and torch.equal(ref.lm_head, t.lm_head[ids])
    with pytest.raises(ConversionError, match="has a reduced vocabulary of its own"):
        convert(ckpt, tiny_target_gguf, tmp_path / "again.gguf", outtype="f32", draft_vocab=32)
    state["d2t"][3] = state["d2t"][2] - 1  # rows 2 and 3 on one token
    save_file(state, str(ckpt / "model.safetensors"))
    with pytest.raises(ConversionError, match="tensor 'd2t' must map its 64 rows to distinct token ids"):
        convert(ckpt, tiny_target_gguf, tmp_path / "bad.gguf", outtype="f32")


def test_a_draft_vocabulary_larger_than_the_responses_keeps_what_they_use(dataset, tiny_target_gguf, tmp_path,
                                                                          capsys):
    """--draft-vocab K above the number of distinct response tokens keeps those (and says so in one line);
    the model card shows the size trained, not K."""
    from safetensors.torch import load_file

    from dflash_llama import gguf_info, schema as L
    from dflash_llama.train.model_card import _loss_vocabulary

    cfg = TrainConfig(target_layer_ids=LAYERS, layers=1, block_size=4, heads=4, kv_heads=2, head_dim=16, ffn=64,
                      epochs=0.5, batch=2, anchors=8, heldout=2, eval_every=100, lr=5e-3, draft_vocab=4000, seed=0)
    ckpt = tmp_path / "draft"
    train(dataset[0], tiny_target_gguf, ckpt, cfg, progress=False, threads=2)
    kept = json.loads((ckpt / "config.json").read_text())[L.DRAFT_VOCAB_SIZE]
    ids = (torch.arange(kept) + load_file(str(ckpt / "model.safetensors"))["d2t"]).tolist()
    eos = gguf_info(tiny_target_gguf).metadata["tokenizer.ggml.eos_token_id"]
    assert kept < 4000 and set(ids) <= set(response_counts(dataset[0])) | {eos}
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"--draft-vocab 4000: the training responses use {kept:,} distinct tokens (end-of-generation ones "
        f"included); the draft keeps those {kept:,}")
    assert _loss_vocabulary({"draft_vocab": 4000}, kept).startswith(
        f"a reduced draft vocabulary of {kept:,} tokens (`--draft-vocab 4000`: every token the responses use, "
        f"saved as d2t")
    assert _loss_vocabulary({"draft_vocab": 64}).startswith(
        "a reduced draft vocabulary of 64 tokens (`--draft-vocab`, ")


def response_counts(data_dir) -> dict[int, int]:
    """Response token counts of a dataset."""
    counts: dict[int, int] = {}
    for tokens, prompt_len, _ in iter_sequences(data_dir):
        for tok in tokens[prompt_len:].tolist():
            counts[int(tok)] = counts.get(int(tok), 0) + 1
    return counts


DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def test_a_dflash1_draft_starts_a_dflash2_draft_that_drafts_the_same_then_trains_its_heads(
        dataset, small_draft, tiny_target_gguf, tmp_path, monkeypatch):
    """--variant dflash2 --init DFLASH1_DRAFT: identity convolutions, so the logits are the DFlash 1
    draft's; training moves the convolutions and the selector (its own loss); sharded checkpoints in
    z-lab's format, which the reference and the converter read."""
    from dflash_llama import schema as L
    from dflash_llama.reference.model import DFlashDraft
    from dflash_llama.train import trainer

    out_data, _, _ = dataset
    first, cfg = small_draft
    t = target_weights_from_gguf(tiny_target_gguf)
    start_dir, trained_dir = tmp_path / "start", tmp_path / "trained"
    train(out_data, tiny_target_gguf, start_dir, TrainConfig(**{**cfg.__dict__, **DFLASH2, "epochs": 0.0}),
          progress=False, threads=2, init=first)
    monkeypatch.setattr(trainer, "SHARD_BYTES", 20_000)  # the tiny draft in shards, as a real one is
    log = train(out_data, tiny_target_gguf, trained_dir, TrainConfig(**{**cfg.__dict__, **DFLASH2, "epochs": 1.0}),
                progress=False, threads=2, init=first)
    config = json.loads((trained_dir / "config.json").read_text())
    assert config["architectures"] == [L.DFLASH2.architecture] and config["dflash_config"]["selector_top_k"] == 4
    index = json.loads((trained_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert "candidate_selector.predecessor_codebook" in index and "layers.0.mlp_conv.base_kernel" in index
    assert not (trained_dir / "model.safetensors").exists() and len(set(index.values())) > 1
    assert all(np.isfinite(log.loss)) and log.loss[-1] > 0
    from dflash_llama.train.model_card import write_model_card

    card = write_model_card(trained_dir, [out_data]).read_text()
    assert card.startswith("# tiny-target-f32 DFlash 2 draft (dflash-llama)\n")
    assert "model.safetensors.index.json" in card
    assert "candidate selector of rank 8 walking the top 4 candidates" in card

    dflash1, start, trained = (load_draft(d, t.embed_tokens, t.lm_head) for d in (first, start_dir, trained_dir))
    assert isinstance(start, DFlashDraft) and start.config.variant is L.DFLASH2
    conv = start.layers[0].attention_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
    assert torch.count_nonzero(conv.base_kernel[:, 1]) == 0 and torch.count_nonzero(conv.kernel_projection.weight) == 0
    assert 0 < start.candidate_selector.hidden_projection.weight.abs().max() < 0.2  # random, small
    tokens, prompt_len, feats = next(iter(iter_sequences(out_data)))
    feats = torch.from_numpy(feats.astype(np.float32))
    a = prompt_len + 2
    block = [int(tokens[a])] + [cfg.mask_token_id] * (cfg.block_size - 1)
    with torch.no_grad():
        assert torch.equal(start(feats[:a], block, a), dflash1(feats[:a], block, a))
        moved = trained.layers[0].mlp_conv
        assert torch.count_nonzero(moved.kernel_projection.weight) > 0 and torch.count_nonzero(moved.base_kernel[:, 1])
        assert not torch.equal(trained.candidate_selector.successor_codebook,
                               start.candidate_selector.successor_codebook)
        # packed training blocks == one block at a time through the inference path: no conv across blocks
        anchors = torch.tensor([prompt_len, prompt_len + 1, prompt_len + 3])
        packed = block_hidden(trained, feats, torch.from_numpy(tokens.astype(np.int64)), anchors)
        for m, a in enumerate(anchors.tolist()):
            block = [int(tokens[a])] + [cfg.mask_token_id] * (cfg.block_size - 1)
            alone = trained.block_states(feats[:a], block, a)
            assert torch.allclose(packed[m], alone, atol=1e-5), (m, (packed[m] - alone).abs().max())
    gguf = convert(trained_dir, tiny_target_gguf, tmp_path / "draft2.gguf", outtype="f32")
    rt = dflash_llama.Runtime(tiny_target_gguf, gguf, n_threads=2, n_ctx=256)
    assert rt.generate("def add(a, b):", 16).tokens == rt.autoregressive("def add(a, b):", 16).tokens
    with pytest.raises(ValueError, match=r"it is a DFlash 2 draft, this training's a DFlash 1 one \(give --variant "
                                         r"dflash2\)"):
        train(out_data, tiny_target_gguf, tmp_path / "back", cfg, progress=False, threads=2, init=trained_dir)


def test_the_selector_loss_is_the_cross_entropy_over_the_candidates_after_the_true_predecessor(small_draft):
    from dflash_llama.reference.model import DFlashDraft
    from dflash_llama.train.trainer import Batch, draft_config, selector_loss

    _, cfg = small_draft
    torch.manual_seed(0)
    draft = DFlashDraft(draft_config(TrainConfig(**{**cfg.__dict__, **DFLASH2}), _FakeTarget()))
    torch.nn.init.normal_(draft.candidate_selector.predecessor_codebook)
    torch.nn.init.normal_(draft.candidate_selector.successor_codebook)
    tokens = torch.tensor([5, 9, 3, 7, 2, 8])
    b = Batch(tokens, torch.zeros(6, 1), torch.tensor([1]), torch.tensor([[3, 7, -1]]))  # block at 1 predicts 3, 7
    y = torch.randn(1, 3, 32)
    logits = torch.full((1, 3, 12), -5.0)
    logits[0, 0, [3, 4, 5, 6]] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # slot 1: 3 is the 4th candidate
    logits[0, 1, [0, 1, 2, 4]] = 1.0  # slot 2: 7 is no candidate
    weights = torch.tensor([1.0, 0.5, 0.25])
    sel = draft.candidate_selector
    cands = torch.tensor([6, 5, 4, 3])
    gate = sel.hidden_projection(y[0, 0])
    want = torch.tensor([4.0, 3.0, 2.0, 1.0]) + (sel.predecessor_codebook[9] * gate) @ sel.successor_codebook[cands].T
    got = selector_loss(draft, y, logits, None, b, weights)
    assert torch.allclose(got, F.cross_entropy(want[None], torch.tensor([3])), atol=1e-6)


class _FakeTarget:
    """The shape of a target for draft_config: hidden 32, vocabulary 12."""
    embed_tokens = torch.zeros(12, 32)
    ffn, n_heads, n_kv_heads, head_dim, rope_theta, n_layers = 64, 4, 2, 8, 10000.0, 4


DSPARK = {"markov_rank": 8, "confidence_head": True}


def test_a_dflash1_draft_starts_a_dspark_draft_that_drafts_the_same_then_trains_its_heads(
        dataset, small_draft, tiny_target_gguf, tmp_path):
    """--variant dspark --block-layout dflash --init DFLASH1_DRAFT: a zero Markov bias, so the chain drafts
    what the DFlash 1 draft drafts; training moves the Markov and confidence heads; the checkpoint (SpecForge's
    layout) loads in the reference, converts, and our runtime stays exact with it. Anchor-first from random
    weights trains too, and a DSpark checkpoint does not start a DFlash 1 draft."""
    from dflash_llama import schema as L

    out_data, _, _ = dataset
    first, cfg = small_draft
    t = target_weights_from_gguf(tiny_target_gguf)
    start_dir, trained_dir = tmp_path / "start", tmp_path / "trained"
    train(out_data, tiny_target_gguf, start_dir, TrainConfig(**{**cfg.__dict__, **DSPARK, "epochs": 0.0}),
          progress=False, threads=2, init=first)
    log = train(out_data, tiny_target_gguf, trained_dir, TrainConfig(**{**cfg.__dict__, **DSPARK, "epochs": 1.0}),
                progress=False, threads=2, init=first)
    config = json.loads((trained_dir / "config.json").read_text())
    assert config["architectures"] == [L.DSPARK.architecture]
    assert {k: config["dflash_config"][k] for k in ("markov_rank", "enable_confidence_head", "sample_from_anchor")} \
        == {"markov_rank": 8, "enable_confidence_head": True, "sample_from_anchor": False}
    assert all(np.isfinite(log.loss)) and log.loss[-1] > 0
    from dflash_llama.train.model_card import write_model_card

    card = write_model_card(trained_dir, [out_data]).read_text()
    assert card.startswith("# tiny-target-f32 DSpark draft (dflash-llama)\n")
    assert ("DSpark heads: a vanilla Markov head of rank 8 (a bias on each slot's logits from the token before it), "
            "and a confidence head") in card and "DFlash 1's block layout: B inputs give B - 1 drafts" in card

    dflash1, start, trained = (load_draft(d, t.embed_tokens, t.lm_head) for d in (first, start_dir, trained_dir))
    assert start.config.variant is L.DSPARK and torch.count_nonzero(start.markov_head.markov_w2.weight) == 0
    tokens, prompt_len, feats = next(iter(iter_sequences(out_data)))
    feats = torch.from_numpy(feats.astype(np.float32))
    with torch.no_grad():
        for a in (prompt_len, prompt_len + 2, prompt_len + 5):
            block = [int(tokens[a])] + [cfg.mask_token_id] * (cfg.block_size - 1)
            chain = start.draft_chain(feats[:a], block, a)
            assert chain.tokens.tolist() == dflash1(feats[:a], block, a).argmax(-1).tolist()
        assert torch.count_nonzero(trained.markov_head.markov_w2.weight) > 0
        assert not torch.equal(trained.confidence_head.proj.weight, start.confidence_head.proj.weight)
        conf = trained.draft_chain(feats[:a], block, a).confidence
        assert conf.shape == (cfg.block_size - 1,) and bool(((conf > 0) & (conf < 1)).all())
    gguf = convert(trained_dir, tiny_target_gguf, tmp_path / "dspark.gguf", outtype="f32")
    rt = dflash_llama.Runtime(tiny_target_gguf, gguf, n_threads=2, n_ctx=256)
    assert rt.generate("def add(a, b):", 16).tokens == rt.autoregressive("def add(a, b):", 16).tokens
    with pytest.raises(ValueError, match=r"it is a DSpark draft, this training's a DFlash 1 one \(give --variant "
                                         r"dspark\)"):
        train(out_data, tiny_target_gguf, tmp_path / "back", cfg, progress=False, threads=2, init=trained_dir)

    anchor_first = tmp_path / "anchor_first"
    train(out_data, tiny_target_gguf, anchor_first,
          TrainConfig(**{**cfg.__dict__, **DSPARK, "sample_from_anchor": True, "epochs": 0.5}),
          progress=False, threads=2)
    af = load_draft(anchor_first, t.embed_tokens, t.lm_head)
    assert af.config.sample_from_anchor and len(af.draft_chain(feats[:a], block, a).tokens) == cfg.block_size
    gguf = convert(anchor_first, tiny_target_gguf, tmp_path / "af.gguf", outtype="f32")
    rt = dflash_llama.Runtime(tiny_target_gguf, gguf, n_threads=2, n_ctx=256)
    assert rt.generate("def add(a, b):", 16).tokens == rt.autoregressive("def add(a, b):", 16).tokens


def test_the_dspark_loss_is_the_papers_on_the_teacher_forced_markov_chain(small_draft):
    """Without a teacher: TV = 1 - p_draft(target) on the Markov-biased logits, the bias of slot j from the
    true token before it; the confidence head's BCE is against 1 - TV; the weights mix as documented."""
    from dflash_llama.reference.model import DFlashDraft
    from dflash_llama.train.trainer import Batch, batch_loss, draft_config, drafted_states

    _, cfg = small_draft
    torch.manual_seed(0)
    draft = DFlashDraft(draft_config(TrainConfig(**{**cfg.__dict__, **DSPARK}), _FakeTarget()))
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    draft.attach_target(torch.randn(12, 32), torch.randn(12, 32))
    tokens = torch.tensor([5, 9, 3, 7, 2, 8, 1])
    b = Batch(tokens, torch.randn(7, 64), torch.tensor([1, 3]), torch.tensor([[3, 7, 2], [2, 8, 1]]))
    w = torch.tensor([1.0, 0.5, 0.25])
    with torch.no_grad():
        y = drafted_states(draft, b.feats, b.tokens, b.anchors)
        prev = torch.tensor([[9, 3, 7], [7, 2, 8]])  # the anchor, then the true tokens
        logits = y @ draft.lm_head.T + draft.markov_head(prev)
        p = F.softmax(logits, -1).gather(-1, b.targets[..., None]).squeeze(-1)
        ce = -p.log()
        conf_logit = draft.confidence_head.proj(torch.cat([y, draft.markov_head.markov_w1(prev)], -1)).squeeze(-1)
        bce = F.binary_cross_entropy_with_logits(conf_logit, p, reduction="none")

        def mean(x):
            return (x * w).sum() / (2 * w.sum())

        got = batch_loss(draft, b, w, None, None, dspark=(0.9, 0.0))
        assert torch.allclose(got, mean(0.1 * ce + 0.9 * (1 - p)), rtol=1e-5)
        got = batch_loss(draft, b, w, None, None, dspark=(0.9, 1.0))
        assert torch.allclose(got, mean(0.1 * ce + 0.9 * (1 - p) + bce), rtol=1e-5)


@pytest.mark.parametrize("extra, message", [
    (["--selector-top-k", "4"], "--selector-top-k is a DFlash 2 setting: give --variant dflash2"),
    (["--markov-rank", "4"], "--markov-rank is a DSpark setting: give --variant dspark"),
    (["--variant", "dspark", "--markov-rank", "0"], "--markov-rank must be positive, got 0"),
    (["--variant", "dspark", "--tv-weight", "2"], "--tv-weight is a weight between 0 and 1, got 2.0"),
    (["--variant", "dspark", "--draft-vocab", "16"], "--draft-vocab with --variant dspark is not supported yet"),
    (["--variant", "dflash2", "--conv-group-size", "7"], "--conv-group-size 7 does not divide the target's hidden"),
    (["--variant", "dflash2", "--selector-top-k", "999999"], "--selector-top-k 999999 is larger than the draft "
                                                                "vocabulary (the target's vocabulary:"),
    (["--variant", "dflash2", "--draft-vocab", "16", "--selector-top-k", "17"],
     "--selector-top-k 17 is larger than the draft vocabulary (--draft-vocab: 16 tokens)"),
    (["--variant", "dflash2", "--selector-rank", "0"], "--selector-rank must be positive, got 0"),
])
def test_cli_refuses_bad_dflash2_arguments(capsys, tiny_target_gguf, tmp_path, extra, message):
    from dflash_llama import cli

    got = cli.main(["train", "--target", str(tiny_target_gguf), "--out", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert got == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_drafts_compare_by_tau_and_acceptance_by_position(tmp_path):
    from dflash_llama.train.eval import EngineScore, write_comparison

    for name, hist in (("d1", [6, 2, 2, 0, 0, 0, 0, 0]), ("d2", [4, 2, 2, 2, 0, 0, 0, 0])):
        s = EngineScore("dflash-llama runtime", 2, 2 + sum(j + 1 for j, n in enumerate(hist) for _ in range(n)),
                        sum(hist), 70, 0, 1.0, exact=True, accepted_hist=hist)
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval.json").write_text(json.dumps({"scores": [s.to_json()]}))
    assert s.acceptance_by_position() == [0.6, 0.4, 0.2, 0.0, 0.0, 0.0, 0.0]
    table = write_comparison({"DFlash 1": tmp_path / "d1", "DFlash 2": tmp_path / "d2"}, tmp_path / "report")
    assert "| DFlash 2 | 2 | 2.200 | 0.000 | yes | 0.600 | 0.400 | 0.200 | 0.000 |" in table.read_text()
    assert (tmp_path / "report" / "acceptance_by_position.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="has no 'other' score"):
        write_comparison({"x": tmp_path / "d1"}, tmp_path / "r2", engine="other")
