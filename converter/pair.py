"""A (target, draft) pair as the runtime takes it: THE way every command resolves its draft.

A draft is given as a GGUF file, as a published Hugging Face directory (config.json +
model.safetensors), or as a folder holding exactly one GGUF. A Hugging Face directory is converted
for its target once, into one cache (`cache_dir()`, `$DFLASH_LLAMA_CACHE`, else
`~/.cache/dflash-llama`) keyed by the draft's content, the target and the output type, so the next
run starts at once.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import dflash_llama
from dflash_llama import schema as L
from dflash_llama.paths import cache_dir

from .checkpoint import read_config
from .conversion import convert

DEFAULT_DRAFT = Path(dflash_llama.__file__).resolve().parent / "data" / "smollm2-135m-dflash"
# how `dflash-llama run` and `bench` convert a Hugging Face draft to decode with: the fastest draft
# step measured on the default pair, acceptance within 3% of f16 with the whole vocabulary
# (docs/benchmarks.md, "A reduced draft vocabulary")
DECODE_DRAFT_TYPE, DECODE_DRAFT_VOCAB = "q8_0", 8192


def resolve_draft(draft: str | os.PathLike, target: str | os.PathLike, outtype: str = "f16",
                  draft_vocab: int | None = 0) -> Path:
    """A GGUF for `draft`: itself if it is one, the one GGUF of a folder, else the cached `outtype`
    conversion of a Hugging Face directory for `target` (with a reduced vocabulary of `draft_vocab`
    tokens when > 0, see `vocabulary`; None: DECODE_DRAFT_VOCAB, or the checkpoint's own reduced
    vocabulary where it has one, as a trained `--draft-vocab` draft does)."""
    draft, target = Path(draft), Path(target)
    if draft.is_file():
        if draft.suffix != ".gguf":
            raise ValueError(f"draft {draft}: expected a .gguf file or a Hugging Face folder")
        return draft
    if not draft.exists():
        hint = ("the default draft ships with the package (python/dflash_llama/data/); "
                if draft == DEFAULT_DRAFT else "")
        raise FileNotFoundError(f"no DFlash draft at {draft}: {hint}train one with `dflash-llama train` "
                                f"and pass -md DIR, or pass a draft GGUF")
    if not (draft / "config.json").exists():
        ggufs = sorted(draft.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise ValueError(f"draft {draft} holds {len(ggufs)} GGUF files: name the one to use")
        raise ValueError(f"draft {draft}: neither a GGUF nor a Hugging Face checkpoint (no config.json)")
    if draft_vocab is None:
        draft_vocab = 0 if L.DRAFT_VOCAB_SIZE in read_config(draft) else DECODE_DRAFT_VOCAB
    vocab = f"-v{draft_vocab}" if draft_vocab else ""
    out = cache_dir() / f"{draft.name}-{_key(draft, target, outtype + vocab)}-{outtype}{vocab}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(draft, target, out, outtype=outtype, draft_vocab=draft_vocab)  # written whole or not at all
    return out


def _key(draft: Path, target: Path, outtype: str) -> str:
    """The cache key: the draft's files, the target (path, size, modification time) and the type."""
    h = hashlib.sha256()
    names = ["config.json", "model.safetensors.index.json"] + sorted(
        p.name for p in draft.glob("model*.safetensors"))  # every shard of a sharded draft
    for name in names:
        f = draft / name
        if f.is_file():
            h.update(name.encode())
            with open(f, "rb") as data:  # in pieces: a draft may be larger than memory
                while chunk := data.read(1 << 24):
                    h.update(chunk)
    st = target.stat() if target.exists() else None
    h.update(f"{target.resolve()}|{st and st.st_size}|{st and st.st_mtime_ns}|{outtype}".encode())
    return h.hexdigest()[:12]
