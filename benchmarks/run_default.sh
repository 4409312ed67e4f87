#!/usr/bin/env bash
# The standard measurement: the default pair (Qwen2.5-Coder 1.5B target, 0.5B draft),
# dtype auto (bf16 on a CPU), greedy, 128 new tokens, the 4-prompt quick set, medians of 3,
# every method, threads fixed to the machine's core count. Writes JSON and CSV (and a PNG
# when matplotlib is installed) into benchmarks/results/, named by set and UTC time.
#
# Run it on a quiet machine: other work on the same cores moves every number.
#   benchmarks/run_default.sh                       # the standard run
#   PROMPTS=all LIMIT=2 benchmarks/run_default.sh   # 2 prompts from each of the 7 category sets
#   benchmarks/run_default.sh --methods chain,hf-assisted-k4   # extra options go to specgen bench
set -euo pipefail

cd "$(dirname "$0")/.."
PROMPTS="${PROMPTS:-quick}"
REPEATS="${REPEATS:-3}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-128}"
THREADS="${THREADS:-$(nproc 2>/dev/null || echo 2)}"
OUT="${OUT:-benchmarks/results}"

stamp="$(date -u +%Y%m%d-%H%M%S)"
name="${PROMPTS##*/}"
name="${name%.jsonl}${LIMIT:+-limit$LIMIT}-$stamp"
mkdir -p "$OUT"

args=(--prompts "$PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" --repeats "$REPEATS"
      --threads "$THREADS" --json "$OUT/$name.json" --csv "$OUT/$name.csv")
if [[ -n "${LIMIT:-}" ]]; then
    args+=(--limit "$LIMIT")
fi
if python -c "import matplotlib" 2>/dev/null; then
    args+=(--plot "$OUT/$name.png")
fi

echo "specgen bench ${args[*]} $*" >&2
specgen bench "${args[@]}" "$@" | tee "$OUT/$name.txt"
