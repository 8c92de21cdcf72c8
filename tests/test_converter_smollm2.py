"""Converting against a target given only as a GGUF (SmolLM2-135M, no Hugging Face dir anywhere)."""

from __future__ import annotations

import pytest

from dflash_llama import gguf_info, schema as L
from dflash_llama.converter import convert

TEXTS = [
    "ha ha ha ha",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "<|im_start|>user\nHéllo wörld, 1234567 — 漢字 🎉\t tabs  and   spaces<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def smollm2_draft_gguf(smollm2_constant_draft_hf, smollm2_gguf, tmp_path_factory):
    return convert(smollm2_constant_draft_hf, smollm2_gguf,
                   tmp_path_factory.mktemp("smollm2_draft_gguf") / "ha-draft-f16.gguf", "f16")


def test_dflash_keys(smollm2_draft_gguf):
    info = gguf_info(smollm2_draft_gguf)
    assert info.architecture == "dflash"
    assert info.get(L.EMBEDDING_LENGTH) == 576
    assert info.get(L.BLOCK_COUNT) == 1
    assert info.get(L.TARGET_LAYERS) == [16]  # default rule: [30 // 2], stored +1
    assert info.get(L.BLOCK_SIZE) == 8
    assert info.get(L.MASK_TOKEN_ID) == 0
    assert info.get(L.GENERAL_FILE_TYPE) == 1  # MOSTLY_F16
    assert info.tensor("fc.weight").shape == (576, 576)
    assert info.tensor("fc.weight").type == "f16"
    assert info.tensor("output_norm.weight").type == "f32"
    assert "token_embd.weight" not in {t.name for t in info.tensors}  # the target's are used


def test_tokenizer_keys_are_the_targets(smollm2_draft_gguf, smollm2_gguf):
    target, draft = gguf_info(smollm2_gguf).metadata, gguf_info(smollm2_draft_gguf).metadata
    target_tok = {k: v for k, v in target.items() if k.startswith("tokenizer.")}
    draft_tok = {k: v for k, v in draft.items() if k.startswith("tokenizer.")}
    assert len(target_tok["tokenizer.ggml.tokens"]) == 49152
    assert draft_tok.pop(L.MASK_TOKEN_ID) == 0
    assert list(draft_tok) == list(target_tok)  # same keys, same order
    for key, value in target_tok.items():
        assert draft_tok[key] == value, key


def test_tokenises_like_the_target(smollm2_draft_gguf, smollm2_gguf):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    def tokenizer(path):
        arch, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
        return arch, convert_gguf_tokenizer(arch, tokenizer_dict)[0]

    target_arch, target = tokenizer(smollm2_gguf)
    draft_arch, draft = tokenizer(smollm2_draft_gguf)
    assert (target_arch, draft_arch) == ("llama", "dflash")
    for text in TEXTS:
        assert draft.encode(text).ids == target.encode(text).ids
    assert target.encode(TEXTS[0]).ids == [3250, 421, 421, 421]  # "ha", " ha" x3
    assert draft.decode(draft.encode(TEXTS[2]).ids, skip_special_tokens=False) == TEXTS[2]
