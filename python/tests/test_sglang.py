"""The SGLang HiCache backend driven through HiCacheStorage's calls, as HiCache's controller makes
them: batch_exists before a prefetch, batch_get into host pages, batch_set on write-back."""
import hashlib
from types import SimpleNamespace

import pytest
import torch

import cxlkv
from cxlkv.sglang import CxlKvHiCacheStorage


def page_hashes(tokens, page):
    """SGLang's chained page hashes: sha256 of the previous hash and the page's token ids, hex."""
    out, prior = [], None
    for i in range(0, len(tokens) - len(tokens) % page, page):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[i:i + page]:
            h.update(int(t).to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


def config(tp_rank=0, tp_size=1, mla=False, **extra):
    return SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, is_mla_model=mla,
                           model_name="Qwen/Qwen3-8B", extra_config=extra)


class HostPool:
    """What the backend reads of SGLang's host KV pool."""
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
        stats = reader.get_stats()
        assert stats["totals"]["inserts"] == 5
        writer.clear()
        assert reader.batch_exists(keys) == 0
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


def test_misuse_is_refused_with_the_reason(pool):
    with pytest.raises(cxlkv.InvalidArgumentError, match="pool_path"):
        CxlKvHiCacheStorage(config())
    s = CxlKvHiCacheStorage(config(), pool=pool)
    with pytest.raises(cxlkv.InvalidArgumentError, match="page size"):
        s.batch_get(["00"])
    with pytest.raises(cxlkv.InvalidArgumentError, match="2 keys but 1 pages"):
        s.batch_set(["aa", "bb"], pages(1, 1))
    assert s.batch_set(["aa"], pages(1, 1))
    with pytest.raises(cxlkv.InvalidArgumentError, match="holds"):
        s.batch_set(["cc", "dd"], [pages(1, 1)[0], torch.zeros(8, dtype=torch.bfloat16)])
    assert s.batch_exists(["cc"]) == 0  # nothing of a refused batch


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
        assert s.get_stats()["totals"]["evictions"] > 0
        with pytest.raises(cxlkv.Error, match="region|space|large"):
            s.batch_set(page_hashes(list(range(16)), 16), [torch.zeros(16 << 20, dtype=torch.bfloat16)])
        assert s.batch_exists(keys) == 2  # what was stored stays
