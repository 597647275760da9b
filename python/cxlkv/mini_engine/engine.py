"""The mini engine's scheduler and worker loop, calling a KV connector in vLLM v1's order.

Per step (vLLM v1's ``Scheduler.schedule`` and the model runner's KV connector hooks):

scheduler  running requests get their next token's slot; when the block pool is empty the
           youngest running request is *preempted*: its blocks are freed, its computed tokens
           reset, and it waits at the front of the queue (its id in the step's
           ``preempted_req_ids``). Without preemptions this step, waiting requests are admitted
           while blocks last: ``get_num_new_matched_tokens`` -> allocate ->
           ``update_state_after_alloc``; a resumed request comes back among the cached
           requests with ``resumed_req_ids`` and a whole new block table. Then
           ``build_connector_meta(scheduler_output)``.
worker     per pipeline stage: ``bind_connector_metadata`` -> ``handle_preemptions`` ->
           ``start_load_kv`` -> per layer ``wait_for_layer_load``, attention, ``save_kv_layer``
           (not in a full CUDA graph step) -> ``wait_for_save`` -> ``get_finished`` ->
           ``clear_connector_metadata``; ``get_block_ids_with_load_errors`` makes the scheduler
           recompute from the first block that failed to load
finish     ``request_finished(request, block_ids)``, blocks freed, the id in the next step's
           ``finished_req_ids``

CUDA graphs (``EngineConfig.cudagraph_mode``): ``"none"`` runs every step eagerly; vLLM's default
``"full_and_piecewise"`` runs a uniform decode step as a full graph (its per-layer hooks are not
called; the forward context says FULL) unless the connector's ``requires_piecewise_for_cudagraph``
asks for piecewise graphs; ``"full"`` does so even then (an engine that ignores the flag).

KV cache groups (``kv_groups`` > 1, vLLM's hybrid allocator): layer ``i`` is in group ``i %
kv_groups``; each group has its own block table, drawn from the one block pool. Pipeline
stages (``pp_size``): one worker connector per stage, each registered with its stage's layers.

The scheduler-side and worker-side connectors are separate instances, as in vLLM (they live in
different processes there). vLLM's data classes are mirrored by the few fields connectors read.
Simplifications: whole prompts (no chunked prefill), no local prefix cache, greedy sampling.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from .model import TorchLlama


@dataclass
class EngineConfig:
    num_blocks: int = 64
    block_size: int = 16
    layout: str = "flash_attn"           # or "flashinfer", or "flashinfer_hnd" (vLLM's permuted HND view)
    hash_seed: bytes = b"cxlkv-mini-engine"  # vLLM: NONE_HASH; equal seeds share blocks
    model_id: str = "tiny-llama"
    cudagraph_mode: str = "none"         # "none" | "full_and_piecewise" (vLLM's default) | "full"
    kv_groups: int = 1
    pp_size: int = 1
    max_running: int = 8


class Request:
    """What connectors read of vLLM's Request: id, token counts, the chained block hashes."""

    def __init__(self, request_id: str, prompt_token_ids: List[int], max_tokens: int, block_size: int,
                 hash_seed: bytes):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: List[int] = []
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: List[bytes] = []
        self._block_size = block_size
        self._root = hashlib.sha256(hash_seed).digest()
        self._rehash()

    @property
    def all_token_ids(self) -> List[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._rehash()

    def _rehash(self) -> None:
        tokens, bs = self.all_token_ids, self._block_size
        while (len(self.block_hashes) + 1) * bs <= len(tokens):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else self._root
            block = tokens[i * bs:(i + 1) * bs]
            self.block_hashes.append(hashlib.sha256(parent + struct.pack(f"<{bs}q", *block)).digest())


class KVCacheBlocks:
    """vLLM's KVCacheBlocks: per group, the request's blocks; fresh blocks carry no hash (this
    engine has no local prefix cache, so every block is fresh)."""

    def __init__(self, tables: List[List[int]]):
        self.blocks = tuple([SimpleNamespace(block_id=b, block_hash=None, is_null=False) for b in t] for t in tables)

    def get_block_ids(self) -> Tuple[List[int], ...]:
        return tuple([b.block_id for b in g] for g in self.blocks)


class FullAttentionSpec:
    """The kind of every group here (vLLM's kv_cache_interface.FullAttentionSpec)."""


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: List[int]
    block_ids: Tuple[List[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: List[str] = field(default_factory=list)
    resumed_req_ids: Set[str] = field(default_factory=set)
    new_block_ids: List[Optional[Tuple[List[int], ...]]] = field(default_factory=list)
    num_computed_tokens: List[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: List[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Dict[str, int]
    finished_req_ids: Set[str]
    preempted_req_ids: Set[str] = field(default_factory=set)


def vllm_config(model: TorchLlama, config: EngineConfig, extra: Dict[str, Any], rank: int = 0) -> Any:
    """The parts of vLLM's VllmConfig a connector reads (``rank``: the worker's global rank)."""
    c = model.config
    model_config = SimpleNamespace(
        model=config.model_id, dtype=torch.float32, use_mla=False,
        get_total_num_hidden_layers=lambda: c.num_layers, get_num_kv_heads=lambda pc: c.num_kv_heads,
        get_head_size=lambda: c.head_dim)
    return SimpleNamespace(model_config=model_config,
                           cache_config=SimpleNamespace(block_size=config.block_size, cache_dtype="auto",
                                                        enable_prefix_caching=True),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=config.pp_size,
                                                           rank=rank),
                           kv_transfer_config=SimpleNamespace(kv_connector_extra_config=dict(extra), kv_role="kv_both"))


def kv_cache_config(model: TorchLlama, config: EngineConfig) -> Any:
    names = model.layer_names()
    groups = [SimpleNamespace(layer_names=[n for i, n in enumerate(names) if i % config.kv_groups == g],
                              kv_cache_spec=FullAttentionSpec()) for g in range(config.kv_groups)]
    return SimpleNamespace(num_blocks=config.num_blocks, kv_cache_groups=groups)


def stage_of_layers(num_layers: int, pp_size: int) -> List[int]:
    from .._vllm_sched import pp_layer_counts
    out: List[int] = []
    for stage, n in enumerate(pp_layer_counts(num_layers, pp_size)):
        out.extend([stage] * n)
    return out


class Engine:
    """Greedy generation over a paged KV cache, with an optional KV connector."""

    SCHEDULER, WORKER = 0, 1

    def __init__(self, model: TorchLlama, config: EngineConfig,
                 connector: Optional[Callable[..., Any]] = None, connector_extra: Optional[dict] = None):
        self.model = model
        self.config = config
        self.kv_caches = model.new_kv_caches(config.num_blocks, config.block_size, config.layout)
        self._free = list(range(config.num_blocks - 1, -1, -1))
        names = model.layer_names()
        self._group_of = [i % config.kv_groups for i in range(len(names))]
        self._stage_of = stage_of_layers(len(names), config.pp_size)
        self.computed_prompt_tokens = 0  # prompt tokens this engine computed itself (not loaded)
        self.recomputed_blocks = 0       # blocks recomputed after a failed load
        self.preemptions = 0
        self.full_graph_steps = 0
        self.sched_conn = None
        self.workers: List[Any] = []
        self._requires_piecewise = False
        if connector is not None:
            extra = dict(connector_extra or {})
            kcc = kv_cache_config(model, config)
            self.sched_conn = connector(vllm_config(model, config, extra), self.SCHEDULER, kcc)
            for stage in range(config.pp_size):
                w = connector(vllm_config(model, config, extra, rank=stage), self.WORKER, kcc)
                w.register_kv_caches({n: t for i, (n, t) in enumerate(zip(names, self.kv_caches))
                                      if self._stage_of[i] == stage})
                self.workers.append(w)
            piecewise = getattr(type(self.sched_conn), "requires_piecewise_for_cudagraph", None)
            self._requires_piecewise = bool(piecewise(extra)) if piecewise else False

    @property
    def worker_conn(self) -> Any:
        """The first stage's worker connector (the only one without pipeline parallelism)."""
        return self.workers[0] if self.workers else None

    def close(self) -> None:
        for conn in [self.sched_conn] + self.workers:
            if conn is not None:
                conn.shutdown()

    def _alloc(self, n: int) -> List[int]:
        return [self._free.pop() for _ in range(n)]

    def _tables_for(self, tokens: int) -> Optional[List[List[int]]]:
        per_group = -(-tokens // self.config.block_size)
        if per_group * self.config.kv_groups > len(self._free):
            return None
        return [self._alloc(per_group) for _ in range(self.config.kv_groups)]

    def _layer_tables(self, tables: List[List[int]]) -> List[List[int]]:
        return [tables[g] for g in self._group_of]

    def generate(self, prompts: List[List[int]], max_tokens: int) -> List[List[int]]:
        bs = self.config.block_size
        waiting = [Request(f"req-{i}", p, max_tokens, bs, self.config.hash_seed) for i, p in enumerate(prompts)]
        order = list(waiting)
        running: List[Request] = []
        tables: Dict[str, List[List[int]]] = {}
        finished_ids: Set[str] = set()
        while waiting or running:
            # ---- scheduler: running requests first, preempting the youngest when blocks run out ----
            new_reqs, cached, scheduled, preempted = [], CachedRequestData(), {}, set()
            for req in list(running):
                if req not in running:  # preempted by an older request this step
                    continue
                grow = None
                if req.num_computed_tokens // bs >= len(tables[req.request_id][0]):
                    while len(self._free) < self.config.kv_groups:
                        victim = running[-1]
                        self._preempt(victim, running, waiting, tables)
                        preempted.add(victim.request_id)
                        if victim is req:
                            break
                    if req not in running:
                        continue
                    grow = [self._alloc(1) for _ in range(self.config.kv_groups)]
                    for table, more in zip(tables[req.request_id], grow):
                        table.extend(more)
                cached.req_ids.append(req.request_id)
                cached.new_block_ids.append(tuple(grow) if grow else None)
                cached.num_computed_tokens.append(req.num_computed_tokens)
                scheduled[req.request_id] = 1
            while waiting and not preempted and len(running) < self.config.max_running:
                req = waiting[0]
                ext = 0
                if self.sched_conn is not None:
                    ext, is_async = self.sched_conn.get_num_new_matched_tokens(req, 0)
                    assert not is_async
                ids = self._tables_for(req.num_tokens)
                if ids is None:
                    break  # waits for blocks
                waiting.pop(0)
                tables[req.request_id] = ids
                if self.sched_conn is not None:
                    self.sched_conn.update_state_after_alloc(req, KVCacheBlocks(ids), ext)
                req.num_computed_tokens = ext
                if req.num_preemptions:  # resumed: a whole new table replaces the old
                    cached.req_ids.append(req.request_id)
                    cached.resumed_req_ids.add(req.request_id)
                    cached.new_block_ids.append(tuple(list(t) for t in ids))
                    cached.num_computed_tokens.append(ext)
                else:
                    new_reqs.append(NewRequestData(req.request_id, req.prompt_token_ids, tuple(list(t) for t in ids), ext))
                scheduled[req.request_id] = req.num_tokens - ext
                running.append(req)
            if not running:
                raise RuntimeError(f"mini engine: {self.config.num_blocks} KV blocks cannot hold one request")
            so = SchedulerOutput(new_reqs, cached, scheduled, finished_ids, preempted)
            finished_ids = set()
            meta = self.sched_conn.build_connector_meta(so) if self.sched_conn is not None else None
            full_graph = self._full_graph_step(new_reqs, cached)
            self.full_graph_steps += full_graph
            # ---- worker ----
            context = SimpleNamespace(cudagraph_runtime_mode=SimpleNamespace(name="FULL" if full_graph else "PIECEWISE"))
            failed: Set[int] = set()
            for w in self.workers:
                w.bind_connector_metadata(meta)
                w.handle_preemptions(meta)
                w.start_load_kv(context)
                failed |= w.get_block_ids_with_load_errors()
            if failed:
                self._recompute_from_failed(running, tables, scheduled, failed)
            logits = {}
            for i, req in enumerate(running):
                start = req.num_computed_tokens
                tokens = req.all_token_ids[start:start + scheduled[req.request_id]]
                if start < req.num_prompt_tokens:
                    self.computed_prompt_tokens += min(len(tokens), req.num_prompt_tokens - start)
                # vLLM runs one batched forward, each layer's hooks once a step: here a layer
                # waits for its load before the first request and is saved after the last.
                hook = None if full_graph else self._batch_hook(first=i == 0, last=i == len(running) - 1)
                logits[req.request_id] = self.model.forward(
                    tokens, start, self.kv_caches, self._layer_tables(tables[req.request_id]), bs,
                    self.config.layout, on_layer=hook)
            for w in self.workers:
                w.wait_for_save()
                w.get_finished(set(finished_ids))
                w.clear_connector_metadata()
            # ---- outputs ----
            for req in list(running):
                req.num_computed_tokens += scheduled[req.request_id]
                req.append(int(torch.argmax(logits[req.request_id])))
                if len(req.output_token_ids) >= req.max_tokens:
                    running.remove(req)
                    ids = tables.pop(req.request_id)
                    if self.sched_conn is not None:
                        self.sched_conn.request_finished(req, ids[0])
                    for t in ids:
                        self._free.extend(reversed(t))
                    finished_ids.add(req.request_id)
        return [r.output_token_ids for r in order]

    def _preempt(self, req: Request, running: List[Request], waiting: List[Request],
                 tables: Dict[str, List[List[int]]]) -> None:
        """vLLM's recompute preemption: blocks freed, computed tokens reset, back to the queue's front."""
        running.remove(req)
        for t in tables.pop(req.request_id):
            self._free.extend(reversed(t))
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.preemptions += 1
        waiting.insert(0, req)

    def _full_graph_step(self, new_reqs: List[NewRequestData], cached: CachedRequestData) -> bool:
        mode = self.config.cudagraph_mode
        uniform_decode = not new_reqs and not cached.resumed_req_ids
        if mode == "full":
            return uniform_decode
        if mode == "full_and_piecewise":
            return uniform_decode and not self._requires_piecewise
        return False

    def _batch_hook(self, first: bool, last: bool) -> Callable[..., None]:
        def hook(when: str, index: int, name: str, kv: torch.Tensor) -> None:
            if not self.workers:
                return
            w = self.workers[self._stage_of[index]]
            if when == "before" and first:
                w.wait_for_layer_load(name)
            elif when == "after" and last:
                w.save_kv_layer(name, kv, None)
        return hook

    def _recompute_from_failed(self, running: List[Request], tables: Dict[str, List[List[int]]],
                               scheduled: Dict[str, int], failed: Set[int]) -> None:
        """vLLM's reaction to load errors: the request restarts from its first failed block."""
        bs = self.config.block_size
        for req in running:
            groups = tables[req.request_id]
            bad = [i for i in range(len(groups[0]))
                   if any(i < len(t) and t[i] in failed for t in groups) and i * bs < req.num_computed_tokens]
            if bad:
                restart = bad[0] * bs
                self.recomputed_blocks += req.num_computed_tokens // bs - bad[0]
                scheduled[req.request_id] += req.num_computed_tokens - restart
                req.num_computed_tokens = restart
