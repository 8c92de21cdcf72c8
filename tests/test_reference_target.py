"""The target adapter: logits, draft features, cache crop, HF and GGUF loading, errors."""

from __future__ import annotations

import pytest
import torch

from dflash_llama.reference import Target

torch.set_num_threads(1)
PROMPT = [1604, 3987, 24, 94, 727, 55, 66, 77]


@torch.inference_mode()
def test_features_are_layer_outputs_and_the_last_one_is_final_normed(reference_target):
    model = reference_target.model
    raw = {}
    hooks = [layer.register_forward_hook(
        lambda mod, inp, out, i=i: raw.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i, layer in enumerate(model.model.layers)]
    trace: dict = {}
    try:
        out = reference_target.forward(PROMPT, 0, reference_target.new_cache(),
                                       feature_layers=[1, 3], trace=trace)
    finally:
        for h in hooks:
            h.remove()
    h = reference_target.hidden_size
    assert out.features.shape == (len(PROMPT), 2 * h)
    assert torch.equal(out.features[:, :h], raw[1][0])  # output of target layer 1
    # layer n-1: transformers hands out the final-norm output, and so do we
    assert torch.equal(out.features[:, h:], model.model.norm(raw[3])[0])
    assert not torch.equal(out.features[:, h:], raw[3][0])
    assert torch.equal(trace["target_feat-1"], out.features[:, :h])
    assert out.logits.shape == (len(PROMPT), reference_target.vocab_size)


@torch.inference_mode()
def test_crop_rolls_the_cache_back(reference_target):
    t = reference_target
    cache = t.new_cache()
    t.forward(PROMPT[:5], 0, cache)
    expected = t.forward(PROMPT[5:], 5, cache, feature_layers=[2])
    t.crop(cache, 5)
    assert cache.get_seq_length() == 5
    again = t.forward(PROMPT[5:], 5, cache, feature_layers=[2])
    assert torch.equal(again.logits, expected.logits)
    assert torch.equal(again.features, expected.features)
    with pytest.raises(ValueError, match="the target cache holds 8 tokens, not 5"):
        t.forward(PROMPT[5:], 5, cache)


def test_embeddings_head_and_eos(reference_target):
    t = reference_target
    assert t.embed_tokens.shape == t.lm_head.shape == (49152, 64)
    assert not torch.equal(t.embed_tokens, t.lm_head)  # the fixture is untied
    assert (t.n_layers, t.hidden_size, t.vocab_size) == (4, 64, 49152)
    assert t.eos_token_ids == [2]  # SmolLM2's <|im_end|>


@torch.inference_mode()
def test_gguf_target_equals_hf_target(tiny_target_gguf, reference_target):
    """transformers' GGUF loader (f32) gives the same model; it misses qwen3's head_dim, which
    the adapter passes from `attention.key_length`."""
    g = Target.load(tiny_target_gguf)
    assert g.model.config.head_dim == 16
    assert torch.equal(g.embed_tokens, reference_target.embed_tokens)
    assert torch.equal(g.lm_head, reference_target.lm_head)
    a = reference_target.forward(PROMPT, 0, reference_target.new_cache(), feature_layers=[0, 3])
    b = g.forward(PROMPT, 0, g.new_cache(), feature_layers=[0, 3])
    assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)
    assert g.tokenizer("def fib(n):")["input_ids"] == \
        reference_target.tokenizer("def fib(n):")["input_ids"]


def test_target_errors(reference_target, tmp_path):
    with pytest.raises(ValueError, match=r"target layer id 4 is out of range for a target with 4 "
                                         r"layers \(valid: 0\.\.3\)"):
        reference_target.check_layer_ids([0, 4])
    with pytest.raises(FileNotFoundError, match="target .*missing does not exist"):
        Target.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot load target .*empty with transformers"):
        Target.load(tmp_path / "empty")
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model\n")
    with pytest.raises(ValueError, match="junk.gguf: not a GGUF file"):
        Target.load(junk)
