#!/usr/bin/env bash
# Warm start: `specgen run "hi" -n 1` end to end, on a running `specgen serve` and in
# its own process (--no-server), interleaved, on the default pair (already in the cache).
# Prints one line per run and the machine's CPU flags; extra options go to serve and run.
#   benchmarks/warm_start.sh              # 3 of each
#   RUNS=5 benchmarks/warm_start.sh --device cpu
set -euo pipefail

cd "$(dirname "$0")/.."
RUNS="${RUNS:-3}"
lscpu | grep -E "Model name|^CPU\(s\)|Flags" || true
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

clock() { python -c "import time; print(time.perf_counter())"; }
start=$(clock)
specgen serve --detach "$@"
echo "serve --detach: $(python -c "print(f'{$(clock) - $start:.2f} s')")"
trap 'specgen serve --stop "$@" || true' EXIT
ps -o rss= -p "$(pgrep -f 'specgen serve' | head -1)" | awk '{printf "server RSS: %.2f GB\n", $1 / 1048576}'

for i in $(seq "$RUNS"); do
    for mode in --server --no-server; do
        start=$(clock)
        specgen run "hi" -n 1 --format plain "$mode" "$@" >/dev/null 2>&1
        echo "run $i $mode: $(python -c "print(f'{$(clock) - $start:.2f} s')")"
    done
done
