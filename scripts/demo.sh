#!/bin/sh
# demo.sh - the main job on a default that needs no download: builds sluice, writes
# the `tiny` synthetic DeepSeek-V4.1-Flash checkpoint, checks and summarises it, then
# runs 16 decode steps of its MoE layers with the experts streamed by sluice-fetcher
# (on the GPU when one is present, else on the CPU twin of its arithmetic: the same
# bytes) and writes a trace of both processes.
set -eu
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target sluice sluice-synth sluice-gguf sluice-fetcher >/dev/null
out=${SLUICE_DEMO_DIR:-out/tiny}
build/bin/sluice-synth --preset tiny --out "$out" --shards 2 --seed 1
first=$(ls "$out"/sluice-tiny-00001-of-*.gguf)
build/bin/sluice-gguf verify "$first"
build/bin/sluice-gguf info "$first" --summary
build/bin/sluice-gguf experts "$first"
# 48 of the 96 expert slots: some experts are evicted and read again.
build/bin/sluice bench moe -m "$first" -n 16 --arena-slots 48 --trace "$out/trace.json"
