#!/usr/bin/env bash
# Builds the GoogleTest suites with AddressSanitizer + UndefinedBehaviorSanitizer
# (CMake option TABSERVE_SANITIZE=ON, build folder build/sanitize) and runs them under ctest:
# test_core (torch-free core), fuzz_corpus_replay (the fuzz corpus and regressions) and test_ops
# (the operators through the dispatcher, linked against the uninstrumented libtorch).
#
#   bash scripts/sanitize.sh                 everything
#   TABSERVE_WITH_TORCH=OFF bash scripts/sanitize.sh   the torch-free tests only (fast)
#
# Environment: PYTHON (the interpreter whose torch test_ops links; default .venv/bin/python or
# python3), CXX (compiler; default the system c++, GCC on Debian, which ships libasan/libubsan).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || command -v python3 )}
BUILD=build/sanitize
# Exit status 3 means "cannot sanitize on this machine" (scripts/run.sh then skips).
if ! echo 'int main() { return 0; }' | "${CXX:-c++}" -x c++ -fsanitize=address,undefined - -o /dev/null 2>/dev/null; then
  echo "[sanitize] ${CXX:-c++} cannot link -fsanitize=address,undefined (libasan / libubsan missing)" >&2
  exit 3
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$BUILD" "${generator[@]}" -DTABSERVE_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTABSERVE_WITH_TORCH="${TABSERVE_WITH_TORCH:-ON}" -DPython3_EXECUTABLE="$PYTHON" >/dev/null
cmake --build "$BUILD" -j "${MAX_JOBS:-$(nproc)}" >/dev/null
# libtorch itself is not instrumented (its own memory errors go unseen), but every allocation
# goes through ASan's malloc, so our out-of-bounds accesses and leaks (LeakSanitizer) are caught.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
ctest --test-dir "$BUILD" --output-on-failure -j "${MAX_JOBS:-$(nproc)}"
