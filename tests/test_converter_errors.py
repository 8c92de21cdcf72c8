"""Every input error of the converter has a clear message, and a failed conversion leaves no file."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from dflash_llama import cli, fixtures, gguf_info
from dflash_llama.converter import ConversionError, conversion, convert


@pytest.fixture
def draft(tiny_draft_hf, tmp_path):
    """A private copy of the tiny draft, free to damage."""
    return shutil.copytree(tiny_draft_hf, tmp_path / "draft")


def edit_config(draft_dir, **changes):
    path = draft_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return config


def fails(draft_dir, target, tmp_path, match, outtype="f32"):
    out = tmp_path / "out" / "draft.gguf"
    out.parent.mkdir(exist_ok=True)
    with pytest.raises(ConversionError, match=match):
        convert(draft_dir, target, out, outtype)
    assert list(out.parent.iterdir()) == []  # no output, no temporary file


def test_no_dflash_config(draft, tiny_target_hf, tmp_path):
    edit_config(draft, dflash_config=None)
    fails(draft, tiny_target_hf, tmp_path, r"config\.json: no 'dflash_config': this is not a DFlash draft")


def test_no_mask_token_id(draft, tiny_target_hf, tmp_path):
    edit_config(draft, dflash_config={"target_layer_ids": [1]})
    fails(draft, tiny_target_hf, tmp_path, r"config\.json: no mask_token_id \(dflash_config\.mask_token_id\)")


def test_mask_token_id_outside_the_vocabulary(draft, tiny_target_hf, tmp_path):
    edit_config(draft, dflash_config={"mask_token_id": 49152})
    fails(draft, tiny_target_hf, tmp_path,
          r"draft/config\.json: mask_token_id 49152 is outside the vocabulary of the target .*tiny_target_hf\d* "
          r"\(49152 tokens\)")


def test_dflash2_architecture_without_its_sizes(draft, tiny_target_hf, tmp_path):
    edit_config(draft, architectures=["DFlash2DraftModel"])  # DFlash 2 converts (test_converter_dflash2)
    fails(draft, tiny_target_hf, tmp_path, r"config\.json: a DFlash 2 config needs dflash_config\.conv_kernel_size$")


def test_foreign_architecture(draft, tiny_target_hf, tmp_path):
    edit_config(draft, architectures=["Qwen3ForCausalLM"])
    fails(draft, tiny_target_hf, tmp_path,
          r"unsupported architecture \['Qwen3ForCausalLM'\]: expected one of \['DFlash2DraftModel', "
          r"'DFlashDraftModel', 'DSparkDraftModel', 'DSparkSpeculator', 'Qwen3DSparkModel'\]$")


def test_hidden_size_mismatch(tiny_target_hf, tmp_path):
    other = tmp_path / "other-target"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"hidden_size": 32, "num_hidden_layers": 4,
                                                   "vocab_size": 49152}))
    draft = fixtures.tiny_draft_hf(tmp_path / "draft32", other)  # hidden 32
    fails(draft, tiny_target_hf, tmp_path,
          r"draft32/config\.json: hidden size mismatch: the draft has hidden_size 32, the target "
          r".*tiny_target_hf\d* has 64")


def test_vocab_size_mismatch(draft, tiny_target_hf, tmp_path):
    edit_config(draft, vocab_size=151936)
    fails(draft, tiny_target_hf, tmp_path,
          r"draft/config\.json: vocab size mismatch: the draft has vocab_size 151936, the target .* has 49152 "
          r"tokens")


def test_vocab_size_mismatch_against_a_gguf_target(draft, tiny_target_gguf, tmp_path):
    edit_config(draft, vocab_size=32000)
    fails(draft, tiny_target_gguf, tmp_path,
          r"draft/config\.json: vocab size mismatch: the draft has vocab_size 32000, the target .*\.gguf has "
          r"49152 tokens")


def test_target_layer_id_out_of_range(draft, tiny_target_hf, tmp_path):
    edit_config(draft, dflash_config={"mask_token_id": 0, "target_layer_ids": [4]})
    fails(draft, tiny_target_hf, tmp_path,
          r"draft/config\.json: target layer id 4 is out of range: the target .* has 4 layers \(valid ids 0\.\.3\)")


def test_target_layer_id_out_of_range_against_a_gguf_target(draft, tiny_target_gguf, tmp_path):
    edit_config(draft, dflash_config={"mask_token_id": 0, "target_layer_ids": [-1]})
    message = (f"{draft / 'config.json'}: target layer id -1 is out of range: the target {tiny_target_gguf} has "
               "4 layers (valid ids 0..3)")
    fails(draft, tiny_target_gguf, tmp_path, f"^{re.escape(message)}$")  # names the file holding the bad id


def test_draft_made_for_a_deeper_target(draft, tiny_target_hf, tmp_path):
    edit_config(draft, num_target_layers=36)
    fails(draft, tiny_target_hf, tmp_path,
          r"draft/config\.json: target depth mismatch: the draft was made for a target with 36 layers "
          r"\(num_target_layers\)")


def test_fc_width_must_match_the_taps(draft, tiny_target_hf, tmp_path):
    edit_config(draft, dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 2]})
    fails(draft, tiny_target_hf, tmp_path,
          r"tensor 'fc\.weight' has shape \[64, 64\], config\.json implies \[64, 128\] "
          r"\(fc input must be len\(target_layer_ids\) \* hidden_size\)")


def test_missing_tensor(draft, tiny_target_hf, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(draft / "model.safetensors")
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(draft / "model.safetensors"))
    fails(draft, tiny_target_hf, tmp_path,
          r"missing tensor 'layers\.0\.mlp\.up_proj\.weight' \(blk\.0\.ffn_up\.weight\)")


def test_unexpected_tensor(draft, tiny_target_hf, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(draft / "model.safetensors")
    tensors["layers.0.mlp.conv.weight"] = torch.zeros(4)
    save_file(tensors, str(draft / "model.safetensors"))
    fails(draft, tiny_target_hf, tmp_path,
          r"unexpected tensor 'layers\.0\.mlp\.conv\.weight': not part of a DFlash 1 draft")


def test_truncated_safetensors(draft, tiny_target_hf, tmp_path):
    path = draft / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    fails(draft, tiny_target_hf, tmp_path,
          rf"model\.safetensors: truncated: tensor '.*' needs bytes up to \d+ but the file has {len(data) // 2}")


def test_truncated_safetensors_header(draft, tiny_target_hf, tmp_path):
    path = draft / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    fails(draft, tiny_target_hf, tmp_path,
          r"model\.safetensors: truncated or not a safetensors file: the header claims \d+ bytes but the file has 100")


def test_garbage_safetensors(draft, tiny_target_hf, tmp_path):
    (draft / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    fails(draft, tiny_target_hf, tmp_path, r"model\.safetensors: corrupt safetensors header")


def test_no_safetensors(draft, tiny_target_hf, tmp_path):
    (draft / "model.safetensors").unlink()
    fails(draft, tiny_target_hf, tmp_path, r"draft: no model\*\.safetensors file")


def test_unreadable_config(draft, tiny_target_hf, tmp_path):
    (draft / "config.json").write_text('{"hidden_size": 64,')
    fails(draft, tiny_target_hf, tmp_path, r"config\.json: not valid JSON \(Expecting")


def test_missing_config(draft, tiny_target_hf, tmp_path):
    (draft / "config.json").unlink()
    fails(draft, tiny_target_hf, tmp_path, r"draft/config\.json: not found \(expected a DFlash draft checkpoint")


def test_missing_config_key(draft, tiny_target_hf, tmp_path):
    edit_config(draft, intermediate_size=None)
    fails(draft, tiny_target_hf, tmp_path, r"config\.json: missing intermediate_size")


def test_target_missing(draft, tmp_path):
    fails(draft, tmp_path / "nope.gguf", tmp_path, r"target .*nope\.gguf: no such file or directory")


def test_target_not_a_gguf(draft, tmp_path):
    (tmp_path / "notes.gguf").write_text("hello\n")
    fails(draft, tmp_path / "notes.gguf", tmp_path,
          r"target .*notes\.gguf: not a GGUF file \(and not a Hugging Face directory\)")


@pytest.mark.parametrize("keep", [1000, 20_000_000])
def test_target_gguf_truncated(draft, tiny_target_gguf, tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    with open(tiny_target_gguf, "rb") as f:
        cut.write_bytes(f.read(keep))
    fails(draft, cut, tmp_path, r"target .*cut\.gguf: unreadable or truncated GGUF")


def test_target_hf_dir_without_config(draft, tmp_path):
    (tmp_path / "empty").mkdir()
    fails(draft, tmp_path / "empty", tmp_path,
          r"target .*empty: no config\.json \(expected a Hugging Face model directory\)")


def test_unknown_outtype(draft, tiny_target_hf, tmp_path):
    fails(draft, tiny_target_hf, tmp_path, r"unknown outtype 'q3_0'; choose one of auto, f32", outtype="q3_0")


def test_failure_while_writing_leaves_nothing_and_keeps_an_old_file(draft, tiny_target_gguf, tmp_path,
                                                                    monkeypatch):
    out = tmp_path / "out" / "draft.gguf"
    out.parent.mkdir()
    out.write_bytes(b"previous conversion")
    real = conversion.tensor_data
    calls = []

    def breaks_on_the_third(name, *args):
        calls.append(name)
        if len(calls) == 3:
            raise ConversionError("disk full (simulated)")
        return real(name, *args)

    monkeypatch.setattr(conversion, "tensor_data", breaks_on_the_third)
    with pytest.raises(ConversionError, match=r"disk full \(simulated\)"):
        convert(draft, tiny_target_gguf, out, "f16")
    assert len(calls) == 3
    assert list(out.parent.iterdir()) == [out]
    assert out.read_bytes() == b"previous conversion"


def test_cli_prints_one_error_line_and_exits_2(draft, tiny_target_hf, tmp_path, capsys):
    edit_config(draft, architectures=["DFlash2DraftModel"])
    out = tmp_path / "x.gguf"
    rc = cli.main(["convert", str(draft), "--target", str(tiny_target_hf), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("dflash-llama convert: error: ")
    assert "config.json: a DFlash 2 config needs dflash_config.conv_kernel_size" in err
    assert err.count("\n") == 1
    assert not out.exists()


def test_cli_rejects_unknown_outtype(draft, tiny_target_hf, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", str(draft), "--target", str(tiny_target_hf), "-o", str(tmp_path / "x.gguf"),
                  "--outtype", "q3_0"])
    assert e.value.code == 2
    assert "invalid choice: 'q3_0'" in capsys.readouterr().err


def test_last_layer_tap_converts_with_a_warning(draft, tiny_target_gguf, tmp_path, capsys):
    edit_config(draft, dflash_config={"mask_token_id": 0, "target_layer_ids": [3]})
    out = tmp_path / "last.gguf"
    rc = cli.main(["convert", str(draft), "--target", str(tiny_target_gguf), "-o", str(out), "--outtype", "f32"])
    assert rc == 0
    err = capsys.readouterr().err
    assert err == ("dflash-llama convert: warning: target layer id 3 is the target's last layer: the pinned "
                   "llama.cpp captures the input of layer id + 1, which does not exist, and its "
                   "draft-dflash aborts on this file (\"layer input tensor is null\")\n")
    assert gguf_info(out).get("dflash.target_layers") == [4]
