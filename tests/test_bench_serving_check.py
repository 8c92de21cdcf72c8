"""The serving check's cheap parts: the cyclic target's weight edit (exact values), the reading of a
server response's draft counts, the table, and its command line's errors. The measurement itself
(llama-server at -np 1 and 8 on a trained pair) is the command's, docs/upstream_status.md has its
numbers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_llama.bench import server, serving_check


def test_cyclic_head_scales_the_branches_and_adds_the_cycle(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    state = {"lm_head.weight": rand(10, 6), "model.embed_tokens.weight": rand(10, 6),
             "model.layers.0.self_attn.o_proj.weight": rand(6, 6),
             "model.layers.1.linear_attn.out_proj.weight": rand(6, 6),
             "model.layers.0.mlp.down_proj.weight": rand(6, 8), "model.layers.0.mlp.up_proj.weight": rand(8, 6)}
    save_file(state, str(tmp_path / "model.safetensors"))
    serving_check.cyclic_head(tmp_path, period=4, branch_scale=0.5, head_gain=2.0)
    got = load_file(str(tmp_path / "model.safetensors"))

    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.linear_attn.out_proj.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(got[name], state[name] * 0.5), name
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(got["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    head, embed = state["lm_head.weight"], state["model.embed_tokens.weight"]
    # token y's row gains its cycle predecessor's embedding: 0->1->2->3->0, 4->5->6->7->4; 8 and 9
    # are an incomplete group and keep their rows
    pred = [3, 0, 1, 2, 7, 4, 5, 6]
    for y, x in enumerate(pred):
        assert torch.allclose(got["lm_head.weight"][y], head[y] + 2.0 * embed[x], rtol=0, atol=1e-6), y
    assert torch.equal(got["lm_head.weight"][8:], head[8:])


def test_draft_counts_and_the_table():
    response = {"choices": [{"text": " a b"}], "usage": {"completion_tokens": 2},
                "timings": {"predicted_ms": 3.5, "draft_n": 40, "draft_n_accepted": 33}}
    assert server.draft_counts(response) == (40, 33)
    assert server.draft_counts({"timings": {"predicted_ms": 1.0}}) == (None, None)  # no draft model
    assert server.draft_counts({}) == (None, None)
    with pytest.raises(server.ServerError, match="not a count"):
        server.draft_counts({"timings": {"draft_n": -1, "draft_n_accepted": 0}})

    Row = serving_check.Row
    rows = [Row("plain", None, 1, ["x", "y"], [0, 0], [0, 0]), Row("plain", None, 8, ["x", "y"], [0, 0], [0, 0]),
            Row("dflash", 7, 1, ["x", "y"], [40, 40], [30, 30]), Row("dflash", 7, 8, ["x", "z"], [40, 40], [30, 0])]
    assert (rows[2].draft_n, rows[2].draft_n_accepted, rows[2].acceptance) == (80, 60, 0.75)
    assert rows[0].acceptance is None
    lines = serving_check.table(rows).splitlines()
    assert lines[2] == "| plain | - | 1 | 0 | 0 | - | 2/2 | 2/2 |"
    assert lines[4] == "| dflash | 7 | 1 | 80 | 60 | 0.750 | 2/2 | 2/2 |"
    assert lines[5] == "| dflash | 7 | 8 | 80 | 30 | 0.375 | 1/2 | 1/2 |"


@pytest.mark.parametrize("args, message", [
    (["--variants", "eagle"], "--variants: expected dflash and/or dflash2, got 'eagle'"),
    (["--n-max", "0"], "--n-max must be integers >= 1, got '0'"),
    (["-n", "0"], "-n, -t and --repeats must be positive"),
    (["--patched"], "--patched and --server go with --rollback-check"),
    (["--rollback-check", "--server", "/nonexistent/llama-server"], "--server /nonexistent/llama-server: no such file"),
])
def test_bad_arguments_are_one_line(args, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "dflash_llama.bench.serving_check", "--out", str(tmp_path), *args],
                       capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())  # refused before building anything
