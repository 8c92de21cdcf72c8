#!/usr/bin/env bash
# Builds llama-dflash-cli with AddressSanitizer (our runtime instrumented, llama.cpp as usual) in
# build/asan, then runs full generations of the tiny fixture pair: greedy (the adaptive loop and the
# whole block), sampled, a short draft length, a full context, plain decoding; and of the tiny target
# with a DFlash 2 draft (f16: codebook rows dequantised on the host): greedy, sampled, a short draft
# length. Then runs the fuzz
# corpus under it (parity/fuzz.py): FUZZ_MUTANTS (default 40) mutants each of the draft and the
# target GGUF, seed FUZZ_SEED (default 0), with no address-space limit (ASan reserves terabytes of
# it) and a 60 s timeout; failing mutants are kept in build/asan/fuzz-findings,
# each with a repro.txt. Exits non-zero on any ASan or LeakSanitizer report, signal, hang or wrong
# output. Needs ./setup.sh done first (for the fixtures).
#
#   runtime/asan_check.sh                     # the generations, then 2 x 40 mutants
#   FUZZ_MUTANTS=0 runtime/asan_check.sh      # the generations only
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/asan
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDFLASH_LLAMA_SANITIZE=ON \
      -DDFLASH_LLAMA_PYTHON=OFF -DPython_EXECUTABLE="$PWD/.venv/bin/python" > "$build.configure.log"
cmake --build "$build" --target llama-dflash-cli
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python - "$work" <<'PY'
import sys
from pathlib import Path
from dflash_llama import fixtures
from dflash_llama.converter import convert
w = Path(sys.argv[1])
t = fixtures.tiny_target_hf(w / "t")
tg = fixtures.tiny_target_gguf(t, w / "target.gguf")
convert(fixtures.tiny_draft_hf(w / "d", t), tg, w / "draft.gguf", outtype="f32")
cfg = fixtures.TinyDraftConfig(variant="dflash2", layers=2, target_layer_ids=[1, 2], conv_kernel_size=3,
                               selector_top_k=8, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
convert(fixtures.tiny_draft_hf(w / "d2", t, cfg), tg, w / "dflash2.gguf", outtype="f16")
PY
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:abort_on_error=0
cli="$build/llama-dflash-cli"
run() { echo "== llama-dflash-cli $*"; "$cli" -m "$work/target.gguf" -md "$work/draft.gguf" -t 2 --json "$@" > /dev/null; }
run -p "def fibonacci(n):" -n 64                                   # the adaptive loop, compact head
run -p "def fibonacci(n):" -n 64 --draft-max 7 --draft-head target  # the whole block, the target's head
run -p "def fibonacci(n):" -n 64 --temp 1.0 --top-k 40 --top-p 0.9 -s 7
run -p "Once upon a time" -n 64 --block-size 16 --draft-max 3
run -p "import numpy as np" -n 200 -c 48 -b 16
run -p "hello" -n 32 --no-draft
run2() { echo "== llama-dflash-cli (DFlash 2) $*"; "$cli" -m "$work/target.gguf" -md "$work/dflash2.gguf" -t 2 --json "$@" > /dev/null; }
run2 -p "def fibonacci(n):" -n 64
run2 -p "def fibonacci(n):" -n 64 --temp 1.0 --top-k 40 -s 7 --draft-max 7 --draft-head target
run2 -p "import numpy as np" -n 200 -c 48 -b 16 --block-size 16 --draft-max 3
echo "AddressSanitizer: no errors in 9 generations"
mutants=${FUZZ_MUTANTS:-40}
if [ "$mutants" -gt 0 ]; then
  # the campaign's own corpus cache (the same tiny pair), in the ASan build folder
  .venv/bin/python -m dflash_llama.parity.fuzz --cli "$cli" --target draft --target target \
      --per-target "$mutants" --seed "${FUZZ_SEED:-0}" --as-limit-gib 0 --timeout 60 -j 2 \
      --work "$build/fuzz-corpus" --out "$build/fuzz-findings" --no-progress
  echo "AddressSanitizer: no errors in the fuzz corpus"
fi
