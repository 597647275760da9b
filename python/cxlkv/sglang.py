"""SGLang HiCache storage backend over a cxlkv pool (``cxlkv.sglang.CxlKvHiCacheStorage``).

Implements the methods of SGLang's ``HiCacheStorage`` (sglang/srt/mem_cache/hicache_storage.py,
as of SGLang 0.5): ``get``, ``set``, ``exists``, ``batch_get``, ``batch_set``, ``batch_exists``,
``clear``, ``get_stats``, ``register_mem_pool_host``. Pages are SGLang's host KV pages, stored
whole (opaque bytes: HiCache's page layout is its own); keys are SGLang's page hashes (hex
sha256 strings) folded into a namespace of model, TP rank/size (left out for MLA, whose latent
is the same on every rank) and PP rank, so ranks never read each other's pages.

SGLang is not imported at module load: where it is installed, the class also derives from its
``HiCacheStorage``; elsewhere (these machines) it is tested through the same calls directly.

Configuration (``storage_config.extra_config``, or keyword arguments): ``pool_path`` (required:
the pool's region path(s)), ``node_id`` (this host's node, default 0), ``dtype`` (of the host
pages, default bfloat16), ``page_bytes`` (when no host pool is registered before the first
``get`` without a target).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from . import _buffers, _cxlkv
from .pool import Namespace, Pool

try:  # the real base class where SGLang is installed
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base  # type: ignore
except ImportError:  # pragma: no cover - SGLang is not installable here
    _Base = object


def _config(storage_config: Any, name: str, default: Any) -> Any:
    return getattr(storage_config, name, default) if storage_config is not None else default


class CxlKvHiCacheStorage(_Base):  # type: ignore[misc, valid-type]
    """SGLang's L3 KV storage on a cxlkv pool: every host of the rack sees every page."""

    def __init__(self, storage_config: Any = None, kwargs: Optional[dict] = None, *, pool: Optional[Pool] = None,
                 **overrides: Any):
        # SGLang's dynamic backend factory calls cls(storage_config, kwargs).
        extra = dict(_config(storage_config, "extra_config", None) or {})
        extra.update(kwargs or {})
        extra.update(overrides)
        if pool is None:
            if "pool_path" not in extra:
                raise _cxlkv.InvalidArgumentError(
                    "CxlKvHiCacheStorage needs the pool: pass extra_config={'pool_path': '/dev/shm/...'} "
                    "(--hicache-storage-backend-extra-config) or pool=cxlkv.Pool(...)")
            pool = Pool(extra["pool_path"], node_id=int(extra.get("node_id", 0)))
            self._owns_pool = True
        else:
            self._owns_pool = False
        self.pool = pool
        mla = bool(_config(storage_config, "is_mla_model", False))
        model = _config(storage_config, "model_name", None) or extra.get("model_name") or "sglang"
        self.namespace: Namespace = pool.namespace(
            str(model), dtype=extra.get("dtype", "bfloat16"), block_size=int(extra.get("page_size", 0)) or 16,
            tp_rank=0 if mla else int(_config(storage_config, "tp_rank", 0)),
            tp_size=1 if mla else int(_config(storage_config, "tp_size", 1)),
            pp_stage=int(_config(storage_config, "pp_rank", 0)), extra_key="sglang-hicache")
        self.page_bytes: int = int(extra.get("page_bytes", 0))
        self.mem_pool_host: Any = None
        self._torch_dtype = extra.get("dtype", "bfloat16")

    # ---- SGLang's interface ----

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Remembers SGLang's host pool; its page size in bytes sizes pages ``get`` allocates."""
        self.mem_pool_host = mem_pool_host
        per_token = getattr(mem_pool_host, "get_size_per_token", None)
        page = getattr(mem_pool_host, "page_size", None)
        if callable(per_token) and page:
            self.page_bytes = int(per_token()) * int(page)
        dtype = getattr(mem_pool_host, "dtype", None)
        if dtype is not None:
            self._torch_dtype = dtype

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many leading pages the pool holds (no pins, no copies)."""
        if not keys:
            return 0
        return self.pool.exists_prefix(self.namespace, self.namespace.keys_from_hashes(keys))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Stores every page (pages already in the pool count as stored). False when the pool
        refused the batch (full, or a bad page): nothing of it is published then."""
        pages = values if values is not None else target_locations
        if not keys:
            return True
        if pages is None or len(pages) != len(keys):
            raise _cxlkv.InvalidArgumentError(f"batch_set: {len(keys)} keys but "
                                              f"{0 if pages is None else len(pages)} pages")
        try:
            self.pool.put(self.namespace, self.namespace.keys_from_hashes(keys), [_flat(p) for p in pages])
        except (_cxlkv.NoSpaceError, _cxlkv.BusyError, _cxlkv.LeaseExpiredError):
            return False  # HiCache treats a failed write-back as "not stored" and carries on
        if not self.page_bytes:
            self.page_bytes = _buffers.describe(_flat(pages[0]), writable=False, what="page").nbytes
        return True

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        got = self.batch_get([key], None if target_location is None else [target_location])
        return got[0]

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[Any]:
        """Pages of the longest stored prefix of ``keys``, read into ``target_locations`` (or new
        tensors); None for each key past it."""
        if not keys:
            return []
        if target_locations is None:
            if not self.page_bytes:
                raise _cxlkv.InvalidArgumentError(
                    "batch_get without target locations needs the page size: register the host pool "
                    "(register_mem_pool_host), store a page first, or pass page_bytes in extra_config")
            target_locations = [self._new_page() for _ in keys]
        if len(target_locations) != len(keys):
            raise _cxlkv.InvalidArgumentError(f"batch_get: {len(keys)} keys but {len(target_locations)} targets")
        n = self.pool.get(self.namespace, self.namespace.keys_from_hashes(keys), [_flat(t) for t in target_locations])
        return [t if i < n else None for i, t in enumerate(target_locations)]

    def clear(self) -> None:
        """Evicts every unpinned block of the pool (HiCache's clear is for benchmarks and tests)."""
        self.pool.evict_all()

    def get_stats(self) -> dict:
        """The pool's cache counters (cxlkv stat's "cache" section)."""
        return self.pool.stats().get("cache", {})

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()

    def _new_page(self) -> Any:
        import torch

        dtype = self._torch_dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype))
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return torch.empty(self.page_bytes // itemsize, dtype=dtype)


def _flat(page: Any) -> Any:
    """A page tensor as one contiguous run of bytes (SGLang's flat host pages already are)."""
    reshape = getattr(page, "reshape", None)
    if reshape is not None and hasattr(page, "is_contiguous") and page.is_contiguous():
        return reshape(-1)
    return page
