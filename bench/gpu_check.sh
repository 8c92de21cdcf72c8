#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU (nvcc and the driver installed): a CUDA build of
# dflash-llama, then `python -m dflash_llama.bench.gpu_check` (bench/gpu_check.py): verify logits
# against decode logits on the GPU, greedy exactness of DFlash on HumanEval prompts, and the
# default-pair bench, with the target and the draft on the GPU. Writes reports/gpu-check-<device>/.
#
#   bench/gpu_check.sh              CUDA build for the GPUs it sees, then the check (-ngl -1: all layers)
#   bench/gpu_check.sh --cpu        a dry run on any machine: CPU build, the same checks with -ngl 0
#
# Other arguments go to bench/gpu_check.py (--limit N, -n N, --bench-min M, --out DIR, -t N).
# Environment: CUDAARCHS (default: the GPUs nvidia-smi sees, cmake/cuda.cmake), as for setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

cuda=ON
ngl=-1
args=()
for arg in "$@"; do
    case "$arg" in
        --cpu) cuda=OFF; ngl=0 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) args+=("$arg") ;;
    esac
done
if [ "$cuda" = ON ] && ! command -v nvcc >/dev/null; then
    echo "gpu_check.sh: no nvcc on the PATH: a CUDA build needs the CUDA toolkit (or run --cpu)" >&2
    exit 2
fi

start=$(date +%s)
GGML_CUDA=$cuda ./setup.sh
build_s=$(( $(date +%s) - start ))
echo "gpu_check.sh: build took ${build_s} s"
if [ "$cuda" = ON ] && ! .venv/bin/python -c "import dflash_llama, sys; sys.exit(0 if dflash_llama.supports_gpu_offload() else 1)"; then
    echo "gpu_check.sh: the CUDA build sees no GPU (nvidia-smi -L: $(nvidia-smi -L 2>&1 | head -1))" >&2
    exit 1
fi
exec .venv/bin/python -m dflash_llama.bench.gpu_check -ngl "$ngl" --build-seconds "$build_s" ${args[@]+"${args[@]}"}
