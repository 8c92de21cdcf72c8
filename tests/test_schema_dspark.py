"""DSpark in the one draft schema: its variant and heads, the block layout per draft, its keys and
tensors (a reduced vocabulary's W2 over its rows, the optional markov_w2.scale), the three checkpoint
formats read alike, what stays refused (one line each)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dflash_llama import schema as S

QWEN3 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 4096, "rope_theta": 10000.0, "model_type": "qwen3"}
DSPARK = {"markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
          "confidence_head_with_markov": True}


def deepspec(**kw) -> dict:
    return {**QWEN3, "architectures": ["Qwen3DSparkModel"], "block_size": 7, "target_layer_ids": [1],
            "mask_token_id": 5, "num_target_layers": 4, **DSPARK, **kw}


def specforge(**kw) -> dict:
    return {**QWEN3, "architectures": ["DSparkDraftModel"], "block_size": 7,
            "num_target_layers": 4,
            "dflash_config": {"target_layer_ids": [1], "mask_token_id": 5, "projector_type": "dspark",
                              **DSPARK, **kw}}


def speculators(**kw) -> dict:
    return {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
            "transformer_layer_config": QWEN3, "draft_vocab_size": 300, "block_size": 7,
            "aux_hidden_state_layer_ids": [2], "mask_token_id": 5, **DSPARK, **kw}


def test_the_three_formats_read_alike_and_round_trip():
    read = {fmt: S.DraftHParams.from_hf_config(make()) for fmt, make in
            (("deepspec", deepspec), ("specforge", specforge), ("speculators", speculators))}
    h = read["deepspec"]
    assert (h.variant, h.heads, h.markov_rank, h.has_confidence_head, h.sample_from_anchor, h.n_drafted) == (
        S.DSPARK, (S.MARKOV, S.CONFIDENCE), 8, True, True, 7)
    assert read["specforge"] == h and read["speculators"] == dataclasses.replace(h, n_layer_target=None)
    assert [S.checkpoint_format(c) for c in (deepspec(), specforge(), speculators())] == [
        "deepspec", "z-lab", "speculators"]
    assert S.DraftHParams.from_hf_config(h.to_hf_config()) == h
    # the tensors: the heads' with the draft's sizes, in ggml order
    specs = {t.gguf: S.expected_shape(t, h.dims()) for t in h.tensor_specs() if t.head}
    assert specs == {"markov_w1.weight": (8, 300), "markov_w2.weight": (8, 300), "conf_proj.weight": (72, 1),
                     "conf_proj.bias": (1,)}
    assert [S.gguf_tensor_name(n)[0] for n in ("markov_head.markov_w1.weight", "model.confidence_head.proj.bias")] == [
        "markov_w1.weight", "conf_proj.bias"]
    # the layout is the draft's, not the variant's; no confidence head: no conf_proj
    dflash_layout = S.DraftHParams.from_hf_config(speculators(sample_from_anchor=False, enable_confidence_head=False))
    assert (dflash_layout.sample_from_anchor, dflash_layout.heads, dflash_layout.n_drafted) == (False, (S.MARKOV,), 6)
    assert not any(t.head == S.CONFIDENCE for t in dflash_layout.tensor_specs())
    # DeepSpec's "DFlash": the same class without a Markov head, an anchor-first DFlash 1 draft
    plain = S.DraftHParams.from_hf_config(deepspec(markov_rank=0))
    assert (plain.variant, plain.heads, plain.sample_from_anchor, plain.has_confidence_head) == (
        S.DFLASH1, (), True, False)
    assert S.DraftHParams.from_hf_config(plain.to_hf_config()) == plain


def test_gguf_keys_say_the_heads_and_the_layout():
    h = S.DraftHParams.from_hf_config(speculators(sample_from_anchor=False))
    kv = dict(h.to_gguf_kv())
    assert (kv[S.SAMPLE_FROM_ANCHOR], kv[S.HAS_CONFIDENCE_HEAD]) == (False, True)  # always written
    tensors = {"markov_w1.weight": (8, 300), "markov_w2.weight": (8, 300), "conf_proj.weight": (72, 1),
               "conf_proj.bias": (1,)}
    kv.update({"tokenizer.ggml.tokens": ["t"] * 300, S.MASK_TOKEN_ID: 5})
    back = S.DraftHParams.from_gguf(kv, tensors=tensors, runtime=False)
    assert (back.markov_rank, back.has_confidence_head, back.sample_from_anchor) == (8, True, False)
    assert S.variant_of_gguf(kv, tensors) is S.DSPARK and S.refusals(kv, tensors, runtime=False) == []
    # missing sample_from_anchor: true for DSpark, as llama.cpp reads it
    del kv[S.SAMPLE_FROM_ANCHOR]
    assert S.DraftHParams.from_gguf(kv, tensors=tensors, runtime=False).sample_from_anchor is True
    # the runtime runs them too, with a reduced vocabulary (W2 over its rows) and a factor on the bias
    assert S.refusals(kv, tensors) == []
    reduced = {**tensors, "markov_w2.weight": (8, 100), "d2t": (100,), "output.weight": (64, 100), S.MARKOV_SCALE: (1,)}
    assert S.refusals(kv, reduced) == [] and S.DraftHParams.from_gguf(kv, tensors=reduced).markov_rank == 8
    assert S.expected_shape(S.hf_tensor_name("markov_w2.weight")[1], back.dims(n_vocab_draft=100)) == (8, 100)
    assert S.hf_tensor_name(S.MARKOV_SCALE)[0] == "markov_head.markov_w2.scale"
    with pytest.raises(ValueError, match=r"^draft\.gguf: tensor 'markov_w2\.scale' has shape \[2\]: expected \[1\] "
                                         r"\(one factor\)$"):
        S.DraftHParams.from_gguf(kv, tensors={**tensors, S.MARKOV_SCALE: (2,)})
    assert S.markov_scale([0.5]) == 0.5
    for bad, message in (([float("nan")], "is nan: expected a finite factor"),
                         ([1.0, 2.0], "has 2 values: expected [1] (one factor)")):
        with pytest.raises(ValueError, match=f"^tensor 'markov_w2.scale' {re.escape(message)}$"):
            S.markov_scale(bad)
    with pytest.raises(ValueError, match=r"^draft\.gguf: 'dflash\.has_confidence_head' = True but the draft has no "
                                         r"conf_proj\.weight$"):
        S.DraftHParams.from_gguf(kv, tensors={k: v for k, v in tensors.items() if "conf" not in k}, runtime=False)
    assert S.refusals({}, ["conf_proj.weight"], runtime=False) == [
        "tensor 'conf_proj.weight': a DSpark tensor in a DFlash 1 draft (no markov_w1.weight)"]
    assert S.refusals({}, [S.MARKOV_SCALE], runtime=False) == [
        "tensor 'markov_w2.scale': a DSpark tensor in a DFlash 1 draft (no markov_w1.weight)"]


@pytest.mark.parametrize("config, message", [
    (deepspec(markov_head_type="gated"), "markov_head_type = 'gated' is not supported (only vanilla, as the pinned "
                                         "llama.cpp runs it)"),
    (specforge(markov_head_type="rnn"), "markov_head_type = 'rnn' is not supported"),
    (speculators(confidence_head_with_markov=False), "confidence_head_with_markov = false is not supported"),
    (speculators(markov_rank=-1), "markov_rank = -1: expected an integer in 0..65536"),
    (deepspec(sample_from_anchor="yes"), "sample_from_anchor = 'yes': expected true or false"),
    (speculators(speculators_model_type="dsv4"), "speculators_model_type = 'dsv4' is not supported"),
    # a DeepSeek-V4 DSpark's keys, wherever a format keeps its settings (found by the DSpark fuzz campaign:
    # the converter ignored them)
    (deepspec(hc_mult=4), "hc_mult = 4: DSpark drafts on a DeepSeek-V4 backbone (hyper-connections) are not "
                          "supported"),
    (speculators(dspark_target_layer_ids=65537), "dspark_target_layer_ids = 65537: DSpark drafts on a DeepSeek-V4"),
    (specforge(hc_eps=1e-6), "dflash_config.hc_eps = 1e-06: DSpark drafts on a DeepSeek-V4"),
    (speculators(transformer_layer_config={**QWEN3, "hc_sinkhorn_iters": 20}),
     "transformer_layer_config.hc_sinkhorn_iters = 20: DSpark drafts on a DeepSeek-V4"),
])
def test_what_stays_refused_is_one_line(config, message):
    with pytest.raises(ValueError, match="^config.json: " + message.replace("(", r"\(").replace(")", r"\)")):
        S.DraftHParams.from_hf_config(config)
    assert S.refusals({S.HYPER_CONNECTION_COUNT: 4}, runtime=False) == [
        f"'{S.HYPER_CONNECTION_COUNT}' = 4: DSpark drafts on a DeepSeek-V4 backbone are not supported"]
