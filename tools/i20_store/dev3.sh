#!/bin/bash
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
R=$PWD
cat /proc/loadavg > $O/load_before.txt
cd $R/tools/i20
export PYTHONPATH=$R/tools/i20/pkg
python3 engprof.py /dev/shm/ep20 workers,before,nochecksum,depth3,h512 2 $O/issue20_store_engprof.json > $O/issue20_store_engprof.txt 2>&1
echo profdone $(date -u) $(cat /proc/loadavg)
python3 bench/bench_engine.py --dir /dev/shm/b20 --mode workers --numa auto --per-side 7 \
  --builtin $R/.bench_payload --builtin-threads 7,8 --case many --state steady --standin off \
  --blocks 2048 --rounds 5 --ours before:order=before --ours after:order=after --ours after512:order=after,hash_kib=512 \
  --json $O/issue20_store_engine_ab2.json > $O/issue20_store_engine_ab2.txt 2>&1
echo benchdone $(date -u) $(cat /proc/loadavg)
