#!/usr/bin/env bash
# One entry point for a fresh machine: sets everything up (idempotently), then runs a job.
#
#   bash scripts/run.sh bench [ARGS...]   the main job: the TabICLv2 benchmark driver (ARGS go to it)
#   bash scripts/run.sh test  [ARGS...]   every test: pytest (ARGS go to pytest) + ctest + a bounded
#                                         fuzz run + ctest under ASan/UBSan (TABSERVE_FUZZ_SECONDS=60)
#   bash scripts/run.sh setup             set-up only
#
# Set-up: Debian packages when GoogleTest or CMake are missing; a Python with torch (the system
# python3 when it already imports torch, as on the GPU machine, else a virtual environment .venv
# with torch 2.14.1 from the local wheel); the Python dependencies that are missing; and the
# extension, rebuilt only when a C++/CUDA source or the build files changed. Environment:
#   TORCH_CUDA_ARCH_LIST  CUDA architectures to build (default 9.0: H100/H200)
#   TABSERVE_CPU_ONLY=1   build without the CUDA kernels
#   TABSERVE_PYTHON       use this Python interpreter instead
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export PYTHONUNBUFFERED=1
log() { printf '[tabserve] %s\n' "$*" >&2; }

ensure_debian_packages() {
  local missing=()
  [ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
  command -v cmake >/dev/null || missing+=(cmake)
  command -v ninja >/dev/null || missing+=(ninja-build)
  # Optional: clang with libFuzzer for the fuzz run (skipped with a message when it cannot install).
  local optional=()
  command -v clang++ >/dev/null && compgen -G '/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-*.a' >/dev/null \
    || optional+=(clang libclang-rt-dev)
  [ ${#missing[@]} -eq 0 ] && [ ${#optional[@]} -eq 0 ] && return 0
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    log "installing Debian packages: ${missing[*]} ${optional[*]}"
    apt-get update -qq || log "apt-get update failed (offline?)"
    if [ ${#missing[@]} -gt 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    if [ ${#optional[@]} -gt 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${optional[@]}" >/dev/null \
        || log "could not install ${optional[*]}: the fuzz run will be skipped"
    fi
  else
    log "missing ${missing[*]} ${optional[*]} and cannot apt-get: C++ tests may not build, fuzzing skips"
  fi
}

choose_python() {
  if [ -n "${TABSERVE_PYTHON:-}" ]; then PY=$TABSERVE_PYTHON; return; fi
  if [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python; return; fi
  if python3 -c 'import torch' 2>/dev/null; then PY=$(command -v python3); return; fi
  log "creating .venv with torch 2.14.1 (local wheel)"
  python3 -m venv .venv
  PY=$ROOT/.venv/bin/python
  "$PY" -m pip install -q --upgrade pip setuptools wheel
  "$PY" -m pip install -q torch==2.14.1
}

ensure_python_packages() {
  # module name -> pip requirement
  local pairs=(numpy:numpy pandas:pandas pyarrow:pyarrow sklearn:scikit-learn pytest:pytest
               platformdirs:platformdirs psutil:psutil huggingface_hub:huggingface_hub
               safetensors:safetensors rich:rich matplotlib:matplotlib ninja:ninja
               setuptools:setuptools tabicl:tabicl==2.2.0
               'ray.data:ray[data]>=2.59,<2.64' aiohttp:aiohttp)
  local wanted=()
  for pair in "${pairs[@]}"; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || wanted+=("${pair#*:}")
  done
  [ ${#wanted[@]} -eq 0 ] && return 0
  log "installing Python packages: ${wanted[*]}"
  # Offline machines (the GPU machine) fail fast here; tests needing a missing package skip.
  "$PY" -m pip install -q --retries 0 --timeout 10 "${wanted[@]}" \
    || log "could not install ${wanted[*]} (offline?): tests needing them skip"
}

build_extension() {
  local stamp=build/.extension-stamp
  local newest
  newest=$(find csrc setup.py pyproject.toml -type f -newer "$stamp" 2>/dev/null | head -n 1 || true)
  if [ -f "$stamp" ] && [ -z "$newest" ] && "$PY" -c 'import tabserve' 2>/dev/null; then return 0; fi
  use_system_compiler
  log "building the extension (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, CXX=${CXX:-g++})"
  MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" -m pip install -q --no-build-isolation --no-deps -e . \
    || { log "extension build failed"; exit 1; }
  mkdir -p build && touch "$stamp"
}

# Prefer the system compiler when PATH puts another toolchain first: on the GPU machine the
# default g++ is /opt/gcc, and an extension built with it crashes (SIGSEGV) whenever a C++ error
# (TORCH_CHECK) is thrown, while /usr/bin/g++ builds one that raises RuntimeError as it should.
use_system_compiler() {
  [ -n "${CXX:-}" ] && return 0
  if [ -x /usr/bin/g++ ] && [ "$(command -v g++)" != /usr/bin/g++ ]; then
    export CC=/usr/bin/gcc CXX=/usr/bin/g++
  fi
}

setup() {
  ensure_debian_packages
  choose_python
  ensure_python_packages
  build_extension
}

run_tests() {
  log "pytest"
  "$PY" -m pytest -q -p no:cacheprovider "$@" test/python
  log "ctest"
  cmake -S . -B build/cmake -G Ninja -DPython3_EXECUTABLE="$PY" >/dev/null
  cmake --build build/cmake >/dev/null
  ctest --test-dir build/cmake --output-on-failure
  run_reliability
}

# Bounded fuzz run and the ASan + UBSan GoogleTest suites (docs/reference/reliability.md); about
# 3 minutes on a 2-core machine. Each skips with a message when its toolchain is missing (exit status 3).
run_reliability() {
  local status
  log "fuzz: string core, ${TABSERVE_FUZZ_SECONDS:-60} s"
  mkdir -p build
  status=0; bash scripts/fuzz.sh "${TABSERVE_FUZZ_SECONDS:-60}" >build/fuzz.log 2>&1 || status=$?
  case $status in
    0) tail -n 6 build/fuzz.log | sed 's/^/  /' >&2 ;;
    3) log "skipping the fuzz run: $(tail -n 1 build/fuzz.log)" ;;
    *) cat build/fuzz.log >&2; log "fuzzing found a crash (input in build/fuzz/)"; return "$status" ;;
  esac
  log "sanitizers: ctest under ASan + UBSan"
  status=0; PYTHON="$PY" bash scripts/sanitize.sh || status=$?
  case $status in
    0) ;;
    3) log "skipping the sanitizer run: no ASan/UBSan runtime for the C++ compiler" ;;
    *) return "$status" ;;
  esac
}

job=${1:-}
shift || true
case "$job" in
  setup) setup ;;
  test) setup; run_tests "$@" ;;
  bench) setup; "$PY" benchmarks/benchmark_tabiclv2.py "$@" ;;
  *) echo "usage: bash scripts/run.sh {bench|test|setup} [ARGS...]" >&2; exit 2 ;;
esac
