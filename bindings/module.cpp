// dflash_llama._core: nanobind glue over runtime/. No logic here: conversions, the GIL released
// around compute, C++ exceptions surfacing as Python exceptions (std::invalid_argument -> ValueError).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <stdexcept>

#include "cpu_dot_cols.h"
#include "engine.h"
#include "gguf_info.h"
#include "glue.h"
#include "ngram.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace dflash_bindings {

namespace {

// Paths arrive as std::filesystem::path: the OS's bytes, so a file name that is not UTF-8 still opens.
nb::dict gguf_info_dict(const std::filesystem::path & path) {
    dflash::gguf_file_info info;
    {
        nb::gil_scoped_release release;
        info = dflash::read_gguf_info(path.string());
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
    out["path"]         = nb::steal<nb::str>(PyUnicode_DecodeFSDefaultAndSize(info.path.data(), (Py_ssize_t) info.path.size()));
    out["architecture"] = info.architecture;
    out["version"]      = info.version;
    out["alignment"]    = info.alignment;
    out["data_offset"]  = info.data_offset;
    out["metadata"]     = metadata;
    out["tensors"]      = tensors;
    return out;
}

// A message that holds bytes which are not UTF-8 (a file name) keeps them as \xNN, not a UnicodeDecodeError.
void set_error(PyObject * type, const char * what) {
    PyObject * message = PyUnicode_DecodeUTF8(what, (Py_ssize_t) std::strlen(what), "backslashreplace");
    PyErr_SetObject(type, message);
    Py_XDECREF(message);
}

void translate_errors(const std::exception_ptr & p, void *) {
    try {
        std::rethrow_exception(p);
    } catch (const std::invalid_argument & e) {
        set_error(PyExc_ValueError, e.what());
    } catch (const std::runtime_error & e) {
        set_error(PyExc_RuntimeError, e.what());
    }
}

void bind_functions(nb::module_ & m) {
    nb::register_exception_translator(&translate_errors);
    m.def("llama_cpp_commit", []() { return std::string(DFLASH_LLAMA_CPP_COMMIT); },
          "The llama.cpp commit this module was built from.");
    m.def("supports_gpu_offload", []() { return llama_supports_gpu_offload(); },
          "Whether this build has a GPU backend with a device (n_gpu_layers / -ngl can offload).");
    m.attr("NO_GPU_BACKEND") = dflash::kNoGpuBackend;
    m.attr("NGRAM_MAX")      = dflash::draft_policy::kNgramMax;  // the longest n-gram proposal verified
    m.def("dot_cols_mismatches", [](const std::string & type, int n, int n_cols, uint32_t seed) {
              for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
                  const char * name = ggml_type_name((ggml_type) t);
                  if (name != nullptr && type == name) {
                      return dflash_dot_cols_mismatches((ggml_type) t, n, n_cols, seed);
                  }
              }
              throw std::invalid_argument("unknown ggml type '" + type + "'");
          }, "type"_a, "n"_a, "n_cols"_a, "seed"_a,
          "Of n_cols random columns, how many multi-column dot products (runtime/cpu_dot_cols.h) differ bit "
          "for bit from ggml's vec_dot for weights of `type` (e.g. 'q4_1'); -1 where this build has no kernel.");
    m.def("set_dot_cols", [](bool on) { dflash_dot_cols_enable(on); }, "on"_a,
          "Turn the multi-column dot products (runtime/cpu_dot_cols.h) on or off for this process, between "
          "generations: the same logits either way, for side-by-side speed measurements.");
    m.def("dot_cols", []() { return dflash_dot_cols_enabled(); },
          "Whether the multi-column dot products are on (DFLASH_LLAMA_DOT_COLS=0 turns them off at start).");
    m.def("gguf_info", &gguf_info_dict, "path"_a,
          "Read a GGUF header. Raises ValueError for a missing, foreign or truncated file.");
}

void bind_generate_params(nb::module_ & m) {
    using dflash::generate_params;
    nb::class_<generate_params>(m, "GenerateParams")
        .def(nb::init<>())
        .def_rw("max_new_tokens", &generate_params::max_new_tokens)
        .def_prop_rw("temperature", [](const generate_params & p) { return p.sampling.temperature; },
                     [](generate_params & p, float v) { p.sampling.temperature = v; })
        .def_prop_rw("top_p", [](const generate_params & p) { return p.sampling.top_p; },
                     [](generate_params & p, float v) { p.sampling.top_p = v; })
        .def_prop_rw("top_k", [](const generate_params & p) { return p.sampling.top_k; },
                     [](generate_params & p, int32_t v) { p.sampling.top_k = v; })
        .def_prop_rw("seed", [](const generate_params & p) { return p.sampling.seed; },
                     [](generate_params & p, uint64_t v) { p.sampling.seed = v; })
        .def_rw("block_size", &generate_params::block_size)
        .def_rw("adaptive", &generate_params::adaptive)
        .def_rw("draft_max", &generate_params::draft_max)
        .def_rw("draft_p_min", &generate_params::draft_p_min)
        .def_rw("ngram", &generate_params::ngram)
        .def_rw("confidence", &generate_params::confidence)
        .def_rw("stop_tokens", &generate_params::stop_tokens)
        .def_rw("stop_at_eog", &generate_params::stop_at_eog);
}

void bind_step_record(nb::module_ & m) {
    nb::class_<dflash::step_record>(m, "StepRecord")
        .def_ro("drafted", &dflash::step_record::drafted)
        .def_prop_ro("source", [](const dflash::step_record & r) { return std::string(dflash::source_name(r.source)); })
        .def_ro("accepted", &dflash::step_record::accepted)
        .def_ro("produced", &dflash::step_record::produced);
}

void bind_policy_summary(nb::module_ & m) {
    using dflash::policy_summary;
    nb::class_<policy_summary>(m, "PolicySummary")
        .def_ro("plain_steps", &policy_summary::plain_steps)
        .def_ro("draft_steps", &policy_summary::draft_steps)
        .def_ro("ngram_steps", &policy_summary::ngram_steps)
        .def_ro("ngram_drafted", &policy_summary::ngram_drafted)
        .def_ro("ngram_accepted", &policy_summary::ngram_accepted)
        .def_prop_ro("draft_tau", &policy_summary::draft_tau)
        .def_prop_ro("ngram_acceptance", &policy_summary::ngram_acceptance)
        .def_ro("probes", &policy_summary::probes)
        .def_ro("shadow_probes", &policy_summary::shadow_probes)
        .def_ro("calibration_ms", &policy_summary::calibration_ms)
        .def_ro("plain_ms", &policy_summary::plain_ms)
        .def_prop_ro("mean_draft", &policy_summary::mean_draft)
        .def_prop_ro("plain_share", &policy_summary::plain_share)
        .def_prop_ro("predicted_tokens_per_second", &policy_summary::predicted_tokens_per_second)
        .def_ro("confidence_steps", &policy_summary::confidence_steps)
        .def_ro("confidence_cut", &policy_summary::confidence_cut)
        .def_ro("confidence_expected", &policy_summary::confidence_expected)
        .def_ro("position_expected", &policy_summary::position_expected)
        .def_ro("confidence_accepted", &policy_summary::confidence_accepted);
}

// The adaptive loop's chooser on its own, fed synthetic costs by the tests.
void bind_draft_policy(nb::module_ & m) {
    using dflash::draft_policy;
    nb::class_<draft_policy>(m, "DraftPolicy")
        .def(nb::init<int32_t>(), "max_draft"_a)
        .def("__init__", [](draft_policy * p, int32_t max_draft, std::vector<double> verify_ms,
                            std::vector<double> draft_ms, bool shadow, double head_row_ms, double head_pass_ms) {
                 const dflash::step_costs costs{ std::move(verify_ms), std::move(draft_ms), head_row_ms, head_pass_ms };
                 new (p) draft_policy(max_draft, &costs, shadow);
             }, "max_draft"_a, "verify_ms"_a, "draft_ms"_a, "shadow"_a, "head_row_ms"_a = 0.0, "head_pass_ms"_a = 0.0)
        .def("resume", &draft_policy::resume, "earlier"_a)
        .def_prop_ro("probe_wait", &draft_policy::probe_wait)
        .def("choose", nb::overload_cast<>(&draft_policy::choose))
        .def("choose_step", [](draft_policy & p, int32_t ngram_len, int32_t match) {
                 const dflash::step_choice c = p.choose(ngram_len, match);
                 return nb::make_tuple(std::string(dflash::source_name(c.source)), c.n);
             }, "ngram_len"_a, "match"_a = 0)
        .def("observe_ngram", &draft_policy::observe_ngram, "m"_a, "accepted"_a, "t_verify_ms"_a)
        .def("observe_head", &draft_policy::observe_head, "rows"_a, "batches"_a, "t_ms"_a)
        .def_prop_ro("head_batch", &draft_policy::head_batch)
        .def("expected_ngram_ms", &draft_policy::expected_ngram_ms, "m"_a, "match"_a = 0)
        .def("expected_ngram_tokens", &draft_policy::expected_ngram_tokens, "m"_a, "match"_a = 0)
        .def("take_shadow", &draft_policy::take_shadow)
        .def("observe_shadow", &draft_policy::observe_shadow, "n"_a, "matched"_a, "settled"_a, "t_draft_ms"_a)
        .def("drop_shadow", &draft_policy::drop_shadow)
        .def("observe_plain", &draft_policy::observe_plain, "t_ms"_a)
        .def("observe_draft", &draft_policy::observe_draft, "n"_a, "accepted"_a, "t_draft_ms"_a, "t_verify_ms"_a)
        .def("expected_tokens", &draft_policy::expected_tokens, "n"_a)
        .def("perfect_speedup", &draft_policy::perfect_speedup)
        .def("gate_begin", &draft_policy::gate_begin, "n"_a)
        .def("keep_slot", &draft_policy::keep_slot, "i"_a, "c"_a)
        .def("observe_confidence", &draft_policy::observe_confidence, "conf"_a, "accepted"_a, "settled"_a, "shadow"_a)
        .def("calibrated", [](const draft_policy & p, float c) { return p.calibration()(c); }, "c"_a)
        .def("expected_ms", &draft_policy::expected_ms, "n"_a)
        .def_prop_ro("summary", &draft_policy::summary);
}

// The n-gram proposal source on its own, for the tests.
void bind_ngram_index(nb::module_ & m) {
    using dflash::ngram_index;
    nb::class_<ngram_index>(m, "NgramIndex")
        .def(nb::init<int32_t, int32_t>(), "n_min"_a = ngram_index::kMinN, "n_max"_a = ngram_index::kMaxN)
        .def("add", nb::overload_cast<const std::vector<int32_t> &>(&ngram_index::add), "tokens"_a)
        .def("propose", &ngram_index::propose, "max_len"_a)
        .def("propose_match", [](const ngram_index & ix, int32_t max_len) {
                 dflash::ngram_proposal p = ix.propose_match(max_len);
                 return nb::make_tuple(p.tokens, p.match);
             }, "max_len"_a)
        .def("__len__", &ngram_index::size);
}

void bind_generate_stats(nb::module_ & m) {
    using dflash::generate_stats;
    nb::class_<generate_stats>(m, "GenerateStats")
        .def_ro("n_prompt", &generate_stats::n_prompt)
        .def_ro("n_generated", &generate_stats::n_generated)
        .def_ro("t_prefill_ms", &generate_stats::t_prefill_ms)
        .def_ro("t_draft_ms", &generate_stats::t_draft_ms)
        .def_ro("t_verify_ms", &generate_stats::t_verify_ms)
        .def_ro("t_other_ms", &generate_stats::t_other_ms)
        .def_ro("t_total_ms", &generate_stats::t_total_ms)
        .def_prop_ro("tokens_per_second", &generate_stats::tokens_per_second);
}

void bind_thread_choice(nb::module_ & m) {
    using dflash::thread_choice;
    nb::class_<thread_choice>(m, "ThreadChoice")
        .def_ro("n_threads", &thread_choice::n_threads)
        .def_ro("measured", &thread_choice::measured)
        .def_ro("counts", &thread_choice::counts)
        .def_ro("plain_ms", &thread_choice::plain_ms)
        .def_ro("batch_rows", &thread_choice::batch_rows)
        .def_ro("batch_ms", &thread_choice::batch_ms)
        .def_ro("measurements", &thread_choice::measurements);
}

void bind_generate_result(nb::module_ & m) {
    using dflash::generate_result;
    nb::class_<generate_result>(m, "GenerateResult")
        .def_ro("tokens", &generate_result::tokens)
        .def_ro("steps", &generate_result::steps)
        .def_ro("stop_reason", &generate_result::stop_reason)
        .def_ro("stats", &generate_result::stats)
        .def_ro("adaptive", &generate_result::adaptive)
        .def_ro("policy", &generate_result::policy)
        .def_ro("threads", &generate_result::threads)
        .def_prop_ro("tau", &generate_result::tau)
        .def_prop_ro("acceptance_by_position", &generate_result::acceptance_by_position);
}

void engine_init(dflash::engine * self, const std::filesystem::path & target, const std::filesystem::path & draft, int32_t n_threads,
                 int32_t n_ctx, int32_t n_batch, int32_t n_gpu_layers, bool kv_f32, int32_t n_seq, bool compact_draft_head,
                 bool verbose, bool measure_threads, bool own_head, bool huge_pages) {
    dflash::engine_params p;
    p.target.path = target.string();
    p.target.n_threads = n_threads;
    p.target.n_ctx = n_ctx;
    p.target.n_batch = n_batch;
    p.target.n_gpu_layers = n_gpu_layers;
    p.target.kv_f32 = kv_f32;
    p.target.n_seq = n_seq;
    p.target.own_head = own_head;
    p.target.huge_pages = huge_pages;
    p.draft_path = draft.string();
    p.compact_draft_head = compact_draft_head;
    p.verbose = verbose;
    p.measure_threads = measure_threads;
    nb::gil_scoped_release release;
    new (self) dflash::engine(p);
}

nb::bytes as_bytes(const std::string & s) { return nb::bytes(s.data(), s.size()); }

nb::ndarray<nb::numpy, float> engine_target_logits(dflash::engine & e, const std::vector<int32_t> & tokens,
                                                   bool one_at_a_time, int32_t n_prefill) {
    std::vector<float> out;
    {
        nb::gil_scoped_release release;
        out = e.target_logits(tokens, one_at_a_time, n_prefill);
    }
    return to_numpy(std::move(out), { tokens.size(), (size_t) e.target().n_vocab() });
}

nb::ndarray<nb::numpy, float> engine_capture(dflash::engine & e, const std::vector<int32_t> & tokens,
                                             const std::vector<int32_t> & layer_ids) {
    std::vector<float> out;
    {
        nb::gil_scoped_release release;
        out = e.capture(tokens, layer_ids);
    }
    return to_numpy(std::move(out), { tokens.size(), layer_ids.size() * (size_t) e.target().n_embd() });
}

nb::dict engine_trace_draft(dflash::engine & e, features_array features, const std::vector<int32_t> & block) {
    std::vector<float> feats(features.data(), features.data() + features.size());
    dflash::draft_trace trace;
    {
        nb::gil_scoped_release release;
        trace = e.trace_draft(feats, (int32_t) features.shape(0), block);
    }
    return trace_to_dict(std::move(trace));
}

void bind_engine(nb::module_ & m) {
    using dflash::engine;
    using prompts = std::vector<std::vector<int32_t>>;
    nb::class_<engine>(m, "Engine")
        .def("__init__", &engine_init, "target"_a, "draft"_a, "n_threads"_a, "n_ctx"_a, "n_batch"_a,
             "n_gpu_layers"_a, "kv_f32"_a, "n_seq"_a, "compact_draft_head"_a, "verbose"_a, "measure_threads"_a = false,
             "own_head"_a = true, "huge_pages"_a = true)
        .def_prop_ro("has_draft", &engine::has_draft)
        .def_prop_ro("threads", &engine::threads)
        .def_prop_ro("compact_draft_head", [](engine & e) { return e.has_draft() && e.draft().compact_head(); })
        .def_prop_ro("n_ctx", [](engine & e) { return e.target().n_ctx(); })
        .def_prop_ro("output_head", [](engine & e) { return std::string(e.target().head_name()); })
        .def_prop_ro("huge_page_bytes", [](engine & e) { return e.target().huge_page_bytes(); })
        .def_prop_ro("n_vocab", [](engine & e) { return e.target().n_vocab(); })
        .def_prop_ro("n_embd", [](engine & e) { return e.target().n_embd(); })
        .def_prop_ro("n_layer", [](engine & e) { return e.target().n_layer(); })
        .def_prop_ro("block_size", [](engine & e) { return e.hparams().block_size; })
        .def_prop_ro("draft_variant", [](engine & e) { return std::string(e.hparams().variant().name); })
        .def_prop_ro("sample_from_anchor", [](engine & e) { return e.hparams().sample_from_anchor; })
        .def_prop_ro("has_confidence_head", [](engine & e) { return e.hparams().has_confidence_head; })
        .def_prop_ro("markov_rank", [](engine & e) { return e.hparams().markov_rank; })
        .def_prop_ro("mask_token_id", [](engine & e) { return e.hparams().mask_token_id; })
        .def_prop_ro("target_layer_ids", [](engine & e) { return e.hparams().target_layer_ids; })
        .def("tokenize", [](engine & e, nb::bytes text, bool add_special) {  // bytes: checked as UTF-8 in C++
                 return e.target().tokenize(std::string(text.c_str(), text.size()), add_special);
             }, "text"_a, "add_special"_a = true)
        .def("detokenize", [](engine & e, const std::vector<int32_t> & tokens) {
                 return as_bytes(e.target().detokenize(tokens));
             }, "tokens"_a)
        .def("piece", [](engine & e, int32_t token) { return as_bytes(e.target().piece(token)); }, "token"_a)
        .def("is_eog", [](engine & e, int32_t token) { return e.target().is_eog(token); }, "token"_a)
        .def("step_costs", [](const engine & e, int32_t block_size) -> nb::object {
                 const dflash::step_costs * c = e.measured_step_costs(block_size);
                 if (c == nullptr) return nb::none();
                 return nb::make_tuple(c->verify, c->draft, c->head_row, c->head_pass);
             }, "block_size"_a)
        .def("forget_policy", &engine::forget_policy)
        .def("remeasure_threads", &engine::remeasure_threads)
        .def("generate", &engine::generate, "prompt"_a, "params"_a, "on_tokens"_a.none() = nb::none(),
             nb::call_guard<nb::gil_scoped_release>())
        .def("autoregressive", &engine::autoregressive, "prompt"_a, "params"_a, "on_tokens"_a.none() = nb::none(),
             nb::call_guard<nb::gil_scoped_release>())
        .def("autoregressive_batch", [](engine & e, const prompts & ps, const dflash::generate_params & p) {
                 return e.autoregressive_batch(ps, p);
             }, "prompts"_a, "params"_a, nb::call_guard<nb::gil_scoped_release>())
        .def("target_logits", &engine_target_logits, "tokens"_a, "one_at_a_time"_a, "n_prefill"_a)
        .def("capture", &engine_capture, "tokens"_a, "layer_ids"_a)
        .def("trace_draft", &engine_trace_draft, "features"_a, "block"_a);
}

} // namespace

} // namespace dflash_bindings

NB_MODULE(_core, m) {
    using namespace dflash_bindings;
    m.doc() = "dflash-llama native runtime";
    bind_functions(m);
    bind_generate_params(m);
    bind_step_record(m);
    bind_policy_summary(m);
    bind_draft_policy(m);
    bind_ngram_index(m);
    bind_generate_stats(m);
    bind_thread_choice(m);
    bind_generate_result(m);
    bind_engine(m);
    bind_native_draft(m);
}
