"""The harness: everything that drives vLLM's real offloading stack around the
tier without being part of it -- ``driver`` (vLLM's scheduler-side
``TieringOffloadingSpec`` on CPU, no GPU), ``demo`` and ``demo_replica``
(``llmkv-fs demo``: replicas in separate processes), ``bench`` (``llmkv-fs
bench``: llmkv_fs against vLLM's built-in fs tier), ``bench_fio`` (the
physical reference) and ``bench_report`` (tables, JSON, plots).

Importing ``demo``, ``bench``, ``bench_report`` or ``bench_fio`` does not
import vLLM or torch (the command line builds its parser from them); vLLM is
imported when a demo replica or a benchmark runs, and by ``driver``.
"""
