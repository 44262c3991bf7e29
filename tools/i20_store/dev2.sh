#!/bin/bash
# device run 2: A/B hash-then-write (before) vs write-then-hash (after) in the real engine, same run
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
R=$PWD
cat /proc/loadavg > $O/load_before.txt
cd $R/tools/i20
export PYTHONPATH=$R/tools/i20/pkg
python3 bench/bench_engine.py --dir /dev/shm/b20 --mode workers --numa auto --per-side 7 \
  --builtin $R/.bench_payload --builtin-threads 7,8 --case many --case long --state steady --standin off \
  --blocks 2048 --rounds 5 --ours before:order=before --ours after:order=after --ours after512:order=after,hash_kib=512 \
  --json $O/issue20_store_engine_ab.json > $O/issue20_store_engine_ab.txt 2>&1
echo benchdone $(date -u) $(cat /proc/loadavg)
cd $R
I20_PKG=$R/tools/i20/pkg python3 tools/i20/pystore.py --dir /dev/shm/ps20 --payload .bench_payload --n 1,8,14 \
  --variants b256,a256,L256,a512,a1m,ours_nock,builtin:t --blocks 2048 --rounds 2 --json $O/issue20_store_py_ab.json > $O/issue20_store_py_ab.txt 2>&1
echo pydone $(date -u) $(cat /proc/loadavg)
