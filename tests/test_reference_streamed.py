"""The layer-streamed reference target (reference/target.py): the numbers of transformers'
`from_pretrained` bit for bit, one decoder layer's weights in memory at a time."""

from __future__ import annotations

import pytest
import torch

from dflash_llama import families
from dflash_llama.reference import Target
from dflash_llama.reference.target import gguf_vocab_tables

PROMPT = [1, 50, 300, 7, 900, 12, 5, 77, 1000, 3, 50, 300]
# transformers' own GGUF loader cannot read these two families' GGUFs (whole or streamed): the
# reference reads their HF directories
GGUF_UNREADABLE = {
    "qwen3moe": r"layer 0: model\.layers\.0\.mlp\.experts\.\w+: torch\.Size\(\[4, \d+, \d+\]\) in the file, "
                r"torch\.Size\(\[4, \d+, \d+\]\) in the model",
    "gpt-oss": r"only 0-dimensional arrays can be converted to Python scalars",
}


def _run(target: Target) -> list[torch.Tensor]:
    """Two forwards through one cache (the second continues the first), logits and every layer's
    output; for a recurrent cache a crop back into the second forward and its logits again."""
    taps = list(range(target.n_layers))
    cache = target.new_cache()
    a = target.forward(PROMPT[:8], 0, cache, feature_layers=taps)
    b = target.forward(PROMPT[8:], 8, cache, feature_layers=taps)
    out = [a.logits, a.features, b.logits, b.features]
    if target._is_recurrent(cache):
        target.crop(cache, 10)
        out.append(target.forward(PROMPT[10:], 10, cache).logits)
    return out


@pytest.mark.parametrize("family", families.NAMES)
@torch.inference_mode()
def test_streamed_target_equals_whole_model_bit_for_bit(family, family_targets):
    hf, gguf = family_targets[family]
    for path in (hf, gguf):
        if path == gguf and family in GGUF_UNREADABLE:
            with pytest.raises(ValueError, match=GGUF_UNREADABLE[family]):
                Target.load(path, streamed=True)
            continue
        target = Target.load(path, streamed=True)
        assert target.streamed
        got = _run(target)
        assert all(torch.equal(w, g) for w, g in zip(_run(Target.load_whole(path)), got)), f"{family} {path.name}"
        assert all(p.device.type == "meta" for p in target.weights.layers.parameters())  # released after running
        if target.embedding is not None:  # untied: only the rows of the tokens seen were read
            assert sorted(torch.nonzero(target.embedding.filled)[:, 0].tolist()) == sorted(set(PROMPT))
        else:
            assert target.model.config.tie_word_embeddings


@torch.inference_mode()
def test_streamed_target_options(family_targets, capsys):
    hf, gguf = family_targets["qwen3"]
    whole = Target.load_whole(gguf)
    kept = Target.load(gguf)  # small: loaded whole, through the same conversion
    assert not kept.streamed and kept.embedding is None
    assert all(torch.equal(a, b) for a, b in zip(whole.model.state_dict().values(), kept.model.state_dict().values()))
    target = Target.load(gguf, streamed=True, progress=True)
    assert torch.equal(target.embed_tokens, whole.embed_tokens)  # every row read on demand
    target.forward(PROMPT, 0, target.new_cache())
    assert "reference target (12 tokens)" in capsys.readouterr().err  # the bar over the layers
    # the draft's head: the streamed target's own when it holds the file's values, else a copy of its own
    assert gguf_vocab_tables(gguf, lazy=True, head_in_memory=target.lm_head)[1] is target.lm_head
    off = target.lm_head.clone()
    off[-1, -1] += 1e-3
    head = gguf_vocab_tables(gguf, lazy=True, head_in_memory=off)[1]
    assert head is not off and torch.equal(head, target.lm_head)
    half = Target.load(gguf, dtype=torch.bfloat16, streamed=True)
    a = whole.forward(PROMPT, 0, whole.new_cache()).logits
    b = half.forward(PROMPT, 0, half.new_cache()).logits
    assert b.dtype == torch.float32 and 0 < float((a - b).norm() / a.norm()) < 5e-2
    with pytest.raises(ValueError, match=r"^reference device 'tpu': choose one of cpu, cuda$"):
        Target.load(gguf, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^reference device cuda: the installed torch sees no CUDA GPU$"):
            Target.load(gguf, device="cuda")
