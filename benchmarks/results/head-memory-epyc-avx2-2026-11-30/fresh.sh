#!/bin/bash
# Fresh `specgen run` processes in turn: lookup-chain with no head memory (cold), lookup-chain
# with the memory the same prompts left in an earlier run (warm), plain. `warm/` holds that memory.
# usage: bash fresh.sh > fresh.txt   (from the folder with the prompts' .txt files)
here=$(pwd)
heads=$HOME/.cache/specgen/heads
one() {  # label method prompt
  python -m specgen run -f "$here/$3.txt" --method $2 -n 64 --format json 2>/dev/null | python -c "
import json,sys;d=json.load(sys.stdin)['stats'];print('$3 $1', d['decode_tokens_per_second'], d['new_tokens'], d.get('rounds'), d.get('accepted'), d.get('drafted'), flush=True)"
}
for i in 1 2 3; do
 for p in translate-02 translate-04 translate-12 codegen-01 explain-01; do
  rm -rf $heads; one cold lookup-chain $p
  rm -rf $heads; cp -r $here/warm $heads; one warm lookup-chain $p
  one plain plain $p
 done
done
