"""What the engine decides once, at start-up: the I/O options (O_DIRECT or
buffered, hash pieces), which CPUs its threads and workers run on, and which
xxh3 code the checksum runs."""
