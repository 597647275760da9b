"""vLLM KV connector over a cxlkv pool (``cxlkv.vllm.CxlKvConnector``).

Implements vLLM v1's ``KVConnectorBase_V1`` (vllm/distributed/kv_transfer/kv_connector/v1/
base.py, the interface of vLLM 0.10-0.11 and later) for the FlashAttention and FlashInfer paged
layouts and MLA:

* scheduler side — ``get_num_new_matched_tokens`` asks the shared index directly (the
  scheduler maps the pool too: no ZMQ hop to a worker), ``update_state_after_alloc``,
  ``build_connector_meta``, ``request_finished``;
* worker side — ``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load``,
  ``save_kv_layer``, ``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``.

Keys are vLLM's own block hashes (``request.block_hashes``: chained digests of the block's
tokens and extra keys) folded into a namespace of model, layout, TP rank and size, and PP stage:
two TP ranks never read each other's slice, MLA's latent (the same on every rank) is shared,
and two vLLM instances share blocks exactly when their hashes agree (same hash function and
seed: ``PYTHONHASHSEED`` for the builtin hash, fixed for sha256).

vLLM is not imported at module load. Where it is installed the classes derive from its base
classes; here they are driven by a small engine (``cxlkv.mini_engine``) that makes vLLM's calls
in vLLM's per-step order. Loads and saves are layer-wise: ``start_load_kv`` pins the hit and
queues its copy layer by layer, ``wait_for_layer_load`` waits for one layer, ``save_kv_layer``
starts the copy of a layer the moment it is written, ``wait_for_save`` publishes; all within the
step, so ``get_finished`` reports nothing pending.

Configuration: ``kv_transfer_config.kv_connector_extra_config`` keys ``pool_path`` (required),
``node_id`` (this host's node, default 0), ``copy_threads`` (default 1), ``layout``
(``flash_attn``, ``flashinfer``, ``flashinfer_hnd`` or ``mla``; default: from the tensors' shape),
``tp_rank`` (default: vLLM's tensor-parallel rank of this worker). FlashInfer's HND caches come as
an NHD-shaped view of HND memory; they need ``layout: flashinfer_hnd`` (a head-major namespace,
pool block format 2, on the scheduler side too), and a worker that finds such tensors without
it says so.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from . import _cxlkv
from .pool import Namespace, Pool, is_permuted_hnd

log = logging.getLogger("cxlkv.vllm")

try:  # vLLM's real base classes where it is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1 as _ConnectorBase, KVConnectorMetadata as _MetadataBase, KVConnectorRole)
except ImportError:  # pragma: no cover - vLLM is not installable on these machines
    _ConnectorBase = object
    _MetadataBase = object

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1


@dataclass
class BlockTransfer:
    """One request's blocks to move in this step: ``block_hashes[i]`` <-> engine block ``block_ids[i]``."""
    req_id: str
    block_hashes: List[bytes]
    block_ids: List[int]


@dataclass
class CxlKvConnectorMetadata(_MetadataBase):  # type: ignore[misc, valid-type]
    loads: List[BlockTransfer] = field(default_factory=list)
    saves: List[BlockTransfer] = field(default_factory=list)


@dataclass
class _RequestState:
    request: Any
    block_ids: List[int] = field(default_factory=list)
    stored_blocks: int = 0                     # leading blocks in the pool already (loaded or saved)
    matched: Optional[Tuple[int, int]] = None  # (first block, blocks) the pool can give
    load: Optional[Tuple[int, int]] = None     # the same, once vLLM allocated for it


def _extra(vllm_config: Any) -> Dict[str, Any]:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


class CxlKvConnector(_ConnectorBase):  # type: ignore[misc, valid-type]
    """vLLM's KV connector on a cxlkv pool: a prefix cache shared by every instance of the rack,
    and the prefill-to-decode hand-off."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        if _ConnectorBase is not object:  # pragma: no cover - only inside vLLM
            super().__init__(vllm_config, role, kv_cache_config)
        self._vllm_config = vllm_config
        self._role = role
        self._connector_metadata: Optional[CxlKvConnectorMetadata] = None
        extra = _extra(vllm_config)
        if "pool_path" not in extra:
            raise _cxlkv.InvalidArgumentError(
                "CxlKvConnector needs the pool: --kv-transfer-config "
                "'{\"kv_connector\":\"CxlKvConnector\",\"kv_connector_module_path\":\"cxlkv.vllm\","
                "\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"pool_path\":\"/dev/shm/cxlkv\"}}'")
        self.pool = Pool(extra["pool_path"], node_id=int(extra.get("node_id", 0)))
        self._copy_threads = int(extra.get("copy_threads", 1))
        self._layout = extra.get("layout")
        self.block_size = int(vllm_config.cache_config.block_size)
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        self._model = str(mc.model)
        self._mla = bool(getattr(mc, "use_mla", False))
        self._num_layers = int(mc.get_num_layers(pc))
        self._kv_heads = int(mc.get_num_kv_heads(pc))
        self._head_size = int(mc.get_head_size())
        self._dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        if self._dtype in (None, "auto"):
            self._dtype = mc.dtype
        self._tp_size = int(getattr(pc, "tensor_parallel_size", 1))
        self._pp_stage = int(extra.get("pp_stage", 0))
        # Scheduler side: one namespace per TP rank (a prefix counts only where every rank has it).
        self._rank_namespaces = [self._namespace(r) for r in range(1 if self._mla else self._tp_size)]
        self._requests: Dict[str, _RequestState] = {}
        # Worker side.
        self._tp_rank = int(extra["tp_rank"]) if "tp_rank" in extra else _worker_tp_rank()
        self._store = None
        self._layer_index: Dict[str, int] = {}
        self._loads: List[Any] = []             # this step's layer-wise loads
        self._saves: List[Tuple[str, Any]] = []  # this step's layer-wise saves
        self._load_errors: Set[int] = set()
        self.loaded_blocks = 0  # counters for tests and logs
        self.saved_blocks = 0

    # ---- shared ----

    def _namespace(self, tp_rank: int) -> Namespace:
        return self.pool.namespace(self._model, dtype=self._dtype, num_layers=self._num_layers,
                                   num_kv_heads=self._kv_heads, head_size=self._head_size,
                                   block_size=self.block_size, tp_rank=tp_rank, tp_size=self._tp_size,
                                   pp_stage=self._pp_stage, mla=self._mla,
                                   head_major=self._layout == "flashinfer_hnd")

    @property
    def role(self) -> Any:
        return self._role

    def bind_connector_metadata(self, connector_metadata: CxlKvConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def shutdown(self) -> None:
        for load in self._loads:
            load.close()
        for _, save in self._saves:
            save.abort()
        self.pool.close()

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the pool holds for this request (whole blocks,
        every TP rank's slice present), read from the shared index without pinning."""
        hashes = list(request.block_hashes)
        first = num_computed_tokens // self.block_size
        if len(hashes) <= first:
            return 0, False
        held = min(self.pool.exists_prefix(ns_, ns_.keys_from_hashes(hashes))
                   for ns_ in self._rank_namespaces)
        hit_tokens = held * self.block_size
        # vLLM must compute at least the last prompt token itself (it needs its logits).
        hit_tokens = min(hit_tokens, request.num_tokens - 1)
        new = hit_tokens - num_computed_tokens
        st = self._requests.setdefault(request.request_id, _RequestState(request))
        st.request = request
        if new <= 0:
            st.matched = None
            return 0, False
        st.matched = (first, held - first)
        return new, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._requests.setdefault(request.request_id, _RequestState(request))
        if num_external_tokens > 0 and st.matched is not None:
            st.load = st.matched
        st.matched = None

    def build_connector_meta(self, scheduler_output: Any) -> CxlKvConnectorMetadata:
        meta = CxlKvConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._requests.setdefault(new.req_id, _RequestState(None))
            st.block_ids = list(new.block_ids[0])
            self._plan(st, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._requests.get(req_id)
            if st is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:
                st.block_ids.extend(added[0])
            self._plan(st, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
        for req_id in getattr(scheduler_output, "finished_req_ids", ()):
            self._requests.pop(req_id, None)
        return meta

    def _plan(self, st: _RequestState, req_id: str, computed_after: int, meta: CxlKvConnectorMetadata) -> None:
        hashes = list(st.request.block_hashes) if st.request is not None else []
        if st.load is not None:
            first, n = st.load
            meta.loads.append(BlockTransfer(req_id, hashes[first:first + n], st.block_ids[first:first + n]))
            st.stored_blocks = max(st.stored_blocks, first + n)
            st.load = None
        full = min(computed_after // self.block_size, len(hashes), len(st.block_ids))
        if full > st.stored_blocks:
            meta.saves.append(BlockTransfer(req_id, hashes[st.stored_blocks:full], st.block_ids[st.stored_blocks:full]))
            st.stored_blocks = full

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[dict]]:
        """Saves ran in the step that computed them: the blocks may be freed now."""
        self._requests.pop(request.request_id, None)
        return False, None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        """vLLM's per-layer paged tensors, in layer order; registered once with the pool."""
        tensors = list(kv_caches.values())
        if is_permuted_hnd(tensors[0]) and self._layout != "flashinfer_hnd":
            # The scheduler side keys blocks before any tensor exists: it must be told.
            raise _cxlkv.InvalidArgumentError(
                "vLLM's KV caches are laid out HND (FlashInfer with the HND KV layout): set "
                "\"layout\": \"flashinfer_hnd\" in kv_connector_extra_config, so the scheduler side keys the same "
                "head-major namespace (pool block format 2) as the workers")
        layout = self._layout or _layout_of(tensors[0], self._mla)
        ns = self._namespace(0 if self._mla else self._tp_rank)
        self._store = self.pool.register_kv_caches(ns, tensors, layout=layout, copy_threads=self._copy_threads)
        self._worker_ns = ns
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Starts this step's loads (layer by layer on the store's copy thread) and reserves its
        saves; returns at once. Blocks a concurrent eviction took since the scheduler looked are
        known here and reported by get_block_ids_with_load_errors."""
        meta = self._connector_metadata
        if meta is None:
            return
        for t in meta.loads:
            keys = self._worker_ns.keys_from_hashes(t.block_hashes)
            try:
                load = self._store.start_get_many_into(keys, t.block_ids)
            except _cxlkv.Error as e:
                log.warning("cxlkv: loading request %s failed: %s", t.req_id, e)
                self._load_errors.update(t.block_ids)
                continue
            self._loads.append(load)
            self.loaded_blocks += load.blocks
            if load.blocks < len(t.block_ids):  # evicted since the scheduler looked: vLLM recomputes them
                self._load_errors.update(t.block_ids[load.blocks:])
        for t in meta.saves:
            keys = self._worker_ns.keys_from_hashes(t.block_hashes)
            try:
                self._saves.append((t.req_id, self._store.start_put_many(keys, t.block_ids)))
            except (_cxlkv.NoSpaceError, _cxlkv.BusyError, _cxlkv.LeaseExpiredError) as e:
                log.warning("cxlkv: saving request %s skipped: %s", t.req_id, e)  # a later miss, no more

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Blocks until this layer of every block loading in this step is in the KV cache."""
        layer = self._layer_index[layer_name]
        for load in self._loads:
            load.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """The layer's KV is written: its copy into the reserved pool blocks starts now."""
        layer = self._layer_index[layer_name]
        for _, save in self._saves:
            save.layer_computed(layer)

    def wait_for_save(self) -> None:
        """Publishes this step's saves (every layer copied) and ends its loads (pins released)."""
        for load in self._loads:
            load.close()
        self._loads = []
        for req_id, save in self._saves:
            try:
                self.saved_blocks += save.finish().written
            except _cxlkv.Error as e:  # a layer never reported, or the lease lost: nothing published
                log.warning("cxlkv: saving request %s not published: %s", req_id, e)
        self._saves = []

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return None, None  # loads and saves complete within their step

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _layout_of(tensor: Any, mla: bool) -> str:
    shape = tuple(tensor.shape)
    if mla or len(shape) == 3:
        return "mla"
    return "flash_attn" if shape[0] == 2 else "flashinfer"


def _worker_tp_rank() -> int:
    try:  # pragma: no cover - only inside vLLM
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore
        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0
