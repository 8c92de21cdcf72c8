#include "output_head.h"

#include "cpu_dot_cols.h"
#include "ggml-cpu.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace dflash {

output_head::output_head(ggml_tensor * weight, int32_t n_threads) : weight_(weight) {
    if (weight == nullptr || weight->buffer == nullptr || !ggml_backend_buffer_is_host(weight->buffer) ||
        !ggml_is_contiguous(weight)) {
        throw std::invalid_argument("the output head needs the target's head weights contiguous in host memory");
    }
    backend_ = ggml_backend_cpu_init();
    if (backend_ == nullptr) {
        throw std::runtime_error("cannot initialise the ggml CPU backend");
    }
    ggml_backend_cpu_set_n_threads(backend_, n_threads);
    galloc_ = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    if (galloc_ == nullptr) {
        ggml_backend_free(backend_);
        throw std::runtime_error("cannot create a ggml graph allocator");
    }
    meta_.resize(ggml_tensor_overhead() * 4 + ggml_graph_overhead_custom(4, false));
}

output_head::~output_head() {
    if (galloc_)  ggml_gallocr_free(galloc_);
    if (backend_) ggml_backend_free(backend_);
}

void output_head::set_threads(int32_t n_threads) {
    ggml_backend_cpu_set_n_threads(backend_, n_threads);
}

// One thread's share of the head: vocabulary rows [v0, v1) against every input row, with ggml's
// own dot product of the weight type, as ggml's matmul calls it (each logit is one vec_dot of a
// weight row and an input row quantized by the vec_dot type's from_float). Contiguous shares, no
// chunk queue: the weights stream once, each row's bytes reused by all input rows from L1.
void output_head::run(ggml_tensor * dst, int ith, int nth, void * userdata) {
    auto * self = static_cast<output_head *>(userdata);
    const ggml_tensor * w = self->weight_;
    const auto * traits = ggml_get_type_traits_cpu(w->type);
    const int64_t n_vocab = w->ne[1], n_embd = w->ne[0];
    const int64_t v0 = n_vocab * ith / nth, v1 = n_vocab * (ith + 1) / nth;
    const int32_t n_rows = self->n_rows_;
    const size_t  q_row  = self->q_row_;
    float * out = (float *) dst->data;
    // two or more rows: each vocabulary row with up to four at a time (cpu_dot_cols.h: each result
    // vec_dot's, bit for bit); else, or where the weight type has no such kernel, vec_dot per logit
    if (dflash_mul_mat_chunk(w->type, n_embd, (const char *) w->data, w->nb[1], v0, v1, self->qx_.data(), q_row, 0,
                             n_rows, (char *) out, (size_t) n_vocab * sizeof(float))) {
        return;
    }
    for (int64_t v = v0; v < v1; ++v) {
        const char * wrow = (const char *) w->data + v * w->nb[1];
        for (int32_t r = 0; r < n_rows; ++r) {
            traits->vec_dot((int) n_embd, out + (size_t) r * n_vocab + v, 0, wrow, 0,
                            self->qx_.data() + (size_t) r * q_row, 0, 1);
        }
    }
}

void output_head::compute(const float * x, int32_t n_rows, float * out) {
    if (n_rows < 1) {
        throw std::invalid_argument("output head: at least one row, got " + std::to_string(n_rows));
    }
    // the input rows in the vec_dot type, as ggml's matmul converts them
    const ggml_type qt = ggml_get_type_traits_cpu(weight_->type)->vec_dot_type;
    q_row_  = ggml_row_size(qt, n_embd());
    n_rows_ = n_rows;
    qx_.resize(q_row_ * n_rows);
    for (int32_t r = 0; r < n_rows; ++r) {
        if (qt == GGML_TYPE_F32) {
            std::memcpy(qx_.data() + r * q_row_, x + (size_t) r * n_embd(), q_row_);
        } else {
            ggml_get_type_traits_cpu(qt)->from_float(x + (size_t) r * n_embd(), qx_.data() + r * q_row_, n_embd());
        }
    }
    ggml_init_params params = { meta_.size(), meta_.data(), /*no_alloc=*/true };
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * args[1] = { weight_ };
    ggml_tensor * logits = ggml_custom_4d(ctx, GGML_TYPE_F32, n_vocab(), n_rows, 1, 1, args, 1, &output_head::run,
                                          GGML_N_TASKS_MAX, this);
    ggml_set_output(logits);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4, false);
    ggml_build_forward_expand(gf, logits);
    const bool ok = ggml_gallocr_alloc_graph(galloc_, gf);
    const bool computed = ok && ggml_backend_graph_compute(backend_, gf) == GGML_STATUS_SUCCESS;
    if (computed) {
        ggml_backend_tensor_get(logits, out, 0, ggml_nbytes(logits));
    }
    ggml_free(ctx);
    if (!computed) {
        throw std::runtime_error("the output head could not be computed (" + std::to_string(n_rows) + " rows)");
    }
}

} // namespace dflash
