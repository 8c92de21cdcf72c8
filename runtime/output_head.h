// The target's output head, computed by us for the rows a step reads. A verify of k tokens needs
// the logits of row i only while rows 0..i-1 were accepted; llama.cpp computes all k (the head is a
// large part of a step: 28M of SmolLM2-135M's 135M weights, 168M of Gemma 3 270M's 268M). Where
// the target's graph ends in one matmul of its final norm (result_output = W x result_norm), the
// target stops every decode's graph after result_norm and this head computes rows on demand.
//
// Exactness: each logit is ggml's own vec_dot for the weight type on the row quantized by that type's
// from_float (or, for several rows, cpu_dot_cols.h's kernel, vec_dot's arithmetic per row), the
// arithmetic of ggml's matmul (whose row results do not depend on how many rows share it); the
// target checks once, bit for bit, against llama.cpp's own logits.
#pragma once

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <cstdint>
#include <vector>

namespace dflash {

class output_head {
public:
    // weight: the target's head [n_embd, n_vocab] in host memory, used in place (the model owns it).
    output_head(ggml_tensor * weight, int32_t n_threads);
    ~output_head();
    output_head(const output_head &) = delete;
    output_head & operator=(const output_head &) = delete;

    void set_threads(int32_t n_threads);
    // out[r * n_vocab + v] = logits of rows x[r * n_embd ...], r < n_rows.
    void compute(const float * x, int32_t n_rows, float * out);

    int64_t n_embd()  const { return weight_->ne[0]; }
    int64_t n_vocab() const { return weight_->ne[1]; }

private:
    static void run(ggml_tensor * dst, int ith, int nth, void * userdata);

    ggml_tensor *        weight_;
    std::vector<char>    qx_;          // the input rows in the weight's vec_dot type
    size_t               q_row_  = 0;
    int32_t              n_rows_ = 0;
    ggml_backend_t       backend_ = nullptr;
    ggml_gallocr_t       galloc_  = nullptr;
    std::vector<uint8_t> meta_;
};

} // namespace dflash
