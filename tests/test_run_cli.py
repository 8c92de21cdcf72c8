"""`dflash-llama run`: the README's main job on the embedded default pair (SmolLM2 + our draft)."""

from __future__ import annotations

import json
import re

import pytest

from dflash_llama import cli
from dflash_llama.run_cli import DEFAULT_DRAFT

PROMPT = ('def count_vowels(text: str) -> int:\n    """Return how many vowels text has.\n'
          '    >>> count_vowels("banana")\n    3\n    """\n')


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LLAMA_CACHE", str(tmp_path))
    return tmp_path


def test_the_packaged_draft_is_small_and_made_for_smollm2():
    files = {p.name: p.stat().st_size for p in DEFAULT_DRAFT.iterdir()}
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert "train_state.pt" not in files
    assert sum(files.values()) <= 25 * 2**20
    config = json.loads((DEFAULT_DRAFT / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["hidden_size"] == 576 and config["num_target_layers"] == 30  # SmolLM2-135M


def test_run_is_exact_and_the_default_draft_is_trained(capsys, cache):
    rc = cli.main(["run", "-p", PROMPT, "-n", "64", "-t", "2", "--draft-max", "7"])  # the whole block, every step
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith(PROMPT)
    assert "exact: yes (identical to the target's greedy output)" in err
    tau = float(re.search(r"tau (\d+\.\d+)", err).group(1))
    assert tau > 1.3, err  # an untrained draft is accepted almost never: tau ~ 1.0
    assert "draft length:" not in err  # a fixed draft length has no adaptive summary
    assert len(list(cache.glob("smollm2-135m-dflash-*-q8_0-v8192.gguf"))) == 1  # converted once, cached


def test_run_defaults_to_the_adaptive_loop(capsys, cache):
    rc = cli.main(["run", "-p", PROMPT, "-n", "32", "-t", "2"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    assert "exact: yes" in err
    m = re.search(r"draft length:    auto: (\d+)% plain steps \((\d+) of (\d+), (\d+) probes, (\d+) of them "
                  r"unverified drafts\)", err)
    assert m, err
    share, plain, steps, probes, shadow = map(int, m.groups())
    assert steps == int(re.search(r"(\d+) target verifies", err).group(1))  # plain steps are target decodes too
    assert 1 <= shadow <= probes and probes - shadow <= steps - plain  # greedy: it opens with a shadow probe
    assert share == round(100 * plain / steps)
    assert re.search(r"; step costs measured first in \d+ ms\n", err), err
    m = re.search(r"\nsteps: +(\d+) plain, (\d+) draft \(tau \d+\.\d\d\), (\d+) n-gram \(acc \d\.\d\d\)\n", err)
    assert m and int(m.group(1)) == plain and sum(map(int, m.groups())) == steps, err
    # the speeds compared: runs that do not stream, in mirrored order (a second round while short)
    timed = re.search(r"speedup \d+\.\d+x \(speculative [\d.]+ / autoregressive [\d.]+ tok/s, each timed (\d) times: "
                      r"(A D D A(?: D A A D)?)\)", err)
    assert timed and int(timed.group(1)) == timed.group(2).count("D"), err


def test_run_of_one_token_measures_no_speedup(capsys, cache):
    assert cli.main(["run", "-p", PROMPT, "-n", "1", "-t", "2"]) == 0
    err = capsys.readouterr().err
    assert err.rstrip().endswith("exact: yes (identical to the target's greedy output); no speedup measured: the one "
                                 "token came from the prompt's decode"), err


def test_run_with_a_missing_draft_says_so(capsys, cache, tmp_path):
    rc = cli.main(["run", "-md", str(tmp_path / "nowhere"), "-n", "4"])
    _, err = capsys.readouterr()
    assert rc == 2
    assert f"dflash-llama run: error: no DFlash draft at {tmp_path / 'nowhere'}" in err
    assert err.count("\n") == 1, err


def test_conversion_flags_with_a_gguf_draft_are_refused(capsys, cache, tiny_draft_gguf):
    """A GGUF draft is decoded as it is: --draft-type / --draft-vocab would be ignored, so they are an error."""
    for flag, value in (("--draft-type", "f16"), ("--draft-vocab", "4096")):
        rc = cli.main(["run", "-md", str(tiny_draft_gguf), flag, value, "-n", "4"])
        _, err = capsys.readouterr()
        assert rc == 2
        assert (f"dflash-llama run: error: {flag} converts a Hugging Face draft directory; "
                f"{tiny_draft_gguf} is a GGUF already") in err
        assert err.count("\n") == 1, err
