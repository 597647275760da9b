"""The vLLM connector where real engines broke it: preemption and resume, full CUDA graphs, two
pipeline stages, two KV cache groups (the hybrid allocator), and the store's block-ownership
invariant underneath. Driven by the mini engine in vLLM's order (cxlkv.mini_engine.engine)."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import cxlkv
from cxlkv.mini_engine import Engine, EngineConfig
from cxlkv.mini_engine.model import load_model
from cxlkv.vllm import CxlKvConnector

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_vllm import PROMPT, cli  # noqa: E402

PROMPTS = [PROMPT[:40], PROMPT[:53], [(5 * i + 1) % 4000 for i in range(1, 45)], PROMPT[:69]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("weights") / "tiny-llama.safetensors")
    subprocess.run([cli(), "generate", "--prompt", "1,2,3", "--max-new", "1", "--save-weights", path],
                   check=True, capture_output=True, timeout=300)
    return load_model(None, path)


def engine(model, pool_path, extra=None, **config):
    return Engine(model, EngineConfig(**config), connector=CxlKvConnector,
                  connector_extra={"pool_path": pool_path, **(extra or {})})


def reference_tokens(model, prompts, max_tokens):
    return Engine(model, EngineConfig(num_blocks=256)).generate(prompts, max_tokens)


def pool_blocks_match_recomputed_kv(model, pool_path, token_lists):
    """Every block the pool holds for these token sequences equals the KV that computing its
    prefix from scratch gives (fp32 on one CPU: equal to 1e-5). Returns how many were checked."""
    bs = 16
    checker = Engine(model, EngineConfig(num_blocks=64), connector=CxlKvConnector,
                     connector_extra={"pool_path": pool_path, "node_id": 5})
    store = checker.worker_conn._worker._stores[0]
    scratch = checker.kv_caches
    checked = 0
    try:
        for tokens in token_lists:
            full = len(tokens) // bs
            ref = model.new_kv_caches(full + 1, bs)
            model.forward(tokens[:full * bs], 0, ref, list(range(full)), bs)
            from cxlkv.mini_engine.engine import Request
            hashes = Request("x", tokens, 1, bs, EngineConfig().hash_seed).block_hashes[:full]
            keys = store.namespace.keys_from_hashes(hashes)
            for i in range(full):
                if store.get_many_into(keys[i:i + 1], [0]) != 1:
                    continue
                for layer in range(len(ref)):
                    got, want = scratch[layer][:, 0], ref[layer][:, i]
                    assert torch.allclose(got, want, atol=1e-5, rtol=0), (
                        f"block {i} of a {len(tokens)}-token sequence, layer {layer}: the pool holds other KV")
                checked += 1
    finally:
        checker.close()
    return checked


def test_preemption_and_resume_publish_only_the_kv_of_each_blocks_own_prefix(model, pool_path):
    cxlkv.create_pool(pool_path, 256 << 20, overwrite=True)
    want = reference_tokens(model, PROMPTS, 40)
    eng = engine(model, pool_path, num_blocks=10)  # too few for four requests: preemption
    try:
        got = eng.generate(PROMPTS, 40)
        assert eng.preemptions >= 2
        assert got == want  # the tokens of a run without the connector
        stats = eng.worker_conn.get_kv_connector_stats().reduce()
        assert stats["refused_by_ownership"] == 0 and stats["save_errors"] == 0
        assert stats["loaded_blocks"] > 0  # resumed requests were served from the pool
    finally:
        eng.close()
    sequences = [p + t for p, t in zip(PROMPTS, got)]
    assert pool_blocks_match_recomputed_kv(model, pool_path, sequences) >= 12


@pytest.mark.parametrize("mode,layerwise,full_steps", [
    ("full_and_piecewise", True, False),   # the connector asks for piecewise graphs: hooks run
    ("full_and_piecewise", False, True),   # whole-step mode: full graphs, no hooks needed
    ("full", True, True),                  # an engine that ignores the request: still saved and loaded
])
def test_full_cuda_graph_steps_lose_no_save_and_race_no_load(model, pool_path, mode, layerwise, full_steps):
    cxlkv.create_pool(pool_path, 256 << 20, overwrite=True)
    want = reference_tokens(model, [PROMPT], 12)
    extra = {"layerwise": layerwise}
    first = engine(model, pool_path, cudagraph_mode=mode, extra=extra)
    try:
        assert first.generate([PROMPT], 12) == want
        assert (first.full_graph_steps > 0) == full_steps
        assert first.worker_conn.saved_blocks == 5  # 4 prompt blocks and one completed while decoding
    finally:
        first.close()
    second = engine(model, pool_path, cudagraph_mode=mode, extra=dict(extra, node_id=1))
    try:
        assert second.generate([PROMPT + want[0][:11]], 1) == [want[0][11:12]]
        assert second.worker_conn.loaded_blocks == 5
    finally:
        second.close()
    assert CxlKvConnector.requires_piecewise_for_cudagraph(extra) is layerwise


def test_two_pipeline_stages_of_equal_layer_counts_keep_their_own_blocks(model, pool_path):
    cxlkv.create_pool(pool_path, 256 << 20, overwrite=True)
    want = reference_tokens(model, [PROMPT], 8)
    first = engine(model, pool_path, pp_size=2)
    try:
        assert first.generate([PROMPT], 8) == want
        stages = first.workers
        assert [w._worker.pp_stage for w in stages] == [0, 1]
        ns = [w._worker._stores[0].namespace for w in stages]
        assert ns[0].num_layers == ns[1].num_layers == 2 and ns[0].id != ns[1].id
        assert [w.saved_blocks for w in stages] == [4, 4]
    finally:
        first.close()
    second = engine(model, pool_path, pp_size=2, extra={"node_id": 1})
    try:
        assert second.generate([PROMPT], 8) == want
        assert [w.loaded_blocks for w in second.workers] == [4, 4]
        # Stage 1's blocks gone: the scheduler counts no hit rather than load half a model.
        with cxlkv.Pool(pool_path, node_id=2) as p:
            stage1 = second.workers[1]._worker._stores[0].namespace
            assert p.evict_namespace(p.namespace(stage1.model_id, dtype=stage1.dtype, num_layers=2, num_kv_heads=2,
                                                 head_size=32, block_size=16, pp_stage=1)) == 4
        from cxlkv.mini_engine.engine import Request
        req = Request("again", PROMPT, 1, 16, EngineConfig().hash_seed)
        assert second.sched_conn.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        second.close()


def test_two_kv_cache_groups_each_keep_a_table_and_a_namespace(model, pool_path):
    cxlkv.create_pool(pool_path, 256 << 20, overwrite=True)
    want = reference_tokens(model, [PROMPT], 8)
    first = engine(model, pool_path, kv_groups=2)
    try:
        assert first.generate([PROMPT], 8) == want
        stores = first.worker_conn._worker._stores
        assert len(stores) == 2 and stores[0].namespace.id != stores[1].namespace.id
        assert first.worker_conn.saved_blocks == 8  # 4 blocks in each group
    finally:
        first.close()
    second = engine(model, pool_path, kv_groups=2, extra={"node_id": 1})
    try:
        assert second.generate([PROMPT], 8) == want
        assert second.worker_conn.loaded_blocks == 8
        assert second.computed_prompt_tokens == len(PROMPT) - 64
    finally:
        second.close()


def test_the_scheduler_query_keeps_no_state_and_a_finished_request_leaves_none(model, pool_path):
    cxlkv.create_pool(pool_path, 64 << 20, overwrite=True)
    eng = engine(model, pool_path)
    try:
        from cxlkv.mini_engine.engine import Request
        req = Request("never-allocated", PROMPT, 1, 16, EngineConfig().hash_seed)
        for computed in (0, 16, 0):
            assert eng.sched_conn.get_num_new_matched_tokens(req, computed) == (0, False)
        assert eng.sched_conn._planner.tracked() == 0
        eng.generate([PROMPT[:20]], 2)
        assert eng.sched_conn._planner.tracked() == 0
        assert eng.sched_conn.requires_kv_delivery is False
    finally:
        eng.close()


def test_the_store_refuses_copies_from_or_into_blocks_a_request_does_not_hold(pool):
    ns = pool.namespace("owned", dtype=torch.float32, num_layers=2, num_kv_heads=2, head_size=32, block_size=16)
    caches = [torch.randn(2, 8, 16, 2, 32) for _ in range(2)]
    store = pool.register_kv_caches(ns, caches, layout="flash_attn")
    keys = ns.chain_keys(list(range(48)))
    assert store.put_many(keys[:1], [0]).written == 1  # untracked until the first assignment
    store.assign_blocks(7, [1, 2])
    with pytest.raises(cxlkv.InvalidArgumentError, match="name the request"):
        store.put_many(keys[1:2], [1])
    with pytest.raises(cxlkv.InvalidArgumentError, match="block 3 is not held by this request"):
        store.put_many(keys[1:3], [1, 3], owner=7)
    with pytest.raises(cxlkv.InvalidArgumentError, match="not held"):
        store.get_many_into(keys[:1], [3], owner=7)
    assert store.exists_prefix(keys) == 1  # nothing of the refused calls
    # Given up while its layers were being copied: the save publishes nothing.
    save = store.start_put_many(keys[1:3], [1, 2], owner=7)
    save.layer_computed(0)
    assert store.release_blocks(7, [2]) == 1
    save.layer_computed(1)
    with pytest.raises(cxlkv.InvalidArgumentError, match="given up by its request"):
        save.finish()
    assert store.exists_prefix(keys) == 1
    # Held throughout (and block 1 shared with another request): published.
    store.assign_blocks(8, [1])
    save = store.start_put_many(keys[1:2], [1], owner=8)
    for layer in (0, 1):
        save.layer_computed(layer)
    assert save.finish().written == 1
    assert store.release_owner(7) == 1 and store.release_owner(8) == 1
    assert store.exists_prefix(keys) == 2


def test_a_sliding_window_group_makes_the_connector_stand_aside_rather_than_publish_a_tail(model, pool_path):
    cxlkv.create_pool(pool_path, 64 << 20, overwrite=True)
    from cxlkv.mini_engine.engine import KVCacheBlocks, Request, SchedulerOutput, CachedRequestData, \
        NewRequestData, kv_cache_config, vllm_config

    class SlidingWindowSpec:  # vLLM's kind: the group keeps only a window of each prefix
        pass

    config = EngineConfig(kv_groups=2)
    kcc = kv_cache_config(model, config)
    kcc.kv_cache_groups[1].kv_cache_spec = SlidingWindowSpec()
    sched = CxlKvConnector(vllm_config(model, config, {"pool_path": pool_path}), 0, kcc)
    try:
        req = Request("swa", PROMPT, 1, 16, config.hash_seed)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, KVCacheBlocks([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]), 0)
        so = SchedulerOutput([NewRequestData("swa", PROMPT, ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9]), 0)],
                             CachedRequestData(), {"swa": len(PROMPT)}, set())
        assert sched.build_connector_meta(so).saves == []
    finally:
        sched.shutdown()
