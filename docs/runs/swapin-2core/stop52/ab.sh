#!/bin/bash
# Stop 52 on the 2-core machine: the landed tree (fd7f5f0, a worktree at $LANDED) and this
# stop's (the checkout), in turn: the swap-in bench's default command (issue 36's target),
# and 256 blocks of random:1b in bf16 in chunks of 64 and of 256 blocks.
set -u
LANDED=${LANDED:-/work/wt}
NEW=$PWD
OUT=${OUT:-docs/runs/swapin-2core/stop52}
for round in 1 2; do
    for tree in landed new; do
        dir=$NEW; [ $tree = landed ] && dir=$LANDED
        echo "== round $round, $tree, default"
        (cd $dir && PYTHONPATH=$dir $NEW/.venv/bin/python -m kvstore.cli bench swapin --transport local --no-fsync --rounds 5 --json $NEW/$OUT/default_${tree}_$round.json | grep -E "^│ +local")
        for chunk in 64 256; do
            echo "== round $round, $tree, random:1b bf16, chunks of $chunk"
            (cd $dir && PYTHONPATH=$dir $NEW/.venv/bin/python -m kvstore.cli bench swapin --transport local --no-fsync --rounds 5 --model random:1b --dtype bfloat16 --num-blocks 256 --chunk-blocks $chunk --json $NEW/$OUT/1b_c${chunk}_${tree}_$round.json | grep -E "^│ +local")
        done
    done
done
uptime
