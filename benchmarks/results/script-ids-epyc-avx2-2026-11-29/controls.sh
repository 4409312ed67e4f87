#!/bin/bash
# One fresh run each of the code before (BEFORE: a worktree of commit ea33a32) and after, and
# plain, on five prompts (PROMPTS: a folder of PROMPT.txt files); token ids compared with plain.
cd /tmp
# (in the environment specgen is installed in)
for p in translate-04 translate-12 german-own-01 translate-01 codegen-01; do
  for side in before after plain; do
    m=lookup-chain; if [ $side = before ]; then export PYTHONPATH=$BEFORE; else unset PYTHONPATH; fi
    if [ $side = plain ]; then m=plain; fi
    python -m specgen run -f $PROMPTS/$p.txt --method $m -n 64 --format json 2>/dev/null > /tmp/v-$p-$side.json
  done
  unset PYTHONPATH
  python - "$p" <<'PY'
import json, sys
p = sys.argv[1]
d = {s: json.load(open(f"/tmp/v-{p}-{s}.json")) for s in ("before", "after", "plain")}
same = all(d[s]["token_ids"] == d["plain"]["token_ids"] for s in ("before", "after"))
st = {s: d[s]["stats"] for s in d}
print(p, "identical to plain:", same, "| before", st["before"]["decode_tokens_per_second"], st["before"]["rounds"], f'{st["before"]["accepted"]}/{st["before"]["drafted"]}',
      "| after", st["after"]["decode_tokens_per_second"], st["after"]["rounds"], f'{st["after"]["accepted"]}/{st["after"]["drafted"]}', "| plain", st["plain"]["decode_tokens_per_second"], flush=True)
PY
done
echo done
