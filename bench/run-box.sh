#!/bin/sh
# run-box.sh - what a GPU box is used for, in one call (device time is scarce): the GPU
# test suite, bench-moe, the end-to-end table (run-moe-e2e.sh) and the fetcher bench
# (run-fetch.sh), the layer's kernel trace (run-ktrace.sh, as built and with
# --norm-kernel), bench-launch (launch costs, the selection's table handoff, the first
# wave of bulk copies) and
# bench-router (the router over 32 or 64 lanes), each into OUT_DIR, each under its own
# time limit. Run it from the repo
# root of a copy whose BUILD_DIR was built elsewhere and carried along with its libraries
# (../shared/device/README.md's recipe: BUILD_DIR/devlibs).
# usage: bench/run-box.sh BUILD_DIR OUT_DIR [tests] [moe] [e2e] [fetch] [ktrace] [launch] [router]
#        (default: the first four)
# SKIP_COLD=1 leaves the e2e's cold runs out; PIN=A,B as run-fetch.sh; ROUTING as run-ktrace.sh;
# KTRACE_FLAGS: the flag sets the kernel trace compares with the build as it is
# (default --norm-kernel; one word a set).
set -u
build=$1
out=$2
shift 2
parts=${*:-tests moe e2e fetch}
mkdir -p "$out"
# The tests find the programs at the build's own absolute path (SL_BIN_DIR).
src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")
if [ -n "$src" ] && [ ! -e "$src" ]; then
    mkdir -p "$(dirname "$src")" && ln -sfn "$PWD" "$src"
fi
export LD_LIBRARY_PATH="$PWD/$build/devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rc=0
for part in $parts; do
    start=$(date +%s)
    case $part in
    tests) (cd "$build" && timeout 300 ctest -L gpu --output-on-failure) >"$out/gpu-tests.txt" 2>&1 || rc=1 ;;
    moe) timeout 180 "$build/bin/bench-moe" -o "$out/moe.md" >"$out/moe.log" 2>&1 || rc=1 ;;
    e2e) timeout 420 sh bench/run-moe-e2e.sh "$build" /tmp/sluice-bench-L4 32 64 >"$out/e2e.txt" 2>&1 || rc=1 ;;
    fetch) timeout 300 sh bench/run-fetch.sh "$build" "$out/fetch.md" >"$out/fetch.log" 2>&1 || rc=1 ;;
    launch) timeout 120 "$build/bin/bench-launch" -o "$out/launch.md" >"$out/launch.log" 2>&1 || rc=1 ;;
    router) timeout 60 "$build/bin/bench-router" -o "$out/router.md" >"$out/router.log" 2>&1 || rc=1 ;;
    ktrace) # shellcheck disable=SC2086 # one word a flag set
        timeout 300 sh bench/run-ktrace.sh "$build" "$out" -- ${KTRACE_FLAGS:---norm-kernel} >"$out/ktrace.log" 2>&1 || rc=1 ;;
    *)
        echo "run-box.sh: unknown part '$part' (tests, moe, e2e, fetch, ktrace, launch, router)" >&2
        exit 2
        ;;
    esac
    echo "== $part: rc so far $rc, $(($(date +%s) - start)) s"
done
exit $rc
