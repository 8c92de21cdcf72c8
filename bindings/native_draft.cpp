// dflash_llama._core.NativeDraft: glue over runtime/native_draft.h (llama.cpp's own DFlash graph,
// the parity harness's third implementation). No logic here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "engine.h"
#include "native_draft.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

nb::ndarray<nb::numpy, float> owned_array(std::vector<float> && data, const std::vector<int64_t> & ne) {
    auto * owned = new std::vector<float>(std::move(data));
    nb::capsule owner(owned, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    std::vector<size_t> shape(ne.rbegin(), ne.rend());  // ggml ne order -> NumPy order
    return nb::ndarray<nb::numpy, float>(owned->data(), shape.size(), shape.data(), owner);
}

} // namespace

void bind_native_draft(nb::module_ & m) {
    nb::class_<dflash::native_draft>(m, "NativeDraft")
        .def("__init__", [](dflash::native_draft * self, dflash::engine & engine, const std::string & path,
                            int32_t n_ctx, int32_t n_threads, bool kv_f32, bool encoder_pass) {
                 dflash::native_draft_params p;
                 p.path = path;
                 p.n_ctx = n_ctx;
                 p.n_threads = n_threads;
                 p.kv_f32 = kv_f32;
                 p.encoder_pass = encoder_pass;
                 nb::gil_scoped_release release;
                 new (self) dflash::native_draft(p, engine.target());
             },
             "engine"_a, "path"_a, "n_ctx"_a, "n_threads"_a, "kv_f32"_a, "encoder_pass"_a,
             nb::keep_alive<1, 2>())  // the engine's target context is the draft's ctx_other
        .def_prop_ro("target_layers", &dflash::native_draft::target_layers)
        .def_prop_ro("mask_token_id", &dflash::native_draft::mask_token_id)
        .def_prop_ro("block_size", &dflash::native_draft::block_size)
        .def_prop_ro("causal", &dflash::native_draft::causal)
        .def_prop_ro("n_ctx", &dflash::native_draft::n_ctx)
        .def("trace", [](dflash::native_draft & d, nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> features,
                         const std::vector<int32_t> & block) {
                 const int32_t n = (int32_t) features.shape(0);
                 std::vector<float> feats(features.data(), features.data() + features.size());
                 dflash::draft_trace trace;
                 {
                     nb::gil_scoped_release release;
                     trace = d.trace(feats, n, block);
                 }
                 nb::dict out;
                 for (auto & [name, t] : trace) {
                     out[name.c_str()] = owned_array(std::move(t.data), t.shape);
                 }
                 return out;
             }, "features"_a, "block"_a);
}
