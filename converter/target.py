"""What the converter needs from the target: its shape (to check the draft against) and its tokenizer.

The target is a GGUF (read with gguf-py's GGUFReader) or a Hugging Face directory (config.json;
its tokenizer is built by the pinned llama.cpp converter, see `tokenizer_fields`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType

from dflash_llama import schema as L

from .checkpoint import ConversionError, read_json


@dataclass(frozen=True)
class TokenizerField:
    key: str
    value: Any
    type: GGUFValueType
    element: GGUFValueType | None  # arrays only


@dataclass(frozen=True)
class TargetInfo:
    path: Path
    kind: str  # "gguf" or "hf"
    architecture: str
    hidden: int
    vocab: int
    n_layer: int
    uses_mrope: bool
    reader: GGUFReader | None = field(default=None, repr=False, compare=False)  # GGUF targets

    def tokenizer_fields(self) -> list[TokenizerField]:
        """Every `tokenizer.*` key of the target, as llama.cpp's converter writes it for this target."""
        if self.reader is not None:
            return _tokenizer_fields(self.reader, self.path)
        return _tokenizer_fields_from_hf(self.path)


def read_target(path: str | os.PathLike) -> TargetInfo:
    path = Path(path)
    if path.is_dir():
        return _read_hf(path)
    if not path.exists():
        raise ConversionError(f"target {path}: no such file or directory")
    return _read_gguf(path)


def _open_gguf(path: Path) -> GGUFReader:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ConversionError(f"target {path}: cannot read: {e.strerror or e}") from e
    if magic != b"GGUF":
        raise ConversionError(f"target {path}: not a GGUF file (and not a Hugging Face directory)")
    try:
        return GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError, IndexError, struct errors... on bad files
        raise ConversionError(f"target {path}: unreadable or truncated GGUF ({type(e).__name__}: {e})") from e


def _field(reader: GGUFReader, key: str, path: Path) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise ConversionError(f"target {path}: GGUF has no {key}")
    return field.contents()


def _int_field(reader: GGUFReader, key: str, path: Path, lo: int, hi: int, default: int | None = None) -> int:
    """An integer key of the target GGUF, in lo..hi."""
    if default is not None and reader.get_field(key) is None:
        return default
    v = _field(reader, key, path)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConversionError(f"target {path}: {key} = {str(v)[:60]!r}: expected an integer in {lo}..{hi}")
    return v


def _read_gguf(path: Path) -> TargetInfo:
    reader = _open_gguf(path)
    arch = _field(reader, "general.architecture", path)
    if not isinstance(arch, str) or not arch:
        raise ConversionError(f"target {path}: general.architecture = {str(arch)[:60]!r}: expected a name")
    n_layer = _int_field(reader, f"{arch}.block_count", path, *L.HF_INTEGERS["num_hidden_layers"])
    # MTP layers count in block_count
    n_layer -= _int_field(reader, f"{arch}.nextn_predict_layers", path, 0, n_layer - 1, default=0)
    sections = reader.get_field(f"{arch}.rope.dimension_sections")
    sections = [] if sections is None else sections.contents()
    if not isinstance(sections, list) or not all(isinstance(s, int) for s in sections):
        raise ConversionError(f"target {path}: {arch}.rope.dimension_sections must be an array of integers")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise ConversionError(f"target {path}: GGUF has no tokenizer (tokenizer.ggml.tokens)")
    if tokens.types[:2] != [GGUFValueType.ARRAY, GGUFValueType.STRING]:
        raise ConversionError(f"target {path}: tokenizer.ggml.tokens must be an array of strings")
    return TargetInfo(
        path=path,
        kind="gguf",
        architecture=arch,
        hidden=_int_field(reader, f"{arch}.embedding_length", path, *L.HF_INTEGERS["hidden_size"]),
        vocab=len(tokens.data),
        n_layer=n_layer,
        uses_mrope=any(sections),
        reader=reader,
    )


def _read_hf(path: Path) -> TargetInfo:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"target {path}: no config.json (expected a Hugging Face model directory)")
    try:
        config = read_json(config_path)
        if not isinstance(config, dict) or not isinstance(config.get("text_config", {}), dict):
            raise ValueError("expected a JSON object (and text_config an object)")
        text = {**config, **config.get("text_config", {})}
        missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if k not in text]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        archs = config.get("architectures") or ["?"]
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ValueError(f"architectures = {str(archs)[:60]!r}: expected a list of class names")
        hidden, vocab, n_layer = (L.hf_integer(k, text[k]) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    except ValueError as e:  # ConversionError too: it names the file already
        raise ConversionError(str(e) if isinstance(e, ConversionError) else f"target {config_path}: {e}") from e
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return TargetInfo(
        path=path,
        kind="hf",
        architecture=archs[0],
        hidden=hidden,
        vocab=vocab,
        n_layer=n_layer,
        uses_mrope=isinstance(rope, dict) and "mrope_section" in rope,
    )


def read_tokenizer_fields(gguf_path: Path) -> list[TokenizerField]:
    """The `tokenizer.*` keys of a GGUF with their exact GGUF types, in file order."""
    return _tokenizer_fields(_open_gguf(gguf_path), gguf_path)


def _tokenizer_fields(reader: GGUFReader, gguf_path: Path) -> list[TokenizerField]:
    out = []
    for key, f in reader.fields.items():
        if not key.startswith(L.TOKENIZER_PREFIX):
            continue
        vtype = f.types[0]
        if vtype == GGUFValueType.ARRAY and len(f.types) > 2:
            raise ConversionError(f"target {gguf_path}: nested array in {key} is not supported")
        element = f.types[1] if vtype == GGUFValueType.ARRAY else None
        out.append(TokenizerField(key, f.contents(), vtype, element))
    if not any(f.key == "tokenizer.ggml.tokens" for f in out):
        raise ConversionError(f"target {gguf_path}: GGUF has no tokenizer (tokenizer.ggml.tokens)")
    return out


def _tokenizer_fields_from_hf(hf_dir: Path) -> list[TokenizerField]:
    """Run the pinned `convert_hf_to_gguf.py --vocab-only` on the target and read its tokenizer keys.

    That is exactly the code the pinned DFlash converter runs (`DFlashModel.set_vocab` calls the
    target's own vocab handler), in its own process so its gguf-py does not meet ours.
    """
    from dflash_llama import paths

    try:
        script = paths.llama_cpp_dir() / "convert_hf_to_gguf.py"
    except (FileNotFoundError, ImportError) as e:
        raise ConversionError(
            f"a tokenizer from the Hugging Face directory {hf_dir} needs the pinned llama.cpp "
            f"converter ({e}); or pass the target GGUF with --target") from e
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the pinned converter must use the pinned gguf-py
    with tempfile.TemporaryDirectory(prefix="dflash-vocab-") as tmp:
        out = Path(tmp) / "vocab.gguf"
        result = subprocess.run(
            [sys.executable, str(script), str(hf_dir), "--vocab-only", "--outfile", str(out)],
            capture_output=True, text=True, env=env)
        if result.returncode != 0 or not out.exists():
            tail = " | ".join(result.stderr.strip().splitlines()[-3:])
            raise ConversionError(f"target {hf_dir}: the pinned llama.cpp converter could not build "
                                  f"its tokenizer: {tail}")
        return read_tokenizer_fields(out)
