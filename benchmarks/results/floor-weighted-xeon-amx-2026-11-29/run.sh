#!/bin/bash
. /work/main/.venv/bin/activate
cd /tmp/ab
for i in 1 2 3; do
  for v in after before; do
    if [ $v = after ]; then src=/work/main; else src=/tmp/wt-before; fi
    echo "$(date +%T) $v $i" >> progress.txt
    PYTHONPATH=$src python -m specgen bench --prompts weak.jsonl --methods plain,chain,lookup-chain -n 64 --repeats 1 --json $v-$i.json > $v-$i.log 2>&1
  done
done
echo "$(date +%T) done" >> progress.txt
