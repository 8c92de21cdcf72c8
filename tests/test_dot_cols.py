"""The multi-column dot products in ggml's matmul (runtime/cpu_dot_cols.h) are ggml's vec_dot, bit for bit.

A verify multiplies each weight by several columns at once; these kernels decode a weight block once
for up to four columns. Exactness of speculative decoding rests on every column's result being the
float vec_dot computes for it alone: held here on random rows, and end to end by
test_runtime_exactness.py::test_verify_logits_equal_decode_logits_bit_for_bit on real targets.
"""

from __future__ import annotations

import pytest

from dflash_llama import _core

KERNEL_TYPES = ["q4_0", "q4_1", "q5_0", "q8_0", "q4_K", "q6_K"]


def test_this_build_has_the_kernels():
    """The CI and development machines are x86-64 with AVX2 and FMA: a build without the kernels
    would pass the bit-for-bit checks below vacuously."""
    assert all(_core.dot_cols_mismatches(t, 256, 2, 0) == 0 for t in KERNEL_TYPES)


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_every_column_is_vec_dots_result(type_name):
    # rows of one block to SmolLM2's and Gemma 3's widths; 1 to 4 columns; 40 random draws each
    sizes = (256, 512, 1536, 2048) if type_name.endswith("K") else (32, 64, 576, 640, 1536, 2048)
    for n in sizes:
        for n_cols in (1, 2, 3, 4):
            bad = sum(_core.dot_cols_mismatches(type_name, n, n_cols, seed) for seed in range(40))
            assert bad == 0, f"{type_name}, n={n}, {n_cols} columns: {bad} results differ from vec_dot"


def test_types_without_a_kernel_and_wrong_arguments():
    assert _core.dot_cols_mismatches("q5_K", 256, 2, 0) == -1  # vec_dot serves it
    assert _core.dot_cols_mismatches("q4_K", 288, 2, 0) == -1  # not whole super-blocks
    assert _core.dot_cols_mismatches("f32", 64, 2, 0) == -1
    assert _core.dot_cols_mismatches("q8_0", 48, 2, 0) == -1    # not whole blocks
    assert _core.dot_cols_mismatches("q8_0", 64, 5, 0) == -1    # four columns at most
    with pytest.raises(ValueError, match="unknown ggml type 'q9_9'"):
        _core.dot_cols_mismatches("q9_9", 64, 2, 0)
