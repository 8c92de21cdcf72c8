"""DFlash 2's selector lattice three ways: ours (ordered candidates, [slot, pred, cand] scores) and
llama.cpp's packed `dflash2_lattice` (unordered candidates) line up as maps keyed by tokens."""

import numpy as np

from dflash_llama.parity import graph as G

CANDS = np.array([[5, 7], [1, 2], [3, 4]])  # 3 draft slots, K = 2, ordered as ours
SCORES = np.arange(12, dtype=np.float64).reshape(3, 2, 2)
SCORES[0, 1] = SCORES[0, 0]  # slot 1: the anchor is the only predecessor, its row repeated
ANCHOR = 9


def packed(order=(1, 0), n_embd=10):
    """The same lattice as llama.cpp packs it, candidates in another order (ggml_top_k's)."""
    out = np.zeros((1 + len(CANDS), n_embd))
    order = list(order)
    for s in range(len(CANDS)):
        out[s + 1, :2] = CANDS[s][order]
        preds = [0, 0] if s == 0 else order
        out[s + 1, 2:6] = SCORES[s][np.ix_(preds, order)].ravel()
    return out


def test_lattices_line_up_whatever_the_candidate_order():
    ours = G.lattice({"selector_candidates": CANDS, "selector_scores": SCORES}, ANCHOR, 2)
    theirs = G.lattice({G.LLAMA_LATTICE: packed()}, ANCHOR, 2)
    assert len(ours) == 2 + 4 + 4 and ours[(1, ANCHOR, 7)] == 1.0 and ours[(3, 2, 4)] == 11.0
    assert G.compare_lattices(ours, theirs) == {"error": 0.0, "entries": 10, "only_a": 0, "only_b": 0}
    theirs[(2, 7, 2)] += 1.0
    assert G.compare_lattices(ours, theirs)["error"] > 0.0


def test_a_different_candidate_set_is_counted():
    other = packed()
    other[3, 0] = 8.0  # slot 3 proposes token 8 where ours has 4
    cmp = G.compare_lattices(G.lattice({"selector_candidates": CANDS, "selector_scores": SCORES}, ANCHOR, 2),
                             G.lattice({G.LLAMA_LATTICE: other}, ANCHOR, 2))
    assert (cmp["entries"], cmp["only_a"], cmp["only_b"]) == (8, 2, 2)


def test_llama_walk_and_our_path_are_the_drafted_tokens():
    assert G.walk_llama_lattice(packed(), 2) == [7, 2, 4]  # argmax from the anchor, then from each pick
    assert G.drafted_tokens({G.LLAMA_LATTICE: packed()}, n_vocab=16, top_k=2) == [7, 2, 4]
    assert G.drafted_tokens({"selector_path": np.array([7, 2, 4])}, n_vocab=16) == [7, 2, 4]


def test_dflash2_graph_order_has_the_convolutions():
    from dflash_llama import schema as L

    names = G.graph_order(2, L.DFLASH2)
    assert names.index("attn_conv_in-0") < names.index("Qcur-0") < names.index("attn_conv_out-0") \
        < names.index("ffn_inp-0") < names.index("ffn_conv_in-0") < names.index("ffn_out-0") \
        < names.index("ffn_conv_out-0") < names.index("l_out-0")
    assert "attn_conv_in-1" not in G.graph_order(2)
    assert G.first_reader("blk.1.ffn_conv_base") == "ffn_conv_in-1"
