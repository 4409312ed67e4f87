#!/bin/sh
# specgen bench with 2 MB pages (the default here: a restart with glibc asking) and with 4 KB
# pages (SPECGEN_HUGE_PAGES=off), taking turns, three times each.
# sh benchmarks/results/huge-pages-zen4-2026-11-30/bench_ab.sh OUTDIR
out=${1:-.}
for i in 1 2 3; do
  for pages in 2mb 4kb; do
    if [ $pages = 4kb ]; then off=off; else off=; fi
    SPECGEN_HUGE_PAGES=$off specgen bench --prompts quick -n 64 --methods plain,chain,lookup-chain --repeats 2 \
      --json "$out/bench-$pages-$i.json" > "$out/bench-$pages-$i.txt" 2>&1
  done
done
