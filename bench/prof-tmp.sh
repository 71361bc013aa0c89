export LD_LIBRARY_PATH=$PWD/build-gpu/devlibs
PIN=2,4 sh bench/run-box.sh build-gpu $OUT tests moe e2e fetch
tail -3 $OUT/gpu-tests.txt
d=/tmp/sluice-bench-L4
first=$(ls $d/sluice-bench-L4-00001-of-*.gguf)
build-gpu/bin/sluice-fetcher -m $first --endpoint ipc:///tmp/p.sock --arena-slots 1536 -q &
fp=$!
sleep 2
CUDA_INJECTION64_PATH=$PWD/build-gpu/lib/libsl_ktrace.so SL_KTRACE=$OUT/ktrace-a-uniform.csv build-gpu/bin/sluice-compute -m $first --endpoint ipc:///tmp/p.sock -n 32 --seed 7 --backend gpu --t0-slots 1536 --t0-preload --warmup 4 --routing uniform 2>&1 | grep "steps in"
kill $fp; wait
