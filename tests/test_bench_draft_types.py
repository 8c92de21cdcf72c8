"""bench/draft_types.py: its one-line refusals, and a measurement on the tiny pair that checks
exactness and reports every N it was asked for."""

import pytest

from dflash_llama.bench import draft_types
from dflash_llama.runtime import Runtime


@pytest.mark.parametrize("argv, message", [
    (["--types", "q9_9"], "--types 'q9_9': choose from auto, f32"),
    (["--types", ","], "--types ',': choose from"),
    (["--limit", "0"], "--limit must be at least 1 and -n at least 2"),
    (["-n", "1"], "--limit must be at least 1 and -n at least 2"),
    (["-md", "draft.gguf"], "-md draft.gguf: expected a draft checkpoint folder"),
    (["--draft-vocabs", "8k"], "--draft-vocabs '8k': expected sizes >= 0, comma-separated"),
    (["--draft-vocabs", "0,-1"], "--draft-vocabs '0,-1': expected sizes >= 0, comma-separated"),
])
def test_bad_arguments_are_one_line_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        draft_types.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_missing_target_is_one_line(tmp_path, capsys):
    assert draft_types.main(["-m", str(tmp_path / "absent.gguf"), "--types", "f16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m dflash_llama.bench.draft_types: error:")


def test_measure_checks_every_output_and_reports_each_n(tiny_target_gguf, tiny_draft_gguf):
    rt = Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=1)
    texts = ["def f(x):", "Once upon a time"]
    assert draft_types.shapes(rt.block_size) == [(1, 2), (1, rt.block_size), (rt.block_size - 1, rt.block_size)]
    m = draft_types.measure(rt, texts, 12, [(1, 2), (1, 4), (3, 4)])
    assert sorted(m) == [(1, 2), (1, 4), (3, 4)]
    for row in m.values():
        assert row["draft_ms"] > 0 and row["verify_ms"] > 0 and row["plain_ms"] > 0
        assert 1.0 <= row["tau"] <= 4.0
