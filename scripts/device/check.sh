#!/usr/bin/env bash
# GPU-machine check in one command of at most 10 minutes: build, probe the C++ error path, then
# the stages: the CUDA-relevant test files, a quick align benchmark, the serving check,
# compute-sanitizer. Logs go to $OUT (or ./device-out). See scripts/device/README.md.
#   STAGES="tests align" DEADLINE=500 bash scripts/device/check.sh [PYTEST ARGS...]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # packages carried as wheels (tabicl, ...)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' | tee -a "$OUT/gpu.txt"

build() {
  echo "== build ($*)"
  env "$@" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install --no-build-isolation \
    --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  grep -m1 -oE '^\S*(g\+\+|c\+\+)' "$OUT/build.log" || true
}

# A C++ error (TORCH_CHECK) must reach Python as RuntimeError, not kill the process.
probe() {
  python3 -X faulthandler - <<'PY' >"$OUT/probe.log" 2>&1
import torch, tabserve
from tabserve import StringColumn, StringIndex
index = StringIndex(StringColumn.from_pylist(["a", "b"]))
q = StringColumn.from_pylist(["a"])
try:
    torch.ops.tabserve.string_lookup(index.vocabulary.data, index.vocabulary.offsets, index.segments,
        index.slot_hash, index.slot_row, q.data.reshape(1, -1), q.offsets, q.valid, 0, 64, True)
except RuntimeError as e:
    print("error path OK:", str(e).splitlines()[0])
PY
  local rc=$?
  cat "$OUT/probe.log" | tail -3
  return $rc
}

# The system compiler: the image's default g++ (/opt/gcc) builds an extension that crashes on
# every C++ error (a TORCH_CHECK aborts the process); scripts/run.sh makes the same choice.
# SKIP_BUILD=1: the caller built this tree in the same command (bench.sh's sanitize part).
DESELECT=()
if [ -z "${SKIP_BUILD:-}" ]; then
  if [ -x /usr/bin/g++ ]; then build CC=/usr/bin/gcc CXX=/usr/bin/g++; else build; fi
  probe || { echo "!! C++ errors crash: deselecting error-path tests"; DESELECT=(-k "not reject and not bad and not raise and not error"); }
fi

# Stages after the build, each skipped once $DEADLINE seconds (default 540) have passed, so one
# device command (10 min at most) always ends with its logs written. STAGES picks them (default all).
STAGES=${STAGES:-"tests align serving sanitize"}
DEADLINE=${DEADLINE:-540}
stage() { [[ " $STAGES " == *" $1 "* ]] || return 1
  if (( SECONDS > DEADLINE )); then echo "== $1: skipped (${SECONDS}s > ${DEADLINE}s)"; return 1; fi
  echo "== $1 (${SECONDS}s)"; }

if stage tests; then
  python3 -m pytest -q -p no:cacheprovider -p no:logging -rfE "${DESELECT[@]}" "$@" \
    test/python/test_string_lookup.py test/python/test_tables.py test/python/test_align.py \
    test/python/test_encoding.py test/python/test_padding_ops.py test/python/test_buckets.py \
    2>&1 | tee "$OUT/pytest_ops.log" | tail -25
  python3 -m pytest -q -p no:cacheprovider -p no:logging -rfE -m cuda "${DESELECT[@]}" \
    test/python/test_tabicl_model.py test/python/test_tabicl_estimators.py \
    test/python/test_padded_inference.py \
    2>&1 | tee "$OUT/pytest_tabicl_cuda.log" | tail -8
fi
if stage align; then
  timeout 150 python3 benchmarks/align_categories.py --device cuda --budget 0.2 \
    --out "$OUT/align_categories_h200.json" 2>&1 | tee "$OUT/align.log" | tail -25
fi
if stage serving; then
  timeout 300 python3 scripts/device/serving_check.py --out "$OUT/serving_check.json" 2>&1 \
    | tee "$OUT/serving_check.log" | tail -12
fi
# compute-sanitizer over the CUDA tests of our kernels (docs/reference/reliability.md); SAN_TIMEOUT seconds
# (default 90) per tool at most; SAN_TOOLS picks the tools.
if stage sanitize; then
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  read -r -a SAN_TESTS <<<"${SAN_TEST_FILES:-test/python/test_string_lookup.py test/python/test_padding_ops.py}"
  for tool in ${SAN_TOOLS:-memcheck racecheck initcheck synccheck}; do
    (( SECONDS > DEADLINE )) && { echo "-- $tool: skipped (time)"; continue; }
    # Leak reports are off by default: at exit they list cuBLAS handles and workspaces that
    # PyTorch keeps for the process (H200), not our kernels' memory.
    extra=(); [ $tool = memcheck ] && extra=(--leak-check "${SAN_LEAKS:-no}")
    [ $tool = racecheck ] && extra=(--racecheck-report all)
    # PyTorch's fused attention kernels (the "masked" prefix-attention backend) use more
    # cuda::barrier objects than synccheck tracks by default; past that the tool kills the context.
    [ $tool = synccheck ] && extra=(--num-cuda-barriers 65536)
    # Without the caching allocator every tensor is its own cudaMalloc (overruns show), but a
    # cudaMalloc inside a CUDA-graph capture invalidates it: capture tests run only with it on.
    nocache=(); select="cuda"
    if [ $tool = memcheck ] || [ $tool = initcheck ]; then
      nocache=(PYTORCH_NO_CUDA_MEMORY_CACHING=1); select="cuda and not graph"
    fi
    select="$select${SAN_K:+ and ($SAN_K)}"  # SAN_K: a further pytest -k expression
    # SAN_KERNEL: check only kernels whose name contains it (the tests' SDPA comparisons run
    # cuDNN kernels whose own racecheck reports would bury ours).
    [ -n "${SAN_KERNEL:-}" ] && extra+=(--kernel-name "kns=$SAN_KERNEL")
    # initcheck with a kernel filter tracks no writes of the other kernels: the tests' copies of
    # their outputs to the host then read "uninitialised" memory (H200);
    # only the filtered kernels' own device reads are meaningful, so leave the host API out.
    [ -n "${SAN_KERNEL:-}" ] && [ $tool = initcheck ] && extra+=(--check-api-memory-access no)
    # SAN_SCRIPT: a script of our kernels alone (scripts/device/sanitize_kernels.py) instead of tests.
    target=(python3 -m pytest -q -p no:cacheprovider -p no:logging -k "$select" "${SAN_TESTS[@]}")
    # SAN_SCRIPT_ARGS: its arguments (e.g. "--only all_equal": some operators' cases alone).
    [ -n "${SAN_SCRIPT:-}" ] && target=(python3 "$SAN_SCRIPT" ${SAN_SCRIPT_ARGS:-})
    env "${nocache[@]}" timeout "${SAN_TIMEOUT:-90}" "$CS" --tool $tool "${extra[@]}" --error-exitcode 1 --target-processes all \
      "${target[@]}" >"$OUT/sanitize_$tool.log" 2>&1
    echo "-- $tool rc=$? $(grep -E 'passed|failed|mismatches' "$OUT/sanitize_$tool.log" | tail -1) $(grep -m1 'ERROR SUMMARY' "$OUT/sanitize_$tool.log")"
  done
fi
echo "== done (${SECONDS}s)"
