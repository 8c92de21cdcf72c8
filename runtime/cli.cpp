// llama-dflash-cli: DFlash speculative decoding with a GGUF target and a GGUF DFlash draft.
//
//   llama-dflash-cli -m target.gguf -md draft.gguf -p "def fib(n):" -n 128
//
// The text streams to stdout as it is produced; statistics go to stderr afterwards (tokens, tau,
// acceptance per block position, tok/s, time split). --json prints one JSON object instead.
#include "engine.h"

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <limits>

namespace {

struct cli_args {
    dflash::engine_params   engine;
    dflash::generate_params gen;
    std::string prompt;
    bool has_prompt = false;
    bool no_draft   = false;
    bool json       = false;
    cli_args() { engine.measure_threads = true; }  // until -t is given
};

void print_usage(const char * argv0) {
    std::printf(
        "usage: %s -m TARGET.gguf -md DRAFT.gguf (-p PROMPT | -f FILE) [options]\n"
        "\n"
        "  -m,  --model FILE        target model (GGUF)\n"
        "  -md, --model-draft FILE  DFlash draft model (GGUF): DFlash 1 or DFlash 2 (convolutions + candidate\n"
        "                           selector)\n"
        "  -p,  --prompt TEXT       prompt\n"
        "  -f,  --file FILE         read the prompt from a file\n"
        "  -n,  --n-predict N       tokens to generate (default: 128)\n"
        "  -t,  --threads N         CPU threads (0 = all; -1 = all, as llama.cpp; default: measured, the fastest\n"
        "                           of 1, 2 and all for a plain decode and a verify, again when decoding slows down)\n"
        "  -c,  --ctx-size N        context size (default: 4096)\n"
        "  -b,  --batch-size N      prompt chunk size (default: 512)\n"
        "  -ngl, --n-gpu-layers N   target layers on the GPU (default: 0; -1: all; a GPU build only);\n"
        "                           the draft runs on the GPU when the target's output layer does\n"
        "  --temp T                 temperature, 0 = greedy (default: 0)\n"
        "  --top-p P                nucleus sampling (default: 1.0 = off)\n"
        "  --top-k K                top-k sampling (default: 0 = off)\n"
        "  -s, --seed N             sampling seed (default: 0)\n"
        "  --block-size B           draft block size (default: the draft's)\n"
        "  --draft-max auto|N       drafted tokens verified per step: auto chooses, each step, what to verify\n"
        "                           for the highest expected speed on this machine: nothing (a plain decode),\n"
        "                           N drafted tokens, or an n-gram continuation (--ngram); N: at most N\n"
        "                           drafted tokens, every step (default: auto)\n"
        "  --draft-p-min P          a draft with a confidence head (DSpark): each draft stops before its first\n"
        "                           slot whose confidence is below P (default: 0 = never)\n"
        "  --ngram on|off           with --draft-max auto, also verify continuations of the text so far found\n"
        "                           by n-gram lookup (the last 4 down to 2 tokens), no draft forward (default: on)\n"
        "  --draft-confidence on|off  with --draft-max auto and a confidence head (DSpark): cut each draft where\n"
        "                           its calibrated confidences stop paying, before the verify (default: on)\n"
        "  --draft-head compact|target  the head the draft proposes through: compact, a Q4_0 copy of the\n"
        "                           target's (cheaper; made at load when the target's is larger), or the\n"
        "                           target's own (as the reference computes it) (default: compact)\n"
        "  --mmap, --no-mmap        --mmap: map the target's file as llama.cpp's tools do; --no-mmap (the\n"
        "                           default): read it into memory, backed by huge pages where the kernel can\n"
        "                           (faster decoding, the same logits)\n"
        "  --no-draft               plain autoregressive decoding of the target\n"
        "  --ignore-eos             do not stop at end-of-generation tokens\n"
        "  --json                   print one JSON object (tokens, text, steps, tau, stats)\n"
        "  -v, --verbose            show llama.cpp's log\n"
        "  --version                print the version and exit\n",
        argv0);
}

// One line: a message from llama.cpp or the OS may hold newlines.
std::string one_line(const char * what) {
    std::string out;
    bool space = false;
    for (const char * c = what; *c; ++c) {
        if (std::isspace((unsigned char) *c)) { space = !out.empty(); continue; }
        if (space) out += ' ';
        space = false;
        out += *c;
    }
    return out.empty() ? "unknown error" : out;
}

[[noreturn]] void usage_error(const std::string & msg) {
    std::fprintf(stderr, "llama-dflash-cli: error: %s (see --help)\n", one_line(msg.c_str()).c_str());
    std::exit(2);
}

// The whole string as an integer of type T; out of T's range is an error, never a wrap. What the
// value means (at least 1, ...) is checked by the runtime, which knows the model.
template <typename T>
T parse_int(const std::string & flag, const char * value) {
    const char * end = value + std::strlen(value);
    const char * digits = value + (std::is_unsigned_v<T> && *value == '-' ? 1 : 0);  // from_chars refuses "-3" for T unsigned
    T v{};
    const auto [ptr, ec] = std::from_chars(digits, end, v);
    if (ptr != end || ptr == digits || (ec != std::errc() && ec != std::errc::result_out_of_range)) {
        usage_error("invalid integer for " + flag + ": '" + value + "'");
    }
    if (ec == std::errc::result_out_of_range || (digits != value && v != 0)) {
        usage_error(flag + " " + value + " is out of range [" + std::to_string(std::numeric_limits<T>::min()) + ", " +
                    std::to_string(std::numeric_limits<T>::max()) + "]");
    }
    return v;
}

float parse_float(const std::string & flag, const char * value) {
    char * end = nullptr;
    errno = 0;
    const float v = std::strtof(value, &end);
    if (end == value || *end != '\0' || std::isspace((unsigned char) *value)) {
        usage_error("invalid number for " + flag + ": '" + value + "'");
    }
    if (errno == ERANGE && std::isinf(v)) {  // "1e99": not a float; "inf" itself is left to the runtime's checks
        usage_error(flag + " " + value + " is out of range for a 32-bit float");
    }
    return v;
}

std::string read_prompt_file(const char * path) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) usage_error(std::string("cannot read prompt file '") + path + "': a directory");
    std::ifstream in(path, std::ios::binary);
    if (!in) usage_error(std::string("cannot read prompt file '") + path + "'");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

cli_args parse_args(int argc, char ** argv) {
    cli_args a;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        auto value = [&]() -> const char * {
            if (i + 1 >= argc) usage_error("missing value for " + flag);
            return argv[++i];
        };
        auto int32 = [&]() { return parse_int<int32_t>(flag, value()); };
        if (flag == "-h" || flag == "--help") { print_usage(argv[0]); std::exit(0); }
        else if (flag == "--version") { std::printf("llama-dflash-cli (llama.cpp %s)\n", DFLASH_LLAMA_CPP_COMMIT); std::exit(0); }
        else if (flag == "-m"   || flag == "--model")        a.engine.target.path = value();
        else if (flag == "-md"  || flag == "--model-draft")  a.engine.draft_path = value();
        else if (flag == "-p"   || flag == "--prompt")       { a.prompt = value(); a.has_prompt = true; }
        else if (flag == "-f"   || flag == "--file")         { a.prompt = read_prompt_file(value()); a.has_prompt = true; }
        else if (flag == "-n"   || flag == "--n-predict")    a.gen.max_new_tokens = int32();
        else if (flag == "-t"   || flag == "--threads")      { a.engine.target.n_threads = int32(); a.engine.measure_threads = false; }
        else if (flag == "-c"   || flag == "--ctx-size")     a.engine.target.n_ctx = int32();
        else if (flag == "-b"   || flag == "--batch-size")   a.engine.target.n_batch = int32();
        else if (flag == "-ngl" || flag == "--n-gpu-layers") a.engine.target.n_gpu_layers = int32();
        else if (flag == "--temp")       a.gen.sampling.temperature = parse_float(flag, value());
        else if (flag == "--top-p")      a.gen.sampling.top_p = parse_float(flag, value());
        else if (flag == "--top-k")      a.gen.sampling.top_k = int32();
        else if (flag == "-s" || flag == "--seed") a.gen.sampling.seed = parse_int<uint64_t>(flag, value());
        else if (flag == "--block-size") a.gen.block_size = int32();
        else if (flag == "--draft-p-min") a.gen.draft_p_min = parse_float(flag, value());
        else if (flag == "--draft-max")  {
            const char * v = value();
            a.gen.adaptive = std::strcmp(v, "auto") == 0;
            if (a.gen.adaptive) a.gen.draft_max.reset();
            else a.gen.draft_max = parse_int<int32_t>(flag, v);
        }
        else if (flag == "--ngram") {
            const std::string v = value();
            if (v != "on" && v != "off") usage_error("--ngram must be on or off, got '" + v + "'");
            a.gen.ngram = v == "on";
        }
        else if (flag == "--draft-confidence") {
            const std::string v = value();
            if (v != "on" && v != "off") usage_error("--draft-confidence must be on or off, got '" + v + "'");
            a.gen.confidence = v == "on";
        }
        else if (flag == "--draft-head") {
            const std::string v = value();
            if (v != "compact" && v != "target") usage_error("--draft-head must be compact or target, got '" + v + "'");
            a.engine.compact_draft_head = v == "compact";
        }
        else if (flag == "--no-draft")   a.no_draft = true;
        else if (flag == "--mmap")       a.engine.target.huge_pages = false;
        else if (flag == "--no-mmap")    a.engine.target.huge_pages = true;
        else if (flag == "--ignore-eos") a.gen.stop_at_eog = false;
        else if (flag == "--json")       a.json = true;
        else if (flag == "-v" || flag == "--verbose") a.engine.verbose = true;
        else usage_error("unknown argument '" + flag + "'");
    }
    if (a.engine.target.path.empty()) usage_error("a target model is required (-m)");
    if (a.engine.draft_path.empty() && !a.no_draft) usage_error("a draft model is required (-md), or pass --no-draft");
    if (!a.has_prompt) usage_error("a prompt is required (-p or -f)");
    if (a.no_draft) a.engine.draft_path.clear();
    return a;
}

std::string json_escape(const std::string & s) {
    std::string out;
    for (const unsigned char c : s) {
        switch (c) {
            case '"':  out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n";  break;
            case '\r': out += "\\r";  break;
            case '\t': out += "\\t";  break;
            default:
                if (c < 0x20) { char buf[8]; std::snprintf(buf, sizeof(buf), "\\u%04x", c); out += buf; }
                else out += (char) c;
        }
    }
    return out;
}

template <typename T>
std::string json_list(const std::vector<T> & v) {
    std::ostringstream ss;
    ss << "[";
    for (size_t i = 0; i < v.size(); ++i) ss << (i ? ", " : "") << v[i];
    ss << "]";
    return ss.str();
}

void print_json(const dflash::generate_result & r, const std::string & text) {
    const auto & s = r.stats;
    std::ostringstream ss;
    ss << "{\"tokens\": " << json_list(r.tokens) << ", \"text\": \"" << json_escape(text) << "\", \"steps\": [";
    for (size_t i = 0; i < r.steps.size(); ++i) {
        ss << (i ? ", " : "") << "{\"drafted\": " << json_list(r.steps[i].drafted) << ", \"accepted\": " << r.steps[i].accepted
           << ", \"produced\": " << r.steps[i].produced << "}";
    }
    ss << "], \"tau\": " << r.tau() << ", \"stop_reason\": \"" << r.stop_reason << "\", \"acceptance_by_position\": "
       << json_list(r.acceptance_by_position()) << ", \"stats\": {\"n_prompt\": " << s.n_prompt << ", \"n_generated\": "
       << s.n_generated << ", \"t_prefill_ms\": " << s.t_prefill_ms << ", \"t_draft_ms\": " << s.t_draft_ms
       << ", \"t_verify_ms\": " << s.t_verify_ms << ", \"t_other_ms\": " << s.t_other_ms << ", \"t_total_ms\": "
       << s.t_total_ms << ", \"tokens_per_second\": " << s.tokens_per_second() << "}, \"threads\": {\"n_threads\": "
       << r.threads.n_threads << ", \"measured\": " << (r.threads.measured ? "true" : "false") << ", \"counts\": "
       << json_list(r.threads.counts) << ", \"plain_ms\": " << json_list(r.threads.plain_ms) << ", \"batch_rows\": "
       << r.threads.batch_rows << ", \"batch_ms\": " << json_list(r.threads.batch_ms) << "}";
    if (r.adaptive) {
        const auto & p = r.policy;
        ss << ", \"policy\": {\"plain_steps\": " << p.plain_steps << ", \"draft_steps\": " << p.draft_steps
           << ", \"ngram_steps\": " << p.ngram_steps << ", \"ngram_drafted\": " << p.ngram_drafted
           << ", \"ngram_accepted\": " << p.ngram_accepted << ", \"draft_tau\": " << p.draft_tau()
           << ", \"probes\": " << p.probes << ", \"shadow_probes\": " << p.shadow_probes
           << ", \"calibration_ms\": " << p.calibration_ms << ", \"mean_draft\": " << p.mean_draft() << ", \"predicted_tokens_per_second\": "
           << p.predicted_tokens_per_second() << ", \"confidence_steps\": " << p.confidence_steps
           << ", \"confidence_cut\": " << p.confidence_cut << ", \"confidence_expected\": " << p.confidence_expected
           << ", \"position_expected\": " << p.position_expected << ", \"confidence_accepted\": "
           << p.confidence_accepted << "}";
    }
    ss << "}";
    std::printf("%s\n", ss.str().c_str());
}

// "1 (measured 6.1 ms vs 9.8 ms at 2; a verify of 8: 41.8 ms vs 60.2 ms at 2)": the count chosen,
// its plain decode and the others', then the same for a verify of the draft's block.
std::string threads_line(const dflash::thread_choice & t) {
    std::ostringstream ss;
    ss.setf(std::ios::fixed);
    ss.precision(1);
    const auto times = [&](const std::vector<double> & ms) {  // the chosen count's first, then the others'
        for (size_t i = 0; i < t.counts.size(); ++i) {
            if (t.counts[i] == t.n_threads) ss << " " << ms[i] << " ms";
        }
        for (size_t i = 0; i < t.counts.size(); ++i) {
            if (t.counts[i] != t.n_threads) ss << " vs " << ms[i] << " ms at " << t.counts[i];
        }
    };
    ss << t.n_threads << " (measured";
    times(t.plain_ms);
    if (t.batch_rows > 0) {
        ss << "; a verify of " << t.batch_rows << ":";
        times(t.batch_ms);
    }
    if (t.measurements > 1) ss << "; " << t.measurements << " measurements";
    ss << ")";
    return ss.str();
}

// `draft`: the draft's hyper-parameters, nullptr for plain decoding.
void print_stats(const dflash::generate_result & r, const dflash::draft_hparams * draft) {
    const auto & s = r.stats;
    const bool speculative = draft != nullptr;
    std::fprintf(stderr, "\n\n");
    if (speculative) {
        std::fprintf(stderr, "draft:            %s", draft->variant().title);
        if (draft->variant().has(dflash::draft_head::selector)) {
            std::fprintf(stderr, " (convolutions of %d taps, selector of rank %d over the top %d)", draft->conv_kernel_size,
                         draft->selector_rank, draft->selector_top_k);
        }
        if (draft->variant().has(dflash::draft_head::markov)) {
            std::fprintf(stderr, " (Markov head of rank %d%s)", draft->markov_rank,
                         draft->has_confidence_head ? ", confidence head" : "");
        }
        if (draft->sample_from_anchor) {
            std::fprintf(stderr, ", anchor-first block");
        }
        std::fprintf(stderr, "\n");
    }
    std::fprintf(stderr, "prompt tokens:    %d\n", s.n_prompt);
    std::fprintf(stderr, "generated tokens: %d (stop: %s)\n", s.n_generated, r.stop_reason.c_str());
    if (speculative) {
        std::fprintf(stderr, "target verifies:  %zu\n", r.steps.size());
        std::fprintf(stderr, "tau:              %.3f tokens per verify\n", r.tau());
        std::fprintf(stderr, "acceptance by block position:");
        for (const double a : r.acceptance_by_position()) std::fprintf(stderr, " %.2f", a);
        std::fprintf(stderr, "\n");
        if (r.adaptive) {
            const auto & p = r.policy;
            std::fprintf(stderr, "draft length:     auto: %.0f%% plain steps (%d probes, %d of them unverified drafts), "
                                 "mean N %.2f over %d drafting steps; predicted %.1f tok/s\n", 100.0 * p.plain_share(),
                         p.probes, p.shadow_probes, p.mean_draft(), p.draft_steps, p.predicted_tokens_per_second());
            std::fprintf(stderr, "steps:            %d plain, %d draft (tau %.2f), %d n-gram (acc %.2f)\n", p.plain_steps,
                         p.draft_steps, p.draft_tau(), p.ngram_steps, p.ngram_acceptance());
            if (p.confidence_steps > 0 || p.confidence_cut > 0) {
                std::fprintf(stderr, "confidence gate:  %lld slots cut; over %d verified drafts, accepted %lld, expected "
                                     "%.1f by the calibrated confidences, %.1f by position\n",
                             (long long) p.confidence_cut, p.confidence_steps, (long long) p.confidence_accepted,
                             p.confidence_expected, p.position_expected);
            }
            if (p.calibration_ms > 0.0) {
                std::fprintf(stderr, "step costs:       measured in %.0f ms before the generation (once per run)\n",
                             p.calibration_ms);
            }
        }
    }
    if (r.threads.measured) {
        std::fprintf(stderr, "threads:          %s\n", threads_line(r.threads).c_str());
    }
    std::fprintf(stderr, "speed:            %.2f tok/s (prefill excluded)\n", s.tokens_per_second());
    std::fprintf(stderr, "time:             total %.1f ms = prefill %.1f + draft %.1f + verify %.1f + other %.1f\n",
                 s.t_total_ms, s.t_prefill_ms, s.t_draft_ms, s.t_verify_ms, s.t_other_ms);
}

} // namespace

int main(int argc, char ** argv) {
    const cli_args args = parse_args(argc, argv);
    try {
        dflash::engine eng(args.engine);
        const std::vector<int32_t> prompt = eng.target().tokenize(args.prompt, true);

        dflash::token_callback stream;
        bool echoed = false;
        if (!args.json) {
            stream = [&](const std::vector<int32_t> & tokens) {
                if (!echoed) std::fputs(args.prompt.c_str(), stdout);  // once the runtime accepted the request
                echoed = true;
                for (const int32_t t : tokens) std::fputs(eng.target().piece(t).c_str(), stdout);
                std::fflush(stdout);
            };
        }
        const dflash::generate_result r = args.no_draft ? eng.autoregressive(prompt, args.gen, stream)
                                                        : eng.generate(prompt, args.gen, stream);
        if (args.json) {
            print_json(r, eng.target().detokenize(r.tokens));
        } else {
            print_stats(r, args.no_draft ? nullptr : &eng.hparams());
        }
    } catch (const std::invalid_argument & e) {  // bad input: a value, a file, a prompt
        std::fprintf(stderr, "llama-dflash-cli: error: %s\n", one_line(e.what()).c_str());
        return 2;
    } catch (const std::exception & e) {
        std::fprintf(stderr, "llama-dflash-cli: error: %s\n", one_line(e.what()).c_str());
        return 1;
    }
    return 0;
}
