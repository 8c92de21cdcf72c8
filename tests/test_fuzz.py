"""The fuzz campaign (parity/fuzz.py): its GGUF walk and mutants, and a short deterministic run of the four
targets that must find no signal, hang, traceback or silent wrong output."""

from __future__ import annotations

import math
import random
import struct

import pytest

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
