#!/bin/sh
# demo.sh - the main job on a default that needs no download: builds sluice, writes
# the `tiny` synthetic DeepSeek-V4.1-Flash checkpoint and prints its summary.
set -eu
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target sluice-synth sluice-gguf >/dev/null
out=${SLUICE_DEMO_DIR:-out/tiny}
build/bin/sluice-synth --preset tiny --out "$out" --shards 2 --seed 1
first=$(ls "$out"/sluice-tiny-00001-of-*.gguf)
build/bin/sluice-gguf verify "$first"
build/bin/sluice-gguf info "$first" --summary
build/bin/sluice-gguf experts "$first"
