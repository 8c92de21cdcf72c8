"""A (target, draft) pair as the runtime takes it: the draft as a GGUF, converted once and cached.

A draft is given as a GGUF file or as a published Hugging Face directory (config.json +
model.safetensors); a directory is converted for its target and kept in a cache keyed by the
content of both, so the next run starts at once.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .conversion import convert

DEFAULT_DRAFT = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m-dflash"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash-llama"


def draft_gguf(draft: Path, target: Path, outtype: str = "f16") -> Path:
    """A GGUF for `draft`: itself if it is one, else a conversion cached by content hash."""
    if draft.is_file():
        return draft
    if not (draft / "config.json").exists():
        raise FileNotFoundError(
            f"no DFlash draft at {draft}: the default draft ships with the package "
            "(python/dflash_llama/data/); train one with `dflash-llama train` and pass --draft DIR")
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((draft / name).read_bytes())
    h.update(str(target.resolve()).encode())
    out = cache_dir() / f"{draft.name}-{h.hexdigest()[:12]}-{outtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(draft, target, out, outtype=outtype)
    return out
