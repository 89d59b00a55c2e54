#!/usr/bin/env bash
# The H200 measurements still to make, in parts that each fit one device call (10 minutes):
# builds with scripts/device_check.sh (no test stages), then runs the named parts in order, each
# bounded by the driver's --deadline. $OUT gets the result JSONs and logs.tgz (the device tool
# returns 8 files at most); merge the driver JSONs here with `python -m tabserve.bench --merge`.
#   bash scripts/device_bench.sh large            # one part per call is the safe plan
#   bash scripts/device_bench.sh medium stream
# Parts: small, large, compiled, medium, xlarge, stream, restart, soak, sanitize, profile, cudatests, recipes,
# align, pytest, attention, icl, ffn, norm, qassmax, checks, allequal, ncu, patch (PATCH_FILE: later
# parts run patched).
set -uo pipefail
cd "$(dirname "$0")/.."
RECIPE_GATES=recipe_without_a_cell  # the recipe-gate CUDA test: the `recipes` part runs it
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/device-out}
LOG=$(mktemp -d /tmp/device-bench.XXXX)
mkdir -p "$OUT"
LIMIT=${LIMIT:-560}  # seconds of this call that the parts may use
left() { local t=$(( $1 - SECONDS )); (( t < 10 )) && t=10; echo $t; }

STAGES=none OUT="$LOG/build" bash scripts/device_check.sh >"$LOG/build_stage.log" 2>&1 || {
  tail -20 "$LOG/build_stage.log"; exit 1; }
ls .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
echo "== built (${SECONDS}s)"

tests() {  # tests NAME SECONDS PYTEST_ARGS...: pytest into $LOG/NAME.log, then its verdict
  local name=$1 seconds=$2; shift 2
  timeout "$seconds" env ${PYTEST_ENV:-} python3 -m pytest -p no:cacheprovider -p no:logging -rfE "$@" \
    >"$LOG/$name.log" 2>&1
  echo "$name rc=$?"
  grep -n -B2 -A12 "^E " "$LOG/$name.log" | head -${PYTEST_TAIL:-60}
  grep " FAILED\|s call" "$LOG/$name.log" | head -30  # with -v / --durations: what failed, what took long
  tail -3 "$LOG/$name.log"
}

bench() {  # bench NAME WORKLOADS... -- CELLS...
  local name=$1; shift
  # A part run again after `patch` writes beside its first run (NAME_2, NAME_3, ...).
  local base=$name n=2
  while [ -e "$OUT/tabiclv2_h200_$name.json" ]; do name=${base}_$n; n=$((n + 1)); done
  local workloads=() cells=()
  while [ "$1" != "--" ]; do workloads+=("$1"); shift; done; shift
  cells=("$@")
  python3 -m tabserve.bench --device cuda --budget 0.3 --min-repeats 5 --timeout "${CELL_TIMEOUT:-200}" --quiet \
    --no-plot ${BENCH_ARGS:-} --workloads "${workloads[@]}" --cells "${cells[@]}" --deadline "${BUDGET:-$(left $((LIMIT - 120)))}" \
    --out "$OUT/tabiclv2_h200_$name.json" --recipes "$LOG/recipes_$name.json" \
    >"$LOG/bench_$name.log" 2>&1
  sed -n '/^Latency/,$p' "$LOG/bench_$name.log" | cut -c1-220
}

for part in "$@"; do
  echo "== $part (${SECONDS}s)"
  case $part in
    small)  # c11, the one recipe not yet gated on the H200: its max-autotune cold call passed 470 s
      # on small (twentieth session; c26's took 420.6 s), so it needs a call of its own with
      # LIMIT=590 CELL_TIMEOUT=500 BENCH_ARGS="--skip-phases end_to_end kv" and may still not end.
      # Cells run in the order named; the other compiled cells need ~60-110 s each.
      bench small small -- ${SMALL_CELLS:-c11-fp16-compile-max-autotune} ;;
    large)  # cells never measured on large: c25 (flash in the head-dim-16 stages), c44. c16 and c12
      # ran in the twenty-second session (c12's end-to-end phase timed out at 200 s: one-shot and
      # KV measured; CELL_TIMEOUT=300 or BENCH_ARGS="--skip-phases end_to_end" for the rest).
      bench large large -- ${LARGE_CELLS:-c1-ref-fp16 c25-fp16-compile-flash-colrow \
        c44-fp16-compile-head16-fused-frozen-kvgraphs-ropeproj} ;;
    compiled)  # whole-model compile and compile + CUDA graphs on the large workload
      # The estimator path compiles anew (about a minute per cell on large): left out here.
      # c1-ref-fp16 + one compiled cell need ~120 s after the build: LIMIT=190 left c40 past its
      # deadline (2026-12-01); give this part LIMIT >= 300.
      BUDGET=${COMPILED_BUDGET:-} BENCH_ARGS=${BENCH_ARGS:---skip-phases end_to_end} bench compiled large -- ${COMPILED_CELLS:-c10-fp16-compile \
        c23-fp16-buckets-compile-cudagraphs c24-fp16-compile-efficient-colrow c25-fp16-compile-flash-colrow} ;;
    medium)
      bench medium medium many-class regression -- ${MEDIUM_CELLS:-c0-ref-fp32 c1-ref-fp16 c5-fp16 \
        c9-fp16-flash-cudnn-icl c18-fp16-buckets-cudagraphs c19-fp16-buckets-cudagraphs-kv} ;;
    xlarge)  # c59: c57 (c52 with the ICL attention on tabserve's flash kernel, fp8 operands) with
      # the column stage's inducing points on it too (c58: half operands, XLARGE_CELLS). c57's
      # cold call took 155 s (twenty-third session) and the 200 s cell timeout stopped it, hence
      # 400 s here (run 5: c57's whole cell 262 s); c0-ref-fp32 (the gate's reference) and
      # c1-ref-fp16 take about 25 and 90 s, so one call holds one such cell beside them. c60:
      # c59 with the column stage's rows over the induced tokens on the flash kernel too (run
      # `ATTENTION_CASES="col row" bash scripts/device_bench.sh attention` first: does it win?);
      # c61: c59 with the ICL stage's train and test rows in one pass per block.
      CELL_TIMEOUT=${CELL_TIMEOUT:-400} BENCH_ARGS=${BENCH_ARGS:---skip-phases end_to_end} \
        bench xlarge xlarge -- ${XLARGE_CELLS:-c1-ref-fp16 \
        c59-fp16-compile-head16-fused-frozen-kvgraphs-ropeproj-outproj-rowtokens-gelu-iclfp8-colflash} ;;
    stream)
      bench stream stream -- ${STREAM_CELLS:-c0-ref-fp32 c1-ref-fp16 c5-fp16 c18-fp16-buckets-cudagraphs} ;;
    restart)  # issue 6's restart target: compile-cache artifacts (c20) against bucket packages (c27)
      bench restart ${RESTART_WORKLOADS:-small} -- ${RESTART_CELLS:-c20-fp16-buckets-warm-cache \
        c27-fp16-buckets-aot-restart c29-fp16-buckets-aot-cudagraphs-restart} ;;
    attention)  # small_head_attention against the SDPA backends on the large workload's shapes
      # ATTENTION_METHODS: only these methods, e.g. "tabserve op|sdpa cudnn" ('|'-separated);
      # ATTENTION_CASES: only the cases naming one of these words, e.g. "col-inducing";
      # ATTENTION_ARGS: more arguments, e.g. --flash-sweep (the flash kernel's half tiles).
      IFS='|' read -ra attention_methods <<<"${ATTENTION_METHODS:-}"
      timeout "$(left $((LIMIT - 10)))" python3 benchmarks/small_head_attention.py --device cuda \
        ${ATTENTION_METHODS:+--methods "${attention_methods[@]}"} ${ATTENTION_CASES:+--cases $ATTENTION_CASES} ${ATTENTION_ARGS:-} \
        --budget 0.3 --json "$OUT/small-head-attention-cuda.json" >"$LOG/attention.log" 2>&1
      echo "attention rc=$?"; tail -25 "$LOG/attention.log" ;;
    icl)  # the ICL stage's head-dim-64 attention per SDPA backend and tabserve's flash_attention
          # (benchmarks/icl_attention.py; ICL_ARGS, e.g. "--cases xlarge --flash-sweep"), after
          # flash_attention's CUDA tests (FLASH_TESTS=0 skips them)
      if [ "${FLASH_TESTS:-1}" = 1 ]; then
        tests flash_pytest "$(left $((LIMIT - 120)))" -v -m cuda test/python/test_flash_attention.py
      fi
      timeout "$(left $((LIMIT - 10)))" python3 benchmarks/icl_attention.py --device cuda --budget 0.3 \
        ${ICL_ARGS:-} --json "$OUT/icl-attention-cuda.json" >"$LOG/icl.log" 2>&1
      echo "icl bench rc=$?"; tail -30 "$LOG/icl.log" | cut -c1-160 ;;
    ffn)  # the fused feed-forward operators: their CUDA tests (FFN_TESTS=0 skips them), then the
          # benchmark (FFN_ARGS, default --sweep: the Triton kernel's tiles; FFN_ARGS= methods only)
      if [ "${FFN_TESTS:-1}" = 1 ]; then
        tests ffn_pytest "$(left $((LIMIT - 60)))" -q test/python/test_feed_forward.py \
          test/python/test_feed_forward_resident.py
      fi
      timeout "$(left $((LIMIT - 10)))" python3 benchmarks/feed_forward.py --device cuda ${FFN_ARGS---sweep} \
        --json "$OUT/feed-forward-cuda.json" >"$LOG/ffn_bench.log" 2>&1
      echo "ffn bench rc=$?"; tail -${FFN_TAIL:-70} "$LOG/ffn_bench.log" ;;
    norm)  # the fused LayerNorm + projection operator: its CUDA tests, then its benchmark
           # (NORM_ARGS, default --sweep: the tiles; NORM_ARGS= methods only)
      tests norm_pytest "$(left $((LIMIT - 60)))" -q test/python/test_norm_linear.py
      timeout "$(left $((LIMIT - 10)))" python3 benchmarks/norm_linear.py --device cuda ${NORM_ARGS---sweep} \
        --json "$OUT/norm-linear-cuda.json" >"$LOG/norm_bench.log" 2>&1
      echo "norm bench rc=$?"; tail -${NORM_TAIL:-40} "$LOG/norm_bench.log" ;;
    qassmax)  # the fused QASSMax scaling: its CUDA tests, then its benchmark on the workloads' calls
      tests qassmax_pytest "$(left $((LIMIT - 60)))" -q -k qassmax test/python/test_padding_ops.py
      timeout "$(left $((LIMIT - 10)))" python3 benchmarks/qassmax_scale.py --device cuda ${QASSMAX_ARGS:-} \
        --json "$OUT/qassmax-scale-cuda.json" >"$LOG/qassmax_bench.log" 2>&1
      echo "qassmax bench rc=$?"; tail -20 "$LOG/qassmax_bench.log" ;;
    checks)  # the one-kernel input checks: their tests (CPU and CUDA), then their benchmark
      tests checks_pytest "$(left $((LIMIT - 60)))" -q test/python/test_table_checks.py
      timeout "$(left $((LIMIT - 10)))" python3 benchmarks/table_checks.py --device cuda \
        --json "$OUT/table-checks-cuda.json" >"$LOG/checks_bench.log" 2>&1
      echo "checks bench rc=$?"; tail -12 "$LOG/checks_bench.log" ;;
    allequal)  # the all_equal operator against the ATen check it replaced (tests: pytest part)
      timeout "$(left $((LIMIT - 10)))" python3 benchmarks/all_equal.py --device cuda \
        --json "$OUT/all-equal-cuda.json" >"$LOG/all_equal.log" 2>&1
      echo "all_equal bench rc=$?"; tail -12 "$LOG/all_equal.log" ;;
    patch)  # apply PATCH_FILE (git diff output, e.g. `git diff main BRANCH > x.patch`, shipped as
      # an untracked file) to this copy; later parts run with it (one call measures both trees).
      # C++ / CUDA changes are rebuilt; Python-only ones need no build.
      patch -p1 --forward <"${PATCH_FILE:?PATCH_FILE names the patch}" >"$LOG/patch.log" 2>&1
      echo "patch rc=$? $(grep -c '^patching file' "$LOG/patch.log") files"
      if grep -q '^patching file csrc/' "$LOG/patch.log"; then
        STAGES=none OUT="$LOG/build_patched" bash scripts/device_check.sh >"$LOG/build_patched.log" 2>&1
        echo "rebuilt rc=$? (${SECONDS}s)"
      fi ;;
    pytest)  # any tests: PYTEST_ARGS (files, -k, -v: no -q here, which would cancel a -v; a run cut
      # by PYTEST_TIMEOUT then still shows each finished test), PYTEST_ENV (e.g. CUDA_LAUNCH_BLOCKING=1)
      tests pytest "${PYTEST_TIMEOUT:-$(left $((LIMIT - 30)))}" ${PYTEST_ARGS:-test/python} ;;
    profile)  # where the time goes (benchmarks/profile_tabiclv2.py): PROFILE_WORKLOADS, and
      # PROFILE_CELLS_LARGE / PROFILE_CELLS_SMALL / ... per workload (else PROFILE_CELLS);
      # PROFILE_TRACE=1: each profiled call as a Perfetto trace too (trace_*.json.gz);
      # PROFILE_PHASE=kv: the KV-cached prediction instead of the one-shot call (profile_W_kv.json)
      for w in ${PROFILE_WORKLOADS:-large small}; do
        phase=${PROFILE_PHASE:-one_shot}; tag=$w${PROFILE_PHASE:+_$PROFILE_PHASE}
        cells_var=PROFILE_CELLS_${w^^}; cells_var=${cells_var//-/_}
        cells=${!cells_var:-${PROFILE_CELLS:-c1-ref-fp16 c5-fp16 c7-fp16-flash c18-fp16-buckets-cudagraphs}}
        timeout "$(left $((LIMIT - 60)))" python3 benchmarks/profile_tabiclv2.py --device cuda \
          --workload $w --phase $phase --cells $cells ${PROFILE_TRACE:+--trace "$OUT"} \
          --out "$LOG/profile_$tag.txt" --json "$OUT/profile_$tag.json" 2>"$LOG/profile_$tag.err"
        echo "profile $tag rc=$?"; cat "$OUT/profile_$tag.json" 2>/dev/null | tr -d '\n ' | cut -c1-1500; echo
      done ;;
    cudatests)  # the CUDA tests of the model, padding, serving and RoPE, then the RoPE benchmark;
      # the recipe gates (about 300 s, most of it max-autotune) run in the `recipes` part. These
      # files no longer fit one call: CUDATESTS_FILES picks some. Twenty-second session: model +
      # padded inference (16 tests) 363 s; padding ops, RoPE, AOT, small-head attention (142 tests)
      # 214 s, 153 s of it the AOT test. -v names each finished test.
      tests cudatests "${CUDATESTS_TIMEOUT:-$(left $((LIMIT - 30)))}" -v --durations=20 -m cuda \
        -k "not $RECIPE_GATES" ${CUDATESTS_FILES:-test/python/test_tabicl_model.py \
        test/python/test_padded_inference.py test/python/test_padding_ops.py test/python/test_rotary.py \
        test/python/test_aot_buckets.py test/python/test_small_head_attention.py}
      echo "cudatests passed=$(grep -c ' PASSED' "$LOG/cudatests.log") failed=$(grep -c ' FAILED' "$LOG/cudatests.log")"
      timeout "$(left $((LIMIT - 10)))" python3 benchmarks/rotary.py --device cuda \
        --json "$OUT/rotary-cuda.json" >"$LOG/rotary.log" 2>&1; tail -12 "$LOG/rotary.log" ;;
    recipes)  # each named recipe no benchmark cell runs, gated the driver's way (307.6 s on the
      # H200, twenty-first session: 197 s of it the max-autotune recipe's compile)
      tests recipes "$(left $((LIMIT - 10)))" -v --durations=0 -m cuda -k $RECIPE_GATES \
        test/python/test_padded_inference.py
      grep " PASSED" "$LOG/recipes.log" ;;
    align)  # issue 3: the CUDA tests of tables and alignment, then the benchmark with a profile
      tests aligntests "$(left $((LIMIT - 30)))" -q -m cuda test/python/test_align.py \
        test/python/test_tables.py test/python/test_encoding.py
      tests stringtests "$(left $((LIMIT - 30)))" -q test/python/test_string_lookup.py  # CPU and CUDA
      timeout "$(left $((LIMIT - 10)))" python3 benchmarks/align_categories.py --device cuda --budget 0.3 \
        --profile ${ALIGN_ARGS:-} --out "$OUT/align_categories_h200.json" >"$LOG/align.log" 2>&1
      echo "align rc=$?"; tail -12 "$LOG/align.log" | cut -c1-220 ;;
    soak)
      timeout "$(left "$LIMIT")" python3 benchmarks/soak.py --device cuda --size full \
        ${SOAK_RECIPE:+--recipe "$SOAK_RECIPE"} --precision "${SOAK_PRECISION:-$([ -n "${SOAK_RECIPE:-}" ] && echo fp32 || echo fp16)}" --max-seconds "${SOAK_SECONDS:-$(left $((LIMIT - 60)))}" \
        --json "$OUT/soak-cuda.json" >"$LOG/soak.log" 2>&1
      echo "soak rc=$?"; tail -30 "$LOG/soak.log" ;;
    ncu)  # Nsight Compute over scripts/ncu_probe.py (NCU_ARGS: the probe's arguments, NCU_KERNELS:
          # a kernel-name regex); the details page and the stall-reason metrics come back as text
      timeout "$(left $((LIMIT - 30)))" ncu --clock-control none --set full -k "regex:${NCU_KERNELS:-feed_forward}" \
        --launch-skip ${NCU_SKIP:-2} -c ${NCU_COUNT:-2} -o "$LOG/probe" python3 scripts/ncu_probe.py ${NCU_ARGS:-} >"$LOG/ncu.log" 2>&1
      echo "ncu rc=$?"; tail -5 "$LOG/ncu.log"
      ncu --import "$LOG/probe.ncu-rep" --page details >"$OUT/ncu-details.txt" 2>&1
      ncu --import "$LOG/probe.ncu-rep" --page raw --csv >"$LOG/ncu-raw.csv" 2>&1
      python3 - "$LOG/ncu-raw.csv" >"$OUT/ncu-stalls.txt" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, units, data = rows[0], rows[1], rows[2:]
# also each pipe's share (tensor / gmma, fma, alu, xu = the exponentials' unit): flash_attention
keep = [i for i, h in enumerate(head) if "issue_stalled" in h and "ratio" in h
        or h.startswith("sm__pipe_") and h.endswith("pct_of_peak_sustained_active")
        or h.startswith("sm__inst_executed_pipe_") and h.endswith(".sum")
        or h in ("Kernel Name", "gpu__time_duration.sum", "sm__inst_executed.sum",
                 "smsp__inst_executed.avg.per_cycle_active", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                 "smsp__issue_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread")]
for r in data:
    print("----")
    for i in keep:
        print(f"{head[i]}: {r[i]} {units[i]}")
PY
      grep -n "Duration\|Registers Per\|Achieved Occupancy\|Issue Slots Busy\|Compute (SM) Throughput\|DRAM Throughput\|Warp Cycles Per Issued" "$OUT/ncu-details.txt" | head -40
      grep -c . "$OUT/ncu-stalls.txt" ;;
    sanitize)
      SKIP_BUILD=1 STAGES=sanitize SAN_TOOLS="${SAN_TOOLS:-synccheck racecheck memcheck initcheck}" SAN_TIMEOUT=${SAN_TIMEOUT:-120} \
        DEADLINE=$(left $((LIMIT - 120))) OUT="$LOG/sanitize" bash scripts/device_check.sh 2>&1 | tail -8 ;;
    *) echo "unknown part $part (small, large, compiled, medium, xlarge, stream, restart, soak, sanitize, profile, cudatests, align, pytest, attention, icl, ffn, norm, qassmax, checks, allequal, patch, ncu)"; exit 2 ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null
echo "== done (${SECONDS}s)"
