"""A deterministic mutation campaign over everything that reads a file we did not write.

Four targets, each fed mutants of the tiny f32 qwen3 pair of `dflash_llama.fixtures`:

- `draft`: a mutated draft GGUF -> `llama-dflash-cli -m TARGET -md MUTANT -p hi -n 4`;
- `target`: a mutated target GGUF -> the same command line;
- `gguf_info`: a mutated draft or target GGUF -> `dflash_llama.gguf_info` in a child Python;
- `converter`: a mutated HF draft directory -> `dflash_llama.converter.convert` in a child Python.

`--variant dflash2` puts a DFlash 2 draft in the pair (grouped dynamic convolutions, candidate selector;
`VARIANT_DRAFTS`), and the converter's seeds are its checkpoint in z-lab's and in vLLM speculators'
format; half of the draft and converter mutants then aim at what DFlash 2 adds (its four sizes, its conv and selector
tensors: shapes, types, data; the speculators keys). `--variant dspark` does the same for a DSpark draft (Markov and
confidence heads; its converter seeds in DeepSpec's, speculators' and SpecForge's formats): its two keys, its heads'
tensors (also re-encoded, resized, of another rank, dropped, with a scale or another variant's tensors beside them),
DeepSpec's keys and DeepSeek-V4's; its CLI runs draft every step, half of them with a confidence threshold.
The variant tables are `GGUF_AIMS` and `HF_AIMS`.

Mutant `index` of `seed` is a pure function of (variant, target, seed, index), so any one of them is
rebuilt with `python -m dflash_llama.parity.fuzz [--variant V] --target T --seed S --index I --keep DIR`.
Each runs in its own child process (timeout, address-space limit) and is classified (see `CATEGORIES`);
a run that succeeds is checked: the CLI's tokens against plain greedy decoding of the same target
(`--no-draft`), the converter's weights against the `safetensors` library's reading of the same checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import random
import re
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_llama import paths, schema

TARGETS = ("draft", "target", "gguf_info", "converter")
# share of a campaign's mutants per target (the CLI targets are where the crashes were)
SHARES = {"draft": 0.45, "target": 0.2, "gguf_info": 0.2, "converter": 0.15}
CATEGORIES = {
    "clean": "a non-zero exit with a one-line error on stderr (and no Python traceback)",
    "exact": "exit 0, and the output is exactly that of plain decoding (CLI) or of the checkpoint (converter)",
    "ran": "exit 0 (gguf_info, or a converter mutant whose weights have no reference)",
    "wrong": "exit 0 with a wrong answer, or an existing output destroyed by a failed conversion",
    "signal": "killed by a signal (or an AddressSanitizer report)",
    "hang": "still running at the timeout",
    "traceback": "a Python child printed a traceback (an exception we do not raise on purpose)",
    "unexplained": "a non-zero exit with nothing on stderr",
}
FAILURES = ("wrong", "signal", "hang", "traceback", "unexplained")
PROMPT, N_PREDICT = "hi", 4


# --- the seed corpus --------------------------------------------------------------------------------

VARIANTS = tuple(schema.VARIANTS)  # the draft variants a corpus can hold
# the seed draft of each variant (fixtures.TinyDraftConfig's fields; the DFlash 1 one: the defaults)
# (speculators' format needs the taps written: the DFlash 2 and DSpark drafts list one, target layer 1;
# DSpark's rank 32 and n_embd + rank = 96 are whole Q8_0 / Q4_0 blocks, so its heads re-encode)
VARIANT_DRAFTS = {"dflash": {}, "dflash2": dict(variant="dflash2", conv_kernel_size=2, conv_group_size=16,
                                                selector_rank=16, selector_top_k=4, identity_conv=False,
                                                target_layer_ids=[1]),
                  "dspark": dict(variant="dspark", markov_rank=32, confidence_head=True, sample_from_anchor=True,
                                 target_layer_ids=[1])}


def _other_formats() -> dict[str, tuple]:
    """The same draft in the other checkpoint formats of its variant: (name, writer(out_dir, draft_dir)),
    the converter's further seeds (each converts to the same tensors)."""
    from dflash_llama import fixtures

    return {"dflash2": (("speculators", fixtures.speculators_draft_hf),),
            "dspark": (("speculators", lambda out, d: fixtures.dspark_draft_as(out, d, "speculators")),
                       ("specforge", lambda out, d: fixtures.dspark_draft_as(out, d, "specforge")))}


@dataclass(frozen=True)
class Corpus:
    target_hf: Path
    target_gguf: Path
    draft_hf: Path
    draft_gguf: Path  # draft_hf converted against target_gguf, f32
    variant: str = "dflash"
    # draft_hf saved in its variant's other formats (DFlash 2: vLLM speculators'; DSpark: speculators',
    # SpecForge's): (format, directory)
    formats: tuple[tuple[str, Path], ...] = ()

    def converter_seeds(self) -> tuple[Path, ...]:
        """The HF draft directories the converter's mutants start from (each converts to draft_gguf)."""
        return (self.draft_hf,) + tuple(d for _, d in self.formats)


def corpus_from(target_hf: Path, target_gguf: Path, draft_hf: Path, work: Path, variant: str = "dflash") -> Corpus:
    """A corpus around existing fixtures: converts the draft (f32) into `work` unless done; a DFlash 2
    or DSpark draft is also saved in its variant's other formats there (`<format>_hf`)."""
    from dflash_llama.converter import convert

    work = Path(work)
    draft_gguf = work / "draft.gguf"
    if not draft_gguf.exists():
        convert(draft_hf, target_gguf, draft_gguf, outtype="f32")
    formats = []
    for name, write in _other_formats().get(variant, ()):
        out = work / f"{name}_hf"
        if not (out / "model.safetensors").exists():
            write(out, draft_hf)
        formats.append((name, out))
    return Corpus(Path(target_hf), Path(target_gguf), Path(draft_hf), draft_gguf, variant, tuple(formats))


def build_corpus(work: Path, variant: str = "dflash") -> Corpus:
    """The tiny f32 pair of `variant` in `work`, built once (keyed by the fixtures' source and the
    seed draft's settings) and reused."""
    from dflash_llama import fixtures

    work = Path(work)
    stamp = work / "corpus.json"
    key = hashlib.sha256(Path(fixtures.__file__).read_bytes()).hexdigest()[:16]
    want = {"fixtures": key, "variant": variant, "draft": VARIANT_DRAFTS[variant]}
    if not (stamp.exists() and json.loads(stamp.read_text()) == want):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        target_hf = fixtures.tiny_target_hf(work / "target_hf")
        fixtures.tiny_target_gguf(target_hf, work / "target.gguf", outtype="f32")
        fixtures.tiny_draft_hf(work / "draft_hf", target_hf, fixtures.TinyDraftConfig(**VARIANT_DRAFTS[variant]))
    corpus = corpus_from(work / "target_hf", work / "target.gguf", work / "draft_hf", work, variant)
    stamp.write_text(json.dumps(want) + "\n")
    return corpus


def default_work_dir(variant: str = "dflash") -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-llama" / "fuzz-corpus"
    return base if variant == "dflash" else base.with_name(f"fuzz-corpus-{variant}")


# --- a GGUF header walk (our own: mutants must hold what gguf-py would refuse to write) -------------

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B",
           U64: "<Q", I64: "<q", F64: "<d"}
TYPE_NAMES = {U8: "u8", I8: "i8", U16: "u16", I16: "i16", U32: "u32", I32: "i32", F32: "f32", BOOL: "bool",
              STRING: "str", ARRAY: "arr", U64: "u64", I64: "i64", F64: "f64"}
INT_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)
FLOAT_TYPES = (F32, F64)
INTS = (0, -1, 1, 2, 3, 7, 512, 513, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 8, 2**63, 2**64 - 1)
FLOATS = (math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-30, 1e30, -1e-6)
# ggml types: F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, I8, I16, I32, I64, F64, BF16, and ids ggml lacks
TENSOR_TYPES = (1, 2, 3, 8, 12, 14, 24, 25, 26, 27, 28, 30, 4, 39, 1000, 2**31)


@dataclass
class GGUFFile:
    version: int
    n_tensors: int
    n_kv: int
    kvs: list  # (key bytes, value type, value); arrays: (element type, [values]); unknown types: raw bytes
    tensors: list  # [name bytes, [dims], ggml type, offset]
    alignment: int
    header_end: int  # end of the tensor table in the seed file
    data: bytes  # the data section, from its aligned start


class _Walk:
    def __init__(self, blob: bytes):
        self.blob, self.pos = blob, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.blob, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> bytes:
        n = self.take("<Q")
        self.pos += n
        return self.blob[self.pos - n:self.pos]

    def value(self, vtype: int):
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            sub, n = self.take("<I"), self.take("<Q")
            return sub, [self.value(sub) for _ in range(n)]
        return self.take(SCALAR_FORMATS[vtype])


def parse_gguf(blob: bytes) -> GGUFFile:
    """The structure of a well-formed GGUF (the seeds): key-values, tensor table, data section."""
    w = _Walk(blob)
    if blob[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    w.pos = 4
    version, n_tensors, n_kv = w.take("<I"), w.take("<Q"), w.take("<Q")
    kvs = []
    for _ in range(n_kv):
        key, vtype = w.string(), w.take("<I")
        kvs.append((key, vtype, w.value(vtype)))
    tensors = []
    for _ in range(n_tensors):
        name, n_dims = w.string(), w.take("<I")
        dims = [w.take("<Q") for _ in range(n_dims)]
        tensors.append([name, dims, w.take("<I"), w.take("<Q")])
    alignment = next((v for k, t, v in kvs if k == b"general.alignment"), 32)
    start = -(-w.pos // alignment) * alignment
    return GGUFFile(version, n_tensors, n_kv, kvs, tensors, alignment, w.pos, blob[start:])


def pack_value(vtype: int, value) -> bytes:
    if vtype == STRING:
        return struct.pack("<Q", len(value)) + value
    if vtype == ARRAY:
        sub, items = value
        return struct.pack("<IQ", sub, len(items)) + b"".join(pack_value(sub, v) for v in items)
    if vtype not in SCALAR_FORMATS:
        return value  # raw bytes after an unknown type id
    fmt = SCALAR_FORMATS[vtype]
    if fmt[-1] in "fd":
        return struct.pack(fmt, float(value))
    size = struct.calcsize(fmt)
    return (int(value) % (1 << 8 * size)).to_bytes(size, "little")  # wraps, as a careless writer would


def serialize_gguf(g: GGUFFile) -> bytes:
    parts = [b"GGUF", struct.pack("<IQQ", g.version % 2**32, g.n_tensors % 2**64, g.n_kv % 2**64)]
    for key, vtype, value in g.kvs:
        parts += [pack_value(STRING, key), struct.pack("<I", vtype % 2**32), pack_value(vtype, value)]
    for name, dims, ttype, offset in g.tensors:
        parts += [pack_value(STRING, name), struct.pack("<I", len(dims))]
        parts += [struct.pack("<Q", d % 2**64) for d in dims]
        parts += [struct.pack("<IQ", ttype % 2**32, offset % 2**64)]
    head = b"".join(parts)
    return head + b"\0" * (-len(head) % g.alignment) + g.data


# --- GGUF mutators: each edits a copy of the parsed seed and says what it did ----------------------

def _value_for(rng: random.Random, vtype: int):
    return rng.choice(FLOATS) if vtype in FLOAT_TYPES else rng.choice(INTS)


def m_kv_value(rng, g, extra_keys):
    """A scalar key gets an edge value, in its own type or another numeric one."""
    scalars = [i for i, (_, t, _) in enumerate(g.kvs) if t in SCALAR_FORMATS]
    i = rng.choice(scalars)
    key, vtype, _ = g.kvs[i]
    new_type = vtype if rng.random() < 0.5 else rng.choice(INT_TYPES + FLOAT_TYPES + (BOOL,))
    value = 2 if new_type == BOOL else _value_for(rng, new_type)
    g.kvs[i] = (key, new_type, value)
    return f"{key.decode()} = {value!r} as {TYPE_NAMES[new_type]}"


ODD_VALUES = ((STRING, b"x"), (STRING, b"\xff\xfe"), (BOOL, 1), (BOOL, 0), (I32, -1), (U32, 7), (F32, math.nan),
              (U64, 2**32 + 8), (I64, -(2**63)), (ARRAY, (I32, [0, 1, 2])), (ARRAY, (STRING, [b"a"])),
              (ARRAY, (F32, [1.0])), (ARRAY, (I32, [])), (ARRAY, (ARRAY, [])), (ARRAY, (99, [])),
              (13, b""), (99, b"\0" * 8))


def m_kv_type(rng, g, extra_keys):
    """Any key gets a value of another type (including unknown type ids)."""
    i = rng.randrange(len(g.kvs))
    vtype, value = rng.choice(ODD_VALUES)
    g.kvs[i] = (g.kvs[i][0], vtype, value)
    return f"{g.kvs[i][0].decode()} retyped to {TYPE_NAMES.get(vtype, vtype)} {value!r:.40}"


def _retyped(items: list, old: int, new: int) -> list:
    if new == STRING:
        return [str(v).encode() if old != STRING else v for v in items]
    if old == STRING:
        return [len(v) for v in items]
    return [float(v) if new in FLOAT_TYPES else (int(v) if math.isfinite(v) else 0) for v in items]


def m_kv_array(rng, g, extra_keys):
    """An array key: element type changed, an element set to an edge value or duplicated, resized."""
    arrays = [i for i, (_, t, _) in enumerate(g.kvs) if t == ARRAY]
    i = rng.choice(arrays)
    key, _, (sub, items) = g.kvs[i]
    items = list(items)
    op = rng.choice(("retype", "element", "duplicate", "empty", "halve", "grow"))
    if op == "retype":
        new = rng.choice([t for t in INT_TYPES + FLOAT_TYPES + (STRING, BOOL) if t != sub])
        sub, items = new, _retyped(items, sub, new)
    elif op == "element" and items:
        j = rng.randrange(len(items))
        items[j] = rng.choice((b"", b"\xff\xfe", b"a\0b")) if sub == STRING else _value_for(rng, sub)
    elif op == "duplicate" and len(items) > 1:
        j, k = rng.sample(range(len(items)), 2)
        items[j] = items[k]
    elif op == "empty":
        items = []
    elif op == "halve":
        items = items[:len(items) // 2]
    else:
        items = items + items[:rng.choice((1, 2, 64))]
    g.kvs[i] = (key, ARRAY, (sub, items))
    return f"{key.decode()}: array {op} (elements {TYPE_NAMES.get(sub, sub)}, {len(items)})"


ODD_STRINGS = (b"", b"\xff\xfe\xfd", b"a\0b", b"x" * 100_000, b"qwen3", b"llama", b"dflash", b"none", b"linear",
               b"yarn", b"gpt2", b"llama\xc3")


def m_kv_string(rng, g, extra_keys):
    strings = [i for i, (_, t, _) in enumerate(g.kvs) if t == STRING]
    i = rng.choice(strings)
    value = rng.choice(ODD_STRINGS)
    g.kvs[i] = (g.kvs[i][0], STRING, value)
    return f"{g.kvs[i][0].decode()} = {value!r:.40}"


def m_kv_add(rng, g, extra_keys):
    """A key the seed lacks (an optional key of the schema), with an edge value of any type."""
    present = {k for k, _, _ in g.kvs}
    key = rng.choice([k for k in extra_keys if k not in present] or list(extra_keys))
    vtype, value = rng.choice(ODD_VALUES + ((U32, 0), (U32, 2**31), (F32, -math.inf), (BOOL, 1), (BOOL, 0)))
    g.kvs.insert(rng.randrange(len(g.kvs) + 1), (key, vtype, value))
    g.n_kv = len(g.kvs)
    return f"added {key.decode()} = {value!r:.40} as {TYPE_NAMES.get(vtype, vtype)}"


def m_kv_structure(rng, g, extra_keys):
    """A key deleted, duplicated (with another value) or renamed."""
    i = rng.randrange(len(g.kvs))
    key, vtype, value = g.kvs[i]
    op = rng.choice(("delete", "duplicate", "rename"))
    if op == "delete":
        del g.kvs[i]
    elif op == "duplicate":
        g.kvs.insert(rng.randrange(len(g.kvs) + 1), (key, *rng.choice(ODD_VALUES + ((vtype, value),))))
    else:
        g.kvs[i] = (rng.choice((b"", key + b"x", key[:-1], b"\xff" + key)), vtype, value)
    g.n_kv = len(g.kvs)
    return f"{key.decode()} {op}d"


def m_tensor_type(rng, g, extra_keys):
    t = rng.choice(g.tensors)
    t[2] = rng.choice(TENSOR_TYPES)
    return f"tensor {t[0].decode()} type {t[2]}"


def m_tensor_shape(rng, g, extra_keys):
    t = rng.choice(g.tensors)
    dims = t[1]
    op = rng.choice(("value", "value", "swap", "flatten", "add", "five", "none"))
    if op == "value":
        j = rng.randrange(len(dims))
        dims[j] = rng.choice((0, 1, dims[j] + 1, dims[j] - 1, dims[j] * 2, 2**31, 2**32 + dims[j], 2**63, 2**64 - 1))
    elif op == "swap" and len(dims) > 1:
        dims.reverse()
    elif op == "flatten":
        t[1] = [math.prod(dims)]
    elif op == "add":
        dims.insert(rng.randrange(len(dims) + 1), rng.choice((1, 2)))
    elif op == "five":
        t[1] = dims + [1] * (5 - len(dims))
    else:
        t[1] = []
    return f"tensor {t[0].decode()} shape {op} -> {t[1]}"


def m_tensor_offset(rng, g, extra_keys):
    t = rng.choice(g.tensors)
    other = rng.choice(g.tensors)[3]
    t[3] = rng.choice((t[3] + 1, t[3] + g.alignment, other, 0, len(g.data), len(g.data) - 4, 2**40, 2**63,
                       2**64 - g.alignment))
    return f"tensor {t[0].decode()} offset {t[3]}"


def m_tensor_structure(rng, g, extra_keys):
    """A tensor deleted, duplicated, renamed (maybe onto another's name), or the count off by one."""
    i = rng.randrange(len(g.tensors))
    name = g.tensors[i][0]
    op = rng.choice(("delete", "duplicate", "rename", "count"))
    if op == "delete":
        del g.tensors[i]
    elif op == "duplicate":
        g.tensors.insert(rng.randrange(len(g.tensors) + 1), copy.deepcopy(g.tensors[i]))
    elif op == "rename":
        g.tensors[i][0] = rng.choice((b"", name + b"x", rng.choice(g.tensors)[0], b"\xff" + name))
    if op == "count":
        g.n_tensors += rng.choice((-1, 1, 2**32))
    else:
        g.n_tensors = len(g.tensors)
    return f"tensor {name.decode()} {op}"


def m_header(rng, g, extra_keys):
    what = rng.choice(("version", "n_kv", "n_tensors"))
    value = rng.choice((0, 1, 2, 4, 2**31, 2**32 - 1)) if what == "version" else getattr(g, what) + rng.choice(
        (-1, 1, 2**32, 2**62))
    setattr(g, what, value)
    return f"header {what} = {value}"


GGUF_MUTATORS = (m_kv_value, m_kv_value, m_kv_type, m_kv_array, m_kv_string, m_kv_add, m_kv_structure,
                 m_tensor_type, m_tensor_type, m_tensor_shape, m_tensor_shape, m_tensor_offset, m_tensor_structure,
                 m_header)


# --- variant mutators: what a draft variant adds (half of its draft's structural mutants) -------------
#
# One table per variant (GGUF_AIMS): its keys, the values and types to give them, its tensors and the
# operations on them; `m_variant_key` and `m_variant_tensor` read it. DFlash 2 draws exactly as before
# the table existed (mutants of earlier campaigns rebuild the same).

TENSOR_DATA = (math.nan, math.inf, -math.inf, 3e38, -3e38, 0.0, 1e-45)
# ggml types a tensor's data can be re-encoded in (the file stays consistent): F16, BF16, Q8_0, Q4_0,
# I8, I32, F64
RETYPES = (1, 30, 8, 2, 24, 26, 28)


@dataclass(frozen=True)
class GGUFAim:
    """What a variant adds to a DFlash 1 draft GGUF, for the mutants aimed there."""

    labels: tuple[str, str]  # how a key and a tensor mutant say what they are ("dflash2_size", ...)
    keys: tuple[bytes, ...]  # its keys in the seed
    key_type: int  # the type they are written in
    other_types: tuple[int, ...]  # another type, one time in five
    ints: tuple  # integer values
    bools: tuple = (1,)  # bool values (bytes: ggml reads any but 0 as true)
    strings: tuple = (b"true",)
    added_keys: tuple = ()  # (key, type, value) a mutant may add: what the variant must refuse
    tensors: tuple[bytes, ...] = ()  # in the names of its tensors
    tensor_ops: tuple[str, ...] = ("data", "data", "data", "dimension", "swap", "type")
    extra_tensors: tuple = ()  # (what, ((name, ne, type, fill), ...)): tensors a mutant may add together
    optional_head: tuple = ()  # (key, tensor names): a head a draft may lack, the key saying whether it has it
    marker: bytes = b""  # a tensor that says the variant (else one of its keys does)

    def detect(self, g: GGUFFile) -> bool:
        if self.marker:
            return any(t[0] == self.marker for t in g.tensors)
        return any(k in self.keys for k, _, _ in g.kvs)

    @property
    def mutators(self) -> tuple:
        return ((self.labels[0], m_variant_key), (self.labels[1], m_variant_tensor),
                (self.labels[1], m_variant_tensor))


def _kv(g: GGUFFile, key: bytes, default=None):
    return next((v for k, _, v in g.kvs if k == key), default)


def m_variant_key(rng, g, aim: GGUFAim):
    """One of the variant's keys: another value (in its own type mostly, or another type), or deleted;
    or a key it must refuse added."""
    if aim.added_keys and rng.random() < 0.2:
        key, vtype, value = rng.choice(aim.added_keys)
        g.kvs.insert(rng.randrange(len(g.kvs) + 1), (key, vtype, value))
        g.n_kv = len(g.kvs)
        return f"added {key.decode()} = {value!r:.40} as {TYPE_NAMES[vtype]}"
    i = rng.choice([i for i, (k, _, _) in enumerate(g.kvs) if k in aim.keys])
    key = g.kvs[i][0]
    if rng.random() < 0.1:
        del g.kvs[i]
        g.n_kv = len(g.kvs)
        return f"{key.decode()} deleted"
    vtype = aim.key_type if rng.random() < 0.8 else rng.choice(aim.other_types)
    if vtype == BOOL:
        value = aim.bools[0] if len(aim.bools) == 1 else rng.choice(aim.bools)
    elif vtype == F32:
        value = rng.choice((2.0, 4.5, math.nan))
    elif vtype == STRING:
        value = rng.choice(aim.strings)
    else:
        value = rng.choice(aim.ints)
    g.kvs[i] = (key, vtype, value)
    return f"{key.decode()} = {value!r} as {TYPE_NAMES[vtype]}"


def m_variant_tensor(rng, g, aim: GGUFAim):
    """One of the variant's tensors: its data (one value or all set to NaN, inf, 3e38, 0, a denormal),
    one dimension off, its dimensions swapped, or its type; where the variant's table says so also:
    re-encoded in another type, resized with its data (one dimension; or the rank all the variant's
    tensors share), deleted, or tensors added beside it."""
    t = rng.choice([t for t in g.tensors if any(h in t[0] for h in aim.tensors)])
    name = t[0].decode()
    op = rng.choice(aim.tensor_ops)
    if op == "data" and t[2] == 0:  # f32, as in the seed
        n, value = math.prod(t[1]), rng.choice(TENSOR_DATA)
        start, count = (t[3] + 4 * rng.randrange(n), 1) if rng.random() < 0.5 else (t[3], n)
        data = bytearray(g.data)
        data[start:start + 4 * count] = struct.pack("<f", value) * count
        g.data = bytes(data)
        return f"tensor {name} data: {'all' if count > 1 else 'one'} = {value!r}"
    if op in TENSOR_OPS and (what := TENSOR_OPS[op](rng, g, t, aim)):
        return what
    if op == "dimension":
        j = rng.randrange(len(t[1]))
        t[1][j] = rng.choice((0, 1, t[1][j] - 1, t[1][j] + 1, t[1][j] * 2))
    elif op == "swap" and len(t[1]) > 1:
        t[1].reverse()
    else:
        t[2] = rng.choice(TENSOR_TYPES)
        return f"tensor {name} type {t[2]}"
    return f"tensor {name} shape {op} -> {t[1]}"


def _f32_array(g: GGUFFile, t: list):
    """An f32 tensor's values, numpy-shaped (ggml's ne reversed)."""
    import numpy as np

    return np.frombuffer(g.data, "<f4", math.prod(t[1]), t[3]).reshape(t[1][::-1] or [1])


def _encoded(values, ttype: int) -> bytes | None:
    """`values` (f32, numpy-shaped) in ggml type `ttype`; None where that type cannot hold its rows."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    if ttype in (0, 1, 2, 8, 30):
        try:
            return quants.quantize(np.ascontiguousarray(values, np.float32), GGMLQuantizationType(ttype)).tobytes()
        except (ValueError, NotImplementedError, quants.QuantError):
            return None
    kind = {24: "<i1", 26: "<i4", 28: "<f8"}[ttype]
    if kind[1] == "i":
        values = np.clip(np.nan_to_num(np.round(values * 16)), -100, 100)
    return values.astype(kind).tobytes()


def _relayout(g: GGUFFile, new: dict[int, bytes | None]) -> None:
    """The data section laid out again with tensor i's bytes replaced by new[i], or tensor i left out
    where new[i] is None (each tensor aligned and right after the one before, as gguf requires; the
    section padded to the alignment); the other tensors keep their bytes."""
    order = sorted(range(len(g.tensors)), key=lambda i: g.tensors[i][3])
    ends = [g.tensors[i][3] for i in order[1:]] + [len(g.data)]
    data = bytearray()
    for i, end in zip(order, ends):
        blob = new[i] if i in new else g.data[g.tensors[i][3]:end]
        if blob is not None:
            data += bytes(-len(data) % g.alignment)
            g.tensors[i][3] = len(data)
            data += blob
    g.data = bytes(data + bytes(-len(data) % g.alignment))
    g.tensors = [t for i, t in enumerate(g.tensors) if i not in new or new[i] is not None]
    g.n_tensors = len(g.tensors)


def _resized(values, shape: list[int]):
    """`values` (numpy-shaped) cut or grown to `shape`, grown by repeating its own values."""
    import numpy as np

    out = values
    for axis, n in enumerate(shape):
        have = out.shape[axis]
        if n <= have:
            out = np.take(out, range(n), axis=axis)
        elif have:
            out = np.take(out, [j % have for j in range(n)], axis=axis)
        else:
            out = np.zeros(out.shape[:axis] + (n,) + out.shape[axis + 1:], np.float32)
    return out


def op_retype(rng, g, t, aim):
    """The tensor in another type, its data re-encoded (F16, BF16, Q8_0, Q4_0, I8, I32, F64)."""
    if t[2] != 0:
        return None
    ttype = rng.choice(RETYPES)
    blob = _encoded(_f32_array(g, t), ttype)
    if blob is None:  # rows that type cannot hold: the type alone changes
        t[2] = ttype
        return f"tensor {t[0].decode()} type {ttype} (rows of {t[1][0]} values, data as f32)"
    t[2] = ttype
    _relayout(g, {g.tensors.index(t): blob})
    return f"tensor {t[0].decode()} re-encoded as type {ttype}"


def op_resize(rng, g, t, aim):
    """One dimension of the tensor changed, its data cut or grown with it (a consistent file)."""
    if t[2] != 0:
        return None
    j = rng.randrange(len(t[1]))
    n = t[1][j]
    dims = list(t[1])
    dims[j] = rng.choice((0, 1, n - 1, n + 1, 2 * n, 48))
    blob = _resized(_f32_array(g, t), dims[::-1]).astype("<f4").tobytes()
    t[1] = dims
    _relayout(g, {g.tensors.index(t): blob})
    return f"tensor {t[0].decode()} resized with its data -> {dims}"


MARKOV_RANKS = (0, 1, 8, 16, 31, 33, 64)  # around the seed's 32; 0 is no head


def op_rank(rng, g, t, aim):
    """DSpark's rank changed in every tensor that has it (markov_w1 and markov_w2's ne0, conf_proj's
    ne0 = n_embd + rank), the data cut or grown: a consistent draft of another rank."""
    n_embd = _kv(g, b"dflash.embedding_length")
    rank = next(d[0] for n, d, _, _ in g.tensors if n == b"markov_w1.weight")
    new_rank = rng.choice([r for r in MARKOV_RANKS if r != rank])
    new = {}
    for i, u in enumerate(g.tensors):
        if u[0] in (b"markov_w1.weight", b"markov_w2.weight", b"conf_proj.weight") and u[2] == 0:
            dims = [(n_embd if u[0] == b"conf_proj.weight" else 0) + new_rank] + u[1][1:]
            new[i] = _resized(_f32_array(g, u), dims[::-1]).astype("<f4").tobytes()
            u[1] = dims
    _relayout(g, new)
    return f"markov rank {rank} -> {new_rank} in {len(new)} tensors, their data cut or grown"


def op_drop_head(rng, g, t, aim):
    """The variant's optional head taken out whole: its tensors deleted, its key set to false or
    deleted (a consistent draft without it)."""
    key, names = aim.optional_head
    _relayout(g, {i: None for i, u in enumerate(g.tensors) if u[0] in names})
    i = next(i for i, (k, _, _) in enumerate(g.kvs) if k == key)
    said = "= 0 as bool" if rng.random() < 0.5 else "deleted"
    if said == "deleted":
        del g.kvs[i]
    else:
        g.kvs[i] = (key, BOOL, 0)
    g.n_kv = len(g.kvs)
    return f"head dropped: {', '.join(n.decode() for n in names)} deleted, {key.decode()} {said}"


def op_delete(rng, g, t, aim):
    """The tensor deleted with its data (a well-formed file that lacks it)."""
    _relayout(g, {g.tensors.index(t): None})
    return f"tensor {t[0].decode()} deleted"


def op_extra(rng, g, t, aim):
    """Tensors the variant must refuse (or read), added with their data."""
    what, tensors = rng.choice(aim.extra_tensors)
    n_embd = _kv(g, b"dflash.embedding_length")
    for name, ne, ttype, fill in tensors:
        ne = [n_embd if d == "H" else d for d in ne]
        blob = struct.pack({0: "<f", 27: "<q"}[ttype], fill) * math.prod(ne)
        g.data += bytes(-len(g.data) % g.alignment)
        g.tensors.append([name, ne, ttype, len(g.data)])
        g.data += blob + bytes(-len(blob) % g.alignment)
    g.n_tensors = len(g.tensors)
    return f"added {what}: {', '.join(n.decode() for n, *_ in tensors)}"


TENSOR_OPS = {"retype": op_retype, "resize": op_resize, "rank": op_rank, "delete": op_delete, "extra": op_extra,
              "drop_head": op_drop_head}

GGUF_AIMS: dict[str, GGUFAim] = {
    # DFlash 2: its four sizes around the seed's (K 2, G 16, rank 16, top-K 4; n_embd 64) and past the
    # bounds the readers check; its conv and selector tensors
    "dflash2": GGUFAim(
        ("dflash2_size", "dflash2_tensor"), tuple(k.encode() for k in schema.DFLASH2_KEYS), U32,
        (U16, I32, U64, I64, F32, BOOL),
        (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 15, 16, 17, 20, 21, 32, 63, 64, 65, 128, 49152, 49153, 2**16,
         2**31 - 1, 2**31, 2**32 - 1, 2**32 + 4, 2**63),
        tensors=(b"conv_", b"selector_")),
    # DSpark: its two bools (also bytes other than 0 and 1, strings, as the pinned llama.cpp reads them,
    # numbers); DeepSeek-V4's and DFlash 2's keys added; the Markov and confidence heads' tensors
    # (rank 32, n_embd 64) re-encoded, resized, their rank changed together, deleted; a W2 scale, a
    # reduced vocabulary, another variant's or DeepSeek-V4's tensors added
    "dspark": GGUFAim(
        ("dspark_key", "dspark_tensor"), (schema.SAMPLE_FROM_ANCHOR.encode(), schema.HAS_CONFIDENCE_HEAD.encode()),
        BOOL, (U8, I8, U32, I32, U64, F32, STRING), (0, 1, 2, -1, 255, 256, 2**32 + 1),
        bools=(0, 1, 0, 1, 2, 255), strings=(b"true", b"false", b"", b"1"),
        added_keys=((schema.HYPER_CONNECTION_COUNT.encode(), U32, 4), (schema.HYPER_CONNECTION_COUNT.encode(), U32, 0),
                    (b"dflash.hyper_connection.sinkhorn_iterations", U32, 20),
                    (schema.CONV_KERNEL_SIZE.encode(), U32, 2), (schema.SELECTOR_RANK.encode(), U32, 32)),
        tensors=(b"markov_", b"conf_proj"),
        tensor_ops=("data", "data", "dimension", "swap", "type", "retype", "retype", "resize", "rank", "rank",
                    "delete", "drop_head", "extra", "extra"),
        extra_tensors=(
            ("a scale of W2", ((b"markov_w2.scale", [1], 0, 1.0),)),
            ("a reduced vocabulary", ((b"d2t", [7], 27, 0), (b"output.weight", ["H", 7], 0, 0.0))),
            ("a DFlash 2 selector", ((b"selector_hidden.weight", ["H", 32], 0, 0.0),)),
            ("DeepSeek-V4 hyper-connections", ((b"blk.0.hc_attn_fn.weight", [256, 24], 0, 0.0),
                                               (b"output_hc_base.weight", [4], 0, 0.0))),
            ("a second conf_proj.bias", ((b"conf_proj.bias", [1], 0, 0.5),)),
            ("a scale of the confidence head", ((b"conf_proj.scale", [1], 0, 1.0),)),
            ("a gated Markov head's gate", ((b"markov_gate.weight", [96, 32], 0, 0.0),))),
        optional_head=(schema.HAS_CONFIDENCE_HEAD.encode(), (b"conf_proj.weight", b"conf_proj.bias")),
        marker=schema.DSPARK.marker.encode()),
}


# --- raw mutators: bytes, mostly inside the header --------------------------------------------------

def _position(rng: random.Random, size: int, header_end: int) -> int:
    return rng.randrange(header_end) if rng.random() < 0.75 else rng.randrange(size)


def raw_mutation(rng: random.Random, blob: bytes, header_end: int) -> tuple[bytes, str]:
    data = bytearray(blob)
    op = rng.choice(("flip", "flip", "truncate", "insert"))
    if op == "flip":
        where = [_position(rng, len(data), header_end) for _ in range(rng.choice((1, 1, 2, 4, 8)))]
        for p in where:
            data[p] ^= 1 << rng.randrange(8)
        return bytes(data), f"bits flipped at {where}"
    if op == "truncate":
        n = _position(rng, len(data), header_end) if rng.random() < 0.8 else len(data) - rng.randrange(1, 64)
        return bytes(data[:n]), f"truncated to {n} bytes"
    p = _position(rng, len(data), header_end)
    inserted = bytes(rng.randrange(256) for _ in range(rng.choice((1, 4, 8, 16))))
    return bytes(data[:p]) + inserted + bytes(data[p:]), f"{len(inserted)} bytes inserted at {p}"


_SEEDS: dict[Path, tuple[bytes, GGUFFile]] = {}  # per worker process: each seed read and parsed once


def mutate_gguf(seed_path: Path, rng: random.Random, extra_keys: list[bytes]) -> tuple[bytes, str]:
    if seed_path not in _SEEDS:
        blob = seed_path.read_bytes()
        _SEEDS[seed_path] = blob, parse_gguf(blob)
    blob, parsed = _SEEDS[seed_path]
    if rng.random() < 0.25:
        return raw_mutation(rng, blob, parsed.header_end)
    g = copy.copy(parsed)
    g.kvs = list(parsed.kvs)
    g.tensors = [[n, list(d), t, o] for n, d, t, o in parsed.tensors]
    aim = next((a for a in GGUF_AIMS.values() if a.detect(parsed)), None)  # a DFlash 1 seed draws as before
    if aim is not None and rng.random() < 0.5:
        label, mutator = rng.choice(aim.mutators)
        what = mutator(rng, g, aim)
    else:
        mutator = rng.choice(GGUF_MUTATORS)
        label, what = mutator.__name__[2:], mutator(rng, g, extra_keys)
    return serialize_gguf(g), f"{label}: {what}"


def extra_keys_for(target: str) -> list[bytes]:
    """Keys a mutant may add: the draft schema's, or the target architecture's optional ones."""
    if target == "draft":
        return [k.key.encode() for k in schema.KEYS] + [b"general.alignment"]
    return [b"general.alignment", b"qwen3.attention.causal", b"qwen3.rope.dimension_count",
            b"qwen3.attention.sliding_window", b"qwen3.rope.scaling.type", b"qwen3.attention.key_length",
            b"qwen3.expert_count", b"tokenizer.ggml.add_bos_token"]


# --- HF draft directory mutators (the converter's input) -------------------------------------------

JSON_VALUES = (0, -1, 1, 2**31, 2**32 + 8, 2**63, 10**12, 1e308, math.nan, math.inf, -math.inf, 0.5, "8", "",
               None, True, False, [], [1, 2], {}, {"a": 1}, [[]], "\udcff", [-1], [10**12])
CONFIG_KEYS = ("num_hidden_layers", "target_layer_ids", "layer_types", "sliding_window", "rope_parameters",
               "rope_scaling", "block_size", "mask_token_id", "num_target_layers", "use_sliding_window",
               "is_causal", "head_dim", "architectures", "torch_dtype")
SIZE_NAMES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # DFlash 2's, in config.json
# speculators' own keys (its DFlash 2 sizes at the top level too)
SPECULATORS_KEYS = ("speculators_model_type", "aux_hidden_state_layer_ids", "transformer_layer_config",
                    "sliding_window_non_causal", "sample_from_anchor", "draft_vocab_size", "target_hidden_size",
                    "block_size", "mask_token_id", "architectures")


def _config_paths(cfg: dict) -> list[tuple]:
    found = []
    for k, v in cfg.items():
        found.append((k,))
        if isinstance(v, dict):
            found += [(k, *sub) for sub in _config_paths(v)]
    return found + [(k,) for k in CONFIG_KEYS] + [("dflash_config", k) for k in ("target_layer_ids", "causal",
                                                                                 "use_swa", "block_size")] \
        + [("rope_parameters", "full_attention"), ("rope_parameters", "factor")]


def _mutate_config(rng: random.Random, d: Path) -> str:
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    op = rng.choice(("set", "set", "set", "delete", "raw"))
    if op == "raw":
        text = path.read_bytes()
        raw = rng.choice(((b"[" * 200_000, "nested 200000 deep"), (b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                                                 "objects nested 50000 deep"),
                          (text[:rng.randrange(len(text))], "truncated"), (b"\xff\xfe" + text, "invalid UTF-8"),
                          (b"", "empty"), (b"[1, 2]", "an array"), (text[:-2] + b', "hidden_size": 65}', "dup key")))
        path.write_bytes(raw[0])
        return f"config.json {raw[1]}"
    keys = rng.choice(_config_paths(cfg))
    return _put(path, cfg, keys, None if op == "delete" else rng.choice(JSON_VALUES), op == "delete")


def _put(path: Path, cfg: dict, keys: tuple, value, delete: bool = False) -> str:
    """config.json with `keys` (a path into nested objects, made where missing) set to `value` or deleted."""
    node = cfg
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    if delete:
        node.pop(keys[-1], None)
        value = "deleted"
    else:
        node[keys[-1]] = value
    path.write_text(json.dumps(cfg))
    return f"config.json {'.'.join(keys)} = {value!r:.40}"


def _mutate_safetensors(rng: random.Random, d: Path) -> str:
    path = d / "model.safetensors"
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header, data = json.loads(blob[8:8 + n]), blob[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    op = rng.choice(("offsets", "offsets", "dtype", "shape", "delete", "duplicate", "metadata", "length", "raw"))
    if op == "offsets":
        other = header[rng.choice(names)]["data_offsets"]
        b, e = entry["data_offsets"]
        entry["data_offsets"] = rng.choice(([str(b), str(e)], [float(b), float(e)], [b + 1, e + 1], [b - 1, e - 1],
                                            list(other), [e, b], [-8, e - b - 8], [b, e + 2**40], [b], None, [b, e, 0]))
    elif op == "dtype":
        entry["dtype"] = rng.choice(("F64", "I32", "U8", "F16", "F32", "BF16", "F8_E4M3", "", 5, None))
    elif op == "shape":
        entry["shape"] = rng.choice(([0], [-1, 64], entry["shape"][::-1], entry["shape"] + [1], ["64"], [2**63],
                                     [1.5], None, 7))
    elif op == "delete":
        del header[name]
    elif op == "duplicate":
        header[name + ".copy" if rng.random() < 0.5 else rng.choice(names)] = dict(entry)
        header[rng.choice(names)] = dict(entry)
    elif op == "metadata":
        header["__metadata__"] = rng.choice(({"format": 5}, [1], "x", {"format": "pt", "a": {"b": 1}}))
    head = json.dumps(header).encode()
    if op == "length":
        delta = rng.choice((-1, 1, -len(head), 2**40))
        path.write_bytes((len(head) + delta).to_bytes(8, "little") + head + data)
        return f"model.safetensors header length {delta:+}"
    blob = len(head).to_bytes(8, "little") + head + data
    if op == "raw":
        blob, what = raw_mutation(rng, blob, 8 + len(head))
        path.write_bytes(blob)
        return f"model.safetensors {what}"
    path.write_bytes(blob)
    return f"model.safetensors {name} {op}: {json.dumps(header.get(name))[:60]}"


def _mutate_files(rng: random.Random, d: Path) -> str:
    op = rng.choice(("index", "index", "index", "no config", "no weights", "config dir", "two parts"))
    if op == "index":
        weight_map = rng.choice(({"fc.weight": 5}, {"fc.weight": ["model.safetensors"]}, {"fc.weight": "missing.st"},
                                 {"fc.weight": "../model.safetensors"}, {}, [1], None, {"fc.weight": None}))
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return f"index weight_map = {weight_map!r}"
    if op == "no config":
        (d / "config.json").unlink()
    elif op == "no weights":
        (d / "model.safetensors").unlink()
    elif op == "config dir":
        (d / "config.json").unlink()
        (d / "config.json").mkdir()
    else:
        shutil.copy(d / "model.safetensors", d / "model-00002.safetensors")
    return op


# --- variant mutators of an HF draft directory: its config keys and its tensors, by the table of the variant


def _dflash2_config_keys(cfg: dict) -> list[tuple]:
    """DFlash 2's sizes (z-lab: in dflash_config or at the top level; speculators: at the top level, with
    speculators' own keys and the layer config's)."""
    if "speculators_model_type" in cfg:
        return [(k,) for k in SIZE_NAMES + SPECULATORS_KEYS] + [
            ("transformer_layer_config", k) for k in ("hidden_size", "num_hidden_layers", "vocab_size", "model_type",
                                                      "layer_types", "head_dim")]
    return [("dflash_config", k) for k in SIZE_NAMES] + [(k,) for k in SIZE_NAMES + ("architectures",)]


DSPARK_SETTINGS = tuple(schema.DSPARK_DEFAULTS)  # markov_rank, markov_head_type, enable_confidence_head, ...
DEEPSEEK_V4_KEYS = schema.DEEPSEEK_V4_HF_KEYS  # a DeepSeek-V4 DSpark checkpoint's own (hyper-connections, ...)


def _dspark_config_keys(cfg: dict) -> list[tuple]:
    """DSpark's settings where its format keeps them (DeepSpec: the top level, beside the copied target
    config; SpecForge: dflash_config; speculators: the top level, with its own keys), DeepSeek-V4's
    keys, the architecture."""
    fmt = schema.checkpoint_format(cfg)
    keys = [(k,) for k in DEEPSEEK_V4_KEYS + ("architectures",)]
    if fmt == "speculators":
        return keys + [(k,) for k in DSPARK_SETTINGS + SPECULATORS_KEYS] + [
            ("transformer_layer_config", k) for k in ("hidden_size", "vocab_size", "model_type", "hc_mult")]
    if fmt == "deepspec":
        return keys + [(k,) for k in DSPARK_SETTINGS + ("block_size", "target_layer_ids", "mask_token_id",
                                                        "num_target_layers", "tie_word_embeddings")]
    return keys + [("dflash_config", k) for k in DSPARK_SETTINGS + ("projector_type", "attention_mode",
                                                                    "target_layer_ids")] + [(k,) for k in
                                                                                            DSPARK_SETTINGS]


def _dspark_respelling(name: str) -> str:
    """Another spelling of a DSpark tensor: W1 and W2 without `markov_head.`, the confidence head as
    Gemma 4's `confidence_proj`, else with `model.`."""
    if name.startswith("markov_head."):
        return name.removeprefix("markov_head.")
    if name.startswith("confidence_head.proj."):
        return name.replace("confidence_head.proj.", "confidence_proj.")
    return "model." + name


@dataclass(frozen=True)
class HFAim:
    """What a variant adds to a DFlash 1 HF checkpoint, for the converter mutants aimed there."""

    config_keys: object  # config.json -> the key paths to set or delete (by the format it is in)
    values: tuple  # JSON values to set them to
    tensors: tuple[str, ...]  # in the names of its safetensors tensors
    respell: object  # a tensor name -> another spelling of it
    extra_tensors: tuple  # (name, dtype, shape): tensors a checkpoint may hold beside them


HF_AIMS: dict[str, HFAim] = {
    "dflash2": HFAim(
        _dflash2_config_keys,
        (0, 1, 2, 3, 5, 8, 17, 32, 64, 65, 2**31, 10**12, -1, 1.5, "4", None, True, False, [], {}, [0], [2], [5],
         [2, 2], "dflash", "dflash2", "dspark", "llama"),
        ("conv", "candidate_selector"),
        lambda name: name.removesuffix(".weight") if name.endswith(".weight") else name + ".weight",
        # speculators' extra tensors: the verifier's copies, a reduced vocabulary's map, mask and head
        (("d2t", "I64", [49152]), ("d2t", "I64", [7]), ("t2d", "BOOL", [49152]), ("t2d", "BOOL", [7]),
         ("embed_tokens.weight", "BF16", [49152, 64]), ("verifier_lm_head.weight", "BF16", [49152, 64]),
         ("lm_head.weight", "BF16", [49152, 64]), ("lm_head.weight", "BF16", [7, 64]),
         ("verifier_norm.weight", "BF16", [64]), ("model.candidate_selector.hidden_projection.weight", "BF16",
                                                  [16, 64]))),
    "dspark": HFAim(
        _dspark_config_keys,
        (0, 1, 2, 4, 8, 16, 31, 32, 33, 64, 256, 65536, 65537, 2**31, 10**12, -1, 1.5, 1e-6, "32", "", None, True,
         False, "true", [], {}, [1], [40, 41, 42], "vanilla", "gated", "rnn", "Vanilla", "dspark", "dflash",
         ["DeepseekV4DSparkModel"], ["Qwen3DSparkModel"], ["DSparkDraftModel"], ["DSparkSpeculator"],
         ["DFlash2DraftModel"]),
        ("markov_head", "confidence_head"),
        _dspark_respelling,
        # the other Markov heads' tensors (gated, rnn), a scale, a reduced vocabulary, DeepSeek-V4's
        # hyper-connections, other embeddings, another variant's tensor
        (("markov_head.gate_proj.weight", "BF16", [32, 160]), ("markov_head.gate_proj.bias", "BF16", [32]),
         ("markov_head.joint_proj.weight", "BF16", [96, 160]), ("markov_head.markov_w2.scale", "F32", [1]),
         ("confidence_proj.weight", "BF16", [1, 96]), ("d2t", "I64", [7]), ("t2d", "BOOL", [49152]),
         ("lm_head.weight", "BF16", [7, 64]), ("embed_tokens.weight", "BF16", [49152, 64]),
         ("mtp.0.hc_attn_fn", "F32", [24, 256]), ("hc_head_base", "F32", [4]),
         ("candidate_selector.hidden_projection.weight", "BF16", [16, 64]))),
}
DTYPE_BYTES = {"I64": 8, "BOOL": 1, "BF16": 2, "F32": 4}


def _variant_config(rng: random.Random, d: Path, aim: HFAim) -> str:
    """One of the variant's config.json keys (where the config's format keeps it) set to an odd value,
    or deleted."""
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    keys = rng.choice(aim.config_keys(cfg))
    delete = rng.random() < 0.15
    return _put(path, cfg, keys, None if delete else rng.choice(aim.values), delete)


def _variant_tensors(rng: random.Random, d: Path, aim: HFAim) -> str:
    """One of the variant's tensors in the safetensors header: shape or dtype changed, deleted, its name
    spelled another way (renamed, or copied); or a tensor a checkpoint may hold beside it added."""
    path = d / "model.safetensors"
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header, data = json.loads(blob[8:8 + n]), blob[8 + n:]
    names = [k for k in header if any(h in k for h in aim.tensors)]
    name = rng.choice(names)
    op = rng.choice(("shape", "dtype", "delete", "spelling", "add", "add"))
    if op == "shape":
        shape = header[name]["shape"]
        j = rng.randrange(len(shape))
        shape[j] = rng.choice((0, 1, shape[j] - 1, shape[j] + 1, shape[j] * 2))
    elif op == "dtype":
        header[name]["dtype"] = rng.choice(("F32", "F16", "I64", "BOOL", "U8"))
    elif op == "delete":  # with its data: the file stays well-formed, the tensor is missing
        b, e = header.pop(name)["data_offsets"]
        for entry in (v for k, v in header.items() if k != "__metadata__" and v["data_offsets"][0] >= e):
            entry["data_offsets"] = [o - (e - b) for o in entry["data_offsets"]]
        data = data[:b] + data[e:]
    elif op == "spelling":
        other = aim.respell(name)
        header[other] = header.pop(name) if rng.random() < 0.5 else dict(header[name])
        name = f"{name} -> {other}"
    else:
        name, dtype, shape = rng.choice(aim.extra_tensors)
        size = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + size]}
        data += bytes(size)  # zeros: d2t offsets 0 (ids 0..k-1), an empty t2d, zero weights
    head = json.dumps(header).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + data)
    return f"model.safetensors {name} {op}"


def mutate_hf_dir(rng: random.Random, seed_dir: Path, out_dir: Path, variant: str = "dflash") -> tuple[str, bool]:
    """Copy the seed draft directory and corrupt it; returns (what, only the weights were touched).
    A variant of HF_AIMS: half the mutants aim at its keys and tensors."""
    shutil.copytree(seed_dir, out_dir)
    aim = HF_AIMS.get(variant)
    if aim is not None and rng.random() < 0.5:
        if rng.random() < 0.6:
            return _variant_config(rng, out_dir, aim), False
        return _variant_tensors(rng, out_dir, aim), True
    kind = rng.choices(("config", "safetensors", "files"), (0.45, 0.45, 0.1))[0]
    if kind == "config":
        return _mutate_config(rng, out_dir), False
    if kind == "safetensors":
        return _mutate_safetensors(rng, out_dir), True
    return _mutate_files(rng, out_dir), False


# --- children ----------------------------------------------------------------------------------------

GGUF_INFO_CHILD = """
import sys
from dflash_llama import gguf_info
try:
    gguf_info(sys.argv[1])
except (ValueError, OSError) as e:
    sys.exit(f"{type(e).__name__}: {e}")
"""

CONVERT_CHILD = """
import sys
from dflash_llama.converter import convert
try:
    convert(sys.argv[1], sys.argv[2], sys.argv[3], outtype="f32")
except (ValueError, OSError) as e:
    sys.exit(f"{type(e).__name__}: {e}")
"""

# after a success, in a child of its own: the weights against the safetensors library's reading
ORACLE_CHILD = """
import sys
from pathlib import Path
src, out, seed_dir, seed_out = sys.argv[1:5]
import numpy as np
import torch
from gguf import GGUFReader
from safetensors import safe_open

def weights(d):
    found = {}
    for p in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})
    return found

try:
    mine = weights(src)
except Exception as e:
    print(f"WRONG: the safetensors library refuses what the converter took: {str(e).splitlines()[0]}")
    sys.exit(0)
seed = weights(seed_dir)
if mine.keys() == seed.keys() and all(torch.equal(mine[k], seed[k]) for k in mine):
    a = {t.name: np.asarray(t.data) for t in GGUFReader(out).tensors}
    b = {t.name: np.asarray(t.data) for t in GGUFReader(seed_out).tensors}
    if a.keys() != b.keys() or any(not np.array_equal(a[k], b[k]) for k in a):
        print("WRONG: the same weights as the seed converted to different tensors")
    else:
        print("EXACT")
"""


@dataclass(frozen=True)
class Options:
    timeout: float = 20.0
    as_limit_gib: float = 6.0  # 0: no limit (AddressSanitizer reserves terabytes of address space)
    cli: str = ""  # llama-dflash-cli; empty: the one of this build
    threads: int = 1


def run_child(cmd: list[str], opts: Options) -> tuple[int | None, str, str]:
    """(exit status or None on timeout, stdout, stderr) of one child under the limits."""
    def limit():
        if opts.as_limit_gib:
            n = int(opts.as_limit_gib * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (n, n))

    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit,
                         start_new_session=True, env=env)
    try:
        out, err = p.communicate(timeout=opts.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return None, "", ""
    return p.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _normalize(line: str) -> str:
    """A stderr line as a cause: no mutant paths, no addresses, short."""
    line = re.sub(r"\S*/(mutant[^/\s]*|corpus)/", "", line)
    line = re.sub(r"0x[0-9a-f]{6,}", "0x...", line)
    return line.strip()[:160]


def classify_exit(rc: int | None, err: str, python: bool, opts: Options) -> tuple[str, str]:
    """(category, cause) of a child's exit, before any check of what it produced."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    first = _normalize(lines[0]) if lines else ""
    if rc is None:
        return "hang", f"timeout after {opts.timeout:g} s"
    sanitizer = next((ln for ln in lines if re.search(r"ERROR: (Address|Leak)Sanitizer|runtime error:", ln)), None)
    if sanitizer:
        return "signal", "ASan: " + _normalize(sanitizer.split("ERROR: ")[-1])
    if rc < 0 or 128 < rc <= 128 + 64:
        n = -rc if rc < 0 else rc - 128
        name = signal.Signals(n).name if n in signal.valid_signals() else f"signal {n}"
        return "signal", f"{name}: {first}" if first else name
    if python and any("Traceback (most recent call last)" in ln for ln in lines):
        return "traceback", _normalize(lines[-1])
    if rc == 0:
        return "ran", ""
    if not lines:
        return "unexplained", f"exit {rc}, nothing on stderr"
    return "clean", _normalize(lines[-1])


@dataclass
class Outcome:
    target: str
    seed: int
    index: int
    mutation: str
    category: str
    cause: str = ""
    names_file: bool = True  # a clean error names the mutated file
    repro: str = ""  # the command that reruns the mutant without the harness
    kept: str = ""  # where the mutant was kept
    variant: str = "dflash"  # of the corpus's draft


@dataclass(frozen=True)
class Job:
    target: str
    seed: int
    index: int
    corpus: Corpus
    opts: Options
    plain_tokens: tuple  # plain greedy tokens of the seed target
    work: str  # scratch folder
    keep: str = ""  # keep failing mutants (or, with always, every one) under this folder
    keep_always: bool = False


def cli_command(opts: Options, target: Path, draft: Path | None, extra: tuple[str, ...] = ()) -> list[str]:
    cli = opts.cli or str(paths.tool("llama-dflash-cli"))
    model = ["-md", str(draft)] if draft else ["--no-draft"]
    return [cli, "-m", str(target), *model, "-p", PROMPT, "-n", str(N_PREDICT), "--json", "-t", str(opts.threads),
            *extra]


# A variant's CLI flags, drawn per mutant after its file. DSpark: a draft every step (`--draft-max`;
# the adaptive policy may decode plainly and never run the Markov chain; 7 fits the seed's block of 8
# in either layout), and one run in two with a confidence threshold (the confidence head runs then
# too, and may cut the draft).
VARIANT_FLAGS = {"dspark": (("--draft-max", "7"), ("--draft-max", "7"), ("--draft-max", "7", "--draft-p-min", "0.3"),
                            ("--draft-max", "7", "--draft-p-min", "0.8"))}


def plain_tokens(opts: Options, target: Path) -> tuple[tuple | None, str, str]:
    """(tokens or None, category, cause) of plain greedy decoding of `target`."""
    rc, out, err = run_child(cli_command(opts, target, None), opts)
    category, cause = classify_exit(rc, err, False, opts)
    if category != "ran":
        return None, category, cause
    try:
        return tuple(json.loads(out)["tokens"]), category, cause
    except (ValueError, KeyError):
        return None, "wrong", "plain decoding printed no JSON result"


# --- one mutant ----------------------------------------------------------------------------------------

def _check_cli(job: Job, out: str, target: Path) -> tuple[str, str]:
    """A run that succeeded must print exactly the tokens of plain greedy decoding of its target."""
    try:
        tokens = tuple(json.loads(out)["tokens"])
    except (ValueError, KeyError):
        return "wrong", "exit 0 without a JSON result"
    if job.target == "draft":
        plain, category, cause = job.plain_tokens, "ran", ""
    else:
        plain, category, cause = plain_tokens(job.opts, target)
    if plain is None:
        if category in ("signal", "hang", "unexplained"):
            return category, f"plain decoding: {cause}"
        return "wrong", f"speculative decoding ran, plain decoding did not: {cause}"
    if tokens != plain:
        return "wrong", f"speculative tokens {list(tokens)} != plain {list(plain)}"
    return "exact", ""


def _run_cli(job: Job, rng: random.Random, scratch: Path) -> tuple[Outcome, list[str]]:
    c = job.corpus
    seed = c.draft_gguf if job.target == "draft" else c.target_gguf
    blob, what = mutate_gguf(seed, rng, extra_keys_for(job.target))
    mutant = scratch / "mutant.gguf"
    mutant.write_bytes(blob)
    target, draft = (c.target_gguf, mutant) if job.target == "draft" else (mutant, c.draft_gguf)
    flags = rng.choice(VARIANT_FLAGS[c.variant]) if c.variant in VARIANT_FLAGS else ()
    cmd = cli_command(job.opts, target, draft, flags)
    rc, out, err = run_child(cmd, job.opts)
    category, cause = classify_exit(rc, err, False, job.opts)
    if category == "ran":
        category, cause = _check_cli(job, out, target)
    return Outcome(job.target, job.seed, job.index, what, category, cause, "mutant" in err), cmd


def _run_gguf_info(job: Job, rng: random.Random, scratch: Path) -> tuple[Outcome, list[str]]:
    which = "draft" if rng.random() < 0.5 else "target"
    seed = job.corpus.draft_gguf if which == "draft" else job.corpus.target_gguf
    blob, what = mutate_gguf(seed, rng, extra_keys_for(which))
    mutant = scratch / "mutant.gguf"
    mutant.write_bytes(blob)
    cmd = [sys.executable, "-c", GGUF_INFO_CHILD, str(mutant)]
    rc, _, err = run_child(cmd, job.opts)
    category, cause = classify_exit(rc, err, True, job.opts)
    outcome = Outcome(job.target, job.seed, job.index, f"{which} {what}", category, cause, "mutant" in err)
    return outcome, [sys.executable, "-c", f"import dflash_llama; dflash_llama.gguf_info({str(mutant)!r})"]


SENTINEL = b"an earlier conversion: a failed one must leave it as it is\n"


def _run_converter(job: Job, rng: random.Random, scratch: Path) -> tuple[Outcome, list[str]]:
    c = job.corpus
    mutant = scratch / "mutant_hf"
    seeds = c.converter_seeds()
    seed_dir = seeds[0] if len(seeds) == 1 else rng.choice(seeds)  # a DFlash 1 corpus draws as before
    what, weights_only = mutate_hf_dir(rng, seed_dir, mutant, c.variant)
    fmt = next((name for name, d in c.formats if d == seed_dir), None)
    if fmt is not None:
        what = f"{fmt} format: {what}"
    (scratch / "out").mkdir()
    out = scratch / "out" / "draft.gguf"
    out.write_bytes(SENTINEL)
    cmd = [sys.executable, "-c", CONVERT_CHILD, str(mutant), str(c.target_gguf), str(out)]
    rc, _, err = run_child(cmd, job.opts)
    category, cause = classify_exit(rc, err, True, job.opts)
    left = sorted(p.name for p in out.parent.iterdir())
    if category == "ran":
        if weights_only:
            category, cause = _check_weights(mutant, out, seed_dir, c.draft_gguf, job.opts)
    elif not out.is_file() or out.read_bytes() != SENTINEL:
        category, cause = "wrong", f"a failed conversion destroyed the existing output ({cause})"
    elif category != "hang" and left != ["draft.gguf"]:
        category, cause = "wrong", f"a failed conversion left {', '.join(left)} behind ({cause})"
    outcome = Outcome(job.target, job.seed, job.index, what, category, cause, "mutant" in err)
    return outcome, [sys.executable, "-c", "from dflash_llama.converter import convert; "
                     f"convert({str(mutant)!r}, {str(c.target_gguf)!r}, {str(out)!r}, outtype='f32')"]


def _check_weights(mutant: Path, out: Path, seed_dir: Path, seed_gguf: Path, opts: Options) -> tuple[str, str]:
    """A converted weights-only mutant of `seed_dir` against the safetensors library's reading of it."""
    oracle = Options(timeout=max(opts.timeout, 120), as_limit_gib=0)  # torch's import is slow under load
    rc, stdout, err = run_child([sys.executable, "-c", ORACLE_CHILD, str(mutant), str(out), str(seed_dir),
                                 str(seed_gguf)], oracle)
    if rc != 0:
        return "wrong", f"the safetensors check failed on the converter's input: {classify_exit(rc, err, True, oracle)}"
    verdict = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    if verdict.startswith("WRONG: "):
        return "wrong", verdict[7:]
    return ("exact", "") if verdict == "EXACT" else ("ran", "")


RUNNERS = {"draft": _run_cli, "target": _run_cli, "gguf_info": _run_gguf_info, "converter": _run_converter}


def reproduction(target: str, seed: int, index: int, variant: str = "dflash") -> str:
    flag = "" if variant == "dflash" else f" --variant {variant}"
    return f"python -m dflash_llama.parity.fuzz{flag} --target {target} --seed {seed} --index {index} --keep DIR"


def mutant_rng(variant: str, target: str, seed: int, index: int) -> random.Random:
    """The random source of one mutant (DFlash 1's as before variants existed)."""
    return random.Random(("" if variant == "dflash" else f"{variant}:") + f"{target}/{seed}/{index}")


def run_mutant(job: Job) -> Outcome:
    """Build mutant (variant, target, seed, index), run it in a child, classify it; keep its files if asked."""
    rng = mutant_rng(job.corpus.variant, job.target, job.seed, job.index)
    scratch = Path(tempfile.mkdtemp(prefix=f"mutant-{job.target}-{job.seed}-{job.index}-", dir=job.work))
    try:
        outcome, cmd = RUNNERS[job.target](job, rng, scratch)  # cmd: the child's call, without the harness
        outcome.variant = job.corpus.variant
        outcome.repro = shlex.join(cmd)
        if job.keep and (job.keep_always or outcome.category in FAILURES):
            kept = Path(job.keep) / f"{job.target}-s{job.seed}-i{job.index}"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(scratch, kept)
            outcome.kept, outcome.repro = str(kept), outcome.repro.replace(str(scratch), str(kept))
            (kept / "repro.txt").write_text(
                f"# {outcome.category}: {outcome.cause}\n# mutation: {outcome.mutation}\n"
                f"# rebuild: {reproduction(job.target, job.seed, job.index, outcome.variant)}\n{outcome.repro}\n")
        return outcome
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --- a campaign ----------------------------------------------------------------------------------------

def split_mutants(total: int, targets: tuple[str, ...] = TARGETS) -> dict[str, int]:
    """`total` mutants over `targets` by SHARES."""
    weight = sum(SHARES[t] for t in targets)
    return {t: max(1, round(total * SHARES[t] / weight)) for t in targets}


def campaign(counts: dict[str, int], seed: int, corpus: Corpus, opts: Options = Options(), jobs: int = 2,
             keep: str | os.PathLike = "", progress: bool = True, work: str | os.PathLike | None = None,
             ) -> list[Outcome]:
    """Run `counts[target]` mutants of each target (indices 0..n-1 of `seed`) on `jobs` workers."""
    import multiprocessing

    from tqdm import tqdm

    plain = ()
    if counts.get("draft"):
        tokens, category, cause = plain_tokens(opts, corpus.target_gguf)
        if tokens is None:
            raise RuntimeError(f"plain decoding of the seed target failed: {category}: {cause}")
        plain = tokens
    with tempfile.TemporaryDirectory(prefix="dflash-fuzz-", dir=work) as scratch:
        todo = [Job(t, seed, i, corpus, opts, plain, scratch, str(keep) if keep else "")
                for t, n in counts.items() for i in range(n)]
        bar = tqdm(total=len(todo), desc="fuzz", unit="mutant", disable=not progress, file=sys.stderr)
        outcomes = []
        if jobs <= 1:
            for job in todo:
                outcomes.append(run_mutant(job))
                bar.update()
        else:
            with multiprocessing.get_context("spawn").Pool(jobs) as pool:
                for outcome in pool.imap_unordered(run_mutant, todo):
                    outcomes.append(outcome)
                    bar.update()
        bar.close()
    return sorted(outcomes, key=lambda o: (TARGETS.index(o.target), o.index))


TITLES = {"draft": "corrupted draft GGUF -> CLI", "target": "corrupted target GGUF -> CLI",
          "gguf_info": "`gguf_info`", "converter": "corrupted HF draft dirs -> converter"}


def summary_table(outcomes: list[Outcome]) -> str:
    """The campaign's table: one row per target, the counts by category (signals by name)."""
    rows = ["| campaign | inputs | clean error | ran (exact / not) | crash by signal | hang | Python traceback "
            "| no message | error not naming the file |", "|---|---|---|---|---|---|---|---|---|"]
    for target in TARGETS:
        mine = [o for o in outcomes if o.target == target]
        if not mine:
            continue
        n = Counter(o.category for o in mine)
        signals = Counter(o.cause.split(":")[0] for o in mine if o.category == "signal")
        sig = f"{n['signal']}" + (f" ({', '.join(f'{c} {s}' for s, c in signals.most_common())})" if signals else "")
        ran = f"{n['exact']} / {n['wrong']}" if target != "gguf_info" else f"{n['ran']}"
        if target == "converter":
            ran = f"{n['ran'] + n['exact']} ({n['exact']} exact) / {n['wrong']}"
        python = target in ("gguf_info", "converter")
        unnamed = sum(1 for o in mine if o.category == "clean" and not o.names_file)
        rows.append(f"| {TITLES[target]} | {len(mine)} | {n['clean']} | {ran} | {sig} | {n['hang']} | "
                    f"{n['traceback'] if python else '-'} | {n['unexplained']} | {unnamed} |")
    return "\n".join(rows)


def failure_causes(outcomes: list[Outcome], limit: int = 40) -> list[str]:
    """The failures grouped by (target, category, cause), the commonest first, with one example each."""
    groups: dict[tuple, list[Outcome]] = {}
    for o in outcomes:
        if o.category in FAILURES:
            groups.setdefault((o.target, o.category, o.cause), []).append(o)
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[:limit]
    return [f"{len(v):5d}  {t:9s} {c:11s} {cause}\n       e.g. {v[0].mutation[:100]}\n       "
            f"{reproduction(t, v[0].seed, v[0].index, v[0].variant)}" for (t, c, cause), v in ranked]


def counts_by_category(outcomes: list[Outcome], target: str) -> dict[str, int]:
    return dict(Counter(o.category for o in outcomes if o.target == target))


# --- the command -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash_llama.parity.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="append", choices=TARGETS, help="a target (repeatable; default all four)")
    p.add_argument("--variant", choices=VARIANTS, default="dflash",
                   help="the draft of the seed pair: DFlash 1 (default), DFlash 2 (its converter seeds in "
                        "z-lab's and speculators' format) or DSpark (DeepSpec's, speculators' and SpecForge's)")
    p.add_argument("--mutants", type=int, default=1000, help="mutants in all, shared over the targets (default 1000)")
    p.add_argument("--per-target", type=int, metavar="N", help="N mutants of each target instead of --mutants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--index", type=int, help="run one mutant only (needs exactly one --target)")
    p.add_argument("--keep", metavar="DIR", help="with --index: keep the mutant and its command line here")
    p.add_argument("--out", metavar="DIR", default="fuzz-findings",
                   help="failing mutants are kept here, each with repro.txt (default ./fuzz-findings)")
    p.add_argument("-j", "--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per child (default 20)")
    p.add_argument("--as-limit-gib", type=float, default=6.0, help="address-space limit per child; 0: none")
    p.add_argument("--cli", help="llama-dflash-cli to run (default: this build's; e.g. build/asan/llama-dflash-cli)")
    p.add_argument("--work", metavar="DIR", help=f"seed corpus cache (default {default_work_dir()}, "
                                                 f"{default_work_dir('dflash2').name} for DFlash 2, ...)")
    p.add_argument("--json", metavar="FILE", help="write every outcome here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    targets = tuple(a.target or TARGETS)
    if a.index is not None and len(targets) != 1:
        sys.exit("fuzz: error: --index needs exactly one --target")
    opts = Options(timeout=a.timeout, as_limit_gib=a.as_limit_gib, cli=a.cli or "")
    corpus = build_corpus(Path(a.work) if a.work else default_work_dir(a.variant), a.variant)
    if a.index is not None:
        plain = plain_tokens(opts, corpus.target_gguf)[0] or () if targets[0] == "draft" else ()
        with tempfile.TemporaryDirectory(prefix="dflash-fuzz-") as scratch:
            o = run_mutant(Job(targets[0], a.seed, a.index, corpus, opts, plain, scratch, a.keep or "", True))
        print(f"{o.category}: {o.cause}\nmutation: {o.mutation}\n{o.repro}")
        return 1 if o.category in FAILURES else 0
    counts = {t: a.per_target for t in targets} if a.per_target else split_mutants(a.mutants, targets)
    outcomes = campaign(counts, a.seed, corpus, opts, a.jobs, a.out,
                        progress=not a.no_progress)
    print(summary_table(outcomes))
    causes = failure_causes(outcomes)
    if causes:
        print(f"\nfailures by cause (mutants kept in {a.out}):")
        print("\n".join(causes))
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(o) for o in outcomes], indent=1) + "\n")
    return 1 if causes else 0


if __name__ == "__main__":
    sys.exit(main())
