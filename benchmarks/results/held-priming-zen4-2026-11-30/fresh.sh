#!/bin/bash
# Fresh `specgen run` processes in turn (this checkout: held priming): lookup-chain with no
# head memory (cold: a user's first answer in the language), lookup-chain with the memory the
# prompt sweep left (warm: memory/), and plain; three turns, 64 tokens.
# usage: bash fresh.sh > fresh.txt   (from this folder, the venv active)
here=$(pwd)
heads=$HOME/.cache/specgen/heads
one() {  # label method prompt
  python -m specgen run -f "$here/$3.txt" --method $2 -n 64 --format json 2>/dev/null | python -c "
import json,sys;d=json.load(sys.stdin)['stats'];print('$3 $1', d['decode_tokens_per_second'], d['new_tokens'], d.get('rounds'), d.get('accepted'), d.get('drafted'), flush=True)"
}
for i in 1 2 3; do
  for p in translate-02 translate-04 translate-12; do
    rm -rf $heads; one cold lookup-chain $p
    rm -rf $heads; cp -r $here/memory $heads; one warm lookup-chain $p
    one plain plain $p
  done
done
