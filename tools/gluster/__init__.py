"""A GlusterFS volume on loopback as a maintained tool, shared by the tests
(tests/kits/gluster_kit.py) and the benchmarks (tools/bench/latency.py): the
server (glusterd.py), the volume's bring-up and teardown (loopback.py) and
the latency added on its server side, measured (delay.py)."""
