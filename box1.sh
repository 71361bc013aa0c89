#!/bin/sh
set -u
export LD_LIBRARY_PATH=$PWD/build-gpu/devlibs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
sh bench/run-box.sh build-gpu $OUT tests moe; grep -E 'tests passed|Failed' $OUT/gpu-tests.txt; tail -2 $OUT/moe.log
timeout 240 sh bench/run-moe-e2e.sh build-gpu /tmp/sluice-bench-L4 32 64 > $OUT/e2e.txt 2>&1; echo "e2e rc $?"
first=$(ls /tmp/sluice-bench-L4/sluice-bench-L4-00001-of-*.gguf)
build-gpu/bin/sluice-fetcher -m $first --endpoint ipc:///tmp/p.sock --arena-slots 1536 -q & fp=$!
sleep 1
CUDA_INJECTION64_PATH=$PWD/build-gpu/lib/libsl_ktrace.so SL_KTRACE=$OUT/k.csv timeout 60 build-gpu/bin/sluice-compute -m $first --endpoint ipc:///tmp/p.sock -n 32 --seed 7 --backend gpu --t0-slots 1536 --t0-preload --warmup 4 --routing uniform > $OUT/kt.log 2>&1; echo "ktrace rc $?"
kill $fp; wait $fp 2>/dev/null
grep -E '^==|= [0-9.]+x' $OUT/e2e.txt | grep -A1 '(a)'
