#!/usr/bin/env bash
# Fuzzes the torch-free string core (test/fuzz/fuzz_string_table.cpp) with libFuzzer under
# AddressSanitizer and UndefinedBehaviorSanitizer, for a bounded time.
#
#   bash scripts/fuzz.sh [SECONDS]      default 60; CI runs it bounded
#                                       (docs/reference/reliability.md)
#   FUZZ_JOBS=2 bash scripts/fuzz.sh 3600   a longer run on every core (libFuzzer -fork)
#
# Needs clang with libFuzzer (Debian: apt-get install clang libclang-rt-dev). The seed corpus
# test/fuzz/corpus is copied to build/fuzz/corpus, where the run adds what it finds, so the
# repository only changes by hand. A crash leaves its input in build/fuzz/crash-*; turn it into a
# regression by copying it to test/fuzz/regressions/<what-it-found> (ctest replays that folder).
# Exit status: 0 when no crash was found, 3 without a libFuzzer toolchain, other non-zero on a crash.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-60}
CXX_FUZZ=${CXX_FUZZ:-$(command -v clang++ || true)}
# Exit status 3 means "cannot fuzz on this machine" (scripts/run.sh then skips with this message).
probe='extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }'
if [ -z "$CXX_FUZZ" ] || ! echo "$probe" | "$CXX_FUZZ" -x c++ -fsanitize=fuzzer - -o /dev/null 2>/dev/null; then
  echo "[fuzz] no clang++ with libFuzzer: apt-get install clang libclang-rt-dev (Debian) to fuzz" >&2
  exit 3
fi
OUT=build/fuzz
mkdir -p "$OUT/corpus"
cp -n test/fuzz/corpus/* "$OUT/corpus/" 2>/dev/null || true
echo "[fuzz] building with $CXX_FUZZ" >&2
"$CXX_FUZZ" -std=c++20 -g -O1 -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -Icsrc test/fuzz/fuzz_string_table.cpp -o "$OUT/fuzz_string_table"
echo "[fuzz] running ${SECONDS_TO_RUN}s over $OUT/corpus" >&2
# -timeout: one input taking over 10 s counts as a hang; -rss_limit_mb: a leak counts as a crash.
args=(-max_total_time="$SECONDS_TO_RUN" -timeout=10 -rss_limit_mb=2048 -max_len=4096
      -print_final_stats=1 -artifact_prefix="$OUT/")
if [ -n "${FUZZ_JOBS:-}" ]; then args+=(-fork="$FUZZ_JOBS" -ignore_crashes=0); fi
"$OUT/fuzz_string_table" "${args[@]}" "$OUT/corpus" test/fuzz/regressions
