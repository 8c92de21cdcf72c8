"""The parity registry (parity/registry.toml): it loads on every supported Python, and bad files say why."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dflash_llama import families
from dflash_llama.parity import registry


def test_the_shipped_registry_loads():
    pairs, defaults = registry.load()
    names = [p.name for p in pairs]
    assert names[:5] == ["tiny-f32", "tiny-f16-gqa", "tiny-q8_0", "tiny-sliding", "tiny-last-layer-tap"]
    # one f32 fixture pair per family beyond qwen3, which the first five use
    dflash2 = [p for p in pairs if p.draft_cfg.get("variant") == "dflash2"]
    dspark = [p for p in pairs if p.draft_cfg.get("variant") == "dspark"]
    assert {p.name: p.family for p in pairs if p.kind == "fixture" and p.family != "qwen3"
            and p not in dflash2 + dspark} == {f"tiny-{f}-f32": f for f in families.NAMES[1:]}
    assert {p.family for p in pairs[:5]} == {"qwen3"}
    assert {p.name: p.finding[:4] for p in pairs if p.expect == "fail"} == {
        "tiny-sliding": "U3: ", "tiny-last-layer-tap": "U2: ", "tiny-gemma3-f32": "U7: ",
        "tiny-dflash2-sliding": "U3: ",
        "tiny-deepspec-dflash": "U14:", "tiny-deepspec-dflash-llama": "U14:", "tiny-dspark-gemma3-f32": "U7: ",
        "tiny-dspark-gemma3-no-confidence": "U7: ", "tiny-dspark-gemma3-dflash-layout": "U7: ",
        "tiny-deepspec-dflash-gemma3": "U14:"}
    # DFlash 2 pairs on three families, blocks 8 and 16, top-K from 2 to 7, causal and sliding layers
    assert {p.family for p in dflash2} == {"qwen3", "llama", "qwen35"}
    assert {p.draft_cfg["block_size"] for p in dflash2} == {8, 16}
    assert sorted(p.draft_cfg["selector_top_k"] for p in dflash2) == [2, 3, 4, 6, 7]
    # DSpark pairs on three families, each with the four layouts: anchor-first with and without the
    # confidence head, DFlash's layout, and DeepSpec's anchor-first "DFlash" (no Markov head); a reduced
    # vocabulary on qwen3; f32 copies of the target's embeddings and head
    def layout(c):
        return ("no-markov" if c["markov_rank"] == 0 else "dflash-layout" if c.get("sample_from_anchor") is False
                else "anchor-first" + ("" if c.get("confidence_head", True) else ", no confidence"))

    assert {(p.family, layout(p.draft_cfg)) for p in dspark if not p.draft_vocab} == {
        (f, kind) for f in ("qwen3", "llama", "gemma3")
        for kind in ("anchor-first", "anchor-first, no confidence", "dflash-layout", "no-markov")}
    assert [(p.name, p.draft_vocab) for p in dspark if p.draft_vocab] == [("tiny-dspark-d2t", 512)]
    assert {p.draft_cfg["dtype"] for p in dspark} == {"float32"} and {p.outtype for p in dspark} == {"f32"}
    # each expected failure names the patch of the series that fixes it, and passes with it, unless
    # its finding has none (U14: which type the tool picks is llama.cpp's call)
    from dflash_llama.parity import patched

    series = tuple(p.name for p in patched.series())
    fails = [p for p in pairs if p.expect == "fail"]
    unpatched = [p for p in fails if p.patch is None]
    assert all(p.patch in series and p.patch.startswith(p.finding[:2].lower()) for p in fails if p.patch)
    assert {p.finding.split(":")[0] for p in unpatched} == {"U14"} and "U14" in patched.UNPATCHED
    assert {p.expected(series) for p in pairs if p.kind == "fixture" and p not in unpatched} == {"pass"}
    assert {p.expected(series) for p in unpatched} == {p.expected() for p in fails} == {"fail"}
    # every pair runs
    assert [p.name for p in pairs if p.skip] == []
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
    bad.write_text('[[pair]]\nname = "x"\nkind = "files"\npatch = "u9.patch"\n')
    with pytest.raises(ValueError, match=r'pair x: patch names the fix of a finding: it needs expect = "fail"$'):
        registry.load(bad)
    bad.write_text('[[pair]]\nname = "x"\nkind = "files"\n[[pair]]\nname = "x"\nkind = "files"\n')
    with pytest.raises(ValueError, match=r"pair names must be unique, repeated: \['x'\]"):
        registry.load(bad)


def test_family_of_a_fixture_pair(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('[[pair]]\nname = "a"\nkind = "fixture"\nouttype = "f32"\n'
                    '[[pair]]\nname = "b"\nkind = "fixture"\nfamily = "gemma3"\nouttype = "f32"\n')
    assert [(p.name, p.family) for p in registry.load(path)[0]] == [("a", "qwen3"), ("b", "gemma3")]
    path.write_text('[[pair]]\nname = "b"\nkind = "fixture"\nfamily = "mamba"\n')
    with pytest.raises(ValueError, match=r"r.toml: pair b: unknown target family 'mamba': known families are "
                                         r"qwen3, llama, qwen3moe, gpt-oss, gemma3, qwen35, qwen35moe$"):
        registry.load(path)
    path.write_text('[[pair]]\nname = "c"\nkind = "files"\nfamily = "llama"\n')
    with pytest.raises(ValueError, match=r"r.toml: pair c: family applies to kind = fixture only$"):
        registry.load(path)
    path.write_text('[[pair]]\nname = "d"\nkind = "files"\ndraft_vocab = 64\n')
    with pytest.raises(ValueError, match=r"r.toml: pair d: draft_vocab applies to kind = fixture only$"):
        registry.load(path)
    path.write_text('[[pair]]\nname = "e"\nkind = "fixture"\ndraft_vocab = -1\n')
    with pytest.raises(ValueError, match=r"r.toml: pair e: draft_vocab must be a token count >= 0, got -1$"):
        registry.load(path)


def test_the_cache_names_hold_the_family(tmp_path, monkeypatch):
    """Two families never share a cached target or draft (nothing is built: the files exist)."""
    from dflash_llama import fixtures

    built = []
    monkeypatch.setattr(fixtures, "tiny_target_hf", lambda out, cfg: built.append(("hf", cfg.family)))
    monkeypatch.setattr(fixtures, "tiny_target_gguf", lambda hf, out, outtype, family: built.append(("gguf", family)))
    for family in ("qwen3", "gemma3"):
        hf, gguf = registry.tiny_target_paths(tmp_path, family)
        hf.mkdir()
        (hf / "config.json").write_text("{}")
        gguf.write_bytes(b"")
    key = registry.target_key("qwen3")
    assert len(key) == 10 and key != registry.target_key("gemma3")
    assert registry.tiny_target(tmp_path) == (tmp_path / f"tiny-target-qwen3-{key}-hf",
                                              tmp_path / f"tiny-target-qwen3-{key}-f32.gguf")
    assert registry.tiny_target(tmp_path, "gemma3")[1].name.startswith("tiny-target-gemma3-")
    assert built == []


def test_a_changed_fixture_or_converter_is_built_anew(tmp_path, monkeypatch):
    """The cache key holds the fixture's settings and the code that builds it: an edit to either (here
    the converter's source, as a stand-in file) names another file, so an old build is never checked."""
    before = registry.target_key("qwen3")
    assert registry.build_key("draft", before, {"block_size": 8}, 0) != registry.build_key(
        "draft", before, {"block_size": 16}, 0)
    edited = tmp_path / "conversion.py"
    edited.write_text("# an edit\n")
    real = registry._code_files
    monkeypatch.setattr(registry, "_code_files", lambda: [*real(), edited])
    assert registry.target_key("qwen3") != before


def test_a_skipped_pair_builds_nothing(tmp_path):
    pair = registry.Pair(name="x", kind="fixture", outtype="f32", family="qwen35moe", skip="not today")
    res = registry.resolve(pair, {}, cache=tmp_path)
    assert res.skip == "not today" and res.target is None
    assert list(tmp_path.iterdir()) == []


def test_a_reduced_vocabulary_reaches_the_converter(tmp_path, monkeypatch):
    """draft_vocab of a fixture pair is the converter's --draft-vocab (nothing is built: stand-ins)."""
    import dflash_llama.converter
    from dflash_llama import fixtures

    hf, gguf = registry.tiny_target_paths(tmp_path)
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    gguf.write_bytes(b"")

    def draft_hf(out, target_hf, cfg):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"")

    calls = []
    monkeypatch.setattr(fixtures, "tiny_draft_hf", draft_hf)
    monkeypatch.setattr(dflash_llama.converter, "convert",
                        lambda hf, target, out, outtype, draft_vocab: calls.append((out.name, outtype, draft_vocab))
                        or out.write_bytes(b""))
    pair = registry.Pair(name="v", kind="fixture", outtype="f32", draft_vocab=512,
                         draft_cfg={"variant": "dspark", "markov_rank": 8})
    res = registry.resolve(pair, {}, cache=tmp_path)
    key = registry.build_key("draft", registry.target_key("qwen3"), pair.draft_cfg, 512)
    assert calls == [(f"v-qwen3-{key}-draft-f32.tmp.gguf", "f32", 512)]
    assert res.draft == tmp_path / f"v-qwen3-{key}-draft-f32.gguf" and res.draft.exists()
