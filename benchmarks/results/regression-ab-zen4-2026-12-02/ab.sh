#!/bin/bash
# ABAB: the commit of 2026-11-30's sweep (d56347f, /tmp/old) against ea85d5e, each a bench process of its own
cd /tmp/ab
. /work/main/.venv/bin/activate
for run in 1 2; do
  for side in new old; do
    if [ $side = old ]; then
      SPECGEN_CACHE=/tmp/oldcache PYTHONPATH=/tmp/old specgen bench --prompts ab.jsonl --methods plain,chain,lookup-chain -n 64 --repeats 1 --json $side-$run.json > $side-$run.txt 2>&1
    else
      specgen bench --prompts ab.jsonl --methods plain,chain,lookup-chain -n 64 --repeats 1 --json $side-$run.json > $side-$run.txt 2>&1
    fi
    echo "$side-$run rc=$?" >> LOG
  done
done
echo doneab >> LOG
