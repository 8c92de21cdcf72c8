"""Where the built pieces live: native tools installed with the package, the pinned llama.cpp,
the cache folder.

Tools are found next to the compiled module (installed by CMake into `dflash_llama/bin`), never
by guessing from PATH, so the binaries always match the pinned llama.cpp of this build.
"""

from __future__ import annotations

import os
from pathlib import Path

PEER_TOOLS = ("llama-speculative-simple", "llama-completion", "llama-bench", "llama-server",
              "llama-quantize")


CACHE_ENV = "DFLASH_LLAMA_CACHE"


def cache_dir() -> Path:
    """The one cache folder of dflash-llama ($DFLASH_LLAMA_CACHE, else ~/.cache/dflash-llama):
    converted drafts, parity's built fixtures, fetched targets."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dflash-llama")


def native_dir() -> Path:
    """The folder holding the compiled module `_core` and `bin/`."""
    from . import _core

    return Path(_core.__file__).resolve().parent


def tool(name: str) -> Path:
    """Path of a native tool of this build (`llama-dflash-cli` or a peer tool)."""
    path = native_dir() / "bin" / name
    if not path.exists():
        hint = ("rebuild with DFLASH_LLAMA_PEER_TOOLS=ON (./setup.sh does)"
                if name in PEER_TOOLS else "rebuild the package (./setup.sh)")
        raise FileNotFoundError(f"{name} is not built at {path}: {hint}")
    return path


def llama_cpp_dir() -> Path:
    """The pinned llama.cpp tree: a copy installed with the package, else the source checkout's."""
    for candidate in (native_dir() / "llama.cpp",
                      Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp"):
        if (candidate / "convert_hf_to_gguf.py").exists():
            return candidate
    raise FileNotFoundError(
        "the pinned llama.cpp tree is missing: run python third_party/fetch_llama_cpp.py "
        "(./setup.sh does)")


def _report_roots() -> list[tuple[Path, str]]:
    """Folders a report writes relative: site-packages and the working folder (no prefix), home (~/)."""
    import site
    import sysconfig

    sites = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    return [(Path(d).resolve(), "") for d in sorted(sites)] + [(Path.cwd().resolve(), ""),
                                                               (Path.home().resolve(), "~/")]


def display_path(path) -> str:
    """A path as a report shows it: relative to the installed package's site-packages, to the working
    folder, or to the home folder, so that committed reports name no machine's folders."""
    p = Path(path).resolve()
    for root, prefix in _report_roots():
        try:
            return prefix + str(p.relative_to(root))
        except ValueError:
            continue
    return str(path)


def portable(text: str) -> str:
    """`display_path` for every path inside a text (a report, a command line)."""
    for root, prefix in _report_roots():
        text = text.replace(str(root) + "/", prefix)
    return text
