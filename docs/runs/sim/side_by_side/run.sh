#!/bin/bash
# partition_cpu_ratio before and after issue 39's second round, side by side: the same bench
# command from a checkout of the base commit (3107fd4, BASE) and of this branch (NEW), each
# with `make native` built, alternated so both see the same load. Usage: run.sh BASE NEW OUT
base=$1 new=$2 out=$3
mkdir -p "$out"
run() {  # base|new tag bench-args...
  local which=$1 tag=$2 root; shift 2
  root=$([ "$which" = base ] && echo "$base" || echo "$new")
  echo "$which $tag start $(uptime)" >> "$out/uptime.txt"
  (cd "$root" && PYTHONPATH=$root kvstore bench sim "$@" --json "$out/${which}_$tag.json")
  echo "$which $tag end   $(uptime)" >> "$out/uptime.txt"
}
for i in 1 2; do
  run base "2d_$i" --days 2 --partitions 4,16 --workers 0 --rounds 7
  run new "2d_$i" --days 2 --partitions 4,16 --workers 0 --rounds 7
done
run base 4d --days 4 --rate-scale 3 --partitions 4,16 --workers 0 --rounds 1
run new 4d --days 4 --rate-scale 3 --partitions 4,16 --workers 0 --rounds 1
