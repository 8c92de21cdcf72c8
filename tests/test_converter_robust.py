"""The converter is bounded and total: every corrupt draft directory is one ConversionError line, in
bounded time and memory, and an existing output survives it. Ends with a small mutation campaign."""

from __future__ import annotations

import json
import random
import shutil
import signal
from contextlib import contextmanager

import pytest

from dflash_llama import cli, gguf_info
from dflash_llama.converter import ConversionError, conversion, convert

PREVIOUS = b"previous conversion"


@pytest.fixture
def draft(tiny_draft_hf, tmp_path):
    """A private copy of the tiny draft, free to damage."""
    return shutil.copytree(tiny_draft_hf, tmp_path / "draft")


@contextmanager
def time_bound(seconds: int, what: str):
    """Fail (not hang) when the body runs past `seconds`."""
    def hang(signum, frame):
        raise AssertionError(f"{what}: still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def edit_config(draft_dir, text: str | None = None, **changes):
    path = draft_dir / "config.json"
    if text is not None:
        path.write_text(text)
        return
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if "." in key:  # one level down: dflash_config.mask_token_id
            outer, inner = key.split(".")
            config[outer][inner] = value
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def read_st(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_st(path, header, body, pad: int = 0, n_delta: int = 0):
    """A safetensors file with `header` (padded to 8 bytes, plus `pad` spaces) and a header length off by n_delta."""
    h = json.dumps(header).encode()
    h += b" " * ((-len(h) % 8) + pad)
    path.write_bytes((len(h) + n_delta).to_bytes(8, "little") + h + body)


def fails(draft_dir, target, tmp_path, match):
    """convert raises a one-line ConversionError matching `match` within 30 s; the old output is untouched."""
    out = tmp_path / "out" / "draft.gguf"
    out.parent.mkdir(exist_ok=True)
    out.write_bytes(PREVIOUS)
    with time_bound(30, "convert"), pytest.raises(ConversionError, match=match) as e:
        convert(draft_dir, target, out, "f32")
    assert "\n" not in str(e.value)
    assert list(out.parent.iterdir()) == [out]  # no temporary file left
    assert out.read_bytes() == PREVIOUS


# --- sizes and counts bounded before anything is allocated ----------------------------------------

@pytest.mark.parametrize("key, value, match", [
    ("num_hidden_layers", 10**12, r"num_hidden_layers = 1000000000000: expected an integer in 1\.\.512"),
    ("num_hidden_layers", -3, r"num_hidden_layers = -3: expected an integer in 1\.\.512"),
    ("num_attention_heads", 10**9, r"num_attention_heads = 1000000000: expected an integer in 1\.\.1024"),
    ("num_key_value_heads", 0, r"num_key_value_heads = 0: expected an integer in 1\.\.1024"),
    ("hidden_size", 2**40, r"hidden_size = 1099511627776: expected an integer in 1\.\.65536"),
    ("intermediate_size", 2**63, r"intermediate_size = 9223372036854775808: expected an integer in 1\.\.1048576"),
    ("head_dim", 4096, r"head_dim = 4096: expected an integer in 2\.\.1024"),
    ("block_size", 1, r"block_size = 1: expected an integer in 2\.\.1024"),
    ("vocab_size", 2**31, r"vocab_size = 2147483648: expected an integer in 1\.\.2147483647"),
    ("max_position_embeddings", 2**32 + 8, r"max_position_embeddings = 4294967304: expected an integer in 1\.\."),
    ("num_target_layers", 10**15, r"num_target_layers = 1000000000000000: expected an integer in 1\.\.512"),
    ("dflash_config.mask_token_id", -1, r"mask_token_id = -1: expected an integer in 0\.\.2147483647"),
    ("dflash_config.target_layer_ids", list(range(600)), r"target_layer_ids = \[0, 1, .*\.\.\.: expected a list "
                                                         r"of 1\.\.512 target layer ids"),
    ("dflash_config.target_layer_ids", [2**40], r"target_layer_ids = 1099511627776: expected an integer in "),
    ("layer_types", ["full_attention"] * 100_000, r"layer_types has 100000 entries for 1 layers"),
])
def test_sizes_are_bounded(draft, tiny_target_gguf, tmp_path, key, value, match):
    edit_config(draft, **{key: value})
    fails(draft, tiny_target_gguf, tmp_path, r"config\.json: " + match)


def test_sliding_window_is_bounded(draft, tiny_target_gguf, tmp_path):
    edit_config(draft, use_sliding_window=True, sliding_window=2**40, max_window_layers=0)
    fails(draft, tiny_target_gguf, tmp_path, r"sliding_window = 1099511627776: expected an integer in 1\.\.2147483647")


@pytest.mark.parametrize("key, value, match", [
    ("rms_norm_eps", -1e-6, r"rms_norm_eps = -1e-06: expected a finite number in \(0, 1\]"),
    ("rms_norm_eps", 1e-50, r"rms_norm_eps = 1e-50: expected a finite number in \(0, 1\]"),  # 0 as a float32
    ("rope_theta", 0, r"rope_theta = 0: expected a finite number in \(0, 1e\+12\]"),
    ("dflash_config.output_multiplier", 1e300, r"output_multiplier = 1e\+300: expected a finite number"),
    ("partial_rotary_factor", 2.0, r"partial_rotary_factor = 2\.0: expected a finite number in \(0, 1\]"),
])
def test_floats_are_finite_and_bounded(draft, tiny_target_gguf, tmp_path, key, value, match):
    edit_config(draft, **{key: value})
    fails(draft, tiny_target_gguf, tmp_path, match)


# --- JSON: depth, strictness, types ---------------------------------------------------------------

def test_deeply_nested_config(draft, tiny_target_gguf, tmp_path):
    edit_config(draft, text='{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    fails(draft, tiny_target_gguf, tmp_path, r"config\.json: not valid JSON here: nested more than 64 levels deep")


def test_deeply_nested_value_in_a_valid_config(draft, tiny_target_gguf, tmp_path):
    deep: list = []
    for _ in range(70):
        deep = [deep]
    edit_config(draft, extra=deep)
    fails(draft, tiny_target_gguf, tmp_path, r"config\.json: not valid JSON here: nested more than 64 levels")


@pytest.mark.parametrize("text, match", [
    ('{"hidden_size": NaN}', r"not valid JSON \(NaN is not a JSON number\)"),
    ('{"hidden_size": 1e999}', r"not valid JSON \(number 1e999 is out of range\)"),
    ('{"hidden_size": 1, "hidden_size": 2}', r"not valid JSON \(key 'hidden_size' appears twice\)"),
    ('{"hidden_size": ' + "9" * 5000 + "}", r"not valid JSON \(Exceeds the limit"),
    ("[1, 2]", r"not a JSON object"),
])
def test_strict_json(draft, tiny_target_gguf, tmp_path, text, match):
    edit_config(draft, text=text)
    fails(draft, tiny_target_gguf, tmp_path, r"config\.json: " + match)


def test_non_utf8_config(draft, tiny_target_gguf, tmp_path):
    (draft / "config.json").write_bytes(b'{"hidden_size": "\xff"}')
    fails(draft, tiny_target_gguf, tmp_path,
          r"config\.json: not valid JSON \(not UTF-8: invalid start byte at byte 17\)")


@pytest.mark.parametrize("key, value, match", [
    ("hidden_size", {"a": 1}, r"hidden_size = \{'a': 1\}: expected an integer in 1\.\.65536"),
    ("num_hidden_layers", True, r"num_hidden_layers = True: expected an integer"),
    ("num_hidden_layers", 1.0, r"num_hidden_layers = 1\.0: expected an integer"),
    ("rope_parameters", 5, r"rope_parameters = 5: expected a JSON object"),
    ("rope_parameters", {"full_attention": 3}, r"rope_parameters\.full_attention = 3: expected a JSON object"),
    ("rope_theta", "1e6", r"rope_theta = '1e6': expected a finite number"),
    ("is_causal", "false", r"is_causal = 'false': expected true or false"),
    ("rope_is_neox_style", 0, r"rope_is_neox_style = 0: expected true or false"),
    ("attention_bias", "no", r"attention_bias = 'no': expected true or false"),
    ("architectures", "DFlashDraftModel", r"architectures = 'DFlashDraftModel': expected a list of class names"),
    ("architectures", [7], r"architectures = \[7\]: expected a list of class names"),
    ("dflash_config", True, r"no 'dflash_config': this is not a DFlash draft checkpoint"),
    ("dflash_config.target_layer_ids", 1, r"target_layer_ids = 1: expected a list of 1\.\.512 target layer ids"),
    ("dflash_config.target_layer_ids", ["1"], r"target_layer_ids = '1': expected an integer"),
    ("dflash_config.mask_token_id", [0], r"mask_token_id = \[0\]: expected an integer"),
    ("dflash_config.causal", 1, r"dflash_config\.causal = 1: expected true or false"),
    ("layer_types", 5, r"layer_types = 5: expected a list of 1 layer types"),
    ("layer_types", [["full_attention"]], r"layer type \['full_attention'\] is not supported"),
    ("max_window_layers", "x", r"max_window_layers = 'x': expected an integer in 0\.\.2147483647"),
])
def test_wrong_json_types(draft, tiny_target_gguf, tmp_path, key, value, match):
    edit_config(draft, **{key: value})
    fails(draft, tiny_target_gguf, tmp_path, r"config\.json: " + match)


# --- safetensors headers, as strict as the safetensors library --------------------------------------

def test_header_one_byte_short(draft, tiny_target_gguf, tmp_path):
    """Read one byte short, the header still parses and every tensor shifts by a byte: garbage, refused."""
    path = draft / "model.safetensors"
    header, body = read_st(path)
    write_st(path, header, body, pad=8, n_delta=-1)
    n = len(path.read_bytes()) - len(body) - 8 - 1
    fails(draft, tiny_target_gguf, tmp_path,
          rf"model\.safetensors: corrupt safetensors file: its tensors cover {len(body)} bytes of data, the file "
          rf"has {len(body) + 1} after its {n}-byte header")


def test_overlapping_tensors(draft, tiny_target_gguf, tmp_path):
    path = draft / "model.safetensors"
    header, body = read_st(path)
    a, b = "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    write_st(path, header, body)
    begin, end = header[a]["data_offsets"]
    fails(draft, tiny_target_gguf, tmp_path,
          rf"corrupt safetensors header: tensor '.*' starts at data offset {begin}, expected {end} "
          r"\(tensors must tile the data: no gap, no overlap\)")


def test_gap_between_tensors(draft, tiny_target_gguf, tmp_path):
    path = draft / "model.safetensors"
    header, body = read_st(path)
    last = max((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")[1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 4, end + 4]  # 4 unused bytes before it
    write_st(path, header, body[:begin] + b"\0" * 4 + body[begin:])
    fails(draft, tiny_target_gguf, tmp_path,
          rf"corrupt safetensors header: tensor '{last}' starts at data offset {begin + 4}, expected {begin} ")


def test_trailing_bytes_after_the_tensors(draft, tiny_target_gguf, tmp_path):
    path = draft / "model.safetensors"
    path.write_bytes(path.read_bytes() + b"\0" * 4)
    fails(draft, tiny_target_gguf, tmp_path, r"corrupt safetensors file: its tensors cover \d+ bytes of data")


@pytest.mark.parametrize("field, value, match", [
    ("data_offsets", ["0", "256"], r"data_offsets must be two non-negative integers"),
    ("data_offsets", [0.0, 256.0], r"data_offsets must be two non-negative integers"),
    ("data_offsets", [0], r"data_offsets must be two non-negative integers"),
    ("data_offsets", [256, 0], r"data_offsets \[256, 0\] end before they begin"),
    ("shape", [-64], r"shape must be a list of non-negative integers"),
    ("shape", "64", r"shape must be a list of non-negative integers"),
    ("dtype", "F33", r"dtype 'F33' is not a safetensors dtype"),
    ("dtype", 4, r"dtype '4' is not a safetensors dtype"),
    ("dtype", None, r"dtype 'None' is not a safetensors dtype"),
])
def test_corrupt_header_entry(draft, tiny_target_gguf, tmp_path, field, value, match):
    path = draft / "model.safetensors"
    header, body = read_st(path)
    header["hidden_norm.weight"][field] = value
    write_st(path, header, body)
    fails(draft, tiny_target_gguf, tmp_path, r"corrupt safetensors entry for 'hidden_norm\.weight' \(" + match)


def test_unsupported_dtype(draft, tiny_target_gguf, tmp_path):
    path = draft / "model.safetensors"
    header, body = read_st(path)
    header["hidden_norm.weight"]["dtype"] = "I32"
    write_st(path, header, body)
    fails(draft, tiny_target_gguf, tmp_path,
          r"tensor 'hidden_norm\.weight' has dtype I32; only F32, F16 and BF16 drafts are supported")


@pytest.mark.parametrize("mutate, match", [
    (lambda h: h.update({"__metadata__": {"format": 1}}), r"__metadata__ must map strings to strings"),
    (lambda h: h.update({"x": 5}), r"corrupt safetensors entry for 'x' \(expected an object with dtype"),
    (lambda h: h["fc.weight"].pop("shape"), r"entry for 'fc\.weight' \(expected an object with dtype, shape"),
])
def test_corrupt_header_structure(draft, tiny_target_gguf, tmp_path, mutate, match):
    path = draft / "model.safetensors"
    header, body = read_st(path)
    mutate(header)
    write_st(path, header, body)
    fails(draft, tiny_target_gguf, tmp_path, match)


def test_header_must_be_an_object(draft, tiny_target_gguf, tmp_path):
    path = draft / "model.safetensors"
    _, body = read_st(path)
    path.write_bytes((8).to_bytes(8, "little") + b"[1]     " + body)
    fails(draft, tiny_target_gguf, tmp_path, r"corrupt safetensors header \(does not start with '\{'\)")


def test_duplicate_tensor_in_the_header(draft, tiny_target_gguf, tmp_path):
    path = draft / "model.safetensors"
    header, body = read_st(path)
    text = json.dumps(header)
    entry = json.dumps({"fc.weight": header["fc.weight"]})[1:-1]
    h = ("{" + entry + ", " + text[1:]).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + body)
    fails(draft, tiny_target_gguf, tmp_path,
          r"corrupt safetensors header: not valid JSON \(key 'fc\.weight' appears twice\)")


def test_deeply_nested_header(draft, tiny_target_gguf, tmp_path):
    path = draft / "model.safetensors"
    h = b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    path.write_bytes(len(h).to_bytes(8, "little") + h)
    fails(draft, tiny_target_gguf, tmp_path, r"corrupt safetensors header: not valid JSON here: nested more than 64")


def test_header_larger_than_the_safetensors_limit(draft, tiny_target_gguf, tmp_path):
    path = draft / "model.safetensors"
    with open(path, "r+b") as f:
        f.write((100_000_001).to_bytes(8, "little"))
        f.truncate(100_000_100)  # sparse: nothing is written
    fails(draft, tiny_target_gguf, tmp_path,
          r"truncated or not a safetensors file: the header claims 100000001 bytes but the file has 100000100 "
          r"\(at most 100000000 allowed\)")


# --- model.safetensors.index.json ------------------------------------------------------------------

def shard(draft_dir, weight_map):
    (draft_dir / "model.safetensors").rename(draft_dir / "model-00001-of-00001.safetensors")
    (draft_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("weight_map, match", [
    ({"fc.weight": 5}, r"weight_map\['fc\.weight'\] = '5': expected the name of a safetensors file in this directory"),
    ({"fc.weight": "../model.safetensors"}, r"weight_map\['fc\.weight'\] = '\.\./model\.safetensors': expected"),
    ({"fc.weight": None}, r"weight_map\['fc\.weight'\] = 'None': expected"),
    ([], r"unreadable safetensors index \(no 'weight_map' object\)"),
    ({"fc.weight": "model-00001-of-00001.safetensors", "lm_head.weight": "model-00001-of-00001.safetensors"},
     r"tensor 'lm_head\.weight' is not in model-00001-of-00001\.safetensors, where the index says it is"),
])
def test_bad_index(draft, tiny_target_gguf, tmp_path, weight_map, match):
    shard(draft, weight_map)
    fails(draft, tiny_target_gguf, tmp_path, r"model\.safetensors\.index\.json: " + match)


def test_sharded_draft_converts(draft, tiny_target_gguf, tmp_path):
    header, _ = read_st(draft / "model.safetensors")
    shard(draft, {k: "model-00001-of-00001.safetensors" for k in header if k != "__metadata__"})
    out = tmp_path / "sharded.gguf"
    convert(draft, tiny_target_gguf, out, "f32")
    assert gguf_info(out).architecture == "dflash"


# --- the CLI and the output ------------------------------------------------------------------------

@pytest.mark.parametrize("damage, message", [
    (lambda d: edit_config(d, num_hidden_layers=10**12),
     "config.json: num_hidden_layers = 1000000000000: expected an integer in 1..512"),
    (lambda d: edit_config(d, text="[" * 10_000),
     "config.json: not valid JSON here: nested more than 64 levels deep"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes() + b"x"),
     "corrupt safetensors file: its tensors cover"),
])
def test_cli_one_line_exit_2_and_the_old_output_kept(draft, tiny_target_gguf, tmp_path, capsys, damage, message):
    damage(draft)
    out = tmp_path / "out.gguf"
    out.write_bytes(PREVIOUS)
    with time_bound(30, "dflash-llama convert"):
        rc = cli.main(["convert", str(draft), "-m", str(tiny_target_gguf), "-o", str(out), "--outtype", "f32"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("dflash-llama convert: error: ") and err.count("\n") == 1
    assert message in err
    assert out.read_bytes() == PREVIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "out.gguf"]


def test_output_that_is_a_directory(draft, tiny_target_gguf, tmp_path):
    (tmp_path / "out.gguf").mkdir()
    with pytest.raises(ConversionError, match=r"output .*out\.gguf is a directory: name the GGUF file to write"):
        convert(draft, tiny_target_gguf, tmp_path / "out.gguf", "f32")
    assert list((tmp_path / "out.gguf").iterdir()) == []


# --- a small mutation campaign: fixed seeds, each mutant converts or is a ConversionError -------------

HOSTILE = [True, False, None, "x", "", [], {}, [1, 2], {"a": 1}, 0, -1, 1.5, -0.0, 2**31, 2**63, 10**12,
           10**30, float("nan"), float("inf"), "9" * 50]


def _paths(obj, prefix=()):
    """Every key path of a JSON object, inner ones included."""
    for k, v in obj.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from _paths(v, (*prefix, k))


def mutate_config(draft_dir, rng: random.Random) -> str:
    path = draft_dir / "config.json"
    text = path.read_text()
    op = rng.choice(["set", "set", "delete", "truncate", "flip"])
    if op in ("truncate", "flip"):
        i = rng.randrange(len(text))
        text = text[:i] if op == "truncate" else text[:i] + chr(rng.randrange(32, 127)) + text[i + 1:]
        path.write_text(text)
        return f"config {op} at {i}"
    config = json.loads(text)
    keys = rng.choice(list(_paths(config)))
    parent = config
    for k in keys[:-1]:
        parent = parent[k]
    if op == "delete":
        del parent[keys[-1]]
    else:
        parent[keys[-1]] = rng.choice(HOSTILE)
    path.write_text(json.dumps(config))
    return f"config {op} {'.'.join(keys)}"


def mutate_header(draft_dir, rng: random.Random) -> str:
    path = draft_dir / "model.safetensors"
    header, body = read_st(path)
    op = rng.choice(["field", "field", "offsets", "length", "flip", "truncate"])
    names = sorted(k for k in header if k != "__metadata__")
    name = rng.choice(names)
    if op == "field":
        field = rng.choice(["dtype", "shape", "data_offsets"])
        header[name][field] = rng.choice(HOSTILE + [["0", "4"], [0.0, 4.0], [1], [-1, 4], ["F16"]])
        write_st(path, header, body)
        return f"header {name}.{field}"
    if op == "offsets":  # near misses: a byte off, swapped, shared with another tensor
        begin, end = header[name]["data_offsets"]
        other = header[rng.choice(names)]["data_offsets"]
        header[name]["data_offsets"] = rng.choice([[begin + 1, end + 1], [begin, end + 1], [end, begin],
                                                   list(other), [begin - 1, end - 1]])
        write_st(path, header, body)
        return f"header {name}.data_offsets near miss"
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    if op == "length":
        delta = rng.choice([-1, 1, -8, 8, 2**40, 2**63])
        data[:8] = ((n + delta) % 2**64).to_bytes(8, "little")
    elif op == "flip":
        i = 8 + rng.randrange(n)
        data[i] = rng.randrange(256)
    else:
        del data[rng.randrange(len(data)):]
    path.write_bytes(bytes(data))
    return f"header {op}"


def test_mutants_convert_or_fail_cleanly(tiny_draft_hf, tiny_target_gguf, tmp_path, monkeypatch):
    """48 mutants (fixed seeds; config.json and safetensors header alike): each converts to a GGUF that
    loads, or raises one ConversionError line within 60 s, and the old output survives. The target is
    fixed, so it is read once (gguf-py takes seconds over its vocabulary)."""
    target = conversion.read_target(tiny_target_gguf)
    monkeypatch.setattr(conversion, "read_target", lambda path: target)
    outcomes = {"converted": 0, "refused": 0}
    for seed in range(48):
        draft_dir = shutil.copytree(tiny_draft_hf, tmp_path / f"draft{seed}")
        what = f"mutant {seed}: " + (mutate_config if seed % 2 == 0 else mutate_header)(draft_dir, random.Random(seed))
        out = tmp_path / f"out{seed}" / "draft.gguf"
        out.parent.mkdir()
        out.write_bytes(PREVIOUS)
        with time_bound(60, what):
            try:
                convert(draft_dir, tiny_target_gguf, out, "f32")
            except ConversionError as e:
                assert "\n" not in str(e), what
                assert out.read_bytes() == PREVIOUS, what
                outcomes["refused"] += 1
            else:
                assert gguf_info(out).architecture == "dflash", what
                outcomes["converted"] += 1
        assert list(out.parent.iterdir()) == [out], what
        shutil.rmtree(draft_dir)
    assert outcomes["refused"] >= 24 and outcomes["converted"] >= 1, outcomes
