#!/bin/bash
# Fresh `specgen run` processes, in turn: the code before (BEFORE: a worktree of commit ea33a32,
# `git worktree add DIR ea33a32`) and after (the installed specgen), lookup-chain, then plain.
# Run from outside the repository (python -m puts the working directory first on sys.path).
# usage: BEFORE=DIR bash fresh-processes.sh > fresh-processes.txt
here=$(cd "$(dirname "$0")" && pwd)
cd /tmp
for i in 1 2 3; do
 for n in 04 12; do
  for side in before after; do
   if [ $side = before ]; then export PYTHONPATH=$BEFORE; else unset PYTHONPATH; fi
   python -m specgen run -f "$here/translate-$n.txt" --method lookup-chain -n 64 --format json 2>/dev/null | python -c "
import json,sys;d=json.load(sys.stdin)['stats'];print('t$n $side lookup-chain', d['decode_tokens_per_second'], d['new_tokens'], d['rounds'], d['accepted'], d['drafted'], flush=True)"
  done
  unset PYTHONPATH
  python -m specgen run -f "$here/translate-$n.txt" --method plain -n 64 --format json 2>/dev/null | python -c "
import json,sys;d=json.load(sys.stdin)['stats'];print('t$n plain plain', d['decode_tokens_per_second'], d['new_tokens'], flush=True)"
 done
done
