#!/bin/bash
. /work/main/.venv/bin/activate
cd /tmp/head
for i in 1 2; do
  for v in whole pruned; do
    if [ $v = whole ]; then q=int8; else q=auto; fi
    echo "$(date +%T) $v $i" >> progress.txt
    python -m specgen bench --prompts weak.jsonl --methods plain,chain,lookup-chain -n 64 --repeats 1 --draft-quant $q --json $v-$i.json > $v-$i.log 2>&1
  done
done
echo "$(date +%T) done" >> progress.txt
