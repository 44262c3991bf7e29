"""Volume room: touching the shared, untrusted volume -- names resolved
beneath the pinned root without following a link, files created new and
small files read bounded, whole-block vectored I/O, leases, quarantine,
config.json, and what the filesystem is and how full. No vLLM, no threads of
its own; every caller states its own threading."""
