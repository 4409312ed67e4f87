#!/usr/bin/env bash
# End-to-end effect of --draft-quant and of the draft-length schedules on the default
# pair (quick set, greedy). Each run measures plain in the same run, so ratios are fair.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
python benchmarks/draft_quant.py --variants none,prune,int8,int8-wo,int8+prune --steps 16 --repeats 3 \
  | tee $out/draft-quant-forward.txt
specgen bench --prompts quick -n 48 --methods chain,chain/k1,chain/k2 \
  --json $out/quant-none.json | tee $out/quant-none.txt
specgen bench --prompts quick -n 48 --draft-quant int8+prune \
  --methods chain,chain/k1,chain/k2,chain/additive,chain/expected-gain,lookup,hf-assisted,hf-lookup \
  --json $out/quant-int8-prune.json | tee $out/quant-int8-prune.txt
