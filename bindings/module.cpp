// dflash_llama._core: nanobind glue over runtime/. No logic here: conversions, the GIL released
// around compute, C++ exceptions surfacing as Python exceptions (std::invalid_argument -> ValueError).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "engine.h"
#include "gguf_info.h"

#include <algorithm>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// A float vector handed to NumPy without a copy; `shape` in NumPy order (row-major).
nb::ndarray<nb::numpy, float> to_numpy(std::vector<float> && data, std::vector<size_t> shape) {
    auto * owned = new std::vector<float>(std::move(data));
    nb::capsule owner(owned, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    return nb::ndarray<nb::numpy, float>(owned->data(), shape.size(), shape.data(), owner);
}

nb::dict gguf_info_dict(const std::string & path) {
    dflash::gguf_file_info info;
    {
        nb::gil_scoped_release release;
        info = dflash::read_gguf_info(path);
    }
    nb::dict metadata;
    for (const auto & kv : info.metadata) {
        metadata[kv.key.c_str()] = nb::cast(kv.value);
    }
    nb::list tensors;
    for (const auto & t : info.tensors) {
        tensors.append(nb::make_tuple(t.name, t.shape, t.type, t.offset, t.nbytes));
    }
    nb::dict out;
    out["path"]         = info.path;
    out["architecture"] = info.architecture;
    out["version"]      = info.version;
    out["alignment"]    = info.alignment;
    out["data_offset"]  = info.data_offset;
    out["metadata"]     = metadata;
    out["tensors"]      = tensors;
    return out;
}

} // namespace

void bind_native_draft(nb::module_ & m);  // native_draft.cpp

NB_MODULE(_core, m) {
    m.doc() = "dflash-llama native runtime";

    m.def("llama_cpp_commit", []() { return std::string(DFLASH_LLAMA_CPP_COMMIT); },
          "The llama.cpp commit this module was built from.");
    m.def("gguf_info", &gguf_info_dict, "path"_a,
          "Read a GGUF header. Raises ValueError for a missing, foreign or truncated file.");

    nb::class_<dflash::generate_params>(m, "GenerateParams")
        .def(nb::init<>())
        .def_rw("max_new_tokens", &dflash::generate_params::max_new_tokens)
        .def_prop_rw("temperature", [](const dflash::generate_params & p) { return p.sampling.temperature; },
                     [](dflash::generate_params & p, float v) { p.sampling.temperature = v; })
        .def_prop_rw("top_p", [](const dflash::generate_params & p) { return p.sampling.top_p; },
                     [](dflash::generate_params & p, float v) { p.sampling.top_p = v; })
        .def_prop_rw("top_k", [](const dflash::generate_params & p) { return p.sampling.top_k; },
                     [](dflash::generate_params & p, int32_t v) { p.sampling.top_k = v; })
        .def_prop_rw("seed", [](const dflash::generate_params & p) { return p.sampling.seed; },
                     [](dflash::generate_params & p, uint64_t v) { p.sampling.seed = v; })
        .def_rw("block_size", &dflash::generate_params::block_size)
        .def_rw("draft_max", &dflash::generate_params::draft_max)
        .def_rw("stop_tokens", &dflash::generate_params::stop_tokens)
        .def_rw("stop_at_eog", &dflash::generate_params::stop_at_eog);

    nb::class_<dflash::step_record>(m, "StepRecord")
        .def_ro("drafted", &dflash::step_record::drafted)
        .def_ro("accepted", &dflash::step_record::accepted)
        .def_ro("produced", &dflash::step_record::produced);

    nb::class_<dflash::generate_stats>(m, "GenerateStats")
        .def_ro("n_prompt", &dflash::generate_stats::n_prompt)
        .def_ro("n_generated", &dflash::generate_stats::n_generated)
        .def_ro("t_prefill_ms", &dflash::generate_stats::t_prefill_ms)
        .def_ro("t_draft_ms", &dflash::generate_stats::t_draft_ms)
        .def_ro("t_verify_ms", &dflash::generate_stats::t_verify_ms)
        .def_ro("t_other_ms", &dflash::generate_stats::t_other_ms)
        .def_ro("t_total_ms", &dflash::generate_stats::t_total_ms)
        .def_prop_ro("tokens_per_second", &dflash::generate_stats::tokens_per_second);

    nb::class_<dflash::generate_result>(m, "GenerateResult")
        .def_ro("tokens", &dflash::generate_result::tokens)
        .def_ro("steps", &dflash::generate_result::steps)
        .def_ro("stop_reason", &dflash::generate_result::stop_reason)
        .def_ro("stats", &dflash::generate_result::stats)
        .def_prop_ro("tau", &dflash::generate_result::tau)
        .def_prop_ro("acceptance_by_position", &dflash::generate_result::acceptance_by_position);

    nb::class_<dflash::engine>(m, "Engine")
        .def("__init__", [](dflash::engine * self, const std::string & target, const std::string & draft,
                            int32_t n_threads, int32_t n_ctx, int32_t n_batch, int32_t n_gpu_layers, bool kv_f32,
                            int32_t n_seq, bool verbose) {
                 dflash::engine_params p;
                 p.target.path = target;
                 p.target.n_threads = n_threads;
                 p.target.n_ctx = n_ctx;
                 p.target.n_batch = n_batch;
                 p.target.n_gpu_layers = n_gpu_layers;
                 p.target.kv_f32 = kv_f32;
                 p.target.n_seq = n_seq;
                 p.draft_path = draft;
                 p.verbose = verbose;
                 nb::gil_scoped_release release;
                 new (self) dflash::engine(p);
             },
             "target"_a, "draft"_a, "n_threads"_a, "n_ctx"_a, "n_batch"_a, "n_gpu_layers"_a, "kv_f32"_a, "n_seq"_a, "verbose"_a)
        .def_prop_ro("has_draft", &dflash::engine::has_draft)
        .def_prop_ro("n_ctx", [](dflash::engine & e) { return e.target().n_ctx(); })
        .def_prop_ro("n_vocab", [](dflash::engine & e) { return e.target().n_vocab(); })
        .def_prop_ro("n_embd", [](dflash::engine & e) { return e.target().n_embd(); })
        .def_prop_ro("n_layer", [](dflash::engine & e) { return e.target().n_layer(); })
        .def_prop_ro("block_size", [](dflash::engine & e) { return e.hparams().block_size; })
        .def_prop_ro("mask_token_id", [](dflash::engine & e) { return e.hparams().mask_token_id; })
        .def_prop_ro("target_layer_ids", [](dflash::engine & e) { return e.hparams().target_layer_ids; })
        .def("tokenize", [](dflash::engine & e, const std::string & text, bool add_special) {
                 return e.target().tokenize(text, add_special);
             }, "text"_a, "add_special"_a = true)
        .def("detokenize", [](dflash::engine & e, const std::vector<int32_t> & tokens) {
                 return nb::bytes(e.target().detokenize(tokens).c_str(), e.target().detokenize(tokens).size());
             }, "tokens"_a)
        .def("piece", [](dflash::engine & e, int32_t token) {
                 const std::string s = e.target().piece(token);
                 return nb::bytes(s.data(), s.size());
             }, "token"_a)
        .def("is_eog", [](dflash::engine & e, int32_t token) { return e.target().is_eog(token); }, "token"_a)
        .def("generate", [](dflash::engine & e, const std::vector<int32_t> & prompt, const dflash::generate_params & p,
                            const dflash::token_callback & on_tokens) {
                 nb::gil_scoped_release release;
                 return e.generate(prompt, p, on_tokens);
             }, "prompt"_a, "params"_a, "on_tokens"_a.none() = nb::none())
        .def("autoregressive", [](dflash::engine & e, const std::vector<int32_t> & prompt, const dflash::generate_params & p,
                                  const dflash::token_callback & on_tokens) {
                 nb::gil_scoped_release release;
                 return e.autoregressive(prompt, p, on_tokens);
             }, "prompt"_a, "params"_a, "on_tokens"_a.none() = nb::none())
        .def("autoregressive_batch", [](dflash::engine & e, const std::vector<std::vector<int32_t>> & prompts,
                                        const dflash::generate_params & p) {
                 nb::gil_scoped_release release;
                 return e.autoregressive_batch(prompts, p);
             }, "prompts"_a, "params"_a)
        .def("target_logits", [](dflash::engine & e, const std::vector<int32_t> & tokens, bool one_at_a_time,
                                 int32_t n_prefill) {
                 std::vector<float> out;
                 {
                     nb::gil_scoped_release release;
                     out = e.target_logits(tokens, one_at_a_time, n_prefill);
                 }
                 return to_numpy(std::move(out), { tokens.size(), (size_t) e.target().n_vocab() });
             }, "tokens"_a, "one_at_a_time"_a, "n_prefill"_a)
        .def("capture", [](dflash::engine & e, const std::vector<int32_t> & tokens, const std::vector<int32_t> & layer_ids) {
                 std::vector<float> out;
                 {
                     nb::gil_scoped_release release;
                     out = e.capture(tokens, layer_ids);
                 }
                 const size_t row = layer_ids.size() * (size_t) e.target().n_embd();
                 return to_numpy(std::move(out), { tokens.size(), row });
             }, "tokens"_a, "layer_ids"_a)
        .def("trace_draft", [](dflash::engine & e, nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> features,
                               const std::vector<int32_t> & block) {
                 const int32_t n = (int32_t) features.shape(0);
                 std::vector<float> feats(features.data(), features.data() + features.size());
                 dflash::draft_trace trace;
                 {
                     nb::gil_scoped_release release;
                     trace = e.trace_draft(feats, n, block);
                 }
                 nb::dict out;
                 for (auto & [name, t] : trace) {
                     std::vector<size_t> shape(t.shape.rbegin(), t.shape.rend());  // ggml ne order -> NumPy order
                     out[name.c_str()] = to_numpy(std::move(t.data), shape);
                 }
                 return out;
             }, "features"_a, "block"_a);

    bind_native_draft(m);
}
