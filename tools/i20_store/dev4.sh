#!/bin/bash
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
R=$PWD
cat /proc/loadavg > $O/load_before.txt
cd $R/tools/i20
export PYTHONPATH=$R/tools/i20/pkg
# warm guest memory first (fresh lease: first touch is slow)
../i20/storebench /dev/shm/warm20 2097152 4096 p 14 one 262144 1 > $O/warm.txt 2>&1
python3 bench/bench_engine.py --dir /dev/shm/b20 --mode workers --numa auto --per-side 7 \
  --builtin $R/.bench_payload --builtin-threads 7,8,16 --case many --state steady --standin both \
  --blocks 2048 --rounds 3 --ours before:order=before --ours after:order=after \
  --ours after16:order=after,io_workers=16 --ours after16nice19:order=after,io_workers=16,nice=19 \
  --json $O/issue20_store_engine_ab3.json > $O/issue20_store_engine_ab3.txt 2>&1
echo benchdone $(date -u) $(cat /proc/loadavg)
