"""HF DFlash draft -> GGUF, in the layout the pinned llama.cpp reads (see dflash_llama.schema).

Reads like a llama.cpp conversion class: check everything first (`make_plan`), then write the
keys, the target's tokenizer and the tensors mapped by the table (`write_gguf`). The values are
those of the pinned `convert_hf_to_gguf.py` bit for bit (f32/f16/bf16) and q8_0 byte for byte:
same widening to float32, same gguf-py quantisers, same rule for which tensors stay f32.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFWriter, LlamaFileType

from dflash_llama import schema as L
from dflash_llama.schema import DraftHParams

from .checkpoint import ConversionError, SourceTensor, read_config, read_tensors
from .target import TargetInfo, TokenizerField, read_target
from .vocabulary import choose_tokens, head_rows, same_as_target

log = logging.getLogger("dflash_llama.converter")

# --outtype -> (type of quantisable tensors, general.file_type), written by us
NATIVE_OUTTYPES = {
    "f32": (Q.F32, LlamaFileType.ALL_F32),
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
# --outtype handled by the pinned llama-quantize from an f32 conversion (types needing no imatrix)
QUANTIZE_OUTTYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l",
                     "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")
OUTTYPES = ("auto", *NATIVE_OUTTYPES, *QUANTIZE_OUTTYPES)
MAX_TENSOR_NAME = 256  # DFlash tensor names are < 64 characters; a longer one is unexpected, not parsed


@dataclass(frozen=True)
class Plan:
    """Everything checked and decided before the output file is opened."""

    draft_dir: Path
    config: DraftHParams  # target_layer_ids resolved
    target: TargetInfo
    tensors: list[tuple[str, SourceTensor | Rows]]  # (GGUF name, source), in writing order
    vocabulary: np.ndarray | None = None  # a reduced vocabulary: the target ids the head keeps, ascending
    own_head: Rows | None = None  # ... its rows from the checkpoint (else from the target's head)


@dataclass(frozen=True)
class Rows:
    """Rows of a checkpoint tensor, in the order a reduced vocabulary's ascending ids want them: a
    head saved beside a `d2t` (`lm_head.weight` [K, n_embd], as speculators saves one) or a DSpark
    draft's `markov_w2`, where row `rows[i]` stands for the i-th id; or a whole-vocabulary markov_w2's
    rows of the ids `--draft-vocab` keeps."""

    source: SourceTensor
    rows: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.source.shape[1:])

    @property
    def dtype(self) -> str:
        return self.source.dtype

    def load_f32(self) -> np.ndarray:
        return np.ascontiguousarray(self.source.load_f32()[self.rows])


def convert(draft_dir: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike,
            outtype: str = "auto", draft_vocab: int = 0) -> Path:
    """Convert a DFlash draft checkpoint; `target` is the target's GGUF or HF directory.

    draft_vocab K > 0: a reduced vocabulary of K target tokens (`d2t` and the target head's rows, or
    the draft's own head's, as the draft's own `output.weight`, a DSpark draft's markov_w2 cut to the
    same rows; see `vocabulary`); 0: the draft uses the target's whole head.

    Raises ConversionError for bad input. The output appears only when complete (written to a
    temporary file in the same directory, then renamed); a failure leaves nothing behind.
    """
    if outtype not in OUTTYPES:
        raise ConversionError(f"unknown outtype {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    out = Path(out)
    if not out.parent.is_dir():
        raise ConversionError(f"output directory {out.parent} does not exist")
    if out.is_dir():
        raise ConversionError(f"output {out} is a directory: name the GGUF file to write")
    plan = make_plan(Path(draft_dir), target)
    if draft_vocab and plan.vocabulary is not None:
        raise ConversionError(f"--draft-vocab {draft_vocab}: the checkpoint {draft_dir} has a reduced vocabulary of "
                              f"its own ({len(plan.vocabulary)} tokens, d2t)")
    if draft_vocab:  # the rows of the kept tokens: of the draft's own head if it has one, of its W2 (DSpark)
        ids = choose_tokens(plan.target, draft_vocab)
        own = next((src for name, src in plan.tensors if name == "output.weight"), None)
        plan = dataclasses.replace(plan, vocabulary=ids, own_head=None if own is None else Rows(own, ids),
                                   tensors=[t for t in _markov_rows(plan.tensors, ids) if t[0] != "output.weight"])
    if outtype == "auto":
        outtype = _guess_outtype(plan)
    if outtype in NATIVE_OUTTYPES:
        with _atomic(out) as tmp:
            write_gguf(plan, tmp, outtype)
    else:
        with _atomic(out) as tmp:
            f32 = tmp.with_suffix(".f32.tmp")
            try:
                write_gguf(plan, f32, "f32")
                _llama_quantize(f32, tmp, outtype)
            finally:
                f32.unlink(missing_ok=True)
    return out


# --- checks ---------------------------------------------------------------------------------------

def make_plan(draft_dir: Path, target: str | os.PathLike) -> Plan:
    where = str(draft_dir / "config.json")
    raw = read_config(draft_dir)
    try:
        cfg = DraftHParams.from_hf_config(raw, where)
    except ValueError as e:
        raise ConversionError(str(e)) from e
    config = L.normalized_hf_config(raw)  # speculators' format, read as z-lab's
    if (draft_dir / "mask_embedding.pt").exists():
        raise ConversionError(f"{draft_dir}: drafts with their own mask_embedding.pt are not supported yet")
    tensors = read_tensors(draft_dir)
    if L.checkpoint_format(raw) == "speculators":
        _drop_verifier_copies(tensors)
    tgt = read_target(target)
    vocabulary, own_head, order = _checkpoint_vocabulary(draft_dir, config, tensors, tgt, cfg.n_embd)
    if cfg.variant is L.DSPARK or cfg.sample_from_anchor:  # (a reduced vocabulary's own head taken above)
        _own_copies(draft_dir, tensors, tgt)

    if cfg.n_embd != tgt.hidden:
        raise ConversionError(f"{where}: hidden size mismatch: the draft has hidden_size {cfg.n_embd}, "
                              f"the target {tgt.path} has {tgt.hidden}")
    if cfg.n_vocab is not None and cfg.n_vocab != tgt.vocab:
        raise ConversionError(f"{where}: vocab size mismatch: the draft has vocab_size {cfg.n_vocab}, "
                              f"the target {tgt.path} has {tgt.vocab} tokens")
    if cfg.mask_token_id >= tgt.vocab:
        raise ConversionError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the vocabulary of "
                              f"the target {tgt.path} ({tgt.vocab} tokens)")
    if cfg.n_layer_target is not None and cfg.n_layer_target != tgt.n_layer:
        raise ConversionError(f"{where}: target depth mismatch: the draft was made for a target with "
                              f"{cfg.n_layer_target} layers (num_target_layers), "
                              f"{tgt.path} has {tgt.n_layer}")
    ids = cfg.target_layer_ids
    if ids is None:
        ids = L.default_target_layer_ids(cfg.n_layer_target or tgt.n_layer, cfg.n_layer)
    bad = [i for i in ids if not 0 <= i < tgt.n_layer]
    if bad:
        raise ConversionError(f"{where}: target layer id {bad[0]} is out of range: the target {tgt.path} has "
                              f"{tgt.n_layer} layers (valid ids 0..{tgt.n_layer - 1})")

    if cfg.target_layer_ids is None:
        log.warning("no target_layer_ids in %s: the published default rule chose target layers %s (written as "
                    "%s %s); z-lab, SGLang and lmdeploy now require the key, since only the training knows "
                    "the layers: add dflash_config.target_layer_ids to be sure", where, ids, L.TARGET_LAYERS,
                    L.target_layers_from_ids(ids))
    lattice = cfg.selector_top_k * (cfg.selector_top_k + 1)
    if cfg.n_embd < lattice:
        log.warning("selector_top_k %d needs hidden_size >= %d in the pinned llama.cpp, which refuses this "
                    "file (\"DFlash2 hidden size is too small for the selector lattice\")",
                    cfg.selector_top_k, lattice)

    if tgt.n_layer - 1 in ids:
        log.warning("target layer id %d is the target's last layer: the pinned llama.cpp captures the "
                    "input of layer id + 1, which does not exist, and its draft-dflash aborts on this "
                    "file (\"layer input tensor is null\")", tgt.n_layer - 1)

    cfg = dataclasses.replace(cfg, target_layer_ids=list(ids))
    dims = cfg.dims(tgt.vocab, None if vocabulary is None else len(vocabulary))
    mapped = _map_tensors(cfg, tensors, dims, draft_dir)
    scale = next((src for name, src in mapped if name == L.MARKOV_SCALE), None)
    if scale is not None:
        try:
            L.markov_scale(scale.load_f32())
        except ValueError as e:
            raise ConversionError(f"{draft_dir}: {e}") from e
    if order is not None:  # a DSpark checkpoint's W2 over its d2t's rows: in the ascending ids' order
        mapped = _markov_rows(mapped, order)
    return Plan(draft_dir, cfg, tgt, mapped, vocabulary, own_head)


def _markov_rows(tensors: list[tuple[str, SourceTensor | Rows]], rows: np.ndarray) -> list:
    """`tensors` with a DSpark draft's markov_w2 (if any) cut to `rows`: W2's rows are the draft's tokens."""
    return [(name, Rows(src, rows) if name == "markov_w2.weight" else src) for name, src in tensors]


# speculators' copies of what the verifier owns (frozen, reloaded from the verifier; which of them a
# checkpoint holds depends on the speculators version): the draft borrows the target's own
_VERIFIER_COPIES = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def _drop_verifier_copies(tensors: dict[str, SourceTensor]) -> None:
    """Take a speculators checkpoint's verifier copies out of `tensors`, and its `lm_head.weight` unless
    a `d2t` makes that the head of a reduced vocabulary (speculators saves it then, and only then: the
    full-vocabulary one "is the exact frozen verifier projection")."""
    reduced = _named(tensors, L.D2T) is not None
    for name in list(tensors):
        base = name.removeprefix("model.")
        if base in _VERIFIER_COPIES or (base == "lm_head.weight" and not reduced):
            del tensors[name]


def _own_copies(draft_dir: Path, tensors: dict[str, SourceTensor], tgt: TargetInfo) -> None:
    """A DSpark-family checkpoint's own embeddings and head (DeepSpec saves copies of the target's):
    a copy of the target's is dropped (the draft borrows the target's); a head that differs stays,
    written as the draft's `output.weight` (the pinned converter drops it whatever it holds); other
    embeddings than the target's are refused (the draft's block embeds with the target's)."""
    for name, embeddings in (("embed_tokens.weight", True), ("lm_head.weight", False)):
        key = _named(tensors, name)
        if key is None:
            continue
        own = tensors[key]
        if own.shape != (tgt.vocab, tgt.hidden):
            raise ConversionError(f"{draft_dir}: tensor {key!r} has shape {list(own.shape)}, expected "
                                  f"[{tgt.vocab}, {tgt.hidden}] (the target's vocabulary and hidden size)")
        same = same_as_target(own, tgt, embeddings)
        if same is None:
            log.warning("%s: the target %s is quantized: its %s cannot be compared with the draft's %s; the "
                        "draft's is %s", draft_dir, tgt.path, "embeddings" if embeddings else "head", key,
                        "dropped" if embeddings else "kept")
        if same or (same is None and embeddings):
            del tensors[key]
        elif embeddings:
            raise ConversionError(f"{draft_dir}: tensor {key!r} differs from the target's token embeddings: a draft "
                                  "with embeddings of its own is not supported")


def _named(tensors: dict[str, SourceTensor], name: str) -> str | None:
    """The key of the checkpoint tensor `name` (spelled with or without a `model.` prefix), if any."""
    return next((n for n in (name, "model." + name) if n in tensors), None)


def _pop(tensors: dict[str, SourceTensor], name: str) -> SourceTensor | None:
    key = _named(tensors, name)
    return None if key is None else tensors.pop(key)


def _checkpoint_vocabulary(draft_dir: Path, config: dict, tensors: dict[str, SourceTensor], tgt: TargetInfo,
                           n_embd: int) -> tuple[np.ndarray | None, Rows | None, np.ndarray | None]:
    """A checkpoint's own reduced vocabulary (taken out of `tensors`): its `d2t` as EAGLE-3, DSpark and
    speculators store it, offsets (target id = i + d2t[i]), and `draft_vocab_size`; the ids, absolute,
    ascending and checked, its own head if it saved one (`lm_head.weight`), and the checkpoint rows
    of the ascending ids (a DSpark draft's markov_w2 is over its rows too). A `t2d` (speculators:
    the same map as a mask over the target's vocabulary) is checked against the `d2t`, then dropped,
    as the pinned converter drops it."""
    src, t2d = _pop(tensors, L.D2T), _pop(tensors, "t2d")
    size = config.get(L.DRAFT_VOCAB_SIZE)
    if src is None:
        if size not in (None, tgt.vocab) and not isinstance(size, bool):
            raise ConversionError(f"{draft_dir}: config.json has {L.DRAFT_VOCAB_SIZE} = {size!r} but the checkpoint "
                                  f"has no d2t tensor mapping its rows to the target's vocabulary")
        if t2d is not None:
            raise ConversionError(f"{draft_dir}: tensor 't2d' without a 'd2t': a reduced vocabulary needs both")
        return None, None, None
    if len(src.shape) != 1 or (size is not None and size != src.shape[0]):
        raise ConversionError(f"{draft_dir}: tensor 'd2t' has shape {list(src.shape)}, expected "
                              f"[{size if size is not None else 'draft_vocab_size'}]")
    ids = np.arange(src.shape[0], dtype=np.int64) + src.load_ints()
    if ids.size == 0 or ids.min() < 0 or ids.max() >= tgt.vocab or np.unique(ids).size != ids.size:
        raise ConversionError(f"{draft_dir}: tensor 'd2t' must map its {ids.size} rows to distinct token ids of the "
                              f"target's vocabulary of {tgt.vocab} (as offsets: id = row + d2t[row])")
    if t2d is not None and (t2d.shape != (tgt.vocab,) or not np.array_equal(np.flatnonzero(t2d.load_ints()),
                                                                             np.sort(ids))):
        raise ConversionError(f"{draft_dir}: tensor 't2d' (shape {list(t2d.shape)}) must mark exactly the "
                              f"{ids.size} tokens of the 'd2t' among the target's {tgt.vocab}")
    head = _pop(tensors, "lm_head.weight")
    if head is not None and head.shape != (ids.size, n_embd):
        raise ConversionError(f"{draft_dir}: tensor 'lm_head.weight' has shape {list(head.shape)}, expected "
                              f"[{ids.size}, {n_embd}] (the head of the reduced vocabulary its 'd2t' maps)")
    order = np.argsort(ids)
    return ids[order], None if head is None else Rows(head, order), order


def _map_tensors(cfg: DraftHParams, tensors: dict[str, SourceTensor], dims: dict[str, int],
                 draft_dir: Path) -> list[tuple[str, SourceTensor]]:
    mapped, source_of = [], {}
    for hf_name, src in tensors.items():
        hit = L.gguf_tensor_name(hf_name) if len(hf_name) <= MAX_TENSOR_NAME else None
        if hit is None:
            raise ConversionError(f"{draft_dir}: unexpected tensor {hf_name!r}: not part of a "
                                  f"{cfg.variant.title} draft")
        name, spec = hit
        if spec.head and cfg.variant.has(spec.head) and spec.head not in cfg.heads:
            raise ConversionError(f"{draft_dir}: tensor {hf_name!r} is a {spec.head} head's, but config.json says "
                                  f"the draft has none (enable_confidence_head)")
        if spec.head and not cfg.variant.has(spec.head):
            title = next(v.title for v in L.VARIANTS.values() if v.has(spec.head))
            raise ConversionError(f"{draft_dir}: tensor {hf_name!r} belongs to a {title} draft, but config.json "
                                  f"describes a {cfg.variant.title} draft (architectures, dflash_config)")
        if name in source_of:  # e.g. a codebook spelled with and without `.weight`
            raise ConversionError(f"{draft_dir}: tensors {source_of[name]!r} and {hf_name!r} are one tensor ({name}): "
                                  "keep one")
        source_of[name] = hf_name
        layer = L.layer_index(name)
        if layer is not None and layer >= cfg.n_layer:
            raise ConversionError(f"{draft_dir}: tensor {hf_name!r} is beyond num_hidden_layers = {cfg.n_layer}")
        want = tuple(reversed(L.expected_shape(spec, dims)))  # PyTorch order
        if src.shape != want:
            hint = (" (fc input must be len(target_layer_ids) * hidden_size)" if name == "fc.weight" else
                    " (one row per token of the target's vocabulary)" if "n_vocab" in spec.shape else "")
            raise ConversionError(f"{draft_dir}: tensor {hf_name!r} has shape {list(src.shape)}, "
                                  f"config.json implies {list(want)}{hint}")
        mapped.append((name, src))
    have = {name for name, _ in mapped}
    for spec in cfg.tensor_specs():
        for bid in range(cfg.n_layer) if "{bid}" in spec.gguf else [None]:
            name = spec.gguf.format(bid=bid)
            if name not in have:
                raise ConversionError(f"{draft_dir}: missing tensor {spec.hf.format(bid=bid)!r} ({name})")
    return mapped


def _guess_outtype(plan: Plan) -> str:
    """Like the pinned converter's "auto": the 16-bit type of the first matrix, else f16."""
    for _, src in plan.tensors:
        if len(src.shape) >= 2:
            return {"BF16": "bf16", "F16": "f16"}.get(src.dtype, "f16")
    return "f16"


# --- writing --------------------------------------------------------------------------------------

def tensor_data(name: str, src: SourceTensor, cfg: DraftHParams, qtype: Q) -> tuple[np.ndarray, Q]:
    """One tensor as written: widened to float32, reordered if needed, then stored as `qtype`
    unless the pinned converter keeps it f32; q8_0 falls back to f16 on rows not a multiple of 32."""
    data = src.load_f32()
    if not cfg.rope_neox and L.is_rope_permuted(name):  # interleaved RoPE pairs -> NeoX halves
        data = np.ascontiguousarray(data[L.rope_halves_order(data.shape[0], cfg.head_dim)])
    if L.stays_f32(name, data.ndim):
        qtype = Q.F32
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:
        return gguf.quants.quantize(data, Q.F16), Q.F16


def write_gguf(plan: Plan, path: Path, outtype: str) -> None:
    qtype, file_type = NATIVE_OUTTYPES[outtype]
    tokenizer: list[TokenizerField] = plan.target.tokenizer_fields()

    writer = GGUFWriter(path=None, arch=L.ARCH)  # writes general.architecture = "dflash"
    writer.add_key_value(L.GENERAL_TYPE, "model", L.STR)
    # general.name, size_label, license...: gguf-py's model-card reader, as the pinned converter
    n_params = sum(math.prod(src.shape) for _, src in plan.tensors)
    try:  # gguf-py reads README.md, config.json and generation_config.json its own way
        card = gguf.Metadata.load(None, plan.draft_dir.resolve(), None, n_params)
        card.name = card.name or plan.draft_dir.resolve().name
        card.size_label = card.size_label or gguf.size_label(n_params, 0, 0, 0)
        card.set_gguf_meta_model(writer)
    except Exception as e:  # yaml, JSON, a wrong type in the model card: any of gguf-py's errors
        raise ConversionError(f"{plan.draft_dir}: unreadable model card (README.md, config.json or "
                              f"generation_config.json, read by gguf-py): {type(e).__name__}: {e}") from e
    for key, value in plan.config.to_gguf_kv(int(file_type), mrope=plan.target.uses_mrope):  # the pinned order
        _add(writer, key, value)
    for f in tokenizer:
        if f.key != L.MASK_TOKEN_ID:  # the draft's own MASK wins over a target's
            writer.add_key_value(f.key, f.value, f.type, f.element)
    _add(writer, L.MASK_TOKEN_ID, plan.config.mask_token_id)

    for name, src in plan.tensors:
        data, stored_as = tensor_data(name, src, plan.config, qtype)
        writer.add_tensor(name, data, raw_dtype=stored_as)
    if plan.vocabulary is not None:  # after the layers, as the pinned converter writes d2t
        rows = plan.own_head.load_f32() if plan.own_head else head_rows(plan.target, plan.vocabulary)
        try:
            writer.add_tensor("output.weight", gguf.quants.quantize(rows, qtype), raw_dtype=qtype)
        except gguf.QuantError:
            writer.add_tensor("output.weight", gguf.quants.quantize(rows, Q.F16), raw_dtype=Q.F16)
        writer.add_tensor(L.D2T, plan.vocabulary.astype(np.int64), raw_dtype=Q.I64)

    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: GGUFWriter, key: str, value) -> None:
    spec = L.KEY[key]
    if spec.type == L.ARR:
        writer.add_key_value(key, list(value), spec.type, spec.element)
    else:
        writer.add_key_value(key, value, spec.type)


class _atomic:
    """A temporary path next to `final`, renamed onto it on success and removed on failure."""

    def __init__(self, final: Path):
        self.final = final

    def __enter__(self) -> Path:
        try:
            fd, name = tempfile.mkstemp(dir=self.final.parent, prefix=f".{self.final.name}.", suffix=".tmp")
        except OSError as e:
            raise ConversionError(f"cannot write in {self.final.parent}: {e.strerror or e}") from e
        os.close(fd)
        self.tmp = Path(name)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and self.tmp.exists():
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(self.tmp, 0o666 & ~umask)  # mkstemp makes it private; give it a normal file's mode
                os.replace(self.tmp, self.final)
        finally:
            self.tmp.unlink(missing_ok=True)  # gone already when renamed


def _llama_quantize(src: Path, dst: Path, outtype: str) -> None:
    from dflash_llama import peers

    try:
        peers.quantize(src, dst, outtype)
    except (FileNotFoundError, ImportError) as e:
        raise ConversionError(f"--outtype {outtype} needs the pinned llama-quantize: {e}") from e
    except peers.PeerError as e:
        tail = " | ".join(str(e).splitlines()[-3:])
        raise ConversionError(f"llama-quantize {outtype.upper()} failed: {tail}") from e
