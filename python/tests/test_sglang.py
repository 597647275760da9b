"""The SGLang HiCache backend driven through HiCacheStorage's calls, as HiCache's controller makes
them: batch_exists before a prefetch, batch_get into host pages, batch_set on write-back; its
answers where the pool fails (misses, never exceptions); its namespaces; get_stats, clear and the
v2 calls; and its signatures against upstream's. The zero-copy path and the controller loop are
in test_sglang_hicache.py."""
import inspect
import logging
import sys
import types
from dataclasses import dataclass, field
from typing import List

import pytest
import torch
from hicache_util import config, fill, page_hashes, page_indices

import cxlkv
from cxlkv.mini_engine.host_pool import HostKVPool
from cxlkv.sglang import CxlKvHiCacheStorage


class HostPool:
    """What the copying path reads of SGLang's host KV pool (no layout, no zero-copy metadata)."""
    page_size = 16
    dtype = torch.bfloat16

    def get_size_per_token(self):
        return 2 * 4 * 2 * 64 * 2  # K and V x layers x heads x head_dim x bf16


def pages(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(HostPool().get_size_per_token() * 16 // 2, generator=g).to(torch.bfloat16) for _ in range(n)]


def test_batch_calls_store_and_return_pages_across_two_hosts(pool_path):
    cxlkv.create_pool(pool_path, 96 << 20, overwrite=True)
    # As SGLang's dynamic backend factory makes it: cls(storage_config, kwargs), with the
    # factory's own keys in extra_config next to ours.
    dynamic = {"backend_name": "cxlkv", "module_path": "cxlkv.sglang", "class_name": "CxlKvHiCacheStorage"}
    writer = CxlKvHiCacheStorage(config(pool_path=pool_path, node_id=0, **dynamic), {})
    reader = CxlKvHiCacheStorage(config(pool_path=pool_path, node_id=1, **dynamic), {})
    try:
        writer.register_mem_pool_host(HostPool())
        reader.register_mem_pool_host(HostPool())
        keys = page_hashes(list(range(100)), 16)
        assert len(keys) == 6
        values = pages(6, 1)
        assert reader.batch_exists(keys) == 0
        assert writer.batch_set(keys[:4], values[:4]) is True
        assert writer.batch_set(keys[:4], values[:4]) is True  # stored already: still "stored"
        assert reader.batch_exists(keys) == 4
        assert reader.exists(keys[3]) and not reader.exists(keys[4])
        got = reader.batch_get(keys)  # allocated by the backend: the host pool's page size
        assert [g is not None for g in got] == [True] * 4 + [False] * 2
        for a, b in zip(got[:4], values[:4]):
            assert torch.equal(a, b)
        targets = [torch.zeros_like(v) for v in values[:2]]
        assert reader.batch_get(keys[:2], targets) == targets
        assert torch.equal(targets[1], values[1])
        assert writer.set(keys[4], values[4]) is True
        assert torch.equal(reader.get(keys[4]), values[4])
        assert reader.get(keys[5]) is None
        assert reader.pool_stats()["totals"]["inserts"] == 5
        page_bytes = values[0].numel() * 2
        assert writer.counters()["set_bytes"] == 5 * page_bytes and writer.counters()["set_skipped_blocks"] == 4
        assert reader.counters()["get_pages"] == 4 + 2 + 1 and reader.counters()["errors"] == {}
    finally:
        writer.close()
        reader.close()


def test_tp_ranks_keep_their_own_pages_and_mla_shares_one(pool):
    keys = page_hashes(list(range(32)), 16)
    r0 = CxlKvHiCacheStorage(config(0, 2), pool=pool)
    r1 = CxlKvHiCacheStorage(config(1, 2), pool=pool)
    assert r0.batch_set(keys, pages(2, 5))
    assert r1.batch_exists(keys) == 0
    m0 = CxlKvHiCacheStorage(config(0, 2, mla=True), pool=pool)
    m1 = CxlKvHiCacheStorage(config(1, 2, mla=True), pool=pool)
    assert m0.batch_set(keys, pages(2, 6))
    assert m1.batch_exists(keys) == 2


@pytest.mark.parametrize("a, b, shared", [
    (dict(cp=(0, 2)), dict(cp=(1, 2)), False),  # CP ranks hold disjoint slices of every page
    (dict(pp=(0, 2)), dict(pp=(1, 2)), False),
    (dict(pp=(0, 2)), dict(pp=(0, 4)), False),  # stage 0 of 2 holds other layers than stage 0 of 4
    (dict(mla=True, cp=(0, 2)), dict(mla=True, cp=(1, 2)), False),  # even for MLA
    (dict(dp=(0, 2)), dict(dp=(1, 2)), True),  # attention-DP replicas: same heads, same bytes
    (dict(model="org/a"), dict(model="org/b"), False),
])
def test_namespace_separates_ranks_whose_pages_differ(pool, a, b, shared):
    keys = page_hashes(list(range(32)), 16)
    first = CxlKvHiCacheStorage(config(**a), pool=pool)
    second = CxlKvHiCacheStorage(config(**b), pool=pool)
    assert first.batch_set(keys, pages(2, 7))
    assert second.batch_exists(keys) == (2 if shared else 0)


def test_older_configs_without_the_new_fields_still_work(pool):
    # SGLang 0.5.0's HiCacheStorageConfig: tp_rank, tp_size, is_mla_model, is_page_first_layout,
    # model_name, extra_config (no pp, cp, dp, tp_lcm fields).
    old = types.SimpleNamespace(tp_rank=0, tp_size=1, is_mla_model=False, is_page_first_layout=True,
                                model_name=None, extra_config=None)
    s = CxlKvHiCacheStorage(old, {}, pool=pool)
    keys = page_hashes(list(range(16)), 16)
    assert s.batch_set(keys, pages(1, 1)) and s.batch_exists(keys) == 1
    assert s.place.cp_size == 1 and s.place.pp_size == 1 and s.place.model == "sglang"


def test_misuse_answers_a_miss_counts_it_and_logs_once(pool, caplog):
    with pytest.raises(cxlkv.InvalidArgumentError, match="pool_path"):
        CxlKvHiCacheStorage(config())  # start-up still raises, saying what to configure
    s = CxlKvHiCacheStorage(config(), pool=pool)
    with caplog.at_level(logging.DEBUG, logger="cxlkv.sglang"):
        assert s.batch_get(["00"]) == [None]  # no page size known
        assert s.batch_set(["aa", "bb"], pages(1, 1)) is False
        assert s.batch_set(["aa"], pages(1, 1))
        assert s.batch_set(["cc", "dd"], [pages(1, 1)[0], torch.zeros(8, dtype=torch.bfloat16)]) is False
        assert s.batch_exists(["cc"]) == 0  # nothing of a refused batch
        assert s.batch_set(["ee"], [None]) is False and s.batch_get(["aa"], [None]) == [None]
        assert s.batch_exists([None]) == 0 and s.exists(None) is False
        assert s.batch_get_v1(["aa"], torch.arange(16)) == [False]  # no host pool registered
        assert s.get(None) is None and s.set("ff", None) is False
    errors = s.counters()["errors"]
    assert errors["InvalidArgumentError"] >= 4 and sum(errors.values()) >= 8
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(errors)  # once per kind; the rest at debug level
    assert any("page size" in r.getMessage() for r in warnings)


def test_a_full_pool_evicts_old_pages_for_new_ones_and_refuses_an_oversized_page(pool_path):
    cxlkv.create_pool(pool_path, 16 << 20, overwrite=True)
    with cxlkv.Pool(pool_path) as p:
        s = CxlKvHiCacheStorage(config(), pool=p)
        batches = []
        for n in range(12):  # 24 pages of 1 MiB through a 16 MiB pool
            keys = page_hashes(list(range(32 * n, 32 * n + 32)), 16)
            values = [torch.full((1 << 19,), float(2 * n + i), dtype=torch.bfloat16) for i in range(2)]
            assert s.batch_set(keys, values)
            batches.append((keys, values))
        keys, values = batches[-1]
        got = s.batch_get(keys, [torch.zeros(1 << 19, dtype=torch.bfloat16) for _ in keys])
        assert all(torch.equal(g, v) for g, v in zip(got, values))  # the newest pages are intact
        assert s.batch_exists(batches[0][0]) == 0  # the oldest were evicted for them
        assert s.pool_stats()["totals"]["evictions"] > 0
        assert s.batch_set(page_hashes(list(range(16)), 16), [torch.zeros(16 << 20, dtype=torch.bfloat16)]) is False
        assert sum(s.counters()["errors"].values()) == 1
        assert s.batch_exists(keys) == 2  # what was stored stays


def test_a_closed_pool_is_a_miss_not_an_exception(pool_path):
    cxlkv.create_pool(pool_path, 16 << 20, overwrite=True)
    p = cxlkv.Pool(pool_path)
    s = CxlKvHiCacheStorage(config(), pool=p)
    keys = page_hashes(list(range(32)), 16)
    assert s.batch_set(keys, pages(2, 3))
    p.close()
    assert s.batch_exists(keys) == 0 and s.batch_get(keys, pages(2, 0)) == [None, None]
    assert s.batch_set(keys, pages(2, 3)) is False and s.clear() is False
    assert sum(s.counters()["errors"].values()) == 4


# ---- get_stats, clear, v2 ----


@dataclass
class StubStorageMetrics:
    """sglang's StorageMetrics (observability/metrics_collector.py, earlier metrics/collector.py)."""
    prefetch_pgs: List[int] = field(default_factory=list)
    backup_pgs: List[int] = field(default_factory=list)
    prefetch_bandwidth: List[float] = field(default_factory=list)
    backup_bandwidth: List[float] = field(default_factory=list)


@pytest.mark.parametrize("module", ["sglang.srt.metrics.collector", "sglang.srt.observability.metrics_collector"])
def test_get_stats_is_storage_metrics_where_sglang_is_importable_and_none_elsewhere(pool, monkeypatch, module):
    s = CxlKvHiCacheStorage(config(), pool=pool)
    keys = page_hashes(list(range(48)), 16)
    assert s.batch_set(keys[:2], pages(2, 1)) and s.batch_set(keys, pages(3, 1))  # 2, then 1 new page
    assert s.batch_get(keys, pages(3, 0))[2] is not None
    assert s.get_stats() is None  # SGLang is not importable here: HiCache logs nothing for None
    stub = types.ModuleType(module)
    stub.StorageMetrics = StubStorageMetrics
    monkeypatch.setitem(sys.modules, module, stub)
    stats = s.get_stats()
    assert isinstance(stats, StubStorageMetrics)  # what log_storage_metrics asserts
    assert stats.backup_pgs == [2, 1] and stats.prefetch_pgs == [3]
    assert len(stats.backup_bandwidth) == 2 and all(b > 0 for b in stats.backup_bandwidth + stats.prefetch_bandwidth)
    assert s.get_stats() == StubStorageMetrics()  # drained: each call reports what came since the last


def test_clear_evicts_this_backends_pages_and_leaves_other_namespaces(pool):
    assert hasattr(cxlkv.Pool, "evict_namespace"), (
        "cxlkv.Pool.evict_namespace is missing from this build: clear() cannot clear one namespace of a shared pool")
    keys = page_hashes(list(range(32)), 16)
    mine = CxlKvHiCacheStorage(config(0, 2), pool=pool)
    theirs = CxlKvHiCacheStorage(config(1, 2), pool=pool)
    other_model = CxlKvHiCacheStorage(config(model="other/model"), pool=pool)
    for s in (mine, theirs, other_model):
        assert s.batch_set(keys, pages(2, 9))
    assert mine.clear() is True
    assert mine.batch_exists(keys) == 0
    assert theirs.batch_exists(keys) == 2 and other_model.batch_exists(keys) == 2


def test_v2_calls_answer_not_supported_as_the_controller_expects(pool, caplog):
    s = CxlKvHiCacheStorage(config(), pool=pool)
    transfer = types.SimpleNamespace(name="mamba", keys=["a", "b", "c"], host_indices=torch.arange(3))
    with caplog.at_level(logging.WARNING, logger="cxlkv.sglang"):
        for _ in range(2):
            s.register_mem_host_pool_v2(object(), "mamba")
            hits = s.batch_exists_v2(["a", "b"], [transfer])
            assert hits.kv_hit_pages == 0 and hits.extra_pool_hit_pages == {}
            # count_pool_hits reads leading True per pool; the controller takes min with the KV hits.
            assert s.batch_get_v2([transfer]) == {"mamba": [False] * 3}
            assert s.batch_set_v2([transfer]) == {"mamba": [False] * 3}
    assert len(caplog.records) == 4  # once per call, not every time
    assert all("not supported" in r.getMessage() for r in caplog.records)
    assert s.registered_pools == {"mamba": s.registered_pools["mamba"]}


# ---- the interface, against upstream ----

EMPTY = inspect.Parameter.empty
# Transcribed from sgl-project/sglang, python/sglang/srt/mem_cache/hicache_storage.py at commit
# 001067fffe33427bee0ed2f007fb7551a1d76b44 (class HiCacheStorage): each method's parameters after
# self, in order, with defaults. When upstream changes them, update this table and the backend.
UPSTREAM_HICACHE_STORAGE = {
    "register_mem_pool_host": [("mem_pool_host", EMPTY)],
    "register_mem_host_pool_v2": [("host_pool", EMPTY), ("host_pool_name", EMPTY)],
    "batch_exists_v2": [("keys", EMPTY), ("pool_transfers", None), ("extra_info", None)],
    "batch_get_v2": [("transfers", EMPTY), ("extra_info", None)],
    "batch_set_v2": [("transfers", EMPTY), ("extra_info", None)],
    "batch_get_v1": [("keys", EMPTY), ("host_indices", EMPTY), ("extra_info", None)],
    "batch_set_v1": [("keys", EMPTY), ("host_indices", EMPTY), ("extra_info", None)],
    "get": [("key", EMPTY), ("target_location", None), ("target_sizes", None)],
    "batch_get": [("keys", EMPTY), ("target_locations", None), ("target_sizes", None)],
    "set": [("key", EMPTY), ("value", None), ("target_location", None), ("target_sizes", None)],
    "batch_set": [("keys", EMPTY), ("values", None), ("target_locations", None), ("target_sizes", None)],
    "exists": [("key", EMPTY)],
    "batch_exists": [("keys", EMPTY), ("extra_info", None)],
    "clear": [],
    "get_stats": [],
}


@pytest.mark.parametrize("name", sorted(UPSTREAM_HICACHE_STORAGE))
def test_every_hicache_storage_method_has_upstreams_signature(name):
    method = getattr(CxlKvHiCacheStorage, name)
    assert method is not getattr(object, name, None), f"{name} is not implemented"
    params = list(inspect.signature(method).parameters.values())[1:]  # after self
    assert [(p.name, p.default) for p in params] == UPSTREAM_HICACHE_STORAGE[name]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params)


def test_constructed_as_the_dynamic_factory_does():
    # backend_factory.py (same commit): backend_class(storage_config, kwargs), kwargs {} by default.
    params = list(inspect.signature(CxlKvHiCacheStorage.__init__).parameters.values())[1:3]
    assert [(p.name, p.kind) for p in params] == [("storage_config", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                                                  ("kwargs", inspect.Parameter.POSITIONAL_OR_KEYWORD)]


def test_registration_of_a_host_pool_without_zero_copy_metadata_refuses_interface_v1(pool):
    with pytest.raises(cxlkv.NotSupportedError, match="interface_v1"):
        CxlKvHiCacheStorage(config(interface_v1=1), pool=pool).register_mem_pool_host(HostPool())
    s = CxlKvHiCacheStorage(config(interface_v1=0), pool=pool)
    s.register_mem_pool_host(HostPool())  # the copying path needs none
    host = fill(HostKVPool(num_pages=2, layout="page_first"), 1)
    keys = page_hashes(list(range(16)), 16)
    assert s.batch_set(keys, [host.get_data_page(0)]) and s.batch_get_v1(keys, page_indices(host, [0])) == [False]


def test_where_sglang_is_importable_the_class_is_a_concrete_hicache_storage(pool, monkeypatch):
    # Upstream's base as an ABC with its abstract methods (same commit), and PoolTransferResult.
    import abc
    import importlib.util

    base = types.ModuleType("sglang.srt.mem_cache.hicache_storage")

    class HiCacheStorage(abc.ABC):
        get = abc.abstractmethod(lambda self, key, target_location=None, target_sizes=None: None)
        batch_get = abc.abstractmethod(lambda self, keys, target_locations=None, target_sizes=None: None)
        set = abc.abstractmethod(lambda self, key, value=None, target_location=None, target_sizes=None: None)
        batch_set = abc.abstractmethod(lambda self, keys, values=None, target_locations=None, target_sizes=None: None)
        exists = abc.abstractmethod(lambda self, key: None)

    @dataclass
    class PoolTransferResult:
        kv_hit_pages: int
        extra_pool_hit_pages: dict

        @classmethod
        def empty(cls):
            return cls(0, {})

    base.HiCacheStorage, base.PoolTransferResult = HiCacheStorage, PoolTransferResult
    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    spec = importlib.util.spec_from_file_location("cxlkv._sglang_under_stub", cxlkv.sglang.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    cls = module.CxlKvHiCacheStorage
    assert issubclass(cls, HiCacheStorage)  # what the dynamic factory checks
    s = cls(config(), {}, pool=pool)  # instantiable: every abstract method is implemented
    assert isinstance(s.batch_exists_v2(["a"], [object()]), PoolTransferResult)
