"""SGLang HiCache's storage loop (HiCacheController in sglang/srt/managers/cache_controller.py),
driving an L3 storage backend the way SGLang does, for tests without SGLang.

Threads, as upstream: a backup thread (write_storage -> backup_queue -> batch_set_v1 or
batch_set, batch by batch of STORAGE_BATCH_SIZE pages, stopping at the first failed batch), a
prefetch thread (prefetch -> prefetch_queue -> batch_exists per batch, stopping at the first
short answer) and its I/O thread (prefetch_buffer -> batch_get_v1 into the host pool by index, or
batch_get into staging pages then set_from_flat_data_page). Like upstream's, each loop catches
only queue.Empty: any exception from the backend ends its thread (recorded in ``thread_errors``
here so a test can say which). The zero-copy calls are chosen as the controller chooses them for
the "dynamic" backend: ``interface_v1`` in the backend's extra config.

Simplified: one rank (no all-reduce of hit counts), the prefetch thread allocates host pages
itself (upstream the scheduler does, between the two threads), no revoke of short prefetches,
and ``check_events`` stands for hiradix_cache's per-step get_stats under --enable-metrics.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

STORAGE_BATCH_SIZE = 128  # sglang.srt.mem_cache.hicache_storage: max pages per batched storage call


@dataclass
class ExtraInfo:
    """HiCacheStorageExtraInfo's fields."""
    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None


@dataclass
class StorageOperation:
    host_indices: torch.Tensor
    hash_value: List[str]
    completed_tokens: int = 0
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class PrefetchOperation:
    request_id: str
    hash_value: List[str]  # the pages asked for; cut to the stored prefix by the hit query
    host_indices: Optional[torch.Tensor] = None
    storage_hit_count: int = 0  # tokens batch_exists reported
    completed_tokens: int = 0  # tokens read into the host pool
    done: threading.Event = field(default_factory=threading.Event)


class HiCacheLoop:
    """Registers ``host_pool`` with ``backend`` (as attach_storage_backend does) and runs the loop."""

    def __init__(self, backend: Any, host_pool: Any, *, batch: int = STORAGE_BATCH_SIZE, poll_s: float = 0.05,
                 backup_skip: bool = False):
        self.backend, self.host, self.page_size = backend, host_pool, host_pool.page_size
        self.batch, self.poll_s = batch, poll_s
        self.backup_skip = backup_skip  # upstream: MLA ranks other than 0 do not back up
        backend.register_mem_pool_host(host_pool)
        zero_copy = bool(getattr(backend, "interface_v1", False))
        self.page_get_func = self._page_get_zero_copy if zero_copy else self._generic_page_get
        self.page_set_func = self._page_set_zero_copy if zero_copy else self._generic_page_set
        self.stop_event = threading.Event()
        self.backup_queue: "queue.Queue[Optional[StorageOperation]]" = queue.Queue()
        self.prefetch_queue: "queue.Queue[Optional[PrefetchOperation]]" = queue.Queue()
        self.prefetch_buffer: "queue.Queue[Optional[PrefetchOperation]]" = queue.Queue()
        self.thread_errors: List[BaseException] = []
        self.metrics: List[Any] = []
        self.threads = [threading.Thread(target=self._run, args=(f,), name=f.__name__, daemon=True)
                        for f in (self.backup_thread_func, self.prefetch_thread_func, self.prefetch_io_aux_func)]

    # ---- the scheduler's side ----

    def start(self) -> "HiCacheLoop":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for q in (self.backup_queue, self.prefetch_queue, self.prefetch_buffer):
            q.put(None)
        for t in self.threads:
            t.join(timeout=10)

    def __enter__(self) -> "HiCacheLoop":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def alive(self) -> bool:
        return all(t.is_alive() for t in self.threads)

    def write_storage(self, host_indices: torch.Tensor, hash_value: List[str]) -> StorageOperation:
        op = StorageOperation(host_indices, list(hash_value))
        self.backup_queue.put(op)
        return op

    def prefetch(self, request_id: str, hash_value: List[str]) -> PrefetchOperation:
        op = PrefetchOperation(request_id, list(hash_value))
        self.prefetch_queue.put(op)
        return op

    def check_events(self) -> Any:
        """hiradix_cache.check_hicache_events under --enable-metrics: the backend's get_stats,
        which StorageMetricsCollector.log_storage_metrics takes as None or a StorageMetrics."""
        stats = self.backend.get_stats()
        self.metrics.append(stats)
        return stats

    # ---- the threads (each loop catches queue.Empty only, as upstream) ----

    def _run(self, loop: Any) -> None:
        try:
            loop()
        except Exception as e:  # recorded; the thread ends here as upstream's would
            self.thread_errors.append(e)

    def backup_thread_func(self) -> None:
        while not self.stop_event.is_set():
            try:
                op = self.backup_queue.get(block=True, timeout=self.poll_s)
                if op is None:
                    continue
                if not self.backup_skip:
                    self._page_backup(op)
                op.done.set()
            except queue.Empty:
                continue

    def prefetch_thread_func(self) -> None:
        while not self.stop_event.is_set():
            try:
                op = self.prefetch_queue.get(block=True, timeout=self.poll_s)
                if op is None:
                    continue
                hit_pages = self._storage_hit_query(op)
                op.hash_value = op.hash_value[:hit_pages]
                op.storage_hit_count = hit_pages * self.page_size
                op.host_indices = self.host.alloc(op.storage_hit_count) if hit_pages else None
                if op.host_indices is None:
                    op.done.set()
                    continue
                self.prefetch_buffer.put(op)
            except queue.Empty:
                continue

    def prefetch_io_aux_func(self) -> None:
        while not self.stop_event.is_set():
            try:
                op = self.prefetch_buffer.get(block=True, timeout=self.poll_s)
                if op is None:
                    continue
                self._page_transfer(op)
                op.done.set()
            except queue.Empty:
                continue

    # ---- the controller's storage calls ----

    def _storage_hit_query(self, op: PrefetchOperation) -> int:
        hits = 0
        for start in range(0, len(op.hash_value), self.batch):
            batch = op.hash_value[start:start + self.batch]
            n = self.backend.batch_exists(batch, ExtraInfo())
            hits += n
            if n < len(batch):
                break
        return hits

    def _page_transfer(self, op: PrefetchOperation) -> None:
        for i in range(0, len(op.hash_value), self.batch):
            hashes = op.hash_value[i:i + self.batch]
            indices = op.host_indices[i * self.page_size:(i + len(hashes)) * self.page_size]
            hit = self.page_get_func(op, hashes, indices, ExtraInfo())
            op.completed_tokens += hit * self.page_size
            if hit != len(hashes):
                break

    def _page_get_zero_copy(self, op: PrefetchOperation, hashes: List[str], indices: torch.Tensor,
                            extra_info: Any = None) -> int:
        results = self.backend.batch_get_v1(hashes, indices, extra_info)
        inc = 0
        for i in range(len(hashes)):  # indexes the result as upstream: a short list is an IndexError
            if not results[i]:
                break
            inc += 1
        return inc

    def _generic_page_get(self, op: PrefetchOperation, hashes: List[str], indices: torch.Tensor,
                          extra_info: Any = None) -> int:
        dummy = [self.host.get_dummy_flat_data_page() for _ in hashes]
        pages = self.backend.batch_get(hashes, dummy)
        if pages is None:
            return 0
        count = 0
        for i in range(len(hashes)):
            if pages[i] is None:
                break
            self.host.set_from_flat_data_page(int(indices[i * self.page_size]), pages[i])
            count += 1
        return count

    def _page_backup(self, op: StorageOperation) -> None:
        for i in range(0, len(op.hash_value), self.batch):
            hashes = op.hash_value[i:i + self.batch]
            indices = op.host_indices[i * self.page_size:(i + len(hashes)) * self.page_size]
            if not self.page_set_func(hashes, indices, ExtraInfo()):
                break
            op.completed_tokens += self.page_size * len(hashes)

    def _generic_page_set(self, hashes: List[str], indices: torch.Tensor, extra_info: Any = None) -> bool:
        data = [self.host.get_data_page(int(indices[i * self.page_size])) for i in range(len(hashes))]
        return self.backend.batch_set(hashes, data)

    def _page_set_zero_copy(self, hashes: List[str], indices: torch.Tensor, extra_info: Any = None) -> bool:
        return all(self.backend.batch_set_v1(hashes, indices, extra_info))
