"""The registry of model pairs (parity/registry.toml) and the files each pair needs, built on demand.

Tiny fixtures (a target of the pair's `family`, qwen3 unless named, and a draft) are built from
seeds into a cache folder (`$DFLASH_LLAMA_CACHE`, else `~/.cache/dflash-llama`), once, under names
holding the family and a key of what made them (`build_key`: the fixture's settings and the code of
the fixtures and of the converter), so that a changed pair, fixture or converter builds anew instead
of checking an old file; GGUFs are converted with our converter. A `files` pair whose files
are missing is skipped, and so is a pair whose `skip` says why it cannot run today.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport (a dependency there)
    import tomli as tomllib

REGISTRY_PATH = Path(__file__).with_name("registry.toml")


@dataclass
class Pair:
    name: str
    kind: str  # "fixture", "default", "files"
    outtype: str | None = None
    draft_cfg: dict = field(default_factory=dict)
    target: str | None = None
    draft: str | None = None
    draft_hf: str | None = None
    target_hf: str | None = None
    expect: str = "pass"
    finding: str | None = None
    family: str = "qwen3"  # kind = fixture: the tiny target's family (dflash_llama.families)
    skip: str | None = None  # why the pair cannot run today (printed; `--all` goes on)
    patch: str | None = None  # expect = "fail": the patch (patches/series) that fixes the finding
    draft_vocab: int = 0  # kind = fixture: a reduced vocabulary of this many tokens (convert --draft-vocab)

    def expected(self, patches: tuple[str, ...] = ()) -> str:
        """"pass" or "fail" with llama.cpp's tools built with `patches` (none: the pinned build)."""
        return "pass" if self.patch is not None and self.patch in patches else self.expect


@dataclass
class Resolved:
    """The files of a pair, ready for `ParityConfig`; `skip` says why a pair cannot run."""
    pair: Pair
    target: Path | None = None
    draft: Path | None = None
    draft_hf: Path | None = None
    target_hf: Path | None = None
    skip: str | None = None


def load(path: str | os.PathLike = REGISTRY_PATH) -> tuple[list[Pair], dict]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: cannot read the parity registry ({e})") from e
    from dflash_llama import families

    pairs = []
    for i, raw in enumerate(data.get("pair", [])):
        if "name" not in raw or raw.get("kind") not in ("fixture", "default", "files"):
            raise ValueError(f"{path}: pair {i} needs a name and kind = fixture, default or files")
        for key in ("family", "draft_vocab"):
            if key in raw and raw["kind"] != "fixture":
                raise ValueError(f"{path}: pair {raw['name']}: {key} applies to kind = fixture only")
        vocab = raw.get("draft_vocab", 0)
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0:
            raise ValueError(f"{path}: pair {raw['name']}: draft_vocab must be a token count >= 0, got {vocab!r}")
        family = raw.get("family", "qwen3")
        try:
            families.get(family)
        except ValueError as e:
            raise ValueError(f"{path}: pair {raw['name']}: {e}") from None
        pairs.append(Pair(name=raw["name"], kind=raw["kind"], outtype=raw.get("outtype"),
                          draft_cfg=dict(raw.get("draft", {})) if raw["kind"] == "fixture" else {},
                          target=raw.get("target"), draft=raw.get("draft") if raw["kind"] == "files" else None,
                          draft_hf=raw.get("draft_hf"), target_hf=raw.get("target_hf"),
                          expect=raw.get("expect", "pass"), finding=raw.get("finding"), family=family,
                          skip=raw.get("skip"), patch=raw.get("patch"), draft_vocab=vocab))
        if raw.get("patch") is not None and raw.get("expect") != "fail":
            raise ValueError(f"{path}: pair {raw['name']}: patch names the fix of a finding: "
                             f"it needs expect = \"fail\"")
    names = [p.name for p in pairs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"{path}: pair names must be unique, repeated: {sorted(dup)}")
    return pairs, data.get("default", {})


def cache_dir() -> Path:
    from dflash_llama.paths import cache_dir as package_cache

    out = package_cache() / "parity"
    out.mkdir(parents=True, exist_ok=True)
    return out


def default_draft_dir(defaults: dict) -> Path:
    import dflash_llama

    return Path(dflash_llama.__file__).resolve().parent / "data" / defaults.get("draft_dir", "smollm2-135m-dflash")


def _expand(p: str | None) -> Path | None:
    return None if p is None else Path(os.path.expandvars(os.path.expanduser(p)))


def _code_files() -> list[Path]:
    """The code a cached fixture depends on: the fixtures module and the converter package."""
    import dflash_llama.converter
    from dflash_llama import fixtures

    return [Path(fixtures.__file__), *sorted(Path(dflash_llama.converter.__file__).parent.glob("*.py"))]


def build_key(*settings) -> str:
    """10 hex digits of a hash of `settings` (JSON) and of the code that builds a fixture from them."""
    h = hashlib.sha256()
    for part in settings:
        h.update(json.dumps(part, sort_keys=True, default=str).encode())
    for f in _code_files():
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


def target_key(family: str) -> str:
    from dataclasses import asdict

    from dflash_llama import fixtures

    return build_key("target", asdict(fixtures.TinyTargetConfig(family=family)))


def tiny_target_paths(cache: Path, family: str = "qwen3") -> tuple[Path, Path]:
    """Where the tiny fixture target of a family is cached: (HF dir, f32 GGUF)."""
    stem = f"tiny-target-{family}-{target_key(family)}"
    return cache / f"{stem}-hf", cache / f"{stem}-f32.gguf"


def tiny_target(cache: Path, family: str = "qwen3") -> tuple[Path, Path]:
    """The tiny fixture target of a family: (HF dir, f32 GGUF), built once."""
    from dflash_llama import fixtures

    hf, gguf = tiny_target_paths(cache, family)
    if not (hf / "config.json").exists():
        fixtures.tiny_target_hf(hf, fixtures.TinyTargetConfig(family=family))
    if not gguf.exists():
        fixtures.tiny_target_gguf(hf, gguf.with_suffix(".tmp"), outtype="f32", family=family)
        gguf.with_suffix(".tmp").rename(gguf)
    return hf, gguf


def _converted(hf: Path, target: Path, out: Path, outtype: str, draft_vocab: int = 0) -> Path:
    from dflash_llama.converter import convert

    if not out.exists() or out.stat().st_mtime < (hf / "model.safetensors").stat().st_mtime:
        tmp = out.with_suffix(".tmp.gguf")
        convert(hf, target, tmp, outtype=outtype, draft_vocab=draft_vocab)
        tmp.rename(out)
    return out


def resolve(pair: Pair, defaults: dict, cache: Path | None = None) -> Resolved:
    """Build (or find) the files of a pair."""
    from dflash_llama import fixtures

    if pair.skip:
        return Resolved(pair, skip=pair.skip)
    cache = cache or cache_dir()
    if pair.kind == "fixture":
        target_hf, target = tiny_target(cache, pair.family)
        cfg = fixtures.TinyDraftConfig(**pair.draft_cfg)
        key = build_key("draft", target_key(pair.family), pair.draft_cfg, pair.draft_vocab)
        stem = f"{pair.name}-{pair.family}-{key}"
        hf = cache / f"{stem}-draft-hf"
        if not (hf / "model.safetensors").exists():
            fixtures.tiny_draft_hf(hf, target_hf, cfg)
        draft = _converted(hf, target, cache / f"{stem}-draft-{pair.outtype}.gguf", pair.outtype, pair.draft_vocab)
        return Resolved(pair, target=target, draft=draft, draft_hf=hf, target_hf=target_hf)
    if pair.kind == "default":
        target = fixtures.smollm2_gguf()
        hf = default_draft_dir(defaults)
        draft = _converted(hf, target, cache / f"smollm2-default-draft-{build_key('default')}-{pair.outtype}.gguf",
                           pair.outtype)
        return Resolved(pair, target=target, draft=draft, draft_hf=hf)
    # files
    paths = {k: _expand(getattr(pair, k)) for k in ("target", "draft", "draft_hf", "target_hf")}
    for key in ("target", "draft"):
        if paths[key] is None:
            raise ValueError(f"registry pair {pair.name}: kind = files needs {key}")
    missing = [str(p) for k, p in paths.items() if p is not None and not p.exists()]
    if missing:
        return Resolved(pair, skip=f"not on disk: {', '.join(missing)}")
    return Resolved(pair, **paths)
