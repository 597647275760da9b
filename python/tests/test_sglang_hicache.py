"""The SGLang backend's zero-copy path (batch_get_v1/batch_set_v1 by host-pool index) and the
backend inside HiCache's controller loop (cxlkv.mini_engine.hicache): pages move between SGLang's
host pool and the cxlkv pool with no copy between, across nodes, CP ranks and TP sizes; the loop's
threads live through every pool error."""
import logging
import sys
import types

import pytest
import torch
from hicache_util import config, fill, page_hashes, page_indices

import cxlkv
from cxlkv.mini_engine.hicache import HiCacheLoop
from cxlkv.mini_engine.host_pool import HostKVPool
from cxlkv.sglang import CxlKvHiCacheStorage

SHAPE = dict(page_size=16, layer_num=2, head_num=2, head_dim=16)


def backend(pool, **kw):
    return CxlKvHiCacheStorage(config(interface_v1=1, **kw), pool=pool)


def two_nodes(pool_path):
    cxlkv.create_pool(pool_path, 32 << 20, overwrite=True)
    return cxlkv.Pool(pool_path, node_id=0), cxlkv.Pool(pool_path, node_id=1)


@pytest.mark.parametrize("layout, mla, pieces", [
    ("page_first", False, 2), ("page_first_direct", False, 2), ("page_head", False, 2), ("layer_first", False, 4),
    ("page_first", True, 1), ("layer_first", True, 2),
])
def test_zero_copy_round_trip_across_two_nodes_lands_in_the_host_pool_at_the_given_indices(
        pool_path, monkeypatch, layout, mla, pieces):
    p0, p1 = two_nodes(pool_path)
    try:
        src = fill(HostKVPool(num_pages=6, layout=layout, mla=mla, **SHAPE), 1)
        dst = HostKVPool(num_pages=6, layout=layout, mla=mla, **SHAPE)
        writer, reader = backend(p0, mla=mla), backend(p1, mla=mla)
        writer.register_mem_pool_host(src)
        reader.register_mem_pool_host(dst)
        keys = page_hashes(list(range(64)), 16)[:3]
        assert writer.batch_set_v1(keys, page_indices(src, [1, 4, 3])) == [True] * 3
        assert reader.batch_exists(keys + ["absent"]) == 3

        seen = []
        real_get = reader.pool.get_addresses

        def get_addresses(ns, k, addresses, size, *, within):
            seen.append((list(addresses), size))
            return real_get(ns, k, addresses, size, within=within)

        monkeypatch.setattr(reader.pool, "get_addresses", get_addresses)
        assert reader.batch_get_v1(keys, page_indices(dst, [5, 0, 2])) == [True] * 3
        for s, d in zip([1, 4, 3], [5, 0, 2]):
            assert torch.equal(dst.get_data_page(d * 16), src.get_data_page(s * 16))  # byte-identical
        for untouched in (1, 3, 4):
            assert not dst.get_data_page(untouched * 16).any()  # nothing else of the host pool written

        # The destinations are the host pool's own memory, at its own page addresses: no staging copy.
        (addresses, size), = seen
        page_bytes = src.get_size_per_token() * src.page_size
        assert len(addresses) == 3 * pieces and size * pieces == page_bytes
        assert addresses == dst.get_page_buffer_meta(page_indices(dst, [5, 0, 2]))[0]
        base, nbytes = dst.kv_buffer.data_ptr(), dst.kv_buffer.numel() * dst.kv_buffer.element_size()
        assert all(base <= a and a + size <= base + nbytes for a in addresses)
        assert writer.counters()["set_bytes"] == 3 * page_bytes and writer.counters()["set_pages"] == 3
        assert reader.counters()["get_bytes"] == 3 * page_bytes and reader.counters()["get_pages"] == 3
        assert reader.counters()["errors"] == {} and writer.counters()["errors"] == {}
    finally:
        p0.close()
        p1.close()


def test_zero_copy_reads_the_stored_prefix_and_refuses_indices_outside_the_host_pool(pool, monkeypatch):
    host = fill(HostKVPool(num_pages=4, **SHAPE), 2)
    s = backend(pool)
    s.register_mem_pool_host(host)
    keys = page_hashes(list(range(64)), 16)
    assert s.batch_set_v1(keys[:2], page_indices(host, [0, 1])) == [True, True]
    assert s.batch_get_v1(keys[:3], page_indices(host, [2, 3, 0])) == [True, True, False]
    assert s.batch_set_v1(keys[2:4], page_indices(host, [3])) == [False, False]  # one page of indices for two keys
    # A host pool whose metadata points past its buffer (SGLang computes addresses from indices):
    # the pool refuses the batch before copying a byte.
    real = host.get_page_buffer_meta
    nbytes = host.kv_buffer.numel() * host.kv_buffer.element_size()
    monkeypatch.setattr(host, "get_page_buffer_meta",
                        lambda idx: ([a + (nbytes if i == 3 else 0) for i, a in enumerate(real(idx)[0])], real(idx)[1]))
    before = host.kv_buffer.clone()
    assert s.batch_set_v1(keys[2:4], page_indices(host, [2, 3])) == [False, False]
    assert s.batch_get_v1(keys[:2], page_indices(host, [2, 3])) == [False, False]
    assert torch.equal(host.kv_buffer, before)
    assert s.batch_exists(keys) == 2  # a refused batch published nothing
    assert s.counters()["errors"] == {"InvalidArgumentError": 3}


def test_cp_ranks_pages_do_not_collide(pool):
    keys = page_hashes(list(range(32)), 16)
    ranks = []
    for r in range(2):
        host = fill(HostKVPool(num_pages=4, **SHAPE), 10 + r)
        s = backend(pool, cp=(r, 2))
        s.register_mem_pool_host(host)
        assert s.batch_set_v1(keys, page_indices(host, [0, 1])) == [True, True]  # same keys, own bytes
        ranks.append((s, host))
    for s, host in ranks:
        assert s.batch_get_v1(keys, page_indices(host, [2, 3])) == [True, True]
        assert torch.equal(host.get_data_page(2 * 16), host.get_data_page(0))
        assert torch.equal(host.get_data_page(3 * 16), host.get_data_page(16))
    assert not torch.equal(ranks[0][1].get_data_page(0), ranks[1][1].get_data_page(0))


def test_engines_of_different_tp_sizes_share_pages_per_head_group(pool):
    # SGLang's tp_lcm_size: a TP1 engine keeps each page_head page as 2 head groups (split 2);
    # each rank of a TP2 engine holds one of those groups and finds it.
    tp1 = fill(HostKVPool(num_pages=3, layout="page_head", page_size=16, layer_num=2, head_num=4, head_dim=16), 3)
    writer = backend(pool, tp_lcm_size=2)
    writer.register_mem_pool_host(tp1)
    keys = page_hashes(list(range(48)), 16)
    assert writer.batch_set_v1(keys, page_indices(tp1, [0, 1, 2])) == [True] * 3
    for r in range(2):
        host = HostKVPool(num_pages=3, layout="page_head", page_size=16, layer_num=2, head_num=2, head_dim=16)
        reader = backend(pool, tp_rank=r, tp_size=2, tp_lcm_size=2)
        reader.register_mem_pool_host(host)
        assert reader.batch_exists(keys) == 3
        assert reader.batch_get_v1(keys, page_indices(host, [2, 1, 0])) == [True] * 3
        for p, q in zip([0, 1, 2], [2, 1, 0]):
            assert torch.equal(host.kv_buffer[:, q], tp1.kv_buffer[:, p, 2 * r:2 * r + 2])
    other_tp = backend(pool, tp_rank=0, tp_size=2)  # no tp_lcm_size: pages per TP rank, as before
    other_tp.register_mem_pool_host(HostKVPool(num_pages=3, layout="page_head", **SHAPE))
    assert other_tp.batch_exists(keys) == 0


class Flaky:
    """A pool method that raises the given errors on its first calls, then works."""

    def __init__(self, real, errors):
        self.real, self.errors, self.calls = real, list(errors), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.real(*args, **kwargs)


def wait(op):
    assert op.done.wait(10), "the loop did not finish the operation: a thread died?"
    return op


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_the_loop_lives_through_pool_errors_and_later_calls_succeed(pool, monkeypatch, caplog, interface_v1):
    s = CxlKvHiCacheStorage(config(interface_v1=interface_v1), pool=pool)
    host = fill(HostKVPool(num_pages=16, **SHAPE), 4)
    put, get = ("put_addresses", "get_addresses") if interface_v1 else ("put", "get")
    monkeypatch.setattr(pool, put, Flaky(getattr(pool, put), [cxlkv.NoSpaceError("pool full")]))
    monkeypatch.setattr(pool, "exists_prefix", Flaky(pool.exists_prefix, [cxlkv.IoError("device error")]))
    monkeypatch.setattr(pool, get, Flaky(getattr(pool, get), [cxlkv.LeaseExpiredError("lease lost")]))
    keys = page_hashes(list(range(64)), 16)
    with caplog.at_level(logging.WARNING, logger="cxlkv.sglang"), HiCacheLoop(s, host) as loop:
        written = page_indices(host, [0, 1, 2, 3])
        host.alloc(4 * 16)  # the written pages are the host's, as HiCache's write-through leaves them
        assert wait(loop.write_storage(written, keys)).completed_tokens == 0  # NoSpaceError: not stored
        assert wait(loop.prefetch("r1", keys)).storage_hit_count == 0  # IoError: no hits
        assert wait(loop.write_storage(written, keys)).completed_tokens == 64
        lost = wait(loop.prefetch("r2", keys))
        assert lost.storage_hit_count == 64 and lost.completed_tokens == 0  # LeaseExpiredError mid-load
        ok = wait(loop.prefetch("r3", keys))
        assert ok.completed_tokens == 64
        for i in range(4):
            dst = int(ok.host_indices[i * 16])
            assert torch.equal(host.get_data_page(dst), host.get_data_page(i * 16))
        assert loop.alive() and loop.thread_errors == []
    assert s.counters()["errors"] == {"NoSpaceError": 1, "IoError": 1, "LeaseExpiredError": 1}
    assert len(caplog.records) == 3


def test_the_loop_lives_with_a_closed_pool(pool_path):
    cxlkv.create_pool(pool_path, 16 << 20, overwrite=True)
    p = cxlkv.Pool(pool_path)
    s = CxlKvHiCacheStorage(config(interface_v1=1), pool=p)
    host = fill(HostKVPool(num_pages=8, **SHAPE), 5)
    keys = page_hashes(list(range(32)), 16)
    with HiCacheLoop(s, host) as loop:
        p.close()
        assert wait(loop.write_storage(page_indices(host, [0, 1]), keys)).completed_tokens == 0
        assert wait(loop.prefetch("r", keys)).storage_hit_count == 0
        assert loop.alive()
    assert sum(s.counters()["errors"].values()) == 2


def test_the_harness_loses_a_thread_to_a_backend_that_raises(pool):
    # The harness is faithful: an exception out of the backend ends the thread, as upstream.
    class Raising(CxlKvHiCacheStorage):
        def batch_exists(self, keys, extra_info=None):
            raise RuntimeError("boom")

    host = HostKVPool(num_pages=2, **SHAPE)
    with HiCacheLoop(Raising(config(), pool=pool), host) as loop:
        op = loop.prefetch("r", page_hashes(list(range(16)), 16))
        loop.threads[1].join(10)  # the prefetch thread
        assert not op.done.is_set() and not loop.alive() and isinstance(loop.thread_errors[0], RuntimeError)


def test_the_loop_reports_storage_metrics_each_step(pool, monkeypatch):
    module = types.ModuleType("sglang.srt.metrics.collector")

    class StorageMetrics:  # upstream's fields
        def __init__(self):
            self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth, self.backup_bandwidth = [], [], [], []

    module.StorageMetrics = StorageMetrics
    s = backend(pool)
    host = fill(HostKVPool(num_pages=8, **SHAPE), 6)
    keys = page_hashes(list(range(48)), 16)
    with HiCacheLoop(s, host) as loop:
        assert loop.check_events() is None  # SGLang not importable
        monkeypatch.setitem(sys.modules, "sglang.srt.metrics.collector", module)
        host.alloc(3 * 16)
        wait(loop.write_storage(page_indices(host, [0, 1, 2]), keys))
        wait(loop.prefetch("r", keys))
        stats = loop.check_events()
    assert isinstance(stats, StorageMetrics) and stats.backup_pgs == [3] and stats.prefetch_pgs == [3]


def test_interface_v1_on_an_sglang_that_calls_the_copying_path_answers_for_that_path(pool, caplog):
    # An SGLang that does not read interface_v1 for the dynamic backend calls batch_set/batch_get:
    # batch_exists must then answer for the pages those store, not the zero-copy ones.
    s = backend(pool)
    host = fill(HostKVPool(num_pages=2, **SHAPE), 7)
    s.register_mem_pool_host(host)
    keys = page_hashes(list(range(16)), 16)
    with caplog.at_level(logging.WARNING, logger="cxlkv.sglang"):
        assert s.batch_set(keys, [host.get_data_page(0)]) and s.batch_exists(keys) == 1
    assert "copying path" in caplog.text
