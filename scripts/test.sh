#!/bin/sh
# test.sh - the whole test suite, as CI runs it:
#   1. format check of every tracked C/CUDA file (.clang-format)
#   2. release-style build with -Wall -Wextra -Werror (CUDA too when nvcc is found),
#      every test (GPU tests skip, saying so, without a GPU)
#   3. AddressSanitizer + UndefinedBehaviorSanitizer build, unit tests
#   4. libFuzzer smoke runs of every fuzz target (clang), SLUICE_FUZZ_SECONDS each
set -eu
cd "$(dirname "$0")/.."
scripts/deps.sh
jobs=$(nproc)
fuzz_seconds=${SLUICE_FUZZ_SECONDS:-20}

echo "== format"
files=$(git ls-files '*.c' '*.h' '*.cu' '*.cuh' 2>/dev/null || true)
if [ -n "$files" ]; then
    # shellcheck disable=SC2086
    clang-format --dry-run --Werror $files
fi

echo "== build + tests"
cmake -S . -B build -DSL_WERROR=ON >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"

echo "== ASan + UBSan unit tests"
cmake -S . -B build-asan -DSL_SANITIZE=ON -DSL_WERROR=ON -DSL_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan -L unit --output-on-failure -j"$jobs"

echo "== fuzz smoke (${fuzz_seconds}s per target)"
CC=clang cmake -S . -B build-fuzz -DSL_FUZZ=ON -DSL_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz -j"$jobs" --target fuzz
for f in build-fuzz/bin/fuzz_*; do
    [ -x "$f" ] || continue
    name=$(basename "$f")
    corpus=fuzz/corpus/${name#fuzz_}
    work=$(mktemp -d)
    [ -d "$corpus" ] && cp -r "$corpus"/. "$work"/
    echo "-- $name"
    # New inputs go to a scratch folder; a crash fails the suite (and its input is kept
    # under build-fuzz/ to reproduce it).
    if ! "$f" -max_total_time="$fuzz_seconds" -print_final_stats=1 \
        -artifact_prefix=build-fuzz/ "$work" >"$work.log" 2>&1; then
        tail -n 40 "$work.log"
        echo "$name found a crash: input saved as build-fuzz/crash-*" >&2
        exit 1
    fi
    tail -n 6 "$work.log"
    rm -rf "$work" "$work.log"
done
echo "== all tests passed"
