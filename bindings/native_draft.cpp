// dflash_llama._core.NativeDraft: glue over runtime/native_draft.h (llama.cpp's own DFlash graph,
// the parity harness's third implementation). No logic here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "engine.h"
#include "glue.h"
#include "native_draft.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace dflash_bindings {

namespace {

void native_draft_init(dflash::native_draft * self, dflash::engine & engine, const std::string & path, int32_t n_ctx,
                       int32_t n_threads) {
    dflash::native_draft_params p;
    p.path = path;
    p.n_ctx = n_ctx;
    p.n_threads = n_threads;
    nb::gil_scoped_release release;
    new (self) dflash::native_draft(p, engine.target());
}

nb::dict native_draft_trace(dflash::native_draft & d, features_array features, const std::vector<int32_t> & block) {
    std::vector<float> feats(features.data(), features.data() + features.size());
    dflash::draft_trace trace;
    {
        nb::gil_scoped_release release;
        trace = d.trace(feats, (int32_t) features.shape(0), block);
    }
    return trace_to_dict(std::move(trace));
}

} // namespace

void bind_native_draft(nb::module_ & m) {
    using dflash::native_draft;
    nb::class_<native_draft>(m, "NativeDraft")
        .def("__init__", &native_draft_init, "engine"_a, "path"_a, "n_ctx"_a, "n_threads"_a,
             nb::keep_alive<1, 2>())  // the engine's target context is the draft's ctx_other
        .def_prop_ro("target_layers", &native_draft::target_layers)
        .def_prop_ro("mask_token_id", &native_draft::mask_token_id)
        .def_prop_ro("block_size", &native_draft::block_size)
        .def_prop_ro("causal", &native_draft::causal)
        .def_prop_ro("selector_top_k", &native_draft::selector_top_k)
        .def_prop_ro("dspark", &native_draft::dspark)
        .def_prop_ro("sample_from_anchor", &native_draft::sample_from_anchor)
        .def_prop_ro("n_ctx", &native_draft::n_ctx)
        .def("trace", &native_draft_trace, "features"_a, "block"_a);
}

} // namespace dflash_bindings
