#!/usr/bin/env bash
# Measurements on the GPU machine, in one command of at most 10 minutes: builds with
# scripts/device/check.sh (no test stages), then runs its arguments in order, each bounded by the
# time left ($LIMIT seconds in all). Everything it writes goes under $OUT (default ./device-out):
# the driver's output per workload in $OUT/<workload>/, the benchmarks' JSON, and logs/.
# See scripts/device/README.md.
#
#   bash scripts/device/bench.sh small large        # the driver's default cells on each workload
#   CELLS="ref-fp16 large" bash scripts/device/bench.sh xlarge
#   bash scripts/device/bench.sh kernels profile    # micro-benchmarks, then the profiles
#
# Arguments: a driver workload (small, medium, large, xlarge, many-class, regression, stream;
# `python -m tabserve.bench --list`), or one of
#   kernels   the kernel micro-benchmarks (KERNELS picks some: small_head_attention icl_attention
#             feed_forward norm_linear layer_norm_cast qassmax_scale table_checks all_equal rotary)
#   profile   benchmarks/profile_tabiclv2.py on PROFILE_WORKLOADS (default "small large") for
#             PROFILE_CELLS (default: the reference fp16 cell and every preset)
#   align     the category-alignment benchmark (its string-lookup and table tests first)
#   soak      benchmarks/soak.py (SOAK_PRESET: serve through a preset; SOAK_SECONDS)
#   soak-estimators  benchmarks/soak.py --estimators: fresh classifiers with the default recipe,
#             background compiles included (SOAK_SIZE, default tiny; SOAK_SECONDS)
#   estimators  the estimator suite (`python -m tabserve.bench estimators`, tabicl in the same
#             run) with ESTIMATOR_ARGS (default: every kind, recipe auto, 3 repeats), in $OUT/estimators
#   many-tables  the many-tables suite with MANY_ARGS (default: 60 tables), in $OUT/many-tables
#   contention  benchmarks/compile_contention.py: a served call alone, beside a Python-busy warm-up,
#             beside one that pauses for the calls (as the background compiles do), and beside a
#             Triton compile in this process and in child processes (--triton)
#   offload   benchmarks/offload_capacity.py: the widest table tabicl and tabserve fit in each
#             offload_mode (OFFLOAD_ARGS, e.g. "--engines tabserve --modes cpu")
#   pytest    PYTEST_ARGS (default: the CUDA tests, -m cuda test/python)
#   sanitize  compute-sanitizer over the kernels' CUDA tests (check.sh's sanitize stage)
#   ncu       Nsight Compute over scripts/device/ncu_probe.py (NCU_ARGS, NCU_KERNELS)
# Driver options: CELLS (default: the driver's default cells), CELLS_FILE (--cells-file),
# BENCH_ARGS (more driver arguments), CELL_TIMEOUT (seconds per cell, default 400).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/device-out}
LOG=$OUT/logs
mkdir -p "$OUT" "$LOG"
LIMIT=${LIMIT:-560}  # seconds of this command that the arguments may use
left() { local t=$(( $1 - SECONDS )); (( t < 10 )) && t=10; echo $t; }

STAGES=none OUT="$LOG/build" bash scripts/device/check.sh >"$LOG/build.log" 2>&1 || {
  tail -20 "$LOG/build.log"; exit 1; }
ls .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
echo "== built (${SECONDS}s)"

tests() {  # tests NAME SECONDS PYTEST_ARGS...: pytest into $LOG/NAME.log, then its verdict
  local name=$1 seconds=$2; shift 2
  timeout "$seconds" python3 -m pytest -p no:cacheprovider -p no:logging -rfE "$@" \
    >"$LOG/$name.log" 2>&1
  echo "$name rc=$?"
  grep -n -B2 -A12 "^E " "$LOG/$name.log" | head -60
  tail -3 "$LOG/$name.log"
}

driver() {  # driver WORKLOAD: the driver's cells on one workload, output in $OUT/WORKLOAD
  local workload=$1
  # shellcheck disable=SC2086  # CELLS and BENCH_ARGS are word lists
  python3 -m tabserve.bench --device cuda --quiet --workloads "$workload" \
    ${CELLS:+--cells $CELLS} ${CELLS_FILE:+--cells-file "$CELLS_FILE"} \
    --timeout "${CELL_TIMEOUT:-400}" --deadline "$(left $((LIMIT - 60)))" ${BENCH_ARGS:-} \
    --out "$OUT/$workload" >"$LOG/bench_$workload.log" 2>&1
  echo "$workload rc=$?"
  sed -n '/^Latency/,$p' "$LOG/bench_$workload.log" | cut -c1-220
}

kernel_bench() {  # kernel_bench NAME [ARGS...]: benchmarks/NAME.py on CUDA, JSON in $OUT
  local name=$1; shift
  timeout "$(left $((LIMIT - 10)))" python3 "benchmarks/$name.py" --device cuda "$@" \
    --json "$OUT/${name//_/-}-cuda.json" >"$LOG/$name.log" 2>&1
  echo "$name rc=$?"; tail -${KERNEL_TAIL:-20} "$LOG/$name.log" | cut -c1-200
}

WORKLOADS=$(python3 -c 'from tabserve.bench.workloads import WORKLOADS; print(*(w.name for w in WORKLOADS))')
for part in "$@"; do
  echo "== $part (${SECONDS}s)"
  if [[ " $WORKLOADS " == *" $part "* ]]; then
    driver "$part"
    continue
  fi
  case $part in
    kernels)
      for name in ${KERNELS:-small_head_attention icl_attention feed_forward norm_linear \
          layer_norm_cast qassmax_scale table_checks all_equal rotary}; do
        kernel_bench "$name"
      done ;;
    profile)
      cells=${PROFILE_CELLS:-ref-fp16 exact medium small large large-fp8}
      for w in ${PROFILE_WORKLOADS:-small large}; do
        # shellcheck disable=SC2086
        timeout "$(left $((LIMIT - 30)))" python3 benchmarks/profile_tabiclv2.py --device cuda \
          --workload "$w" --cells $cells --out "$LOG/profile_$w.txt" --json "$OUT/profile_$w.json" \
          2>"$LOG/profile_$w.err"
        echo "profile $w rc=$?"
      done ;;
    align)
      tests align_tests "$(left $((LIMIT - 120)))" -q test/python/test_string_lookup.py \
        test/python/test_align.py test/python/test_tables.py test/python/test_encoding.py
      timeout "$(left $((LIMIT - 10)))" python3 benchmarks/align_categories.py --device cuda \
        --budget 0.3 --out "$OUT/align_categories_h200.json" >"$LOG/align.log" 2>&1
      echo "align rc=$?"; tail -12 "$LOG/align.log" | cut -c1-220 ;;
    soak)
      timeout "$(left "$LIMIT")" python3 benchmarks/soak.py --device cuda --size full \
        ${SOAK_PRESET:+--preset "$SOAK_PRESET"} --max-seconds "${SOAK_SECONDS:-$(left $((LIMIT - 60)))}" \
        --json "$OUT/soak-cuda.json" >"$LOG/soak.log" 2>&1
      echo "soak rc=$?"; tail -30 "$LOG/soak.log" ;;
    soak-estimators)
      timeout "$(left "$LIMIT")" python3 benchmarks/soak.py --estimators --device cuda \
        --size "${SOAK_SIZE:-tiny}" --max-seconds "${SOAK_SECONDS:-$(left $((LIMIT - 60)))}" \
        --json "$OUT/soak-estimators-cuda.json" >"$LOG/soak-estimators.log" 2>&1
      echo "soak-estimators rc=$?"; tail -30 "$LOG/soak-estimators.log" ;;
    estimators)
      # shellcheck disable=SC2086  # ESTIMATOR_ARGS is a word list
      timeout "$(left "$LIMIT")" python3 -m tabserve.bench estimators --device cuda --quiet \
        ${ESTIMATOR_ARGS:---recipes auto --repeats 3} --out "$OUT/estimators" \
        >"$LOG/estimators.log" 2>&1
      echo "estimators rc=$?"; tail -40 "$LOG/estimators.log" | cut -c1-220 ;;
    many-tables)
      # shellcheck disable=SC2086  # MANY_ARGS is a word list
      timeout "$(left "$LIMIT")" python3 -m tabserve.bench many-tables --device cuda \
        ${MANY_ARGS:---tables 60} --out "$OUT/many-tables" >"$LOG/many-tables.log" 2>&1
      echo "many-tables rc=$?"; tail -30 "$LOG/many-tables.log" | cut -c1-220 ;;
    contention)
      timeout "$(left "$LIMIT")" python3 benchmarks/compile_contention.py --device cuda --triton \
        --json "$OUT/compile-contention-cuda.json" >"$LOG/contention.log" 2>&1
      echo "contention rc=$?"; tail -6 "$LOG/contention.log" ;;
    offload)
      # shellcheck disable=SC2086  # OFFLOAD_ARGS is a word list
      timeout "$(left "$LIMIT")" python3 benchmarks/offload_capacity.py --device cuda \
        --deadline "$(left $((LIMIT - 30)))" ${OFFLOAD_ARGS:-} --json "$OUT/offload-capacity-cuda.json" \
        >"$LOG/offload.log" 2>&1
      echo "offload rc=$?"; tail -24 "$LOG/offload.log" | cut -c1-200 ;;
    pytest)
      # shellcheck disable=SC2086
      tests pytest "$(left $((LIMIT - 30)))" ${PYTEST_ARGS:--m cuda test/python} ;;
    sanitize)
      SKIP_BUILD=1 STAGES=sanitize DEADLINE=$(left $((LIMIT - 120))) OUT="$LOG/sanitize" \
        bash scripts/device/check.sh 2>&1 | tail -8 ;;
    ncu)
      timeout "$(left $((LIMIT - 30)))" ncu --clock-control none --set full \
        -k "regex:${NCU_KERNELS:-feed_forward}" --launch-skip "${NCU_SKIP:-2}" -c "${NCU_COUNT:-2}" \
        -o "$LOG/probe" python3 scripts/device/ncu_probe.py ${NCU_ARGS:-} >"$LOG/ncu.log" 2>&1
      echo "ncu rc=$?"; tail -5 "$LOG/ncu.log"
      ncu --import "$LOG/probe.ncu-rep" --page details >"$OUT/ncu-details.txt" 2>&1
      grep -n "Duration\|Registers Per\|Achieved Occupancy\|Compute (SM) Throughput\|DRAM Throughput" \
        "$OUT/ncu-details.txt" | head -40 ;;
    *) echo "unknown argument $part: a workload ($WORKLOADS) or kernels, profile, align, soak, soak-estimators," \
         "estimators, many-tables, contention, offload, pytest, sanitize, ncu"; exit 2 ;;
  esac
done
echo "== done (${SECONDS}s)"
