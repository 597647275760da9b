"""The mini engine's scheduler and worker loop, calling a KV connector in vLLM v1's order.

Per step (vLLM v1's ``Scheduler.schedule`` and ``GPUModelRunner.execute_model``):

scheduler  for each waiting request: ``get_num_new_matched_tokens`` -> allocate blocks ->
           ``update_state_after_alloc``; running requests get their next token's slot;
           then ``build_connector_meta(scheduler_output)``
worker     ``bind_connector_metadata`` -> ``start_load_kv`` -> per layer ``wait_for_layer_load``,
           attention, ``save_kv_layer`` -> ``wait_for_save`` -> ``get_finished`` ->
           ``clear_connector_metadata``; ``get_block_ids_with_load_errors`` makes the scheduler
           recompute from the first block that failed to load
finish     ``request_finished(request, block_ids)``, blocks freed, the id in the next step's
           ``finished_req_ids``

The scheduler-side and worker-side connectors are two instances, as in vLLM (they live in
different processes there). vLLM's data classes are mirrored by the few fields connectors read.
Simplifications: one prefill per step, whole prompts (no chunked prefill), no local prefix
cache, greedy sampling.
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


class Request:
    """What connectors read of vLLM's Request: id, token counts, the chained block hashes."""

    def __init__(self, request_id: str, prompt_token_ids: List[int], max_tokens: int, block_size: int,
                 hash_seed: bytes):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: List[int] = []
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
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
    def __init__(self, block_ids: List[int]):
        self._ids = list(block_ids)

    def get_block_ids(self) -> Tuple[List[int]]:
        return (self._ids,)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: List[int]
    block_ids: Tuple[List[int]]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: List[str] = field(default_factory=list)
    new_block_ids: List[Optional[Tuple[List[int]]]] = field(default_factory=list)
    num_computed_tokens: List[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: List[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Dict[str, int]
    finished_req_ids: Set[str]


def vllm_config(model: TorchLlama, config: EngineConfig, extra: Dict[str, Any]) -> Any:
    """The parts of vLLM's VllmConfig a connector reads."""
    c = model.config
    model_config = SimpleNamespace(
        model=config.model_id, dtype=torch.float32, use_mla=False,
        get_num_layers=lambda pc: c.num_layers, get_num_kv_heads=lambda pc: c.num_kv_heads,
        get_head_size=lambda: c.head_dim)
    return SimpleNamespace(model_config=model_config,
                           cache_config=SimpleNamespace(block_size=config.block_size, cache_dtype="auto"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           kv_transfer_config=SimpleNamespace(kv_connector_extra_config=dict(extra)))


class Engine:
    """Greedy generation over a paged KV cache, with an optional KV connector."""

    SCHEDULER, WORKER = 0, 1

    def __init__(self, model: TorchLlama, config: EngineConfig,
                 connector: Optional[Callable[[Any, int], Any]] = None, connector_extra: Optional[dict] = None):
        self.model = model
        self.config = config
        self.kv_caches = model.new_kv_caches(config.num_blocks, config.block_size, config.layout)
        self._free = list(range(config.num_blocks - 1, -1, -1))
        self.computed_prompt_tokens = 0  # prompt tokens this engine computed itself (not loaded)
        self.recomputed_blocks = 0       # blocks recomputed after a failed load
        self.sched_conn = self.worker_conn = None
        if connector is not None:
            vcfg = vllm_config(model, config, connector_extra or {})
            self.sched_conn = connector(vcfg, self.SCHEDULER)
            self.worker_conn = connector(vcfg, self.WORKER)
            self.worker_conn.register_kv_caches(dict(zip(model.layer_names(), self.kv_caches)))

    def close(self) -> None:
        for conn in (self.sched_conn, self.worker_conn):
            if conn is not None:
                conn.shutdown()

    def _alloc(self, n: int) -> List[int]:
        if n > len(self._free):
            raise RuntimeError(f"mini engine: out of KV blocks ({n} wanted, {len(self._free)} free)")
        return [self._free.pop() for _ in range(n)]

    def generate(self, prompts: List[List[int]], max_tokens: int) -> List[List[int]]:
        bs = self.config.block_size
        waiting = [Request(f"req-{i}", p, max_tokens, bs, self.config.hash_seed) for i, p in enumerate(prompts)]
        order = list(waiting)
        running: List[Request] = []
        tables: Dict[str, List[int]] = {}
        finished_ids: Set[str] = set()
        while waiting or running:
            # ---- scheduler ----
            new_reqs, cached, scheduled = [], CachedRequestData(), {}
            for req in running:
                grow = None
                if req.num_computed_tokens // bs >= len(tables[req.request_id]):
                    grow = self._alloc(1)
                    tables[req.request_id].extend(grow)
                cached.req_ids.append(req.request_id)
                cached.new_block_ids.append((grow,) if grow else None)
                cached.num_computed_tokens.append(req.num_computed_tokens)
                scheduled[req.request_id] = 1
            if waiting:
                req = waiting.pop(0)
                ext = 0
                if self.sched_conn is not None:
                    ext, is_async = self.sched_conn.get_num_new_matched_tokens(req, 0)
                    assert not is_async
                ids = self._alloc((req.num_tokens + bs - 1) // bs)
                tables[req.request_id] = ids
                if self.sched_conn is not None:
                    self.sched_conn.update_state_after_alloc(req, KVCacheBlocks(ids), ext)
                req.num_computed_tokens = ext
                new_reqs.append(NewRequestData(req.request_id, req.prompt_token_ids, (list(ids),), ext))
                scheduled[req.request_id] = req.num_tokens - ext
                running.append(req)
            so = SchedulerOutput(new_reqs, cached, scheduled, finished_ids)
            finished_ids = set()
            meta = self.sched_conn.build_connector_meta(so) if self.sched_conn is not None else None
            # ---- worker ----
            if self.worker_conn is not None:
                self.worker_conn.bind_connector_metadata(meta)
                self.worker_conn.start_load_kv(None)
                failed = self.worker_conn.get_block_ids_with_load_errors()
                if failed:
                    self._recompute_from_failed(running, tables, scheduled, failed)
            logits = {}
            for req in running:
                start = req.num_computed_tokens
                tokens = req.all_token_ids[start:start + scheduled[req.request_id]]
                if start < req.num_prompt_tokens:
                    self.computed_prompt_tokens += min(len(tokens), req.num_prompt_tokens - start)
                logits[req.request_id] = self.model.forward(
                    tokens, start, self.kv_caches, tables[req.request_id], bs, self.config.layout,
                    on_layer=self._layer_hook)
            if self.worker_conn is not None:
                self.worker_conn.wait_for_save()
                self.worker_conn.get_finished(set(finished_ids))
                self.worker_conn.clear_connector_metadata()
            # ---- outputs ----
            for req in list(running):
                req.num_computed_tokens += scheduled[req.request_id]
                req.append(int(torch.argmax(logits[req.request_id])))
                if len(req.output_token_ids) >= req.max_tokens:
                    running.remove(req)
                    ids = tables.pop(req.request_id)
                    if self.sched_conn is not None:
                        self.sched_conn.request_finished(req, ids)
                    self._free.extend(reversed(ids))
                    finished_ids.add(req.request_id)
        return [r.output_token_ids for r in order]

    def _layer_hook(self, when: str, index: int, name: str, kv: torch.Tensor) -> None:
        if self.worker_conn is None:
            return
        if when == "before":
            self.worker_conn.wait_for_layer_load(name)
        else:
            self.worker_conn.save_kv_layer(name, kv, None)

    def _recompute_from_failed(self, running: List[Request], tables: Dict[str, List[int]],
                               scheduled: Dict[str, int], failed: Set[int]) -> None:
        """vLLM's reaction to load errors: the request restarts from its first failed block."""
        bs = self.config.block_size
        for req in running:
            table = tables[req.request_id]
            bad = [i for i, b in enumerate(table) if b in failed and i * bs < req.num_computed_tokens]
            if bad:
                restart = bad[0] * bs
                self.recomputed_blocks += req.num_computed_tokens // bs - bad[0]
                scheduled[req.request_id] += req.num_computed_tokens - restart
                req.num_computed_tokens = restart
