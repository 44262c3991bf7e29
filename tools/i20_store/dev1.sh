#!/bin/bash
# device run 1: probe + C store matrix + python store matrix (+ perf if present)
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
{
date -u; uname -a; nproc; lscpu; cat /proc/loadavg
which perf strace gcc python3; python3 -V
cat /sys/kernel/mm/transparent_hugepage/shmem_enabled
ls /sys/kernel/mm/transparent_hugepage/ 2>/dev/null
for f in /sys/kernel/mm/transparent_hugepage/hugepages-*/shmem_enabled; do echo "$f: $(cat $f)"; done 2>/dev/null
mount | grep -E "/dev/shm|tmpfs" | head
cat /proc/sys/kernel/perf_event_paranoid
grep -E "MemFree|Shmem" /proc/meminfo
cat /proc/self/cgroup
} > $O/machine.txt 2>&1
export I20_PKG=$PWD/tools/i20/pkg
B=tools/i20/storebench
D=/dev/shm/sb20
# warm guest memory (first touch on a fresh lease is slow)
$B $D 2097152 4096 p 14 one 262144 1 > $O/warm.txt 2>&1
for rep in 1 2; do
for n in 1 4 8 14; do
 for m in t p; do
  for v in one pieces pieces_hash hash_one overwrite memcpy hash one_noren; do
   $B $D 2097152 1024 $m $n $v 262144 1
  done
 done
done
done > $O/cbench.jsonl 2>$O/cbench.err
echo cdone $(date -u)
python3 tools/i20/pystore.py --dir /dev/shm/ps20 --payload .bench_payload --n 1,4,8,14 \
  --variants ours256,ours_nock,ours0,builtin:t,builtin:p --blocks 2048 --json $O/pystore.json > $O/pystore.txt 2>&1
echo pydone $(date -u)
if which perf >/dev/null 2>&1; then
 for spec in ours256:14 builtin:t:8 builtin:p:14; do
  v=${spec%:*}; n=${spec##*:}; tag=$(echo $v | tr ':' '_')_$n
  perf record -q -a -g -F 999 -o /tmp/p_$tag.data -- python3 tools/i20/pystore.py --dir /dev/shm/pp20 --payload .bench_payload --n $n --variants $v --blocks 4096 > $O/perf_run_$tag.txt 2>&1
  perf report -i /tmp/p_$tag.data --stdio --no-children --sort sym 2>/dev/null | grep -v "^$" | head -150 > $O/perf_$tag.txt
  perf report -i /tmp/p_$tag.data --stdio --no-children --sort sym -g none 2>/dev/null | grep "%" | head -60 > $O/perf_flat_$tag.txt
 done
fi
echo alldone $(date -u)
