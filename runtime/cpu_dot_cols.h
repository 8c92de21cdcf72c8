// Dot products of one quantized weight row with several input columns at once, bit for bit what
// ggml's per-row vec_dot of the weight type computes for each column on its own.
//
// Why: a verify of k tokens multiplies every weight matrix by k columns. Without repacked weights,
// tiled matmuls or sgemm (each sums in another order than one-token decoding, see docs/gemma3.md)
// ggml's matmul calls vec_dot once per row and column, decoding the row's quantized blocks again for
// every column. Here each block is decoded once and applied to up to four columns; every column's
// arithmetic (the integer block sums, their float scaling and accumulation, the final horizontal
// sum) is vec_dot's, in its order, so a verify still computes the logits of one-token decoding.
//
// Compiled into ggml's CPU backend (cmake/ggml_cpu_cols.cmake), whose matmul calls
// dflash_mul_mat_chunk for a chunk of two or more columns; types or CPUs without a kernel here fall
// back to vec_dot.
#pragma once

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Whether this build has a multi-column kernel for weights of `type` (on this CPU's instruction set)
// and the kernels are on.
bool dflash_dot_cols_supported(enum ggml_type type);

// The kernels on or off for the whole process (on unless the environment says DFLASH_LLAMA_DOT_COLS=0):
// off, every column takes ggml's vec_dot, with the same results. For side-by-side measurements
// (python -m dflash_llama.bench.dot_cols); not to be switched while a matmul runs.
void dflash_dot_cols_enable(bool on);
bool dflash_dot_cols_enabled(void);

// One chunk of ggml's matmul of a 2-D weight (rows r0..r1 of w, row stride w_stride, n values each)
// by columns c0..c1 of y (stride y_stride, in the vec_dot type): dst + c * dst_stride (bytes) holds
// column c's results, one float per weight row. False (nothing written) where `type` has no kernel
// or the chunk has fewer than two columns: the caller computes it with vec_dot.
bool dflash_mul_mat_chunk(enum ggml_type type, int64_t n, const char * w, size_t w_stride, int64_t r0, int64_t r1,
                          const char * y, size_t y_stride, int64_t c0, int64_t c1, char * dst, size_t dst_stride);

// For tests: of n_cols (1..4) columns of random values, how many results of one weight row against
// them at once differ bit for bit from vec_dot's (the row quantized by `type` from random values drawn
// from `seed`); -1 where no kernel.
int dflash_dot_cols_mismatches(enum ggml_type type, int n, int n_cols, uint32_t seed);

#ifdef __cplusplus
}
#endif
