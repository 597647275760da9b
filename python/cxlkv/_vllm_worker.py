"""The vLLM connector's worker side: one store per KV cache group, block ownership, the step's
loads and saves (``cxlkv.vllm`` describes the whole connector).

Every step starts with the plan's ownership: released owners give up every block in each
group's store, then granted blocks are assigned. From then on the store itself refuses a load
into, or a save from, a block the request does not hold, and publishes a save only if its blocks
stayed held until its copies were done (include/cxlkv/kv_store.h, "Block ownership"). Nothing
here raises into vLLM's forward: a failed load is reported as load errors (vLLM recomputes),
a failed save is a future miss; both are counted and logged once per kind.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Set, Tuple

from . import _cxlkv
from .pool import KvStore, is_permuted_hnd

log = logging.getLogger("cxlkv.vllm")


def _layout_of(tensor: Any, mla: bool) -> str:
    shape = tuple(tensor.shape)
    if mla or len(shape) == 3:
        return "mla"
    return "flash_attn" if shape[0] == 2 else "flashinfer"


class Worker:
    def __init__(self, connector: Any, pp_stage: int, tp_rank: int, copy_threads: int):
        self._c = connector
        self.pp_stage = pp_stage
        self.tp_rank = tp_rank
        self._copy_threads = copy_threads
        self._stores: List[KvStore] = []
        self._layer_of: Dict[str, Tuple[int, int]] = {}  # layer name -> (group, layer within group)
        self._applied: Any = None  # the plan whose ownership is in the stores (held: an id() could be reused)
        self._whole_step = False
        self._loads: List[Tuple[int, Any]] = []           # (group, KvLoad) of this step
        self._saves: List[Tuple[int, str, Any]] = []      # (group, req_id, KvSave) of this step
        self._pending_whole: List[Tuple[int, Any]] = []   # whole-step saves: (group, BlockTransfer)
        self._load_errors: Set[int] = set()
        self._logged: Set[str] = set()
        self.totals = {"loaded_blocks": 0, "saved_blocks": 0}
        self._stats: Dict[str, int] = {}

    # ---- registration ----

    def register(self, kv_caches: Dict[str, Any]) -> None:
        """vLLM's per-layer paged tensors, grouped as its KV cache config groups them."""
        c = self._c
        names = list(kv_caches)
        groups = c._groups
        if len(groups) == 1 and groups[0].layer_names is None:
            members = [names]
        else:
            members = [[n for n in g.layer_names if n in kv_caches] for g in groups]
            missing = [n for n in names if not any(n in m for m in members)]
            if missing:
                raise _cxlkv.InvalidArgumentError(
                    f"cxlkv: layers {missing[:3]} are in no KV cache group of vLLM's kv_cache_config")
        first = kv_caches[names[0]]
        if is_permuted_hnd(first) and c._layout != "flashinfer_hnd":
            # The scheduler side keys blocks before any tensor exists: it must be told.
            raise _cxlkv.InvalidArgumentError(
                "vLLM's KV caches are laid out HND (FlashInfer with the HND KV layout): set "
                "\"layout\": \"flashinfer_hnd\" in kv_connector_extra_config, so the scheduler side keys the same "
                "head-major namespace (pool block format 2) as the workers")
        layout = c._layout or _layout_of(first, c._mla)
        for g, layer_names in enumerate(members):
            ns = c._namespace(g, self.pp_stage, self.tp_rank)
            tensors = [kv_caches[n] for n in layer_names]
            self._stores.append(c.pool.register_kv_caches(ns, tensors, layout=layout,
                                                           copy_threads=self._copy_threads))
            for i, n in enumerate(layer_names):
                self._layer_of[n] = (g, i)

    # ---- a step ----

    def apply_ownership(self, plan: Any) -> None:
        """Releases, then grants, once per plan (handle_preemptions and start_load_kv both ask)."""
        if self._applied is plan:
            return
        self._applied = plan
        for owner in plan.released:
            for store in self._stores:
                self._guard("release", lambda s=store: s.release_owner(owner))
        for grant in plan.granted:
            for store, ids in zip(self._stores, grant.block_ids):
                if ids:
                    self._guard("assign", lambda s=store, i=ids: s.assign_blocks(grant.owner, i))

    def start_step(self, plan: Any, whole_step: bool) -> None:
        """Starts the step's loads (whole now, or layer by layer) and reserves its layer-wise saves."""
        self.apply_ownership(plan)
        self._whole_step = whole_step
        for tables in plan.failed_loads:
            for ids in tables:
                self._load_errors.update(ids)
            self._count("load_errors", sum(len(t) for t in tables))
        for t in plan.loads:
            for g, store in enumerate(self._stores):
                self._start_load(g, store, t)
        for t in plan.saves:
            for g, store in enumerate(self._stores):
                if whole_step:
                    self._pending_whole.append((g, t))
                else:
                    self._start_save(g, store, t)

    def _start_load(self, g: int, store: KvStore, t: Any) -> None:
        ids = t.block_ids[g]
        keys = store.namespace.keys_from_hashes(t.block_hashes)
        try:
            if self._whole_step:
                got = store.get_many_into(keys, ids, owner=t.owner)
            else:
                load = store.start_get_many_into(keys, ids, owner=t.owner)
                self._loads.append((g, load))
                got = load.blocks
        except _cxlkv.Error as e:
            self._refused("load", t.req_id, e)
            self._load_errors.update(ids)
            self._count("load_errors", len(ids))
            return
        self.totals["loaded_blocks"] += got
        self._count("loaded_blocks", got)
        self._count("loaded_bytes", got * store.namespace.block_bytes)
        if got < len(ids):  # evicted since the scheduler looked: vLLM recomputes them
            self._load_errors.update(ids[got:])
            self._count("load_errors", len(ids) - got)

    def _start_save(self, g: int, store: KvStore, t: Any) -> None:
        keys = store.namespace.keys_from_hashes(t.block_hashes)
        try:
            self._saves.append((g, t.req_id, store.start_put_many(keys, t.block_ids[g], owner=t.owner)))
        except _cxlkv.Error as e:  # a full pool, a busy key, a lost lease: a later miss, no more
            self._refused("save", t.req_id, e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if layer_name not in self._layer_of:  # a layer vLLM did not register (no KV): nothing moves
            return
        g, layer = self._layer_of[layer_name]
        for lg, load in self._loads:
            if lg == g:
                load.wait_layer(layer)

    def save_kv_layer(self, layer_name: str) -> None:
        if layer_name not in self._layer_of:
            return
        g, layer = self._layer_of[layer_name]
        for sg, req_id, save in self._saves:
            if sg == g:
                self._guard("save", lambda s=save: s.layer_computed(layer), req_id)

    def wait_for_save(self) -> None:
        """Ends the step: loads released, saves published. A layer-wise save whose layers were
        not all reported (a step whose hooks did not run) has its forward done by now: the rest
        are reported here rather than the save lost."""
        for _, load in self._loads:
            load.close()
        self._loads = []
        for g, req_id, save in self._saves:
            try:
                for layer in save.unreported_layers():
                    save.layer_computed(layer)
                written = save.finish().written
            except _cxlkv.Error as e:  # the lease lost, blocks given up: nothing published
                self._refused("save", req_id, e)
                continue
            self._saved(g, written)
        self._saves = []
        for g, t in self._pending_whole:
            store = self._stores[g]
            try:
                written = store.put_many(store.namespace.keys_from_hashes(t.block_hashes), t.block_ids[g],
                                         owner=t.owner).written
            except _cxlkv.Error as e:
                self._refused("save", t.req_id, e)
                continue
            self._saved(g, written)
        self._pending_whole = []

    def _saved(self, g: int, written: int) -> None:
        self.totals["saved_blocks"] += written
        self._count("saved_blocks", written)
        self._count("saved_bytes", written * self._stores[g].namespace.block_bytes)

    def take_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> Dict[str, int]:
        stats, self._stats = self._stats, {}
        return stats

    def shutdown(self) -> None:
        for _, load in self._loads:
            load.close()
        for _, _, save in self._saves:
            save.abort()
        self._loads, self._saves, self._pending_whole = [], [], []

    # ---- errors: counted, logged once per kind, never raised into vLLM ----

    def _count(self, key: str, n: int = 1) -> None:
        self._stats[key] = self._stats.get(key, 0) + n

    def _refused(self, what: str, req_id: str, e: Exception) -> None:
        kind = f"{what}:{type(e).__name__}"
        ownership = "not held by this request" in str(e) or "given up by its request" in str(e)
        self._count("refused_by_ownership" if ownership else f"{what}_errors")
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("cxlkv: %s of request %s failed (logged once per kind): %s", what, req_id, e)

    def _guard(self, what: str, fn: Any, req_id: str = "-") -> Any:
        try:
            return fn()
        except _cxlkv.Error as e:
            self._refused(what, req_id, e)
            return None
