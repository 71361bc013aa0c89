#!/bin/sh
# run-ncu.sh - one launch of a kernel of bench-moe under Nsight Compute on the GPU box:
# its stall reasons per SASS instruction (source counters), the scheduler and memory
# sections, as text into OUT_DIR (details.txt, raw.txt, sass.csv.gz). Run from the repo root of
# a copy whose BUILD_DIR was built elsewhere and carried with its libraries
# (../shared/device/README.md's recipe: BUILD_DIR/devlibs). ncu locks the clocks to the
# base frequency and runs the launch alone: use it for where a kernel stalls, not for
# how long it takes.
# usage: bench/run-ncu.sh BUILD_DIR OUT_DIR REGEX [SKIP]
#   REGEX: ncu's -k regex over demangled names (template arguments as "(int)4",
#          "(bool)1"), e.g. the shipped packed down:
#          'k_down_pt_q3_k<.*\(bool\)1, \(bool\)0, \(int\)112'
#   SKIP: matching launches skipped first (default 3)
set -eu
build=$1
out=$2
regex=$3
skip=${4:-3}
ncu=${NCU:-/usr/local/cuda/bin/ncu}
export LD_LIBRARY_PATH="$PWD/$build/devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p "$out"
"$ncu" --kernel-name-base demangled -k "regex:$regex" -s "$skip" -c 1 \
    --section WarpStateStats --section SourceCounters --section SchedulerStats \
    --section InstructionStats --section SpeedOfLight --section MemoryWorkloadAnalysis \
    -o "$out/kernel" "$build/bin/bench-moe" --iters 5 --quick >"$out/ncu-run.txt" 2>&1
"$ncu" -i "$out/kernel.ncu-rep" --page details >"$out/details.txt"
# every metric collected; the warps stalled per issued instruction, by reason, are the
# smsp__average_warps_issue_stalled_*_per_issue_active lines
"$ncu" -i "$out/kernel.ncu-rep" --page raw >"$out/raw.txt"
"$ncu" -i "$out/kernel.ncu-rep" --page source --csv --print-source sass >"$out/sass.csv"
gzip -f "$out/sass.csv"
rm -f "$out/kernel.ncu-rep"
