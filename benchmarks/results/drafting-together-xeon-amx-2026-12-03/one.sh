#!/bin/bash
# one.sh TREE NAME: serve from TREE (traced), run the three loads twice, stop
TREE=$1; NAME=$2; OUT=/tmp/ab
cd /work/main && . .venv/bin/activate
PYTHONPATH=$TREE python $TREE/benchmarks/results/mixed-trace-xeon-amx-2026-12-03/trace_serve.py $OUT/$NAME.rounds --port 8123 --api-key k --suffix-scope request > $OUT/$NAME.serve.log 2>&1 &
PID=$!
for i in $(seq 1 300); do curl -s -o /dev/null -H "Authorization: Bearer k" http://127.0.0.1:8123/v1/models && break; sleep 2; done
python benchmarks/mixed_load.py --url http://127.0.0.1:8123 --key k --loads plain:4 lookup-chain:4 plain:2,lookup-chain:2 --requests 3 --max-tokens 64 --rounds 2 --json $OUT/$NAME.json > $OUT/$NAME.load.log 2>&1
kill -INT $PID; wait $PID
python benchmarks/results/drafting-together-xeon-amx-2026-12-03/by_round.py $OUT/$NAME.rounds > $OUT/$NAME.by_round.txt
