// What the binding files share: the one NumPy helper (C++ vectors handed over without a copy) and
// each file's bind_* entry point. Glue only.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "draft_graph.h"  // draft_trace

#include <string>
#include <utility>
#include <vector>

namespace dflash_bindings {

namespace nb = nanobind;

// Target features from Python: [n_tokens, n_taps * n_embd], float32, C-contiguous.
using features_array = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// A float vector handed to NumPy without a copy; `shape` in NumPy order (row-major).
inline nb::ndarray<nb::numpy, float> to_numpy(std::vector<float> && data, const std::vector<size_t> & shape) {
    auto * owned = new std::vector<float>(std::move(data));
    nb::capsule owner(owned, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    return nb::ndarray<nb::numpy, float>(owned->data(), shape.size(), shape.data(), owner);
}

// A draft trace as {name: array}; ggml's ne order (ne0 first) becomes NumPy order.
inline nb::dict trace_to_dict(dflash::draft_trace && trace) {
    nb::dict out;
    for (auto & [name, t] : trace) {
        out[name.c_str()] = to_numpy(std::move(t.data), std::vector<size_t>(t.shape.rbegin(), t.shape.rend()));
    }
    return out;
}

void bind_native_draft(nb::module_ & m);  // native_draft.cpp

} // namespace dflash_bindings
