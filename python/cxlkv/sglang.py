"""SGLang HiCache L3 storage backend over a cxlkv pool (``cxlkv.sglang.CxlKvHiCacheStorage``).

Written against SGLang's ``HiCacheStorage`` (sglang/srt/mem_cache/hicache_storage.py) as its
``HiCacheController`` (sglang/srt/managers/cache_controller.py) calls it:

- prefetch thread: ``batch_exists`` (how many leading pages are stored), then per batch of
  pages ``batch_get_v1(keys, host_indices)`` straight into the host KV pool — or, without
  ``interface_v1``, ``batch_get`` into staging pages the controller copies in;
- backup thread: ``batch_set_v1(keys, host_indices)`` from the host pool — or ``batch_set`` of
  page copies;
- scheduler: ``get_stats`` every step under ``--enable-metrics`` (it asserts a
  ``StorageMetrics``), ``clear`` on request.

Those threads catch nothing but ``queue.Empty``: an exception out of any call here ends the
thread and silently turns L3 off for the life of the process. So after start-up nothing here
raises. A failed call answers with its miss value (``batch_get``: None entries, ``*_v1``: False
flags, ``batch_set``: False, ``batch_exists``: 0, ``exists``: False), is counted per error kind
(``counters()["errors"]``) and logged once per kind on the "cxlkv.sglang" logger. The
constructor and ``register_mem_pool_host`` (SGLang's start-up) do raise, saying what to configure.

Keys are SGLang's page hashes in a namespace of model, TP rank/size (left out for MLA, whose
latent every rank holds), PP rank and size, attention-CP rank and size, and the host layout
(see _hicache_pages). Configuration (``--hicache-storage-backend-extra-config``): ``pool_path``
(required), ``node_id`` (default 0), ``lease_ms`` (2000), ``interface_v1`` (SGLang's switch to
the zero-copy calls), ``model_name``, ``dtype``, ``page_size`` and ``page_bytes`` (only for use
without a registered host pool).

SGLang is not imported at module load: where it is installed the class derives from its
``HiCacheStorage``; elsewhere it is driven through the same calls (python/tests/test_sglang.py,
cxlkv.mini_engine.hicache).
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from . import _buffers, _cxlkv
from ._hicache_pages import RankPlace, ZeroCopyPlan, open_namespace, plan_zero_copy, rank_place
from .pool import Namespace, Pool

logger = logging.getLogger("cxlkv.sglang")

try:  # the real base class where SGLang is installed (the dynamic factory checks issubclass)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base  # type: ignore
except ImportError:  # pragma: no cover - SGLang is not installable here
    _Base = object

# Where SGLang keeps StorageMetrics: it moved from metrics/collector.py to
# observability/metrics_collector.py. HiCache asserts isinstance against its own import.
_STORAGE_METRICS_MODULES = ("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector")
# Per-batch metric samples kept between two get_stats calls (nobody drains them without --enable-metrics).
_METRIC_SAMPLES = 4096


def _upstream(name: str, modules: tuple) -> Any:
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


@dataclass
class _NoHits:
    """PoolTransferResult's shape, for batch_exists_v2 where SGLang is not importable."""
    kv_hit_pages: int = 0
    extra_pool_hit_pages: dict = field(default_factory=dict)


def _len(xs: Any) -> int:
    try:
        return len(xs)
    except TypeError:
        return 0


def _flag(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _flat(page: Any) -> Any:
    """A page tensor as one contiguous run of bytes (SGLang's flat host pages already are)."""
    reshape = getattr(page, "reshape", None)
    if reshape is not None and hasattr(page, "is_contiguous") and page.is_contiguous():
        return reshape(-1)
    return page


class CxlKvHiCacheStorage(_Base):  # type: ignore[misc, valid-type]
    """SGLang's L3 KV storage on a cxlkv pool: every host of the rack sees every page."""

    def __init__(self, storage_config: Any = None, kwargs: Optional[dict] = None, *, pool: Optional[Pool] = None,
                 **overrides: Any):
        # SGLang's dynamic backend factory calls cls(storage_config, kwargs).
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        extra.update(kwargs or {})
        extra.update(overrides)
        if pool is None:
            if "pool_path" not in extra:
                raise _cxlkv.InvalidArgumentError(
                    "CxlKvHiCacheStorage needs the pool: pass extra_config={'pool_path': '/dev/shm/...'} "
                    "(--hicache-storage-backend-extra-config) or pool=cxlkv.Pool(...)")
            pool = Pool(extra["pool_path"], node_id=int(extra.get("node_id", 0)),
                        lease_ms=int(extra.get("lease_ms", 2000)))
            self._owns_pool = True
        else:
            self._owns_pool = False
        self.pool = pool
        self.place: RankPlace = rank_place(storage_config, extra)
        self.interface_v1 = _flag(extra.get("interface_v1", 0))
        self.page_bytes: int = int(extra.get("page_bytes", 0))
        self.mem_pool_host: Any = None
        self._dtype: Any = extra.get("dtype", "bfloat16")
        self._page_size = int(extra.get("page_size", 0)) or 16
        self._layout: Optional[str] = None
        self._lock = threading.Lock()
        self._ns: Optional[Namespace] = None  # the pages batch_get/batch_set move; made on first use
        self._plan: Optional[ZeroCopyPlan] = None  # how *_v1 move pages, once a host pool is registered
        self._copying_seen = False  # batch_get/batch_set called although interface_v1 is on
        self._v1_unsupported = "no host pool is registered (register_mem_pool_host)"
        self._counts: Counter = Counter()
        self._errors: Counter = Counter()
        self._logged: set = set()
        self._samples = {k: deque(maxlen=_METRIC_SAMPLES)
                         for k in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")}
        self._metrics_cls: Any = None
        if self.place.tp_lcm_size:
            logger.info("cxlkv HiCache: tp_lcm_size=%d: with a page_head host layout pages are kept per head "
                        "group, shared by engines of other TP sizes", self.place.tp_lcm_size)

    # ---- start-up (may raise: SGLang surfaces it) ----

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes SGLang's host KV pool: its dtype, page size and layout make the namespace (made
        here, so a pool that refuses it fails start-up, not a transfer), and its buffer metadata
        the zero-copy plan. Raises NotSupportedError where interface_v1 is on and this host pool's
        pages cannot move zero-copy (saying why and what to change)."""
        self.mem_pool_host = mem_pool_host
        per_token = getattr(mem_pool_host, "get_size_per_token", None)
        page = getattr(mem_pool_host, "page_size", None)
        if callable(per_token) and page:
            self.page_bytes = int(per_token()) * int(page)
        if page:
            self._page_size = int(page)
        dtype = getattr(mem_pool_host, "dtype", None)
        if dtype is not None:
            self._dtype = dtype
        self._layout = getattr(mem_pool_host, "layout", None)
        with self._lock:
            self._ns = None
        self._namespace()
        try:
            self._plan = plan_zero_copy(self.pool, self.place, mem_pool_host, self._layout, self._dtype)
            self._v1_unsupported = ""
        except _cxlkv.Error as e:
            self._plan, self._v1_unsupported = None, str(e)
            if self.interface_v1:
                raise _cxlkv.NotSupportedError(
                    f"cxlkv HiCache: interface_v1 is on but {e}. Use --hicache-mem-layout page_first (or "
                    f"page_first_direct, layer_first), or drop interface_v1 from the extra config") from e
            logger.info("cxlkv HiCache: zero-copy (interface_v1) would not work with this host pool: %s", e)
            return
        plan = self._plan
        if self.interface_v1 and plan.pieces > 2:
            logger.info("cxlkv HiCache: host layout %s keeps a page in %d pieces of %d bytes; each is a pool block "
                        "(page_first keeps an MHA page in 2): prefer --hicache-mem-layout page_first",
                        self._layout, plan.pieces, plan.piece_bytes)
        if not self.interface_v1:
            logger.info("cxlkv HiCache: interface_v1 is off, so HiCache moves pages through batch_get/batch_set "
                        "and staging copies; add \"interface_v1\": 1 to the extra config for zero-copy")
        elif self.place.tp_lcm_size and not plan.split:
            logger.info("cxlkv HiCache: tp_lcm_size is set but the host layout is %s (per-head-group pages need "
                        "page_head, and not MLA): pages stay per TP rank", self._layout)

    # ---- SGLang's calls (never raise) ----

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many leading pages the pool holds (no pins, no copies)."""
        try:
            if not keys:
                return 0
            plan = self._v1_plan_or_none()
            if plan is not None:
                n = self.pool.exists_prefix(plan.namespace, plan.keys(keys)) // plan.pieces
            else:
                ns = self._namespace()
                n = self.pool.exists_prefix(ns, ns.keys_from_hashes(keys))
            self._count(exists_calls=1)
            return min(int(n), len(keys))
        except Exception as e:
            self._failed("batch_exists", e)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """The longest stored prefix of ``keys`` read straight into the registered host pool at
        ``host_indices`` (page_size indices per key); True per page read."""
        n = _len(keys)
        try:
            if n == 0:
                return []
            plan, args = self._zero_copy(keys, host_indices, n)
            start = time.perf_counter()
            blocks = self.pool.get_addresses(*args, within=plan.within)
            pages = min(blocks // plan.pieces, n)
            self._moved("get", pages, blocks * plan.piece_bytes, time.perf_counter() - start)
            return [i < pages for i in range(n)]
        except Exception as e:
            self._failed("batch_get_v1", e)
            return [False] * n

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """The host pool's pages at ``host_indices`` stored under ``keys``, straight from host
        memory; all True, or all False when the pool refused the batch (nothing of it published)."""
        n = _len(keys)
        try:
            if n == 0:
                return []
            plan, args = self._zero_copy(keys, host_indices, n)
            start = time.perf_counter()
            put = self.pool.put_addresses(*args, within=plan.within)
            self._moved("set", -(-put.written // plan.pieces), put.written * plan.piece_bytes,
                        time.perf_counter() - start, skipped=put.skipped)
            return [True] * n
        except Exception as e:
            self._failed("batch_set_v1", e)
            return [False] * n

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Stores every page (pages already in the pool count as stored). False when the pool
        refused the batch (full of pinned pages, a bad page): nothing of it is published then."""
        try:
            pages = values if values is not None else target_locations
            if not keys:
                return True
            if pages is None or len(pages) != len(keys):
                raise _cxlkv.InvalidArgumentError(f"batch_set: {len(keys)} keys but {_len(pages)} pages")
            self._copying_path_used()
            ns = self._namespace()
            flat = [_flat(p) for p in pages]
            start = time.perf_counter()
            put = self.pool.put(ns, ns.keys_from_hashes(keys), flat)
            size = _buffers.describe(flat[0], writable=False, what="page").nbytes
            self._moved("set", put.written, put.written * size, time.perf_counter() - start, skipped=put.skipped)
            if not self.page_bytes:
                self.page_bytes = size
            return True
        except Exception as e:
            self._failed("batch_set", e)
            return False

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[Any]:
        """Pages of the longest stored prefix of ``keys``, read into ``target_locations`` (or new
        tensors of the host pool's page size); None for each key past it."""
        n = _len(keys)
        try:
            if n == 0:
                return []
            if target_locations is None:
                if not self.page_bytes:
                    raise _cxlkv.InvalidArgumentError(
                        "batch_get without target locations needs the page size: register the host pool "
                        "(register_mem_pool_host), store a page first, or pass page_bytes in extra_config")
                target_locations = [self._new_page() for _ in range(n)]
            if len(target_locations) != n:
                raise _cxlkv.InvalidArgumentError(f"batch_get: {n} keys but {len(target_locations)} targets")
            self._copying_path_used()
            ns = self._namespace()
            flat = [_flat(t) for t in target_locations]
            start = time.perf_counter()
            got = self.pool.get(ns, ns.keys_from_hashes(keys), flat)
            size = _buffers.describe(flat[0], writable=False, what="page").nbytes
            self._moved("get", got, got * size, time.perf_counter() - start)
            return [t if i < got else None for i, t in enumerate(target_locations)]
        except Exception as e:
            self._failed("batch_get", e)
            return [None] * n

    def clear(self) -> bool:
        """Evicts this backend's pages (its namespaces) and nothing of the rest of the shared
        pool; False (logged) where it could not."""
        try:
            evict = getattr(self.pool, "evict_namespace", None)
            if evict is None:
                raise _cxlkv.NotSupportedError(
                    "this cxlkv build has no Pool.evict_namespace, so nothing was cleared (evict_all would clear "
                    "every engine's pages of the shared pool): update cxlkv")
            spaces = {ns.id: ns for ns in (self._namespace(), self._plan.namespace if self._plan else None) if ns}
            evicted = sum(int(evict(ns)) for ns in spaces.values())
            logger.info("cxlkv HiCache: cleared %d blocks of %s", evicted, ", ".join(map(repr, spaces.values())))
            return True
        except Exception as e:
            self._failed("clear", e)
            return False

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics of the batches since the last call (pages per batch, GiB/s per
        batch); None where SGLang is not importable (HiCache then logs nothing)."""
        try:
            cls = self._metrics_cls or _upstream("StorageMetrics", _STORAGE_METRICS_MODULES)
            if cls is None:
                return None
            self._metrics_cls = cls
            metrics = cls()
            with self._lock:
                for name, samples in self._samples.items():
                    getattr(metrics, name).extend(samples)
                    samples.clear()
            return metrics
        except Exception as e:
            self._failed("get_stats", e)
            return None

    # ---- HiCache's v2 interface (hybrid models' side pools): not supported ----
    # The controller reads batch_get_v2's result with count_pool_hits (leading True per pool) and
    # takes the minimum with the KV hits, so every pool named with all-False flags is what makes
    # it load nothing; an empty dict would read as "no side pool limits the hit".

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if not hasattr(self, "registered_pools"):
            self.registered_pools: Dict[Any, Any] = {}
        self.registered_pools[host_pool_name] = host_pool
        self._v2_refused("register_mem_host_pool_v2")

    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """Zero hits: a hybrid model's prefix is only usable with its side pools, not stored here."""
        self._v2_refused("batch_exists_v2")
        try:
            cls = _upstream("PoolTransferResult", ("sglang.srt.mem_cache.hicache_storage",))
            if cls is not None:
                return cls.empty() if hasattr(cls, "empty") else cls(0, {})
        except Exception as e:
            self._failed("batch_exists_v2", e)
        return _NoHits()

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Dict[Any, List[bool]]:
        self._v2_refused("batch_get_v2")
        return self._all_false(transfers)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Dict[Any, List[bool]]:
        self._v2_refused("batch_set_v2")
        return self._all_false(transfers)

    # ---- cxlkv's own ----

    @property
    def namespace(self) -> Namespace:
        """The namespace batch_get/batch_set keep pages in (made on first use)."""
        return self._namespace()

    def counters(self) -> dict:
        """What this backend counted since it was made: pages and bytes moved by get and set
        (bytes as copied between host memory and the pool: no staging copy in between on the
        *_v1 path), blocks skipped as already stored, calls, and errors per kind."""
        with self._lock:
            out = dict(self._counts)
            out["errors"] = dict(self._errors)
        for k in ("get_pages", "get_bytes", "get_calls", "set_pages", "set_bytes", "set_calls", "set_skipped_blocks",
                  "exists_calls"):
            out.setdefault(k, 0)
        return out

    def pool_stats(self) -> dict:
        """The pool's cache counters (cxlkv stat's "cache" section: every engine's, not only this one's)."""
        return self.pool.stats().get("cache", {})

    def close(self) -> None:
        try:
            if self._owns_pool:
                self.pool.close()
        except Exception as e:
            self._failed("close", e)

    # ---- internals ----

    def _namespace(self) -> Namespace:
        with self._lock:
            if self._ns is None:
                self._ns = open_namespace(self.pool, self.place, layout=self._layout, dtype=self._dtype,
                                          page_size=self._page_size)
            return self._ns

    def _v1_plan_or_none(self) -> Optional[ZeroCopyPlan]:
        """The plan batch_exists answers for: the zero-copy one, unless HiCache moves pages through
        batch_get/batch_set after all (an SGLang that does not read interface_v1 for the dynamic
        backend): then its pages are the copying path's, and so must its prefix be."""
        return self._plan if self.interface_v1 and not self._copying_seen else None

    def _copying_path_used(self) -> None:
        if self._copying_seen or not self.interface_v1:
            return
        self._copying_seen = True
        logger.warning("cxlkv HiCache: interface_v1 is set but HiCache calls batch_get/batch_set: this SGLang "
                       "does not take the zero-copy path for the dynamic backend; answering for the copying path")

    def _zero_copy(self, keys: List[str], host_indices: Any, n: int) -> tuple:
        """The plan and the (namespace, keys, addresses, piece bytes) of a v1 call's pages."""
        plan = self._require_plan()
        addresses = plan.addresses(self.mem_pool_host, host_indices, n)
        return plan, (plan.namespace, plan.keys(keys), addresses, plan.piece_bytes)

    def _require_plan(self) -> ZeroCopyPlan:
        if self._plan is None:
            raise _cxlkv.NotSupportedError(f"zero-copy batch_get_v1/batch_set_v1: {self._v1_unsupported}")
        return self._plan

    def _count(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)

    def _moved(self, op: str, pages: int, nbytes: int, seconds: float, skipped: int = 0) -> None:
        with self._lock:
            self._counts.update({f"{op}_calls": 1, f"{op}_pages": pages, f"{op}_bytes": nbytes,
                                 **({"set_skipped_blocks": skipped} if op == "set" else {})})
            if pages:
                kind = "prefetch" if op == "get" else "backup"
                self._samples[f"{kind}_pgs"].append(pages)
                if seconds > 0:
                    self._samples[f"{kind}_bandwidth"].append(nbytes / seconds / (1 << 30))

    def _failed(self, what: str, err: BaseException) -> None:
        kind = type(err).__name__
        with self._lock:
            self._errors[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logger.warning("cxlkv HiCache: %s failed (%s: %s); answered as a miss, HiCache carries on. Later %s "
                           "errors are counted (counters()['errors']) and logged at debug level", what, kind, err, kind)
        else:
            logger.debug("cxlkv HiCache: %s failed (%s: %s)", what, kind, err)

    def _v2_refused(self, what: str) -> None:
        with self._lock:
            first = ("v2", what) not in self._logged
            self._logged.add(("v2", what))
        if first:
            logger.warning("cxlkv HiCache: %s is not supported (hybrid models' side pools: Mamba, SWA, DSA "
                           "indexer); answered as nothing stored, so such a model gets no L3 hits", what)

    def _all_false(self, transfers: Any) -> Dict[Any, List[bool]]:
        try:
            return {t.name: [False] * _len(getattr(t, "keys", None) or []) for t in transfers or []}
        except Exception as e:
            self._failed("v2", e)
            return {}

    def _new_page(self) -> Any:
        import torch

        dtype = self._dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype))
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return torch.empty(self.page_bytes // itemsize, dtype=dtype)
