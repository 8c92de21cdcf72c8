#include "huge_pages.h"

#include <cerrno>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dflash {

size_t collapse_to_huge_pages(ggml_backend_buffer_t buffer) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr uintptr_t kHuge = uintptr_t(2) << 20;
    constexpr int kCollapse = 25;  // MADV_COLLAPSE, absent from older headers
    if (buffer == nullptr || !ggml_backend_buffer_is_host(buffer)) {
        return 0;
    }
    const auto base = (uintptr_t) ggml_backend_buffer_get_base(buffer);
    const uintptr_t begin = (base + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t end   = (base + ggml_backend_buffer_get_size(buffer)) & ~(kHuge - 1);
    if (base == 0 || end <= begin) {
        return 0;
    }
    // the advice keeps the range huge-page eligible under THP's "madvise" mode; the collapse fails
    // harmlessly where unsupported (EINVAL), leaving the 4 KiB pages as they are, and transiently
    // (EAGAIN: no huge page free at that moment, or lock contention) on a busy machine: tried again
    madvise((void *) begin, end - begin, MADV_HUGEPAGE);
    for (int attempt = 0; attempt < 4; ++attempt) {
        if (madvise((void *) begin, end - begin, kCollapse) == 0) {
            return (size_t) (end - begin);
        }
        if (errno != EAGAIN) {
            break;
        }
    }
    return 0;
#else
    (void) buffer;
    return 0;
#endif
}

} // namespace dflash
