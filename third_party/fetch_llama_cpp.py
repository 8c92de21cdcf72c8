#!/usr/bin/env python3
"""Fetch the pinned llama.cpp into third_party/llama.cpp.

The pin is the PyPI sdist named in third_party/llama.cpp.lock, which vendors llama.cpp under
`vendor/llama.cpp`. The sdist is downloaded with pip, its sha256 checked against the lock file,
and only that folder is unpacked. Running it again once the tree is present does nothing.

Usage: python third_party/fetch_llama_cpp.py [--lock FILE] [--dest DIR] [--force]
Stdlib only: CMake calls it at configure time, before any dependency is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
STAMP = ".dflash-llama-pin"  # written inside the unpacked tree: "<sha256> <commit>"


class FetchError(RuntimeError):
    pass


def read_lock(path: Path) -> dict[str, str]:
    lock = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise FetchError(f"{path}: malformed line {line!r} (expected key = value)")
        lock[key.strip()] = value.strip()
    for key in ("package", "version", "filename", "sha256", "subdir", "commit"):
        if key not in lock:
            raise FetchError(f"{path}: missing key {key!r}")
    return lock


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_sdist(lock: dict[str, str], cache: Path) -> Path:
    sdist = cache / lock["filename"]
    if sdist.exists():
        return sdist
    cache.mkdir(parents=True, exist_ok=True)
    # --no-build-isolation: pip only reads metadata; an isolated build env would compile cmake
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "--quiet", "-d", str(cache),
           f"{lock['package']}=={lock['version']}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not sdist.exists():
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FetchError(
            f"could not download {lock['package']}=={lock['version']} with pip ({tail[0]}); "
            f"check that PyPI is reachable, or place {lock['filename']} in {cache} by hand")
    return sdist


def unpack(sdist: Path, subdir: str, dest: Path) -> None:
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/{subdir}/"
    tmp = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=dest.parent))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                if not m.name.startswith(prefix) or not (m.isfile() or m.isdir() or m.issym()):
                    continue
                m.name = m.name[len(prefix):]
                if m.name:
                    members.append(m)
            if not members:
                raise FetchError(f"{sdist} holds no {subdir}/: is this the right sdist?")
            tar.extractall(tmp, members=members, filter="data")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def fetch(lock_path: Path, dest: Path, force: bool = False) -> Path:
    lock = read_lock(lock_path)
    stamp = dest / STAMP
    wanted = f"{lock['sha256']} {lock['commit']}"
    if not force and stamp.exists() and stamp.read_text().strip() == wanted:
        return dest

    cache = dest.parent / ".cache"
    sdist = download_sdist(lock, cache)
    got = sha256_of(sdist)
    if got != lock["sha256"]:
        raise FetchError(
            f"sha256 mismatch for {sdist.name}: lock file {lock_path} says {lock['sha256']}, "
            f"the download is {got}. Fix the lock file, or delete {sdist} to download it again")
    unpack(sdist, lock["subdir"], dest)
    stamp.write_text(wanted + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lock", type=Path, default=HERE / "llama.cpp.lock")
    ap.add_argument("--dest", type=Path, default=HERE / "llama.cpp")
    ap.add_argument("--force", action="store_true", help="unpack again even if present")
    args = ap.parse_args(argv)
    try:
        dest = fetch(args.lock, args.dest, args.force)
    except (FetchError, OSError, tarfile.TarError) as e:
        print(f"fetch_llama_cpp: error: {e}", file=sys.stderr)
        return 1
    print(f"fetch_llama_cpp: llama.cpp {read_lock(args.lock)['commit']} at {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
