#!/bin/bash
# engine bench while the disk fills up underneath it, after its cluster started
cd /work/main
for i in $(seq 1 6); do
  rm -rf /mnt/small/*
  avail=$(df -B1 --output=avail /mnt/small | tail -1)
  fallocate -l $((avail - 160*1024*1024)) /mnt/small/filler
  ( sleep $((i % 3 + 3)); n=0; while fallocate -l 4m /mnt/small/grow$n 2>/dev/null; do n=$((n+1)); sleep 0.15; done; sleep 60 ) &
  filler=$!
  TMPDIR=/mnt/small timeout 300 .venv/bin/python -m kvstore.cli bench engine --json /tmp/ebs$i.json --model random:small --prompt-lengths 128,256 --cached-fractions 0,0.5,0.9 --repeats 3 --block-tokens 16 --nodes 12 --fetch-policy always > /tmp/ebs$i.out 2>&1
  rc=$?
  kill $filler 2>/dev/null; pkill -f "sleep 60"; wait $filler 2>/dev/null
  echo "run $i rc=$rc $(python3 -c "import json;d=json.load(open('/tmp/ebs$i.json'));print([ (r['prompt_tokens'],r['cached_tokens'],r['same_first_token']) for r in d['results']])" 2>/dev/null) $(grep -o 'error:.*' /tmp/ebs$i.out | head -1 | cut -c1-150) $(grep -c 'write-back.*failed' /tmp/ebs$i.out)"
done
rm -rf /mnt/small/*
