#!/bin/bash
. /work/main/.venv/bin/activate
cd /tmp/int4draft
for i in 1 2; do
  for v in int4 int8; do
    echo "$(date +%T) $v $i" >> progress.txt
    if [ $v = int4 ]; then export SPECGEN_INT4_DRAFT=1; else export SPECGEN_INT4_DRAFT=0; fi
    python patched.py bench --prompts eight.jsonl --methods plain,chain -n 64 --repeats 1 --json $v-$i.json > $v-$i.log 2>&1
  done
done
echo "$(date +%T) done" >> progress.txt
