#!/bin/sh
# run-fetch.sh - bench/fetch on a bench-L4 checkpoint generated where it runs, then
# bench/socket (the transport's floor) into the same table file.
# usage: [PIN=A,B] bench/run-fetch.sh BUILD_DIR OUT_FILE [CHECKPOINT_DIR]
# PIN: the CPUs of the pinned hit round trips (fetcher, client), default 2,4.
set -eu
build=$1
out=$2
dir=${3:-/tmp/sluice-bench-L4}
if ! ls "$dir"/sluice-bench-L4-00001-of-*.gguf >/dev/null 2>&1; then
    "$build/bin/sluice-synth" --preset bench-L4 --out "$dir" --shards 4 --seed 1
    sync # the new shards on disk before any ceiling is measured (writeback slows reads)
fi
first=$(ls "$dir"/sluice-bench-L4-00001-of-*.gguf)
"$build/bin/sluice-gguf" verify "$first"
"$build/bin/bench-fetch" -m "$first" --readers 16 --samples 20000 --pin "${PIN:-2,4}" --out "$out"
# The transport's own floor in the same run: ZeroMQ (and AF_UNIX) round trips between two
# bare processes, pinned as the fetcher and the client were.
{
    echo
    echo "The floor under the hit round trip, two bare processes (bench/socket.c):"
    echo
    "$build/bin/bench-socket" --pin "${PIN:-2,4}"
} | tee -a "$out"
