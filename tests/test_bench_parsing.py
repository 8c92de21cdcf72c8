"""Reading the peer tools' output, the exactness rule for peers, and prompt sets. No models needed."""

from __future__ import annotations

import json
import sys

import pytest

from dflash_llama import peers, prompts
from dflash_llama.bench.runner import text_matches

COMPLETION_STDERR = """\
0.00.298.968 I common_perf_print:    sampling time =       1.69 ms
0.00.298.973 I common_perf_print:        load time =      84.24 ms
0.00.298.975 I common_perf_print: prompt eval time =       0.97 ms /     5 tokens (    0.19 ms per token,  5175.98 tokens per second)
0.00.298.987 I common_perf_print:        eval time =       8.50 ms /    15 runs   (    0.57 ms per token,  1764.91 tokens per second)
0.00.298.988 I common_perf_print:       total time =      11.93 ms /    20 tokens
"""

SPECULATIVE_STDERR = """\
0.00.634.289 I encoded    5 tokens in    0.003 seconds, speed: 1923.077 t/s
0.00.634.309 I decoded   17 tokens in    0.175 seconds, speed:   97.421 t/s
0.00.634.336 I n_draft   = 7
0.00.634.348 I n_predict = 17
0.00.634.361 I n_drafted = 98
0.00.634.374 I n_accept  = 12
0.00.634.387 I accept    = 12.245%
"""


def test_parse_completion_text_and_speed():
    r = peers.parse_completion(" return a\n\n  b\n\n", COMPLETION_STDERR)
    assert r.text == " return a\n\n  b"
    assert (r.n_tokens, r.decode_ms, r.prompt_ms, r.stopped) == (15, 8.5, 0.97, False)
    assert r.tokens_per_second == pytest.approx(15 / 0.0085)


def test_parse_completion_end_of_text():
    r = peers.parse_completion(" done [end of text]\n\n\n", COMPLETION_STDERR)
    assert (r.text, r.stopped) == (" done", True)


def test_parse_completion_rejects_foreign_output():
    with pytest.raises(peers.PeerError, match="eval time"):
        peers.parse_completion("text\n\n", "nothing useful")
    with pytest.raises(peers.PeerError, match="blank line"):
        peers.parse_completion("truncated", COMPLETION_STDERR)


def test_parse_speculative_strips_the_echoed_prompt():
    prompt = "def f(x):\n    \"\"\"a\\nb\"\"\"\n"
    r = peers.parse_speculative("\n\n" + prompt + "    return x\n\n\n\n\n", SPECULATIVE_STDERR, prompt, 16)
    assert r.text == "    return x\n"
    assert (r.n_tokens, r.decode_ms, r.prompt_ms, r.n_drafted, r.n_accept) == (17, 175.0, 3.0, 98, 12)
    assert r.stopped is False  # 17 tokens > -n 16: it ran past -n, no end of generation
    assert peers.parse_speculative("\n\n" + prompt + "\n\n\n\n", SPECULATIVE_STDERR, prompt, 32).stopped is True
    with pytest.raises(peers.PeerError, match="echoed prompt"):
        peers.parse_speculative("\n\nsomething else\n\n\n\n", SPECULATIVE_STDERR, prompt, 16)
    with pytest.raises(peers.PeerError, match="two final blank lines"):
        peers.parse_speculative("\n\n" + prompt + " x\n\n", SPECULATIVE_STDERR, prompt, 16)


def test_speculative_tau_counts_target_decodes():
    r = peers.parse_speculative("\n\nabc d\n\n\n\n", SPECULATIVE_STDERR, "abc", 16)
    assert r.tau == pytest.approx(17 / (17 - 12))  # each of the 5 decodes gave its accepted drafts + 1


def test_peer_command_lines(monkeypatch):
    monkeypatch.setattr(peers.paths, "tool", lambda name: f"/bin/{name}")
    cmd = peers.speculative_command("t.gguf", "a\\nb", 8, "draft-dflash", draft="d.gguf", n_max=3, threads=2,
                                    n_ctx=256)
    assert cmd[0] == "/bin/llama-speculative-simple"
    flags = " ".join(cmd[1:])
    assert "-p a\\nb --no-escape -n 8 -t 2 -tb 2 -c 256 --temp 0 --seed 0 -fa off" in flags
    assert flags.endswith("--spec-type draft-dflash -md d.gguf -td 2 -tbd 2 --spec-draft-n-max 3")
    auto = peers.speculative_command("t.gguf", "p", 8, "ngram-simple", threads=1, n_ctx=64, flash_attn="auto",
                                     extra_args=["-lv", "5"], exe="/tmp/patched")
    assert auto[0] == "/tmp/patched" and auto[auto.index("-fa") + 1] == "auto" and auto[-2:] == ["-lv", "5"]
    assert "-md" not in auto
    with pytest.raises(ValueError, match="draft-dflash needs a draft model"):
        peers.speculative_command("t.gguf", "p", 8, "draft-dflash", threads=1, n_ctx=64)
    srv = peers.server_command("t.gguf", port=8080, threads=2, n_ctx=256, n_parallel=4, draft="d.gguf", n_max=1)
    assert srv == ["/bin/llama-server", "-m", "t.gguf", "--host", "127.0.0.1", "--port", "8080", "-t", "2",
                   "-tb", "2", "-c", "1024", "-np", "4", "--no-webui", "-fa", "off", "-md", "d.gguf",
                   "--spec-type", "draft-dflash", "-td", "2", "-tbd", "2", "--spec-draft-n-max", "1"]


def test_a_failed_run_reports_its_assert():
    log = "load: ok\n" + "".join(f"line {i}\n" for i in range(12)) + \
        "dflash.cpp:42: GGML_ASSERT(inp != nullptr && \"layer input tensor is null\") failed\n" + \
        "".join(f"#{i} backtrace frame\n" for i in range(10))
    run = peers.ToolRun(["/bin/llama-speculative-simple"], -6, "", log)
    assert not run.ok and run.log_tail() == \
        'dflash.cpp:42: GGML_ASSERT(inp != nullptr && "layer input tensor is null") failed'
    assert peers.ToolRun(["x"], 0, "", log).log_tail().splitlines() == [f"#{i} backtrace frame" for i in range(2, 10)]


def test_a_failing_tool_raises_with_its_last_lines(monkeypatch):
    monkeypatch.setattr(peers.paths, "tool", lambda name: sys.executable)  # python, asked to run a missing file
    with pytest.raises(peers.PeerError, match="exited with 2:\n.*can't open file '/nonexistent/in.gguf'"):
        peers.quantize("/nonexistent/in.gguf", "/nonexistent/out.gguf", "q4_0")


def test_peer_exactness_rule():
    # the reference ran to -n: a peer that decoded further must start with it
    assert text_matches("abc def", "abc", ref_stopped=False) == (True, None)
    assert text_matches("abX def", "abc", ref_stopped=False) == (False, 2)
    assert text_matches("ab", "abc", ref_stopped=False) == (False, 2)
    # the reference stopped at end of generation: equal text only
    assert text_matches("abc", "abc", ref_stopped=True) == (True, None)
    assert text_matches("abc more", "abc", ref_stopped=True) == (False, 3)


def test_prompt_files(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "x\n"}) + "\n\n" + json.dumps("y") + "\n")
    assert prompts.from_file(tmp_path / "p.jsonl") == [prompts.Prompt("a", "x\n"), prompts.Prompt("p/1", "y")]
    (tmp_path / "p.json").write_text(json.dumps(["one", {"task_id": "t", "prompt": "two"}]))
    assert prompts.from_file(tmp_path / "p.json") == [prompts.Prompt("p/0", "one"), prompts.Prompt("t", "two")]
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    assert [p.text for p in prompts.from_file(tmp_path / "p.txt")] == ["first", "second"]


def test_bad_prompt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        prompts.load(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON value"):
        prompts.from_file(tmp_path / "bad.jsonl")
    (tmp_path / "noprompt.json").write_text('[{"text": "x"}]')
    with pytest.raises(ValueError, match='prompt 0 is an object without a string "prompt" field'):
        prompts.from_file(tmp_path / "noprompt.json")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        prompts.from_file(tmp_path / "empty.txt")


def test_humaneval_and_spread():
    he = prompts.humaneval()
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[0].text.endswith("\n")
    picked = prompts.spread(he, 5)
    assert [p.id for p in picked] == ["HumanEval/0", "HumanEval/41", "HumanEval/82", "HumanEval/122",
                                      "HumanEval/163"]
    assert prompts.spread(he, None) == he
    with pytest.raises(ValueError, match="--limit must be at least 1"):
        prompts.spread(he, 0)


def test_peers_get_gpu_layers_only_from_a_gpu_build(monkeypatch):
    """A GPU build's llama.cpp tools offload every layer unless told (-ngl auto): the bench hands them
    the runtime's -ngl; a CPU build's get no flag, and -ngl N there is an error."""
    import dflash_llama

    monkeypatch.setattr(peers.paths, "tool", lambda name: f"/bin/{name}")
    monkeypatch.setattr(dflash_llama, "supports_gpu_offload", lambda: False)
    assert "-ngl" not in peers.speculative_command("t.gguf", "p", 8, "draft-dflash", draft="d.gguf", threads=1, n_ctx=64)
    with pytest.raises(ValueError, match=r"^-ngl 3: this build has no GPU backend \(build with GGML_CUDA=ON ./setup.sh\)$"):
        peers.gpu_flags(3)
    monkeypatch.setattr(dflash_llama, "supports_gpu_offload", lambda: True)
    spec = peers.speculative_command("t.gguf", "p", 8, "draft-dflash", draft="d.gguf", threads=1, n_ctx=64,
                                     n_gpu_layers=-1)
    assert spec[spec.index("-ngl"):spec.index("-ngl") + 4] == ["-ngl", "all", "-ngld", "all"]
    srv = peers.server_command("t.gguf", port=1, threads=1, n_ctx=64, n_gpu_layers=0)
    assert srv[srv.index("-ngl") + 1] == "0" and "-ngld" not in srv


def test_the_prose_prompt_set_is_english_paragraphs_from_the_interpreters_documentation():
    from pydoc_data.topics import topics

    prose = prompts.load("prose")
    assert len(prose) >= 30 and len({p.id for p in prose}) == len(prose)
    assert prose == prompts.prose()  # deterministic
    for p in prose:
        name = p.id.removeprefix("prose/")
        assert p.text.endswith("\n\n") and "\n" not in p.text[:-2] and len(p.text) >= 82
        paragraphs = [" ".join(line.strip() for line in b.splitlines()) for b in topics[name].split("\n\n")]
        assert p.text[:-2] in paragraphs[1:]  # a paragraph of the topic, unwrapped (the title is not one)
        assert "::=" not in p.text and not p.text.rstrip().endswith(":")
    with pytest.raises(FileNotFoundError, match="give 'humaneval' or 'prose' or a prompt file"):
        prompts.load("chat")
