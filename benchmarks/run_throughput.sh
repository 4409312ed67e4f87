#!/usr/bin/env bash
# Throughput of dynamic batching, the cost of deterministic mode per method and batch
# size, its rollback rate per window, and how often outputs differ without it (default pair,
# quick set, greedy). One process: every ratio compares cells measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
specgen bench --prompts quick -n 32 --methods plain,chain --batch-sizes 1,4 \
  --verify-windows 8,16,32,64 --json benchmarks/results/throughput.json "$@" \
  | tee benchmarks/results/throughput.txt
