"""The fuzz campaign (parity/fuzz.py): its GGUF walk and mutants, and a short deterministic run of the four
targets that must find no signal, hang, traceback or silent wrong output."""

from __future__ import annotations

import json
import math
import random
import struct

import numpy as np
import pytest

import dflash_llama
from dflash_llama.parity import fuzz

# the short run: fixed seed, mutants per target (about 3 minutes on 2 cores)
SEED = 19
SHORT_RUN = {"draft": 90, "target": 30, "gguf_info": 60, "converter": 40}


@pytest.fixture(scope="module")
def corpus(tiny_target_hf, tiny_target_gguf, tiny_draft_hf, tmp_path_factory) -> fuzz.Corpus:
    return fuzz.corpus_from(tiny_target_hf, tiny_target_gguf, tiny_draft_hf, tmp_path_factory.mktemp("fuzz_corpus"))


@pytest.fixture(scope="module")
def short_run(corpus, tmp_path_factory) -> list[fuzz.Outcome]:
    outcomes = fuzz.campaign(SHORT_RUN, SEED, corpus, jobs=2, keep=tmp_path_factory.mktemp("fuzz_findings"),
                             progress=False)
    print("\n" + fuzz.summary_table(outcomes) + "\n" + "\n".join(fuzz.failure_causes(outcomes)))
    return outcomes


@pytest.fixture(scope="module")
def dflash2_corpus(tiny_target_hf, tiny_target_gguf, tmp_path_factory) -> fuzz.Corpus:
    from dflash_llama import fixtures

    work = tmp_path_factory.mktemp("fuzz_corpus_dflash2")
    draft = fixtures.tiny_draft_hf(work / "draft_hf", tiny_target_hf,
                                   fixtures.TinyDraftConfig(**fuzz.VARIANT_DRAFTS["dflash2"]))
    return fuzz.corpus_from(tiny_target_hf, tiny_target_gguf, draft, work, "dflash2")


def test_gguf_walk_round_trips_the_seeds(corpus):
    for seed in (corpus.draft_gguf, corpus.target_gguf):
        blob = seed.read_bytes()
        g = fuzz.parse_gguf(blob)
        assert fuzz.serialize_gguf(g) == blob
        assert g.n_kv == len(g.kvs) and g.n_tensors == len(g.tensors)


def test_mutants_are_a_function_of_seed_and_index(corpus):
    keys = fuzz.extra_keys_for("draft")
    made = [fuzz.mutate_gguf(corpus.draft_gguf, random.Random(f"draft/3/{i}"), keys) for i in (7, 7, 8)]
    assert made[0] == made[1]
    assert made[0][0] != made[2][0]
    assert made[0][0] != corpus.draft_gguf.read_bytes()


@pytest.mark.parametrize("rng_seed", range(8))
def test_kv_edge_value_is_written_in_the_new_type(rng_seed):
    g = fuzz.GGUFFile(3, 0, 1, [(b"dflash.block_size", fuzz.U32, 8)], [], 32, 0, b"")
    fuzz.m_kv_value(random.Random(rng_seed), g, [])
    key, vtype, value = g.kvs[0]
    back = fuzz.parse_gguf(fuzz.serialize_gguf(g)).kvs[0]
    assert back[:2] == (key, vtype)
    expected = struct.unpack(fuzz.SCALAR_FORMATS[vtype], fuzz.pack_value(vtype, value))[0]  # wrapped to its width
    assert back[2] == expected or (math.isnan(back[2]) and math.isnan(value))
    if vtype in (fuzz.U64, fuzz.I64) and not isinstance(value, float):
        assert expected % 2**64 == value % 2**64  # 2^32 + 8 stays 2^32 + 8: no cut to 32 bits


def test_classification_of_exits():
    opts = fuzz.Options(timeout=20)
    assert fuzz.classify_exit(None, "", False, opts) == ("hang", "timeout after 20 s")
    assert fuzz.classify_exit(-6, "x.c:1: GGML_ASSERT(a) failed\nbacktrace", False, opts) == (
        "signal", "SIGABRT: x.c:1: GGML_ASSERT(a) failed")
    assert fuzz.classify_exit(139, "", False, opts) == ("signal", "SIGSEGV")
    assert fuzz.classify_exit(1, "Traceback (most recent call last):\n  ...\nKeyError: 'a'", True, opts) == (
        "traceback", "KeyError: 'a'")
    assert fuzz.classify_exit(1, "llama-dflash-cli: error: /tmp/mutant-1/mutant.gguf: bad", False, opts) == (
        "clean", "llama-dflash-cli: error: mutant.gguf: bad")
    assert fuzz.classify_exit(1, "", False, opts)[0] == "unexplained"
    assert fuzz.classify_exit(0, "", False, opts) == ("ran", "")


def test_split_follows_the_shares():
    assert fuzz.split_mutants(10000) == {"draft": 4500, "target": 2000, "gguf_info": 2000, "converter": 1500}
    assert fuzz.split_mutants(10, ("converter",)) == {"converter": 10}


@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_short_run_finds_no_failure(short_run, target):
    mine = [o for o in short_run if o.target == target]
    assert len(mine) == SHORT_RUN[target]
    failures = [f"{o.category}: {o.cause} ({o.mutation}; {fuzz.reproduction(o.target, o.seed, o.index)})"
                for o in mine if o.category in fuzz.FAILURES]
    assert failures == []
    counts = fuzz.counts_by_category(short_run, target)
    assert counts.get("clean", 0) > 0  # the mutants do reach the checks


def test_dflash2_mutants_reach_its_keys_and_tensors_and_fail_nothing(dflash2_corpus, tmp_path):
    """A DFlash 2 pair: the mutants aim at its sizes, conv and selector tensors (data included) and
    both checkpoint formats, depend on the variant, and a short run (seed 23) fails nothing."""
    c = dflash2_corpus
    keys = fuzz.extra_keys_for("draft")
    drafts = [fuzz.mutate_gguf(c.draft_gguf, fuzz.mutant_rng("dflash2", "draft", 23, i), keys)[1] for i in range(40)]
    assert sum(w.startswith("dflash2_size: dflash.") for w in drafts) == 6
    assert sum(w.startswith("dflash2_tensor: tensor ") for w in drafts) == 8
    assert "dflash2_tensor: tensor selector_successor.weight data: one = nan" in drafts
    assert fuzz.mutant_rng("dflash2", "draft", 23, 0).random() != fuzz.mutant_rng("dflash", "draft", 23, 0).random()
    assert fuzz.reproduction("draft", 23, 4, "dflash2") == (
        "python -m dflash_llama.parity.fuzz --variant dflash2 --target draft --seed 23 --index 4 --keep DIR")
    outcomes = fuzz.campaign({"draft": 12, "converter": 8}, 23, c, jobs=2, keep=tmp_path, progress=False)
    print("\n" + fuzz.summary_table(outcomes) + "\n" + "\n".join(fuzz.failure_causes(outcomes)))
    assert [o.category for o in outcomes if o.category in fuzz.FAILURES] == []
    assert {o.variant for o in outcomes} == {"dflash2"}
    assert fuzz.counts_by_category(outcomes, "draft").get("exact", 0) > 0  # a DFlash 2 draft ran, and was exact
    assert any(o.mutation.startswith("speculators format: ") for o in outcomes if o.target == "converter")
    # found by the 2,400-mutant DFlash 2 campaign (seed 2030): a list or an object as
    # speculators_model_type was a TypeError traceback
    found = [fuzz.run_mutant(fuzz.Job("converter", 2030, i, c, fuzz.Options(), (), str(tmp_path))) for i in (135, 239)]
    assert [(o.mutation, o.category, o.cause.split("config.json: ")[-1]) for o in found] == [
        ("speculators format: config.json speculators_model_type = [5]", "clean",
         "speculators_model_type = [5] is not supported (only dflash, dflash2, dspark)"),
        ("speculators format: config.json speculators_model_type = {}", "clean",
         "speculators_model_type = {} is not supported (only dflash, dflash2, dspark)")]


@pytest.fixture(scope="module")
def dspark_corpus(tiny_target_hf, tiny_target_gguf, tmp_path_factory) -> fuzz.Corpus:
    from dflash_llama import fixtures

    work = tmp_path_factory.mktemp("fuzz_corpus_dspark")
    draft = fixtures.tiny_draft_hf(work / "draft_hf", tiny_target_hf,
                                   fixtures.TinyDraftConfig(**fuzz.VARIANT_DRAFTS["dspark"]))
    return fuzz.corpus_from(tiny_target_hf, tiny_target_gguf, draft, work, "dspark")


def test_dspark_mutants_reach_its_keys_heads_and_formats_and_fail_nothing(dspark_corpus, tmp_path):
    """A DSpark pair: the mutants aim at its two keys and its heads' tensors (a consistent draft of
    another rank among them), its runs draft every step, its converter seeds are DeepSpec's,
    speculators' and SpecForge's checkpoints, and a short run (seed 43) fails nothing."""
    c = dspark_corpus
    keys = fuzz.extra_keys_for("draft")
    made = [fuzz.mutate_gguf(c.draft_gguf, fuzz.mutant_rng("dspark", "draft", 43, i), keys) for i in range(40)]
    assert sum(w.startswith("dspark_key: ") for _, w in made) == 6
    assert sum(w.startswith("dspark_tensor: ") for _, w in made) == 12
    # mutant 4: rank 32 -> 1 in W1, W2 and conf_proj with their data, the file laid out again
    blob, what = made[4]
    assert what == "dspark_tensor: markov rank 32 -> 1 in 3 tensors, their data cut or grown"
    (tmp_path / "rank1.gguf").write_bytes(blob)
    seed, mutant = dflash_llama.gguf_info(c.draft_gguf), dflash_llama.gguf_info(tmp_path / "rank1.gguf")
    assert [mutant.tensor(n).shape for n in ("markov_w1.weight", "markov_w2.weight", "conf_proj.weight")] == [
        (1, 49152), (1, 49152), (65,)]
    for name, keep in (("markov_w1.weight", slice(0, 1)), ("conf_proj.weight", slice(0, 65))):
        assert np.array_equal(mutant.read(name), seed.read(name)[..., keep])
    assert np.array_equal(mutant.read("fc.weight"), seed.read("fc.weight"))  # the others moved, unchanged
    # a DSpark run drafts every step (the Markov chain runs): the seed pair with its flags
    cmd = fuzz.cli_command(fuzz.Options(), c.target_gguf, c.draft_gguf, fuzz.VARIANT_FLAGS["dspark"][0])
    rc, out, err = fuzz.run_child(cmd, fuzz.Options(timeout=60))
    steps = json.loads(out)["steps"] if rc == 0 else err
    assert len(steps) == fuzz.N_PREDICT - 1 and all(step["drafted"] for step in steps)
    outcomes = fuzz.campaign({"draft": 12, "converter": 6}, 43, c, jobs=2, keep=tmp_path, progress=False)
    print("\n" + fuzz.summary_table(outcomes) + "\n" + "\n".join(fuzz.failure_causes(outcomes)))
    assert [o.category for o in outcomes if o.category in fuzz.FAILURES] == []
    assert {o.variant for o in outcomes} == {"dspark"}
    assert fuzz.counts_by_category(outcomes, "draft").get("exact", 0) > 0  # a DSpark draft ran, and was exact
    assert {o.mutation.split(" format: ")[0] for o in outcomes if " format: " in o.mutation} == {
        "speculators", "specforge"}
    # found by the first DSpark run (seed 1): a DeepSeek-V4 key in a speculators config was ignored
    found = fuzz.run_mutant(fuzz.Job("converter", 1, 1, c, fuzz.Options(), (), str(tmp_path)))
    assert (found.mutation, found.category, found.cause.split("config.json: ")[-1]) == (
        "speculators format: config.json dspark_target_layer_ids = 65537", "clean",
        "dspark_target_layer_ids = 65537: DSpark drafts on a DeepSeek-V4 backbone (hyper-connections) are not "
        "supported")
