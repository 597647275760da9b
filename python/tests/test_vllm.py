"""The vLLM connector driven in vLLM's per-step order by the torch mini engine: the torch engine
gives the reference engine's tokens; with the connector it gives the same tokens, and a second
engine (another node, another process) is served from the pool with its hits counted; load
errors are recomputed; TP ranks and MLA keep vLLM's key semantics."""
import glob
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import cxlkv
from cxlkv.mini_engine import Engine, EngineConfig, Request
from cxlkv.mini_engine.engine import KVCacheBlocks, vllm_config
from cxlkv.mini_engine.model import load_model
from cxlkv.vllm import CxlKvConnector

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PROMPT = [(7 * i + 3) % 4000 for i in range(1, 70)]  # 69 tokens: 4 full blocks of 16


def cli():
    path = os.environ.get("CXLKV_CLI")
    if path:
        return path
    found = glob.glob(os.path.join(REPO, "build", "*", "tools", "cxlkv", "cxlkv"))
    if not found:
        pytest.skip("the cxlkv CLI is not built (scripts/build); ctest sets CXLKV_CLI")
    return max(found, key=os.path.getmtime)  # the newest build


def reference(prompt, max_new, weights=None, save=None):
    cmd = [cli(), "generate", "--prompt", ",".join(map(str, prompt)), "--max-new", str(max_new)]
    if save:
        cmd += ["--save-weights", save]
    if weights:
        cmd += ["--weights", weights]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    return json.loads(out)["tokens"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("weights") / "tiny-llama.safetensors")
    tokens = reference(PROMPT, 8, save=path)
    return SimpleNamespace(path=path, reference=tokens, model=load_model(None, path))


def test_the_torch_engine_gives_the_reference_engines_tokens(weights):
    assert Engine(weights.model, EngineConfig()).generate([PROMPT], 8) == [weights.reference]
    short = [5, 9, 1]
    assert Engine(weights.model, EngineConfig()).generate([short], 5) == [reference(short, 5, weights.path)]


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "flashinfer_hnd"])
def test_a_second_engine_is_served_from_the_pool_with_the_same_tokens(weights, pool_path, layout):
    cxlkv.create_pool(pool_path, 256 << 20, overwrite=True)
    extra = {"pool_path": pool_path}
    if layout == "flashinfer_hnd":  # vLLM's NHD-shaped view of HND memory: the scheduler must know
        extra["layout"] = layout
    first = Engine(weights.model, EngineConfig(layout=layout), connector=CxlKvConnector, connector_extra=extra)
    second = Engine(weights.model, EngineConfig(layout=layout), connector=CxlKvConnector,
                    connector_extra=dict(extra, node_id=1))
    try:
        assert first.generate([PROMPT], 8) == [weights.reference]
        assert first.worker_conn.loaded_blocks == 0
        assert first.worker_conn.saved_blocks == 4
        assert first.computed_prompt_tokens == len(PROMPT)
        assert second.generate([PROMPT], 8) == [weights.reference]
        assert second.worker_conn.loaded_blocks == 4  # every full prompt block from the pool
        assert second.computed_prompt_tokens == len(PROMPT) - 64
        assert second.worker_conn.saved_blocks == 0
        # A prompt sharing the first two blocks hits exactly those.
        other = PROMPT[:32] + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]
        third = Engine(weights.model, EngineConfig(layout=layout), connector=CxlKvConnector, connector_extra=extra)
        try:
            assert third.generate([other], 4) == Engine(weights.model, EngineConfig()).generate([other], 4)
            assert third.worker_conn.loaded_blocks == 2
        finally:
            third.close()
    finally:
        first.close()
        second.close()


def test_hnd_caches_without_the_layout_in_the_config_are_refused_with_the_fix(weights, pool_path):
    cxlkv.create_pool(pool_path, 64 << 20, overwrite=True)
    with pytest.raises(cxlkv.InvalidArgumentError, match='"layout": "flashinfer_hnd"'):
        Engine(weights.model, EngineConfig(layout="flashinfer_hnd"), connector=CxlKvConnector,
               connector_extra={"pool_path": pool_path})


def test_hnd_and_nhd_engines_of_one_model_never_share_blocks(weights, pool_path):
    cxlkv.create_pool(pool_path, 256 << 20, overwrite=True)
    hnd = Engine(weights.model, EngineConfig(layout="flashinfer_hnd"), connector=CxlKvConnector,
                 connector_extra={"pool_path": pool_path, "layout": "flashinfer_hnd"})
    try:
        assert hnd.generate([PROMPT], 8) == [weights.reference]
        assert hnd.worker_conn.saved_blocks == 4
    finally:
        hnd.close()
    # The same model id in the other format is a layout mismatch, not a silent reinterpretation.
    with pytest.raises(cxlkv.VersionMismatchError, match="format=2"):
        Engine(weights.model, EngineConfig(layout="flashinfer"), connector=CxlKvConnector,
               connector_extra={"pool_path": pool_path})


def test_prefill_and_decode_engine_processes_share_one_pool(weights, pool_path):
    cxlkv.create_pool(pool_path, 256 << 20, overwrite=True)

    def engine(node, max_tokens):
        cmd = [sys.executable, "-m", "cxlkv.mini_engine", "--weights", weights.path, "--prompt",
               ",".join(map(str, PROMPT)), "--max-tokens", str(max_tokens), "--pool", pool_path, "--node-id", str(node)]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout)

    prefill = engine(0, 1)  # the prefill engine: the prompt's KV and the first token
    assert prefill["saved_blocks"] == 4 and prefill["loaded_blocks"] == 0
    assert prefill["tokens"] == weights.reference[:1]
    decode = engine(1, 8)  # the decode engine on another node: the prompt's KV from the pool
    assert decode["loaded_blocks"] == 4
    assert decode["computed_prompt_tokens"] == len(PROMPT) - 64
    assert decode["tokens"] == weights.reference


class EvictingConnector(CxlKvConnector):
    """Evicts the pool between the scheduler's match and the worker's load (what another node's
    eviction can do), so the load fails and vLLM must recompute."""

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            self.pool.evict_all()


def test_blocks_that_fail_to_load_are_reported_and_recomputed(weights, pool_path):
    cxlkv.create_pool(pool_path, 256 << 20, overwrite=True)
    extra = {"pool_path": pool_path}
    warm = Engine(weights.model, EngineConfig(), connector=CxlKvConnector, connector_extra=extra)
    warm.generate([PROMPT], 1)
    warm.close()
    victim = Engine(weights.model, EngineConfig(), connector=EvictingConnector, connector_extra=extra)
    try:
        assert victim.generate([PROMPT], 8) == [weights.reference]
        assert victim.worker_conn.loaded_blocks == 0
        assert victim.recomputed_blocks == 4
        assert victim.computed_prompt_tokens == len(PROMPT)
    finally:
        victim.close()


def fake_config(pool_path, tp_size=1, mla=False, heads=2, head_size=32, layers=2):
    model = SimpleNamespace(config=SimpleNamespace(num_layers=layers, num_kv_heads=heads, head_dim=head_size))
    cfg = vllm_config(model, EngineConfig(model_id="fake"), {"pool_path": pool_path})
    cfg.model_config.use_mla = mla
    cfg.model_config.dtype = torch.bfloat16
    cfg.parallel_config.tensor_parallel_size = tp_size
    return cfg


def one_step(sched, worker, request, num_computed, block_ids):
    """One scheduler + worker step of a whole prompt, as the mini engine makes it."""
    from cxlkv.mini_engine.engine import CachedRequestData, NewRequestData, SchedulerOutput
    ext, _ = sched.get_num_new_matched_tokens(request, num_computed)
    sched.update_state_after_alloc(request, KVCacheBlocks([block_ids]), ext)
    so = SchedulerOutput([NewRequestData(request.request_id, request.prompt_token_ids, (block_ids,), ext)],
                         CachedRequestData(), {request.request_id: request.num_tokens - ext}, set())
    meta = sched.build_connector_meta(so)
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions(meta)
    worker.start_load_kv(None)
    for name in ("l0", "l1"):  # the model's layers, as vLLM's attention calls them
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, None, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return ext


def test_the_scheduler_counts_a_prefix_only_where_every_tp_rank_holds_it(pool_path):
    cxlkv.create_pool(pool_path, 128 << 20, overwrite=True)
    cfg = fake_config(pool_path, tp_size=2)
    sched = CxlKvConnector(cfg, 0)
    ranks = []
    for r in range(2):
        c = fake_config(pool_path, tp_size=2)
        c.kv_transfer_config.kv_connector_extra_config["tp_rank"] = r
        w = CxlKvConnector(c, 1)
        w.register_kv_caches({f"l{i}": torch.randn(2, 8, 16, 2, 32).to(torch.bfloat16) for i in range(2)})
        ranks.append(w)
    req = Request("r", list(range(40)), 1, 16, b"seed")
    assert one_step(sched, ranks[0], req, 0, [0, 1, 2]) == 0  # rank 0 saves its slice
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # rank 1's is missing
    one_step(sched, ranks[1], Request("r1", list(range(40)), 1, 16, b"seed"), 0, [3, 4, 5])
    assert sched.get_num_new_matched_tokens(req, 0) == (32, False)
    assert sched.get_num_new_matched_tokens(req, 16) == (16, False)
    for c in ranks + [sched]:
        c.shutdown()


def test_mla_latents_are_shared_by_every_rank(pool_path):
    cxlkv.create_pool(pool_path, 128 << 20, overwrite=True)
    workers = []
    for r in range(2):
        c = fake_config(pool_path, tp_size=2, mla=True, heads=1, head_size=64)
        c.kv_transfer_config.kv_connector_extra_config["tp_rank"] = r
        w = CxlKvConnector(c, 1)
        caches = {f"l{i}": torch.randn(8, 16, 64).to(torch.bfloat16) for i in range(2)}
        w.register_kv_caches(caches)
        workers.append((w, caches))
    sched = CxlKvConnector(fake_config(pool_path, tp_size=2, mla=True, heads=1, head_size=64), 0)
    req = Request("m", list(range(33)), 1, 16, b"seed")
    one_step(sched, workers[0][0], req, 0, [1, 2, 3])  # rank 0 writes the latents
    req2 = Request("m2", list(range(33)), 1, 16, b"seed")
    assert one_step(sched, workers[1][0], req2, 0, [5, 6, 7]) == 32  # rank 1 loads them
    for i in range(2):
        assert torch.equal(workers[1][1][f"l{i}"][5:7], workers[0][1][f"l{i}"][1:3])
    for w, _ in workers:
        w.shutdown()
    sched.shutdown()


def test_a_connector_without_a_pool_path_says_how_to_configure_it():
    cfg = fake_config("unused")
    cfg.kv_transfer_config.kv_connector_extra_config.clear()
    with pytest.raises(cxlkv.InvalidArgumentError, match="kv_connector_extra_config"):
        CxlKvConnector(cfg, 0)
