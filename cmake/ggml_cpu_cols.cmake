# ggml's CPU backend with our multi-column dot products (runtime/cpu_dot_cols.h) in its matmul.
#
# The pinned tree stays as fetched: the ggml-cpu target compiles a copy of its ggml-cpu.c, written
# here into the build folder, in which the matmul's chunk function first offers the chunk to
# dflash_mul_mat_chunk (2-D weights, two or more columns, one column per vec_dot call) and falls
# through to ggml's own loop where that declines. The hook's text is matched exactly: a pin whose
# matmul moved fails the configure in one line instead of building something else.

set(_cpu_target ggml-cpu)
if (NOT TARGET ${_cpu_target})
    message(FATAL_ERROR "ggml_cpu_cols: no target ${_cpu_target} (a build with several CPU variants is not supported)")
endif()
set(_cpu_src ${LLAMA_CPP_DIR}/ggml/src/ggml-cpu/ggml-cpu.c)
set(_cpu_copy ${CMAKE_CURRENT_BINARY_DIR}/ggml-cpu-cols/ggml-cpu.c)
file(READ ${_cpu_src} _text)

function(_cols_insert anchor insert before)
    string(FIND "${_text}" "${anchor}" _first)
    string(FIND "${_text}" "${anchor}" _last REVERSE)
    if (_first EQUAL -1 OR NOT _first EQUAL _last)
        message(FATAL_ERROR "ggml_cpu_cols: the matmul of ${_cpu_src} is not as pinned (anchor '${anchor}' "
                            "found ${_first}/${_last}): update cmake/ggml_cpu_cols.cmake for this llama.cpp")
    endif()
    if (before)
        string(REPLACE "${anchor}" "${insert}${anchor}" _out "${_text}")
    else()
        string(REPLACE "${anchor}" "${anchor}${insert}" _out "${_text}")
    endif()
    set(_text "${_out}" PARENT_SCOPE)
endfunction()

_cols_insert("static void ggml_compute_forward_mul_mat_one_chunk(" [=[
// dflash-llama: multi-column dot products, bit for bit vec_dot per column (runtime/cpu_dot_cols.h)
bool dflash_mul_mat_chunk(enum ggml_type type, int64_t n, const char * w, size_t w_stride, int64_t r0, int64_t r1,
                          const char * y, size_t y_stride, int64_t c0, int64_t c1, char * dst, size_t dst_stride);

]=] TRUE)
_cols_insert("    // attempt to reduce false-sharing (does not seem to make a difference)\n" [=[
    // dflash-llama: 2-D weights by columns stored one after the other, several at a time
    if (num_rows_per_vec_dot == 1 && ne02 == 1 && ne03 == 1 && ne12 == 1 && ne13 == 1 && nb0 == sizeof(float) &&
        (src1_cont || src1->type != vec_dot_type) &&
        dflash_mul_mat_chunk(type, ne00, (const char *) src0->data, nb01, ir0_start, ir0_end,
                             (const char *) wdata, row_size, ir1_start, ir1_end, (char *) dst->data, nb1)) {
        return;
    }

]=] TRUE)

set(_old "")
if (EXISTS ${_cpu_copy})
    file(READ ${_cpu_copy} _old)
endif()
if (NOT _old STREQUAL _text)  # rewritten only when it changes: no rebuild on every configure
    file(WRITE ${_cpu_copy} "${_text}")
endif()
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_cpu_src})

get_target_property(_sources ${_cpu_target} SOURCES)
list(FIND _sources "ggml-cpu/ggml-cpu.c" _at)
if (_at EQUAL -1)
    message(FATAL_ERROR "ggml_cpu_cols: ${_cpu_target} does not compile ggml-cpu/ggml-cpu.c as pinned")
endif()
list(REMOVE_AT _sources ${_at})
list(INSERT _sources ${_at} ${_cpu_copy})
set_property(TARGET ${_cpu_target} PROPERTY SOURCES ${_sources})
target_sources(${_cpu_target} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/runtime/cpu_dot_cols.c)
target_include_directories(${_cpu_target} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/runtime)
