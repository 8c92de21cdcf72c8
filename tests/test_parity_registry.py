"""The parity registry (parity/registry.toml): it loads on every supported Python, and bad files say why."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dflash_llama.parity import registry


def test_the_shipped_registry_loads():
    pairs, defaults = registry.load()
    names = [p.name for p in pairs]
    assert names[:5] == ["tiny-f32", "tiny-f16-gqa", "tiny-q8_0", "tiny-sliding", "tiny-last-layer-tap"]
    assert {p.name: p.expect for p in pairs if p.expect == "fail"} == {"tiny-sliding": "fail",
                                                                       "tiny-last-layer-tap": "fail"}
    assert [p.outtype for p in pairs if p.kind == "default"] == ["f32", "f16", "q8_0"]
    assert defaults == {"draft_dir": "smollm2-135m-dflash"}
    assert (registry.default_draft_dir(defaults) / "config.json").is_file()  # the trained default draft ships


def test_tomllib_is_imported_only_where_python_has_it():
    """Python 3.10 (pyproject's floor) has no tomllib: the import falls back to the tomli backport."""
    tree = ast.parse(Path(registry.__file__).read_text())
    guarded = [node for node in ast.walk(tree) if isinstance(node, ast.Try)
               and any(isinstance(s, ast.Import) and s.names[0].name == "tomllib" for s in node.body)]
    assert len(guarded) == 1
    (handler,) = guarded[0].handlers
    assert handler.type.id == "ModuleNotFoundError"
    assert [(a.name, a.asname) for s in handler.body for a in s.names] == [("tomli", "tomllib")]
    top_level = [a.name for s in tree.body if isinstance(s, ast.Import) for a in s.names]
    assert "tomllib" not in top_level


def test_bad_registries(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[pair]\nname = 1\n")
    with pytest.raises(ValueError, match="bad.toml: cannot read the parity registry"):
        registry.load(bad)
    bad.write_text('[[pair]]\nname = "x"\nkind = "other"\n')
    with pytest.raises(ValueError, match="pair 0 needs a name and kind = fixture, default or files"):
        registry.load(bad)
    bad.write_text('[[pair]]\nname = "x"\nkind = "files"\n[[pair]]\nname = "x"\nkind = "files"\n')
    with pytest.raises(ValueError, match=r"pair names must be unique, repeated: \['x'\]"):
        registry.load(bad)
