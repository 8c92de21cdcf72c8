// Weights in huge pages. A decode streams every weight once per step; in 4 KiB pages that is one TLB
// entry per 4 KiB read, in 2 MiB pages one per 2 MiB. With the weights in anonymous memory (the target
// loads without mmap: a file's page-cache pages cannot be collapsed this way), MADV_COLLAPSE (Linux
// 6.1+) rebuilds a range in transparent huge pages at once, whatever THP's sysfs mode but "never".
// Measured on the 2-CPU development machine (SmolLM2-135M Q4_1, llama-bench -n 64 -t 1, anonymous
// weights, 6 interleaved pairs): huge pages 1.037x (median) as fast as 4 KiB pages, no pair slower.
// Where the kernel cannot (another OS, an older kernel, THP off), nothing changes: same bytes, same
// kernels, bit for bit the same logits.
#pragma once

#include "ggml-backend.h"

#include <cstddef>

namespace dflash {

// Back the 2 MiB-aligned part of a host buffer with huge pages; the bytes now in huge pages (0: none).
size_t collapse_to_huge_pages(ggml_backend_buffer_t buffer);

} // namespace dflash
