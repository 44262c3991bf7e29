#!/usr/bin/env bash
# Issue 12's benchmark matrix on a big machine without vLLM (Python 3.10+
# with xxhash, a C compiler), about 8 minutes on 16 cores. From the repo root:
#
#   OUT=/tmp/out bash tools/device_bench.sh
#
# Writes to $OUT: machine.txt, ref_blockio (the compiled reference),
# engine.json / engine.txt (threads vs worker processes, 1-16 per side, idle
# and with the scheduler stand-in, plus the C reference at each point),
# engine_nochecksum.* (8 per side, checksums off, both modes and C),
# memory.json (worker page tables and start-up time against region size: 1, 4, 8 GiB).
set -euo pipefail
OUT=${OUT:?set OUT to a directory}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
MEDIUM=${MEDIUM:-/dev/shm/llmkv_device_bench}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ uname -a; nproc; lscpu | head -20; free -g; uptime; $PY -V; } >"$OUT/machine.txt" 2>&1
cc -O2 -pthread -o "$OUT/ref_blockio" tools/ref_blockio.c
rm -rf "$MEDIUM"
# 2 MiB blocks, 512 per direction (1 GiB) per run; 2 rounds alternate the
# order of the 4 configurations.
timeout 330 $PY tools/bench_engine.py --dir "$MEDIUM" --mode threads --mode workers \
    --standin both --numa auto --per-side 1 --per-side 2 --per-side 4 --per-side 8 \
    --per-side 16 --blocks 512 --blocks-per-job 8 --rounds 2 \
    --reference "$OUT/ref_blockio" --json "$OUT/engine.json" | tee "$OUT/engine.txt"
timeout 60 $PY tools/bench_engine.py --dir "$MEDIUM" --mode threads --mode workers \
    --numa auto --per-side 8 --blocks 512 --rounds 2 --no-checksum \
    --reference "$OUT/ref_blockio" --json "$OUT/engine_nochecksum.json" \
    | tee "$OUT/engine_nochecksum.txt"
timeout 90 $PY tools/worker_memory.py --dir "$MEDIUM" --gib 1 --gib 4 --gib 8 \
    --json "$OUT/memory.json" | tee "$OUT/memory.txt"
rm -rf "$MEDIUM"
