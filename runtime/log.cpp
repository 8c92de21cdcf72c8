#include "log.h"

#include "ggml.h"
#include "llama.h"

#include <cstdio>
#include <mutex>

namespace dflash {

namespace {

std::mutex  g_mutex;
std::string g_last_error;
bool        g_verbose = false;

void on_log(ggml_log_level level, const char * text, void *) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (level == GGML_LOG_LEVEL_ERROR) {
        g_last_error = text;
        while (!g_last_error.empty() && (g_last_error.back() == '\n' || g_last_error.back() == ' ')) {
            g_last_error.pop_back();
        }
    }
    if (g_verbose) {
        std::fputs(text, stderr);
    }
}

} // namespace

void log_init(bool verbose) {
    static std::once_flag once;
    std::call_once(once, [] { llama_backend_init(); });
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        g_verbose = verbose;
    }
    llama_log_set(on_log, nullptr);
    ggml_log_set(on_log, nullptr);
}

std::string last_error() {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_last_error;
}

void clear_last_error() {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_last_error.clear();
}

} // namespace dflash
