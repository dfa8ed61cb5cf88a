#!/bin/bash
# ab.sh TAG N: N alternating runs of base and branch, JSON to /tmp/w6/ab_TAG_{base,new}_i.json
TAG=$1; N=${2:-2}
for i in $(seq 1 $N); do
  for which in base new; do
    if [ $which = base ]; then P=/tmp/w6/base; else P=/work/wt/w6-swapin; fi
    L=$(cut -d' ' -f1 /proc/loadavg)
    (cd $P && PYTHONPATH=$P /work/main/.venv/bin/kvstore bench swapin --transport local --no-fsync --rounds 5 --json /tmp/w6/ab_${TAG}_${which}_$i.json > /dev/null 2>&1)
    python3 -c "
import json;d=json.load(open('/tmp/w6/ab_${TAG}_${which}_$i.json'));r=d['results'][0]
print('$which $i load', '$L', d['config']['load_average_1m_before_after'], 'GB/s %.2f cache %.2f client %.3f nodes %.3f idle %.3f p50 %.0f' % (r['gb_per_s'], r['cache_gb_per_s'], r['client_cpu_s_per_gb'], r['nodes_cpu_s_per_gb'], r['nodes_idle_cpu_s_per_gb'], r['p50_ms']))"
  done
done
