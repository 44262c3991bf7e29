"""Engine room: thread pools, block I/O, lookups and NUMA placement.
Imports without vLLM (stdlib, numpy-free, xxhash), so it can be driven and
benchmarked on its own."""
