"""`dflash-llama generate`: the reference engine (and the runtime engine against it), arguments, the
JSON schema, errors."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dflash_llama import cli
from dflash_llama.reference import Sampling, generate_autoregressive, generate_speculative, load_draft_for_target

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """The runtime engine converts an HF draft into the cache: keep it out of the home folder."""
    monkeypatch.setenv("DFLASH_LLAMA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def run(capsys, *argv) -> tuple[int, str, str]:
    """`dflash-llama generate --engine reference ARGV` (a later --engine in ARGV wins)."""
    rc = cli.main(["generate", "--engine", "reference", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_matches_the_reference_loop(capsys, reference_drafts, reference_target):
    draft_dir = reference_drafts["gqa4_last_layer_tap"]
    rc, out, _ = run(capsys, "--target", reference_target.source, "--draft", draft_dir,
                     "--prompt-ids", "1604,3987,24,94", "-n", 10, "--block-size", 3, "--json")
    assert rc == 0
    got = json.loads(out)
    assert set(got) == {"tokens", "text", "steps", "tau", "prompt_ids"}
    draft = load_draft_for_target(draft_dir, reference_target)
    expected = generate_speculative(reference_target, draft, [1604, 3987, 24, 94], 10,
                                    block_size=3, stop_token_ids=[2])
    assert got["tokens"] == expected.tokens and len(got["tokens"]) == 10
    assert got["steps"] == [{"drafted": s.drafted, "accepted": s.accepted, "produced": s.produced}
                            for s in expected.steps]
    assert all(len(s["drafted"]) <= 2 for s in got["steps"])
    assert got["tau"] == pytest.approx(expected.tau)
    assert got["text"] == reference_target.tokenizer.decode(expected.tokens)
    assert got["prompt_ids"] == [1604, 3987, 24, 94]


def test_text_prompt_and_sampling(capsys, tiny_draft_hf, reference_target):
    rc, out, _ = run(capsys, "--target", reference_target.source, "--draft", tiny_draft_hf,
                     "-p", "def fib(n):", "-n", 8, "--temp", 0.8, "--top-p", 0.9, "--top-k", 40,
                     "--seed", 7, "--json")
    assert rc == 0
    got = json.loads(out)
    prompt = reference_target.tokenizer("def fib(n):")["input_ids"]
    assert got["prompt_ids"] == prompt
    draft = load_draft_for_target(tiny_draft_hf, reference_target)
    expected = generate_speculative(reference_target, draft, prompt, 8, stop_token_ids=[2],
                                    sampling=Sampling(0.8, 0.9, 40, seed=7))
    assert got["tokens"] == expected.tokens


def test_no_draft_is_plain_target_decoding(capsys, reference_target):
    rc, out, err = run(capsys, "--target", reference_target.source, "--no-draft",
                       "--prompt-ids", "5,6,7", "-n", 6, "--json")
    assert rc == 0
    got = json.loads(out)
    assert got["tokens"] == generate_autoregressive(reference_target, [5, 6, 7], 6).tokens
    assert got["steps"] == [{"drafted": [], "accepted": 0, "produced": 1}] * 5
    assert got["tau"] == 1.0
    rc, out, err = run(capsys, "--target", reference_target.source, "--no-draft",
                       "--prompt-ids", "5,6,7", "-n", 6)
    assert rc == 0 and out == reference_target.tokenizer.decode(got["tokens"]) + "\n"
    assert "[reference] 6 tokens, 5 steps, tau 1.000" in err


def test_runtime_engine_same_schema_and_tokens(capsys, tiny_draft_hf, tiny_target_hf, tiny_target_gguf):
    common = ["--draft", tiny_draft_hf, "-p", "def fibonacci(n):", "-n", 12, "--json"]
    rc, out, err = run(capsys, "--engine", "runtime", "--target", tiny_target_gguf, "--kv-f32", "--draft-max", 7,
                       *common)  # the reference verifies the whole block (8) every step
    assert rc == 0, err
    runtime = json.loads(out)
    rc, out, err = run(capsys, "--engine", "reference", "--target", tiny_target_hf, *common)
    assert rc == 0, err
    reference = json.loads(out)
    assert set(reference) <= set(runtime)
    assert runtime["prompt_ids"] == reference["prompt_ids"]  # same tokenisation
    assert runtime["tokens"] == reference["tokens"]  # f32 target: the engines agree token for token
    assert [s["drafted"] for s in runtime["steps"]] == [s["drafted"] for s in reference["steps"]]


def test_runtime_engine_draft_max_auto_is_the_default_and_stays_exact(capsys, tiny_draft_hf, tiny_target_gguf):
    common = ["--engine", "runtime", "--target", tiny_target_gguf, "--draft", tiny_draft_hf,
              "-p", "def fibonacci(n):", "-n", 16, "--ignore-eos", "--json"]
    rc, out, err = run(capsys, *common)
    assert rc == 0, err
    auto = json.loads(out)
    policy = auto["policy"]
    assert policy["plain_steps"] + policy["draft_steps"] == len(auto["steps"])
    assert policy["plain_steps"] == sum(1 for s in auto["steps"] if not s["drafted"])
    assert all(len(s["drafted"]) <= 7 for s in auto["steps"])  # the tiny draft's block is 8
    rc, out, _ = run(capsys, *common, "--draft-max", "auto")
    assert rc == 0 and json.loads(out)["tokens"] == auto["tokens"]
    rc, out, _ = run(capsys, "--engine", "runtime", "--target", tiny_target_gguf, "--no-draft",
                     "-p", "def fibonacci(n):", "-n", 16, "--ignore-eos", "--json")
    assert auto["tokens"] == json.loads(out)["tokens"]


def test_draft_max_must_be_auto_or_a_count(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--target", "T", "--draft", "D", "-p", "x", "--draft-max", "most"])
    assert e.value.code == 2
    assert "argument --draft-max: --draft-max must be 'auto' or an integer, got 'most'" in capsys.readouterr().err


def test_runtime_engine_needs_a_gguf_target(capsys, tiny_draft_hf, tiny_target_hf):
    rc, out, err = run(capsys, "--engine", "runtime", "--target", tiny_target_hf, "--draft",
                       tiny_draft_hf, "-p", "hello", "-n", 4, "--json")
    assert (rc, out) == (2, "")
    assert "--engine runtime reads the target through llama.cpp: give a .gguf" in err


@pytest.mark.parametrize("args, message", [
    (["-p", "x"], "give -md DRAFT, or --no-draft for plain target decoding"),
    (["--no-draft", "--draft", "D", "-p", "x"], "give -md DRAFT, or --no-draft"),
    (["--no-draft", "--block-size", "4", "-p", "x"], "--block-size needs a draft"),
    (["--no-draft", "--prompt-ids", "1,x"], "--prompt-ids '1,x': expected comma-separated"),
    (["--no-draft", "--prompt-ids", "5", "-n", "0"], "max_new_tokens must be >= 1, got 0"),
    (["--no-draft", "--prompt-ids", "5", "--top-p", "0"], r"top_p must be in \(0, 1\], got 0.0"),
    (["--draft", "TINY_DRAFT", "--prompt-ids", "5", "--block-size", "0"], "block_size must be >= 1, got 0"),
])
def test_argument_errors(capsys, tiny_target_hf, tiny_draft_hf, args, message):
    """Usage and input errors: exit 2, one line; the values are checked by the engine (reference/speculative.py)."""
    args = [str(tiny_draft_hf) if a == "TINY_DRAFT" else a for a in args]
    got_rc, out, err = run(capsys, "--target", tiny_target_hf, *args)
    assert (got_rc, out) == (2, "")
    assert err.startswith("dflash-llama generate: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_mismatched_draft_and_missing_files(capsys, tiny_target_hf, tmp_path):
    from dflash_llama import fixtures

    narrow = tmp_path / "narrow"
    narrow.mkdir()
    cfg = json.loads((tiny_target_hf / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    draft = fixtures.tiny_draft_hf(tmp_path / "draft", narrow)
    rc, out, err = run(capsys, "--target", tiny_target_hf, "--draft", draft, "-p", "x")
    assert rc == 2
    assert "has hidden size 32 but target" in err and "made for another target" in err
    rc, out, err = run(capsys, "--target", tmp_path / "nope", "--no-draft", "-p", "x")
    assert rc == 2 and "nope does not exist" in err


def test_gguf_target_and_gguf_draft(capsys, tiny_target_gguf, pinned_draft_ggufs,
                                    reference_drafts, reference_target):
    """Both models as GGUF (target through transformers' loader, draft from llama.cpp's
    converter) give the tokens and steps of the HF pair."""
    args = ["--prompt-ids", "1604,3987,24,94", "-n", 12, "--json"]
    rc, out, _ = run(capsys, "--target", tiny_target_gguf, "--draft",
                     pinned_draft_ggufs["gqa4_last_layer_tap"], *args)
    assert rc == 0
    rc, out_hf, _ = run(capsys, "--target", reference_target.source, "--draft",
                        reference_drafts["gqa4_last_layer_tap"], *args)
    assert rc == 0
    assert json.loads(out) == json.loads(out_hf)
