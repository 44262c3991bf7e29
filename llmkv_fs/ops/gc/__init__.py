"""Keep a shared cache volume healthy while vLLM replicas use it: remove
orphaned digests (no live lease, nothing used for --min-age), temp files of
dead writers, and -- when the volume or the cache is over its limit -- the
least recently used blocks. Never follows a symlink, never evicts a block
used within --protect (an orphaned digest goes whole once nothing in it was
used for --min-age), never touches config.json or leases of a digest it
keeps. One gc per volume at a time (a lock file in the root).

Several roots (a tier's root_dir list with path_sharding by_block_hash, or
several ROOT arguments): each root gets its own pass under its own lock, its
capacity limits apply to each root, and a busy or missing root does not stop
the others; the exit status is the worst of the roots'.

Also runs as ``python -m llmkv_fs gc``; needs neither vLLM nor torch.
"""

# The package: rules.py decides (pure: facts in, verdicts out), inventory.py
# holds what one scan found, actions.py acts (re-checking right before each
# removal; evict.py: capacity eviction in global age order), lock.py keeps
# one gc per volume, sweep.py runs one pass in order, report.py says what it
# did, command.py is the command line's side.

from llmkv_fs.ops.gc.command import (
    EXIT_BUSY,
    EXIT_ERRORS,
    EXIT_SIGTERM,
    add_arguments,
    run,
)

__all__ = ["EXIT_BUSY", "EXIT_ERRORS", "EXIT_SIGTERM", "add_arguments", "run"]
