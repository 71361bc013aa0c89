#!/bin/sh
# ab-arm.sh - builds one arm of an A/B here: BUILD_DIR configured with CMAKE_CUDA_FLAGS
# set to FLAGS (e.g. "-DGT_SPL=0"), its bench-moe and sluice-compute copied to
# BUILD_DIR/ab/bench-moe-NAME and BUILD_DIR/ab/sluice-compute-NAME (the names
# bench/ab-quick.sh and the (a) runs look for), then BUILD_DIR built again without
# flags, so that BUILD_DIR/bin holds the default ("new") build. Run it once per arm,
# then pack the runtime libraries (docs/building.md).
# usage: bench/ab-arm.sh BUILD_DIR NAME FLAGS
set -eu
if [ $# -ne 3 ] || [ "$2" = new ]; then
    echo "usage: bench/ab-arm.sh BUILD_DIR NAME FLAGS (NAME not \"new\": that is the default build)" >&2
    exit 2
fi
build=$1
name=$2
flags=$3
mkdir -p "$build/ab"
cmake -S . -B "$build" -DCMAKE_CUDA_FLAGS="$flags" >/dev/null
cmake --build "$build" -j"$(nproc)" --target bench-moe sluice-compute
cp "$build/bin/bench-moe" "$build/ab/bench-moe-$name"
cp "$build/bin/sluice-compute" "$build/ab/sluice-compute-$name"
cmake -S . -B "$build" -DCMAKE_CUDA_FLAGS="" >/dev/null
cmake --build "$build" -j"$(nproc)"
echo "ab-arm.sh: $build/ab/bench-moe-$name and sluice-compute-$name built with \"$flags\""
