"""Each root's upkeep: prepared before any I/O (root checked, config.json,
rank directory), then watched while running (still the same directory, free
space, lease, access stamps), the verdict shared with worker processes."""
