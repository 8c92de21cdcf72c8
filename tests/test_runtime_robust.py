"""Every value the runtime reads from a GGUF is checked before use: a bad draft or target is one
line naming the file, the key or tensor, the value and what was expected (ValueError in Python, one
line and a non-zero exit from the CLI), never an abort inside ggml or llama.cpp."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType as V, GGUFWriter

import dflash_llama
from dflash_llama import paths


def rewrite(src: Path, dst: Path, kv: dict | None = None, tensors: dict | None = None, drop=()) -> Path:
    """`dst` = `src` with keys replaced by (value, type[, sub_type]) and tensors by NumPy arrays
    (written with the array's dtype), in the file's order, tensors `drop` left out; a new key or
    tensor is appended."""
    kv, tensors = dict(kv or {}), dict(tensors or {})
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), "unused")
    writer.kv_data[0].clear()  # the writer's own general.architecture: the file's (or the edit's) is written below
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        new = kv.pop(name, None)
        if new is None:
            new = (f.contents(), f.types[0], f.types[-1]) if f.types[0] == V.ARRAY else (f.contents(), f.types[0])
        writer.add_key_value(name, new[0], new[1], sub_type=new[2] if len(new) > 2 else None)
    for name, new in kv.items():
        writer.add_key_value(name, new[0], new[1], sub_type=new[2] if len(new) > 2 else None)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name in drop:
            continue
        if t.name in tensors:
            writer.add_tensor(t.name, tensors.pop(t.name))
        else:
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType(t.tensor_type))
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def tensor_data(path: Path, name: str) -> np.ndarray:
    return np.asarray(next(t for t in GGUFReader(str(path)).tensors if t.name == name).data)


def refused(message: str, target: Path, draft: Path | None = None) -> None:
    """Runtime(...) raises ValueError(`message`) (no abort: it would take this process down) and the CLI
    prints exactly that one line and exits 2 (an input error, the convention of every CLI)."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dflash_llama.Runtime(target, draft, n_threads=1, n_ctx=64)
    args = ["-m", str(target)] + (["-md", str(draft)] if draft else ["--no-draft"])
    res = subprocess.run([str(paths.tool("llama-dflash-cli")), *args, "-p", "hi", "-n", "2", "-t", "1"],
                         capture_output=True, text=True, timeout=120)
    assert (res.returncode, res.stdout) == (2, ""), res.stderr
    assert res.stderr == f"llama-dflash-cli: error: {message}\n"


# --- the draft ------------------------------------------------------------------------------------

I32_KEY = "expected an array of at most 512 integers in 0..512"
DRAFT_KEYS = {  # key -> (planted value, message after "<file>: ")
    "causal as a number": ({"dflash.attention.causal": (1, V.UINT32)},
                           "dflash.attention.causal: u32 1, expected a bool"),
    "causal as a string": ({"dflash.attention.causal": ("yes", V.STRING)},
                           "dflash.attention.causal: str 'yes', expected a bool"),
    "causal as an array": ({"dflash.attention.causal": ([True], V.ARRAY, V.BOOL)},
                           "dflash.attention.causal: array of 1 bool, expected a bool"),
    "rope scaling as an integer": ({"dflash.rope.scaling.type": (1, V.UINT32)},
                                   "dflash.rope.scaling.type: u32 1, expected a string"),
    "architecture as a bool": ({"general.architecture": (True, V.BOOL)},
                               "general.architecture: bool true, expected a string"),
    "target layers as strings": ({"dflash.target_layers": (["1", "2"], V.ARRAY, V.STRING)},
                                 f"dflash.target_layers: array of 2 str, {I32_KEY}"),
    "target layer out of range": ({"dflash.target_layers": ([1, 9999], V.ARRAY, V.INT32)},
                                  f"dflash.target_layers[1]: 9999, {I32_KEY}"),
    "rms epsilon NaN": ({"dflash.attention.layer_norm_rms_epsilon": (float("nan"), V.FLOAT32)},
                        "dflash.attention.layer_norm_rms_epsilon: f32 nan, expected a finite number in 0..1"),
    "rms epsilon negative": ({"dflash.attention.layer_norm_rms_epsilon": (-0.5, V.FLOAT32)},
                             "dflash.attention.layer_norm_rms_epsilon: f32 -0.5, expected a finite number in 0..1"),
    "block size 2^32 + 8": ({"dflash.block_size": (2**32 + 8, V.UINT64)},
                            "dflash.block_size: u64 4294967304, expected an integer in 2..1024"),
    "block size above 2^63": ({"dflash.block_size": (2**63 + 8, V.UINT64)},
                              f"dflash.block_size: u64 {2**63 + 8}, expected an integer in 2..1024"),
    "negative block count": ({"dflash.block_count": (-1, V.INT32)},
                             "dflash.block_count: i32 -1, expected an integer in 1..512"),
    "block count above 512": ({"dflash.block_count": (513, V.UINT32)},
                              "dflash.block_count: u32 513, expected an integer in 1..512"),
    "head count 2^31": ({"dflash.attention.head_count": (2**31, V.UINT32)},
                        "dflash.attention.head_count: u32 2147483648, expected an integer in 1..1024"),
    "kv heads not a divisor": ({"dflash.attention.head_count_kv": (3, V.UINT32)},
                               "dflash.attention.head_count_kv: 3, expected a divisor of "
                               "dflash.attention.head_count (4)"),
    "tokens as integers": ({"tokenizer.ggml.tokens": ([1, 2], V.ARRAY, V.INT32)},
                           "tokenizer.ggml.tokens: array of 2 i32, expected an array of strings"),
    "negative mask token": ({"tokenizer.ggml.mask_token_id": (-3, V.INT32)},
                            "tokenizer.ggml.mask_token_id: i32 -3, expected an integer in 0..2147483647"),
    "infinite rope base": ({"dflash.rope.freq_base": (float("inf"), V.FLOAT32)},
                           "dflash.rope.freq_base: f32 inf, expected a finite number in 1e-30..1e+30"),
    "sample_from_anchor as a string": ({"dflash.sample_from_anchor": ("no", V.STRING)},
                                       "dflash.sample_from_anchor: str 'no', expected a bool"),
}


@pytest.mark.parametrize("case", sorted(DRAFT_KEYS))
def test_a_bad_draft_key_is_one_line(case, tiny_draft_gguf, tiny_target_gguf, tmp_path):
    kv, message = DRAFT_KEYS[case]
    bad = rewrite(tiny_draft_gguf, tmp_path / "bad.gguf", kv=kv)
    refused(f"{bad}: {message}", tiny_target_gguf, bad)


MATRIX_TYPES = ("a float or quantised matrix type (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, "
                "q2_K..q6_K, iq*)")


@pytest.mark.parametrize("name, dtype, expected", [
    ("blk.0.attn_q.weight", np.int32, f"type i32, expected {MATRIX_TYPES}"),  # was a segfault in mul_mat
    ("fc.weight", np.int8, f"type i8, expected {MATRIX_TYPES}"),
    ("blk.0.attn_norm.weight", np.float16, "type f16, expected f32 (a norm or 1-D weight)"),  # was an abort
    ("blk.0.attn_k_norm.weight", np.int32, "type i32, expected f32 (a norm or 1-D weight)"),
], ids=["i32 matrix", "i8 fc", "f16 norm", "i32 norm"])
def test_a_draft_tensor_of_the_wrong_type_is_refused(name, dtype, expected, tiny_draft_gguf, tiny_target_gguf,
                                                      tmp_path):
    data = tensor_data(tiny_draft_gguf, name).astype(dtype)
    bad = rewrite(tiny_draft_gguf, tmp_path / "bad.gguf", tensors={name: data})
    refused(f"{bad}: tensor '{name}': {expected}", tiny_target_gguf, bad)


@pytest.fixture(scope="module")
def reduced_vocab_gguf(tiny_draft_hf, tiny_target_gguf, tmp_path_factory) -> Path:
    from dflash_llama.converter import convert

    return convert(tiny_draft_hf, tiny_target_gguf, tmp_path_factory.mktemp("d2t") / "d2t.gguf", "f32",
                   draft_vocab=64)


def d2t_case(case: str, draft: Path, dst: Path) -> tuple[Path, str]:
    """A broken reduced vocabulary planted in `draft` (which has one) and the message after '<file>: '."""
    d2t = tensor_data(draft, "d2t").astype(np.int64)
    if case == "no own head":
        return rewrite(draft, dst, drop=("output.weight",)), ("tensor 'd2t' (a reduced vocabulary) needs the "
                                                               "draft's own 'output.weight' over its 64 rows")
    if case == "own head, no d2t":
        return rewrite(draft, dst, drop=("d2t",)), (
            "tensor 'output.weight': the runtime uses the target's embeddings and head; a draft with its own is "
            "not supported by this runtime (an own head needs a d2t: a reduced vocabulary)")
    if case == "id past the vocabulary":
        d2t[-1] = 49152
        return rewrite(draft, dst, tensors={"d2t": d2t}), ("d2t maps draft row 63 to token 49152, outside the "
                                                           "target's vocabulary of 49152 tokens")
    if case == "negative id":
        d2t[3] = -1
        return rewrite(draft, dst, tensors={"d2t": d2t}), "tensor 'd2t': entry 3 is -1, not a token id"
    if case == "two rows, one token":
        d2t[5] = d2t[4]
        return rewrite(draft, dst, tensors={"d2t": d2t}), f"d2t maps two draft rows to token {d2t[4]}"
    if case == "i32 ids":
        return (rewrite(draft, dst, tensors={"d2t": d2t.astype(np.int32)}),
                "tensor 'd2t': type i32, expected i64 (token ids)")
    if case == "head rows differ":
        head = tensor_data(draft, "output.weight")[:32]
        return rewrite(draft, dst, tensors={"output.weight": head}), ("tensor 'output.weight' has ne[1] = 32, "
                                                                      "expected 64")
    raise KeyError(case)


@pytest.mark.parametrize("case", ["no own head", "own head, no d2t", "id past the vocabulary", "negative id",
                                  "two rows, one token", "i32 ids", "head rows differ"])
def test_a_broken_reduced_vocabulary_is_one_line(case, reduced_vocab_gguf, tiny_target_gguf, tmp_path):
    bad, message = d2t_case(case, reduced_vocab_gguf, tmp_path / "bad.gguf")
    refused(f"{bad}: {message}", tiny_target_gguf, bad)


def test_a_draft_in_f16_still_loads(tiny_draft_gguf, tiny_target_gguf, tmp_path):
    """The allow-list admits float matrices other than f32 (the type check is not a blanket refusal)."""
    name = "blk.0.ffn_up.weight"
    f16 = rewrite(tiny_draft_gguf, tmp_path / "f16.gguf",
                  tensors={name: tensor_data(tiny_draft_gguf, name).astype(np.float16)})
    rt = dflash_llama.Runtime(tiny_target_gguf, f16, n_threads=1, n_ctx=64)
    assert len(rt.generate("hi", 4).tokens) == 4


def test_a_draft_tensor_with_an_extra_dimension_is_refused(tiny_draft_gguf, tiny_target_gguf, tmp_path):
    name = "output_norm.weight"
    data = tensor_data(tiny_draft_gguf, name)
    bad = rewrite(tiny_draft_gguf, tmp_path / "bad.gguf", tensors={name: np.stack([data, data])})
    refused(f"{bad}: tensor '{name}' has ne[1] = 2, expected 1 dimensions", tiny_target_gguf, bad)


def with_tensor_offset(src: Path, dst: Path, name: str, offset: int) -> tuple[Path, int]:
    """`dst` = `src` with tensor `name`'s data offset (in its tensor-info entry) set to `offset`; returns
    (dst, the offset it had)."""
    info = next(t for t in GGUFReader(str(src)).tensors if t.name == name).field
    at = info.offset + sum(part.nbytes for part in info.parts[:-1])  # the offset is the entry's last part
    raw = bytearray(src.read_bytes())
    old = int.from_bytes(raw[at:at + 8], "little")
    raw[at:at + 8] = offset.to_bytes(8, "little")
    dst.write_bytes(raw)
    return dst, old


@pytest.mark.parametrize("shift", ["misaligned", "another tensor's", "past the end"])
def test_a_draft_tensor_offset_is_checked(shift, tiny_draft_gguf, tiny_target_gguf, tmp_path):
    """gguf refuses offsets that do not tile the data section; the message says which tensor and why."""
    name = "blk.0.attn_q.weight"
    _, old = with_tensor_offset(tiny_draft_gguf, tmp_path / "probe.gguf", name, 0)
    offset = {"misaligned": old + 1, "another tensor's": 0, "past the end": 2**40}[shift]
    bad, _ = with_tensor_offset(tiny_draft_gguf, tmp_path / "bad.gguf", name, offset)
    refused(f"{bad}: not a readable GGUF file (bad magic, corrupt or truncated header): tensor '{name}' has offset "
            f"{offset}, expected {old}", tiny_target_gguf, bad)


@pytest.mark.parametrize("which", ["draft", "target"])
def test_truncated_tensor_data_names_the_tensor(which, tiny_draft_gguf, tiny_target_gguf, tmp_path):
    src = tiny_draft_gguf if which == "draft" else tiny_target_gguf
    reader = GGUFReader(str(src))
    first = min(reader.tensors, key=lambda t: t.data_offset)
    size = first.data_offset + 1000  # inside the first tensor's bytes
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(src.read_bytes()[:size])
    # the first tensor of the file's table whose bytes pass the end of the file
    cut = next(t for t in reader.tensors if t.data_offset + t.n_bytes > size)
    message = (f"{bad}: truncated: tensor '{cut.name}' ends at byte {cut.data_offset + cut.n_bytes} but the file "
               f"has {size}")
    if which == "draft":
        refused(message, tiny_target_gguf, bad)
    else:  # the target pre-check: llama.cpp's loader would say "failed to load model" without naming a tensor
        refused(message, bad)


# --- the target: what llama.cpp's loader would assert on ------------------------------------------

TARGET_KEYS = {
    "block count 0": ({"qwen3.block_count": (0, V.UINT32)},
                      "qwen3.block_count: u32 0, expected an integer in 1..512"),
    "block count 600": ({"qwen3.block_count": (600, V.UINT32)},
                        "qwen3.block_count: u32 600, expected an integer in 1..512"),
    "rope size not the head size": ({"qwen3.rope.dimension_count": (8, V.UINT32)},
                                    "qwen3.rope.dimension_count: 8, expected the head size 16 "
                                    "(llama.cpp's qwen3 graph rotates whole heads)"),
    "rms epsilon -inf": ({"qwen3.attention.layer_norm_rms_epsilon": (float("-inf"), V.FLOAT32)},
                         "qwen3.attention.layer_norm_rms_epsilon: f32 -inf, expected a finite number in 0..1"),
    "rms epsilon NaN": ({"qwen3.attention.layer_norm_rms_epsilon": (float("nan"), V.FLOAT32)},
                        "qwen3.attention.layer_norm_rms_epsilon: f32 nan, expected a finite number in 0..1"),
    "unknown rope scaling": ({"qwen3.rope.scaling.type": ("spiral", V.STRING)},
                             "qwen3.rope.scaling.type: 'spiral', expected none, linear, yarn or longrope"),
    "experts used without experts": ({"qwen3.expert_used_count": (2, V.UINT32)},
                                     "qwen3.expert_used_count: u32 2, expected an integer in 0..0"),
    "causal as a string": ({"qwen3.attention.causal": ("no", V.STRING)},
                           "qwen3.attention.causal: str 'no', expected a bool"),
}


@pytest.mark.parametrize("case", sorted(TARGET_KEYS))
def test_a_bad_target_key_is_one_line(case, tiny_target_gguf, tmp_path):
    kv, message = TARGET_KEYS[case]
    bad = rewrite(tiny_target_gguf, tmp_path / "bad.gguf", kv=kv)
    refused(f"{bad}: {message}", bad)


def test_a_target_with_two_equal_token_strings_is_refused(tiny_target_gguf, tmp_path):
    tokens = list(GGUFReader(str(tiny_target_gguf)).fields["tokenizer.ggml.tokens"].contents())
    tokens[6] = tokens[5]
    bad = rewrite(tiny_target_gguf, tmp_path / "bad.gguf", kv={"tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING)})
    refused(f"{bad}: tokenizer.ggml.tokens[6]: '{tokens[5]}', expected each token string once "
            "(it is also an earlier token)", bad)


@pytest.mark.parametrize("name, dtype, expected", [
    ("blk.0.attn_q.weight", np.int32, f"type i32, expected {MATRIX_TYPES}"),  # was a segfault
    ("token_embd.weight", np.int32, f"type i32, expected {MATRIX_TYPES}"),    # was an abort in get_rows
    ("blk.0.attn_norm.weight", np.float16, "type f16, expected f32 (a norm or 1-D weight)"),
    ("blk.1.attn_q_norm.weight", np.float16, "type f16, expected f32 (a norm or 1-D weight)"),
], ids=["i32 matrix", "i32 embedding", "f16 norm", "f16 q norm"])
def test_a_target_tensor_of_the_wrong_type_is_refused(name, dtype, expected, tiny_target_gguf, tmp_path):
    data = tensor_data(tiny_target_gguf, name).astype(dtype)
    bad = rewrite(tiny_target_gguf, tmp_path / "bad.gguf", tensors={name: data})
    refused(f"{bad}: tensor '{name}': {expected}", bad)


def test_a_non_causal_target_is_refused(tiny_target_gguf, tiny_draft_gguf, tmp_path):
    """With bidirectional attention the verify lets each drafted token see the ones after it:
    speculative output differed from the target's own plain decoding."""
    bad = rewrite(tiny_target_gguf, tmp_path / "bidirectional.gguf", kv={"qwen3.attention.causal": (False, V.BOOL)})
    refused(f"{bad}: qwen3: qwen3.attention.causal is false, expected a causal target (the verify would let "
            "each drafted token see the ones after it, so speculative output would differ from plain decoding)",
            bad, tiny_draft_gguf)


def test_a_non_causal_target_is_refused_without_a_draft_too(tiny_target_gguf, tmp_path):
    """Refused when loaded, whatever the request: plain decoding of it would not be a causal LM either."""
    bad = rewrite(tiny_target_gguf, tmp_path / "bidirectional.gguf", kv={"qwen3.attention.causal": (False, V.BOOL)})
    refused(f"{bad}: qwen3: qwen3.attention.causal is false, expected a causal target (the verify would let "
            "each drafted token see the ones after it, so speculative output would differ from plain decoding)",
            bad)


def test_a_tokenizer_that_does_not_fit_its_vocabulary_is_one_line(tiny_target_gguf, tmp_path):
    """Found by the 10,000-mutant campaign (seed 2028, target 38): llama.cpp's SentencePiece tokenizer
    over this byte-level vocabulary throws std::out_of_range, which said only "unordered_map::at"."""
    bad = rewrite(tiny_target_gguf, tmp_path / "spm.gguf", kv={"tokenizer.ggml.model": ("llama", V.STRING)})
    message = (f"{bad}: its tokenizer (tokenizer.ggml.model 'llama') cannot tokenize the prompt with this "
               "vocabulary (unordered_map::at)")
    rt = dflash_llama.Runtime(bad, n_threads=1, n_ctx=64)  # it loads: the tokenizer fails on use
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        rt.tokenize("hi")
    res = subprocess.run([str(paths.tool("llama-dflash-cli")), "-m", str(bad), "--no-draft", "-p", "hi", "-n", "2",
                          "-t", "1"], capture_output=True, text=True, timeout=120)
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"llama-dflash-cli: error: {message}\n")


CHILD = """
import sys, dflash_llama
try:
    dflash_llama.Runtime(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None, n_threads=1, n_ctx=64)
except ValueError as e:
    print("ValueError:", e)
"""


@pytest.mark.parametrize("which", ["draft", "target"])
def test_a_python_process_survives_a_corrupt_file(which, tiny_draft_gguf, tiny_target_gguf, tmp_path):
    """The inputs that aborted a Python process calling Runtime(...) (rc 134): a ValueError it can catch."""
    if which == "draft":  # an I32 matrix: was a segfault in ggml_compute_forward_mul_mat
        name = "blk.0.attn_q.weight"
        bad = rewrite(tiny_draft_gguf, tmp_path / "bad.gguf",
                      tensors={name: tensor_data(tiny_draft_gguf, name).astype(np.int32)})
        argv, message = [tiny_target_gguf, bad], f"{bad}: tensor '{name}': type i32, expected {MATRIX_TYPES}"
    else:  # block_count 0: was llama.cpp's assert
        bad = rewrite(tiny_target_gguf, tmp_path / "bad.gguf", kv={"qwen3.block_count": (0, V.UINT32)})
        argv, message = [bad], f"{bad}: qwen3.block_count: u32 0, expected an integer in 1..512"
    res = subprocess.run([sys.executable, "-c", CHILD, *map(str, argv)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"ValueError: {message}\n"


def test_a_causal_flag_that_is_true_loads(tiny_target_gguf, tmp_path):
    ok = rewrite(tiny_target_gguf, tmp_path / "causal.gguf", kv={"qwen3.attention.causal": (True, V.BOOL)})
    assert len(dflash_llama.Runtime(ok, None, n_threads=1, n_ctx=64).autoregressive("hi", 2).tokens) == 2


# --- gguf_info: invalid UTF-8 -----------------------------------------------------------------------

def _plant_bytes(path: Path, marker: bytes, replacement: bytes) -> None:
    raw = path.read_bytes()
    assert raw.count(marker) == 1 and len(marker) == len(replacement)
    path.write_bytes(raw.replace(marker, replacement))


def test_gguf_info_invalid_utf8_in_a_value_is_replaced(tiny_draft_gguf, tmp_path):
    bad = rewrite(tiny_draft_gguf, tmp_path / "value.gguf", kv={"general.name": ("abcQQd", V.STRING)})
    _plant_bytes(bad, b"abcQQd", b"abc\xff\xfed")
    assert dflash_llama.gguf_info(bad).metadata["general.name"] == "abc\ufffd\ufffdd"


def test_gguf_info_invalid_utf8_in_a_key_names_the_file(tiny_draft_gguf, tmp_path):
    bad = rewrite(tiny_draft_gguf, tmp_path / "key.gguf", kv={"general.QQname": ("x", V.STRING)})
    _plant_bytes(bad, b"general.QQname", b"general.\xc3\x28name")
    message = f"{bad}: key 'general.\ufffd(name': the name is not valid UTF-8 (a corrupt header)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dflash_llama.gguf_info(bad)


def test_gguf_info_invalid_utf8_in_a_tensor_name_names_the_file(tiny_draft_gguf, tmp_path):
    name = "output_norm.weight"
    bad = rewrite(tiny_draft_gguf, tmp_path / "tensor.gguf")
    _plant_bytes(bad, b"\x00" + name.encode(), b"\x00output_norm.\xed\xa0\x80ght")  # a UTF-16 surrogate
    message = f"{bad}: tensor 'output_norm.\ufffd\ufffd\ufffdght': the name is not valid UTF-8 (a corrupt header)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dflash_llama.gguf_info(bad)


# --- GPU offload -----------------------------------------------------------------------------------

@pytest.mark.parametrize("ngl", [1, -1, -2])
def test_gpu_layers_that_this_build_cannot_offload_are_refused(ngl, tiny_target_gguf, tiny_draft_gguf):
    """-ngl on a CPU build, or below -1, is a one-line error (llama.cpp's tools only warn and go on
    on the CPU), from Runtime, llama-dflash-cli, run and generate alike; a GPU build takes -ngl 1 and -1."""
    if ngl >= -1 and dflash_llama.supports_gpu_offload():
        rt = dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=1, n_ctx=64, n_gpu_layers=ngl)
        assert rt.generate("hi", 4).tokens == rt.autoregressive("hi", 4).tokens
        return
    message = (f"n_gpu_layers {ngl}: this build has no GPU backend (build with GGML_CUDA=ON ./setup.sh)" if ngl >= -1
               else f"n_gpu_layers must be at least -1 (-1: all layers), got {ngl}")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dflash_llama.Runtime(tiny_target_gguf, tiny_draft_gguf, n_threads=1, n_ctx=64, n_gpu_layers=ngl)
    res = subprocess.run([str(paths.tool("llama-dflash-cli")), "-m", str(tiny_target_gguf), "-md",
                          str(tiny_draft_gguf), "-ngl", str(ngl), "-p", "hi", "-n", "2", "-t", "1"],
                         capture_output=True, text=True, timeout=120)
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"llama-dflash-cli: error: {message}\n")
    cli = [sys.executable, "-m", "dflash_llama.cli"]
    for sub in (["generate", "-m", str(tiny_target_gguf), "-md", str(tiny_draft_gguf)],
                ["run", "-m", str(tiny_target_gguf), "-md", str(tiny_draft_gguf)]):
        res = subprocess.run([*cli, *sub, "-ngl", str(ngl), "-p", "hi", "-n", "2", "-t", "1"],
                             capture_output=True, text=True, timeout=300)
        assert (res.returncode, res.stdout, res.stderr) == (2, "", f"dflash-llama {sub[0]}: error: {message}\n")


def test_the_reference_engine_refuses_gpu_layers(tiny_target_gguf, tiny_draft_hf):
    res = subprocess.run([sys.executable, "-m", "dflash_llama.cli", "generate", "--engine", "reference", "-m",
                          str(tiny_target_gguf), "-md", str(tiny_draft_hf), "-ngl", "1", "-p", "hi", "-n", "2"],
                         capture_output=True, text=True, timeout=300)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == ("dflash-llama generate: error: -ngl 1: the reference engine runs on the CPU; "
                          "-ngl is for --engine runtime\n")
