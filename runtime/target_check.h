// The target's GGUF checked before llama.cpp loads it. llama.cpp's loader asserts on some values
// (a layer count of 0, duplicate token strings, an I32 weight, a RoPE size that is not the head
// size, ...), and an assert takes the whole process down: the CLI, or the Python process that
// called Runtime(...). Each check here turns one of those into a one-line error.
#pragma once

#include <string>

struct llama_model;

namespace dflash {

// Throws std::invalid_argument "<path>: <key or tensor>: <value>, expected <what>".
void check_target_gguf(const std::string & path);

// After loading: refuses a target that llama.cpp runs without a causal mask (the architecture's
// default or `<arch>.attention.causal` false): the verify would let each drafted token see the
// ones after it, and speculative output would differ from plain decoding.
void check_target_causal(const llama_model * model, const std::string & path);

} // namespace dflash
