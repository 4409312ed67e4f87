#!/bin/bash
# A primed head memory (memory/, the one this machine's prompt sweep left: scripts, blocks,
# ids) under eager priming (HEAD=/tmp/eager, a worktree of the commit before held priming) and
# held priming (this checkout), and plain, in turn: the draft step in fresh processes, then
# fresh `specgen run` processes of lookup-chain at 64 tokens.
# usage: bash held.sh > held.txt   (from this folder, the venv active)
here=$(pwd)
heads=$HOME/.cache/specgen/heads
restore() { rm -rf $heads; cp -r $here/memory $heads; }
sg() {  # code label args...
  local code=$1; shift
  PYTHONPATH=$code python -c "import sys, specgen; assert specgen.__file__.startswith('$code'); from specgen.cli import main; sys.argv[0]='specgen'; main()" "$@"
}
one() {  # code label method prompt
  restore
  sg $1 run -f "$here/$4.txt" --method $3 -n 64 --format json 2>/dev/null | python -c "
import json,sys;d=json.load(sys.stdin)['stats'];print('$4 $2', d['decode_tokens_per_second'], d['new_tokens'], d.get('rounds'), d.get('accepted'), d.get('drafted'), flush=True)"
}
for i in 1 2; do
  restore; PYTHONPATH=/tmp/eager python $here/draftstep.py eager
  restore; PYTHONPATH=/work/main python $here/draftstep.py held
  rm -rf $heads; PYTHONPATH=/work/main python $here/draftstep.py none
done
for i in 1 2 3; do
  for p in translate-02 translate-04 codegen-01 explain-01; do
    one /tmp/eager eager lookup-chain $p
    one /work/main held lookup-chain $p
    one /work/main plain plain $p
  done
done
