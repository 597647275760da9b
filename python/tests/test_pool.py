"""Round trips through the pool from Python: every dtype and layout, engine keys, prefixes,
whole-block put/get, two processes, and bad input raising clear exceptions."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import cxlkv

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]  # uint8: fp8 storage


def random_tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


def layer_shape(layout, blocks, block_size, heads, head_size):
    if layout == "flash_attn":
        return (2, blocks, block_size, heads, head_size)
    if layout == "flashinfer":
        return (blocks, 2, block_size, heads, head_size)
    if layout == "flashinfer_hnd":
        return (blocks, 2, heads, block_size, head_size)
    return (blocks, block_size, head_size)


def engine_block(tensors, layout, block):
    """One engine block's bytes across layers, whatever the layout."""
    parts = []
    for t in tensors:
        if layout == "flash_attn":
            parts += [t[0, block], t[1, block]]
        else:
            parts.append(t[block])
    return [p.clone() for p in parts]


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla", "flashinfer_hnd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_registered_tensors_round_trip_between_two_engines(pool, layout, dtype):
    layers, blocks, block_size, heads, head_size = 3, 8, 4, 2, 32
    mla = layout == "mla"
    ns = pool.namespace(f"m-{layout}-{dtype}", dtype=dtype, num_layers=layers, num_kv_heads=heads,
                        head_size=head_size, block_size=block_size, mla=mla, head_major=layout == "flashinfer_hnd")
    shape = layer_shape(layout, blocks, block_size, 1 if mla else heads, head_size)
    prefill = [random_tensor(shape, dtype, 10 + l) for l in range(layers)]
    decode = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
    src = pool.register_kv_caches(ns, prefill, layout=layout, copy_threads=2)
    dst = pool.register_kv_caches(ns, decode, layout=layout)
    keys = ns.keys_from_hashes([os.urandom(32) for _ in range(5)])
    src_ids, dst_ids = [6, 1, 3, 0, 7], [2, 5, 4, 7, 0]
    assert src.exists_prefix(keys) == 0
    assert src.put_many(keys, src_ids) == cxlkv.PutResult(written=5, skipped=0)
    assert dst.exists_prefix(keys) == 5
    assert dst.get_many_into(keys, dst_ids) == 5
    for s, d in zip(src_ids, dst_ids):
        for a, b in zip(engine_block(prefill, layout, s), engine_block(decode, layout, d)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert src.put_many(keys, src_ids) == cxlkv.PutResult(written=0, skipped=5)


def test_hnd_tensors_need_a_head_major_namespace_and_keep_their_blocks_apart(pool):
    layers, blocks, block_size, heads, head_size = 2, 4, 4, 2, 32
    nhd = pool.namespace("m-hnd", dtype=torch.float16, num_layers=layers, num_kv_heads=heads, head_size=head_size,
                         block_size=block_size)
    hnd_tensors = [random_tensor(layer_shape("flashinfer_hnd", blocks, block_size, heads, head_size), torch.float16, l)
                   for l in range(layers)]
    with pytest.raises(cxlkv.InvalidArgumentError, match="head_major=True"):
        pool.register_kv_caches(nhd, hnd_tensors, layout="flashinfer_hnd")
    with pytest.raises(cxlkv.VersionMismatchError, match="format=2"):  # the model is registered token-major
        pool.namespace("m-hnd", dtype=torch.float16, num_layers=layers, num_kv_heads=heads, head_size=head_size,
                       block_size=block_size, head_major=True)
    hnd = pool.namespace("m-hnd", dtype=torch.float16, num_layers=layers, num_kv_heads=heads, head_size=head_size,
                         block_size=block_size, head_major=True, extra_key="hnd")
    assert hnd.head_major and "head-major" in repr(hnd)
    with pytest.raises(cxlkv.InvalidArgumentError, match="head_major=True"):
        pool.register_kv_caches(hnd, [torch.zeros(layer_shape("flashinfer", blocks, block_size, heads, head_size),
                                                  dtype=torch.float16)] * layers, layout="flashinfer")
    store = pool.register_kv_caches(hnd, hnd_tensors, layout="flashinfer_hnd")
    tokens = list(range(2 * block_size))
    keys = hnd.chain_keys(tokens)
    assert store.put_many(keys, [3, 1]).written == 2
    assert pool.exists_prefix(nhd, nhd.chain_keys(tokens)) == 0  # another namespace: never read token-major


def test_vllms_nhd_shaped_view_of_an_hnd_cache_registers_as_what_its_memory_holds(pool):
    layers, blocks, block_size, heads, head_size = 2, 6, 4, 2, 32
    ns = pool.namespace("m-hnd-view", dtype=torch.float16, num_layers=layers, num_kv_heads=heads,
                        head_size=head_size, block_size=block_size, head_major=True)
    memory = [random_tensor(layer_shape("flashinfer_hnd", blocks, block_size, heads, head_size), torch.float16, 40 + l)
              for l in range(layers)]
    views = [m.permute(0, 1, 3, 2, 4) for m in memory]  # [blocks, 2, block_size, heads, head_size], HND strides
    assert all(cxlkv.pool.is_permuted_hnd(v) for v in views) and not cxlkv.pool.is_permuted_hnd(memory[0])
    src = pool.register_kv_caches(ns, views, layout="flashinfer_hnd")
    back = [torch.zeros_like(m) for m in memory]
    dst = pool.register_kv_caches(ns, back, layout="flashinfer_hnd")
    keys = ns.keys_from_hashes([os.urandom(32) for _ in range(3)])
    assert src.put_many(keys, [5, 0, 2]).written == 3
    assert dst.get_many_into(keys, [1, 3, 4]) == 3
    for s, d in zip([5, 0, 2], [1, 3, 4]):
        for m, b in zip(memory, back):
            assert torch.equal(m[s], b[d])
    # One KV head (a TP rank of an MQA model): both orders are the same bytes and the view is
    # contiguous, still shaped NHD; it registers as HND all the same.
    one = pool.namespace("m-hnd-view-1", dtype=torch.float16, num_layers=layers, num_kv_heads=1,
                         head_size=head_size, block_size=block_size, head_major=True)
    one_memory = [random_tensor(layer_shape("flashinfer_hnd", blocks, block_size, 1, head_size), torch.float16, 50 + l)
                  for l in range(layers)]
    one_src = pool.register_kv_caches(one, [m.permute(0, 1, 3, 2, 4) for m in one_memory], layout="flashinfer_hnd")
    one_back = [torch.zeros_like(m) for m in one_memory]
    one_dst = pool.register_kv_caches(one, one_back, layout="flashinfer_hnd")
    one_keys = one.keys_from_hashes([os.urandom(32) for _ in range(3)])
    assert one_src.put_many(one_keys, [5, 0, 2]).written == 3
    assert one_dst.get_many_into(one_keys, [1, 3, 4]) == 3
    assert all(torch.equal(m[5], b[1]) for m, b in zip(one_memory, one_back))
    # An NHD tensor that is merely non-contiguous is not an HND cache: it is refused, as before.
    odd = [torch.zeros((blocks, 2, block_size, heads, 2 * head_size), dtype=torch.float16)[..., ::2]] * layers
    with pytest.raises(cxlkv.InvalidArgumentError, match="not contiguous|shaped"):
        pool.register_kv_caches(ns, odd, layout="flashinfer_hnd")


def test_exists_prefix_follows_puts_and_get_stops_at_the_first_miss(pool):
    ns = pool.namespace("prefix", dtype="bf16", num_layers=2, num_kv_heads=1, head_size=16, block_size=4)
    shape = layer_shape("flash_attn", 16, 4, 1, 16)
    a = [random_tensor(shape, torch.bfloat16, l) for l in range(2)]
    b = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    sa, sb = pool.register_kv_caches(ns, a), pool.register_kv_caches(ns, b)
    tokens = np.arange(8 * 4, dtype=np.int32)
    keys = ns.chain_keys(tokens)
    assert keys.shape == (8, 2)
    for n in range(1, 9):
        sa.put_many(keys[n - 1:n], [n - 1])
        assert sa.exists_prefix(keys) == n
        assert pool.exists_prefix(ns, keys) == n
    pool.evict_all()
    sa.put_many(keys[:3], [0, 1, 2])
    sa.put_many(keys[4:], [4, 5, 6, 7])
    assert sa.exists_prefix(keys) == 3
    assert sb.get_many_into(keys, list(range(8))) == 3
    assert torch.equal(b[0][:, 3:], torch.zeros_like(b[0][:, 3:]))  # past the prefix: untouched
    assert torch.equal(b[1][:, :3].view(torch.uint8), a[1][:, :3].view(torch.uint8))
    assert pool.evict_all() == 7  # every pin released


def test_engine_hashes_of_two_tp_ranks_never_collide(pool):
    hashes = [os.urandom(32) for _ in range(64)] + ["deadbeef" * 8, 1234567890123]
    seen = set()
    spaces = []
    for rank in range(4):
        ns = pool.namespace("llama", dtype=torch.float16, num_layers=2, num_kv_heads=2, head_size=64,
                            tp_rank=rank, tp_size=4)
        spaces.append(ns)
        for k in map(tuple, ns.keys_from_hashes(hashes).tolist()):
            assert k not in seen
            seen.add(k)
    assert len(seen) == 4 * len(hashes)
    # The same hash in the same namespace is the same key (deterministic), in any process.
    assert np.array_equal(spaces[1].keys_from_hashes(hashes), spaces[1].keys_from_hashes(hashes))
    # MLA's latent is the same on every rank: one namespace for all of them.
    m0 = pool.namespace("ds", dtype="bf16", num_layers=2, num_kv_heads=1, head_size=64, tp_rank=0, tp_size=2,
                        mla=True)
    m1 = pool.namespace("ds", dtype="bf16", num_layers=2, num_kv_heads=1, head_size=64, tp_rank=1, tp_size=2,
                        mla=True)
    assert m0.id == m1.id


def test_whole_blocks_from_numpy_and_buffers_with_checksums(pool_path):
    cxlkv.create_pool(pool_path, 64 << 20, overwrite=True, checksum=True)
    with cxlkv.Pool(pool_path) as pool:
        ns = pool.namespace("pages", dtype=np.float16, num_layers=2, num_kv_heads=2, head_size=16, block_size=8)
        values = [np.random.default_rng(i).standard_normal(ns.block_bytes // 2).astype(np.float16) for i in range(3)]
        values[2] = bytes(values[2].tobytes())  # any buffer
        keys = ns.keys_from_hashes(["page-a", "page-b", "page-c"])
        assert pool.put(ns, keys, values) == cxlkv.PutResult(3, 0)
        assert pool.put(ns, keys[:1], values[:1]) == cxlkv.PutResult(0, 1)
        outs = [np.zeros(ns.block_bytes // 2, np.float16), torch.zeros(ns.block_bytes // 2, dtype=torch.float16),
                bytearray(ns.block_bytes)]
        assert pool.get(ns, keys, outs) == 3
        assert np.array_equal(outs[0], values[0])
        assert np.array_equal(outs[1].numpy(), values[1])
        assert bytes(outs[2]) == values[2]
        missing = ns.keys_from_hashes(["page-z"])
        assert pool.get(ns, missing, [bytearray(ns.block_bytes)]) == 0


def test_a_block_put_by_one_process_is_read_by_another(pool):
    ns = pool.namespace("xproc", dtype=torch.float16, num_layers=2, num_kv_heads=2, head_size=32, block_size=4)
    shape = layer_shape("flash_attn", 4, 4, 2, 32)
    mine = [random_tensor(shape, torch.float16, 100 + l) for l in range(2)]
    store = pool.register_kv_caches(ns, mine)
    keys = ns.keys_from_hashes([b"h0", b"h1", b"h2"])
    store.put_many(keys, [0, 1, 2])
    reader = textwrap.dedent(f"""
        import sys, torch, cxlkv
        with cxlkv.Pool({pool.path!r}, node_id=1, lease_ms=1000) as pool:
            ns = pool.namespace("xproc", dtype=torch.float16, num_layers=2, num_kv_heads=2, head_size=32,
                                block_size=4)
            out = [torch.zeros(2, 4, 4, 2, 32, dtype=torch.float16) for _ in range(2)]
            store = pool.register_kv_caches(ns, out)
            keys = ns.keys_from_hashes([b"h0", b"h1", b"h2"])
            assert store.exists_prefix(keys) == 3
            assert store.get_many_into(keys, [2, 3, 0]) == 3
            torch.save(out, sys.argv[1])
    """)
    saved = pool.path + ".pt"
    try:
        subprocess.run([sys.executable, "-c", reader, saved], check=True, timeout=120)
        out = torch.load(saved)
    finally:
        if os.path.exists(saved):
            os.unlink(saved)
    for src, dst in [(0, 2), (1, 3), (2, 0)]:
        for l in range(2):
            assert torch.equal(out[l][:, dst], mine[l][:, src])


def test_bad_input_raises_clear_exceptions(pool):
    ns = pool.namespace("bad", dtype=torch.float16, num_layers=2, num_kv_heads=2, head_size=32, block_size=4)
    shape = layer_shape("flash_attn", 4, 4, 2, 32)
    good = [torch.zeros(shape, dtype=torch.float16) for _ in range(2)]
    with pytest.raises(cxlkv.InvalidArgumentError, match="holds float32; the namespace is float16"):
        pool.register_kv_caches(ns, [torch.zeros(shape, dtype=torch.float32)] * 2)
    with pytest.raises(cxlkv.InvalidArgumentError, match="not contiguous"):
        pool.register_kv_caches(ns, [torch.zeros(shape[::-1], dtype=torch.float16).permute(4, 3, 2, 1, 0)] * 2)
    with pytest.raises(cxlkv.InvalidArgumentError, match=r"shaped \[2, 4, 4, 2, 16\]"):
        pool.register_kv_caches(ns, [torch.zeros(2, 4, 4, 2, 16, dtype=torch.float16)] * 2)
    with pytest.raises(ValueError, match="1 layer tensors for a namespace of 2 layers"):
        pool.register_kv_caches(ns, good[:1])
    with pytest.raises(cxlkv.InvalidArgumentError, match="not one of"):
        pool.register_kv_caches(ns, good, layout="paged")
    with pytest.raises(cxlkv.NotSupportedError, match="meta tensor"):
        pool.register_kv_caches(ns, [torch.empty(shape, dtype=torch.float16, device="meta")] * 2)
    with pytest.raises(cxlkv.InvalidArgumentError, match="not a KV dtype"):
        pool.namespace("bad2", dtype=torch.int64, num_layers=1, num_kv_heads=1, head_size=16)
    with pytest.raises(cxlkv.VersionMismatchError):
        pool.namespace("bad", dtype=torch.float16, num_layers=2, num_kv_heads=2, head_size=64, block_size=4)
    store = pool.register_kv_caches(ns, good)
    keys = ns.keys_from_hashes([b"a", b"b"])
    with pytest.raises(cxlkv.InvalidArgumentError, match="out of range"):
        store.put_many(keys, [0, 4])
    with pytest.raises(cxlkv.InvalidArgumentError, match="block ids must be"):
        store.put_many(keys, [0, -1])
    with pytest.raises(cxlkv.InvalidArgumentError, match="shape"):
        store.exists_prefix(np.zeros((2, 3), np.uint64))
    with pytest.raises(cxlkv.InvalidArgumentError, match="read-only"):
        pool.get(ns, keys[:1], [bytes(ns.block_bytes)])
    with pytest.raises(cxlkv.InvalidArgumentError, match=f"a block of .* is {ns.block_bytes}"):
        pool.put(ns, keys[:1], [bytes(ns.block_bytes - 1)])
    assert store.exists_prefix(keys) == 0  # nothing published by any refused call
    store.put_many(keys, [0, 1])
    pool.close()
    with pytest.raises(cxlkv.InvalidArgumentError, match="closed"):
        pool.exists_prefix(ns, keys)
    with pytest.raises(cxlkv.InvalidArgumentError, match="closed"):
        store.get_many_into(keys, [2, 3])
    pool.close()  # twice is fine


def test_opening_a_missing_or_foreign_region_fails_with_the_reason(pool_path):
    with pytest.raises(cxlkv.NotFoundError):
        cxlkv.Pool("/dev/shm/cxlkv-pytest-no-such-region")
    with open(pool_path, "wb") as f:
        f.write(b"not a region" * 1000)
    with pytest.raises(cxlkv.Error) as e:
        cxlkv.Pool(pool_path)
    assert "region" in str(e.value)
    with pytest.raises(cxlkv.AlreadyExistsError):
        cxlkv.create_pool(pool_path, 64 << 20)
    assert issubclass(cxlkv.TimeoutError, TimeoutError) and issubclass(cxlkv.NotFoundError, LookupError)


def test_stats_count_the_lookups(pool):
    ns = pool.namespace("stats", dtype=torch.float16, num_layers=1, num_kv_heads=1, head_size=16, block_size=4)
    kv = [torch.ones(2, 2, 4, 1, 16, dtype=torch.float16)]
    store = pool.register_kv_caches(ns, kv)
    keys = ns.keys_from_hashes([b"x", b"y"])
    store.put_many(keys, [0, 1])
    assert store.get_many_into(keys, [1, 0]) == 2
    assert store.get_many_into(ns.keys_from_hashes([b"z"]), [0]) == 0
    cache = pool.stats()["cache"]
    assert cache["states"]["ready"] == 2
    assert cache["totals"]["inserts"] == 2
    assert cache["totals"]["lookups"] == 2
    assert cache["totals"]["hit_blocks"] == 2 and cache["totals"]["miss_blocks"] == 1
    assert cache["per_node"]["0"]["pins"] == 0  # every pin released
    assert [n["model"] for n in cache["namespaces"]] == ["stats"]


def test_layer_wise_loads_and_saves(pool):
    ns = pool.namespace("layers", dtype=torch.float16, num_layers=3, num_kv_heads=2, head_size=32, block_size=4)
    shape = layer_shape("flash_attn", 6, 4, 2, 32)
    a = [random_tensor(shape, torch.float16, 40 + l) for l in range(3)]
    b = [torch.zeros(shape, dtype=torch.float16) for _ in range(3)]
    sa, sb = pool.register_kv_caches(ns, a), pool.register_kv_caches(ns, b)
    keys = ns.keys_from_hashes([b"p", b"q", b"r"])
    with sa.start_put_many(keys, [5, 0, 2]) as save:  # dropped unfinished: aborted
        save.layer_computed(0)
    assert sa.exists_prefix(keys) == 0
    save = sa.start_put_many(keys, [5, 0, 2])
    for layer in range(3):
        save.layer_computed(layer)
    with pytest.raises(cxlkv.InvalidArgumentError):
        save.layer_computed(1)  # twice
    assert sa.exists_prefix(keys) == 0  # nothing published before finish
    assert save.finish() == cxlkv.PutResult(3, 0)
    assert sa.exists_prefix(keys) == 3
    with sb.start_get_many_into(keys, [1, 3, 4]) as load:
        assert load.blocks == 3
        assert pool.evict_all() == 0  # pinned while in flight
        for layer in range(3):
            load.wait_layer(layer)
            assert torch.equal(b[layer][:, [1, 3, 4]], a[layer][:, [5, 0, 2]])
    assert pool.evict_all() == 3  # released by close


def test_closing_the_pool_ends_layer_wise_operations_in_flight(pool):
    ns = pool.namespace("close", dtype=torch.float16, num_layers=2, num_kv_heads=1, head_size=16, block_size=4)
    shape = layer_shape("flash_attn", 4, 4, 1, 16)
    store = pool.register_kv_caches(ns, [random_tensor(shape, torch.float16, l) for l in range(2)])
    keys = ns.keys_from_hashes([b"x", b"y"])
    store.put_many(keys[:1], [0])
    load = store.start_get_many_into(keys, [2, 3])
    save = store.start_put_many(keys[1:], [1])
    save.layer_computed(0)
    pool.close()  # waits for the load, aborts the save
    with pytest.raises(cxlkv.InvalidArgumentError, match="closed"):
        save.finish()
    with pytest.raises(cxlkv.InvalidArgumentError, match="closed"):
        load.wait_layer(0)
    load.close()
    save.abort()
