// One logger for llama.cpp, ggml and our runtime: quiet by default, the last error kept so that
// exceptions can say why llama.cpp refused something.
#pragma once

#include <string>

namespace dflash {

// Installs the logger (idempotent). verbose: also print llama.cpp's info and warnings to stderr.
void log_init(bool verbose);

// The most recent error line logged by llama.cpp / ggml, "" if none; clear_last_error() resets it.
std::string last_error();
void        clear_last_error();

} // namespace dflash
