"""vLLM KV connector over a cxlkv pool (``cxlkv.vllm.CxlKvConnector``).

Follows vLLM v1's ``KVConnectorBase_V1`` and ``SupportsHMA`` as of vLLM 0.33
(vllm/distributed/kv_transfer/kv_connector/v1/base.py, vllm/v1/core/sched/output.py; the
revisions are named in docs/integrations.md) for the FlashAttention and FlashInfer paged
layouts and MLA:

* scheduler side — ``get_num_new_matched_tokens`` asks the shared index directly (the
  scheduler maps the pool too: no ZMQ hop to a worker) and keeps nothing;
  ``update_state_after_alloc`` turns the match into a planned load; ``build_connector_meta``
  follows the scheduler output (resumed requests replace their block table, preempted ones
  lose it) and emits the step's block ownership, loads and saves (``_vllm_sched.Planner``);
  ``request_finished`` / ``request_finished_all_groups``;
* worker side — ``register_kv_caches`` (one store per KV cache group), ``handle_preemptions``
  (ownership first: a preempted or finished request's blocks are released in the store before
  anything else moves, and the store then refuses any copy from or into a block its request does
  not hold), ``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``,
  ``get_finished``, ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``,
  ``shutdown``.

Keys are vLLM's own block hashes folded into a namespace per (KV cache group, PP stage, TP
rank) of model and layout; MLA's latent (the same on every TP rank) is shared. Two vLLM
instances share blocks exactly when their hashes agree (same hash function and seed).

Loads and saves are layer-wise by default: ``wait_for_layer_load`` / ``save_kv_layer`` pace
them, so the connector asks vLLM for piecewise CUDA graphs (``requires_piecewise_for_cudagraph``:
a full graph's replay skips those hooks). ``"layerwise": false`` selects the whole-step mode
instead, which needs no per-layer hook and runs under full CUDA graphs: loads complete in
``start_load_kv`` before the forward, saves run whole in ``wait_for_save`` after it. A step that
vLLM runs as a full graph anyway (its forward context says so) is run whole-step as well.

vLLM is not imported at module load. Where it is installed the classes derive from its base
classes; here they are driven by ``cxlkv.mini_engine``, which makes vLLM's calls in vLLM's order.
Configuration (``kv_connector_extra_config``): ``pool_path`` (required), ``node_id`` (default 0),
``copy_threads`` (default 1), ``layout`` (``flash_attn``, ``flashinfer``, ``flashinfer_hnd`` or
``mla``; default: from the tensors' shape; ``flashinfer_hnd`` must be given, on the scheduler side
too), ``layerwise`` (default true). ``tp_rank`` / ``pp_stage`` override vLLM's own ranks (tests).
"""
from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

from . import _cxlkv
from ._vllm_sched import BlockTransfer, Planner, StepPlan, pp_layer_counts
from ._vllm_worker import Worker
from .pool import Namespace, Pool

log = logging.getLogger("cxlkv.vllm")

try:  # vLLM's real base classes where it is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1 as _ConnectorBase, KVConnectorMetadata as _MetadataBase, KVConnectorRole,
        SupportsHMA as _HmaBase)
except ImportError:  # pragma: no cover - vLLM is not installable on these machines
    _ConnectorBase = object
    _MetadataBase = object

    class _HmaBase:  # type: ignore[no-redef]
        """Stands for vLLM's SupportsHMA marker (a second ``object`` base is not allowed)."""

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats as _StatsBase  # type: ignore
except ImportError:  # pragma: no cover - see above
    _StatsBase = object

__all__ = ["CxlKvConnector", "CxlKvConnectorMetadata", "CxlKvConnectorStats", "BlockTransfer"]


if _MetadataBase is object:
    class CxlKvConnectorMetadata(StepPlan):
        """One step's plan (``_vllm_sched.StepPlan``), as vLLM carries it to the workers."""
else:  # pragma: no cover - only inside vLLM
    class CxlKvConnectorMetadata(StepPlan, _MetadataBase):  # type: ignore[misc, valid-type, no-redef]
        """One step's plan (``_vllm_sched.StepPlan``), as vLLM carries it to the workers."""


_STAT_KEYS = ("lookups", "lookup_hit_tokens", "loaded_blocks", "loaded_bytes", "saved_blocks", "saved_bytes",
              "load_errors", "save_errors", "refused_by_ownership")


@dataclass
class CxlKvConnectorStats(_StatsBase):  # type: ignore[misc, valid-type]
    """Counts since the last report, summed over workers (vLLM's KVConnectorStats shape)."""
    data: Optional[Dict[str, int]] = None

    def __post_init__(self) -> None:
        if self.data is None:
            self.data = {k: 0 for k in _STAT_KEYS}

    def reset(self) -> None:
        self.data = {k: 0 for k in _STAT_KEYS}

    def aggregate(self, other: "CxlKvConnectorStats") -> "CxlKvConnectorStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + int(v)
        return self

    def reduce(self) -> Dict[str, int]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def clone_and_reset(self) -> "CxlKvConnectorStats":
        old = CxlKvConnectorStats(dict(self.data))
        self.reset()
        return old


def _extra(vllm_config: Any) -> Dict[str, Any]:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() not in ("0", "false", "no", "off")


_CONNECTOR_BASES = (_HmaBase,) if _ConnectorBase is object else (_ConnectorBase, _HmaBase)


class CxlKvConnector(*_CONNECTOR_BASES):  # type: ignore[misc]
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
        self._layout = extra.get("layout")
        self.layerwise = _flag(extra.get("layerwise", True))
        cc, mc, pc = vllm_config.cache_config, vllm_config.model_config, vllm_config.parallel_config
        self.block_size = int(cc.block_size)
        self._model = str(mc.model)
        self._mla = bool(getattr(mc, "use_mla", False))
        self._dtype = getattr(cc, "cache_dtype", "auto")
        if self._dtype in (None, "auto"):
            self._dtype = mc.dtype
        self._kv_heads = int(mc.get_num_kv_heads(pc))
        self._head_size = int(mc.get_head_size())
        self._tp_size = int(getattr(pc, "tensor_parallel_size", 1))
        self._pp_size = int(getattr(pc, "pipeline_parallel_size", 1))
        total_layers = _total_layers(mc, pc)
        self._stage_layers = pp_layer_counts(total_layers, self._pp_size, os.environ.get("VLLM_PP_LAYER_PARTITION"))
        self._groups = _kv_cache_groups(kv_cache_config)
        partial = [f"{i} ({g.kind})" for i, g in enumerate(self._groups) if g.kind not in _WHOLE_PREFIX_KINDS]
        if partial:
            # A sliding-window or state group keeps only a tail of each prefix (vLLM nulls the rest):
            # its blocks cannot be keyed by prefix hash, and a prefix without them cannot be loaded.
            log.warning("cxlkv: KV cache groups %s keep no whole prefix: this model gets no pool hits and "
                        "saves nothing (full-attention and MLA groups only)", ", ".join(partial))
        role_name = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_role", "kv_both") or "kv_both"
        self._loads_enabled = role_name != "kv_producer" and not partial
        self._saves_enabled = role_name != "kv_consumer" and not partial
        self._stats = CxlKvConnectorStats()
        if _is_scheduler(role):
            # A prefix counts only where every (group, stage, TP rank) namespace holds it.
            ranks = [0] if self._mla else range(self._tp_size)
            self._lookup_namespaces = [self._namespace(g, s, r) for g in range(len(self._groups))
                                       for s in range(self._pp_size) for r in ranks]
            self._planner = Planner(self.block_size, len(self._groups), saves=self._saves_enabled,
                                    prefix_caching=bool(getattr(cc, "enable_prefix_caching", True)))
            self._worker = None
        else:
            tp_rank, pp_stage = _worker_ranks(vllm_config, extra)
            self._worker = Worker(self, pp_stage, 0 if self._mla else tp_rank, int(extra.get("copy_threads", 1)))

    # ---- shared ----

    def _namespace(self, group: int, stage: int, tp_rank: int) -> Namespace:
        layers = self._stage_layers[stage] if len(self._groups) == 1 else self._groups[group].layers_in_stage(
            stage, self._stage_layers)
        # One group keeps the unqualified namespace (blocks stay shared with single-group engines).
        extra_key = "" if len(self._groups) == 1 else f"vllm-kv-group-{group}-{self._groups[group].kind}"
        return self.pool.namespace(self._model, dtype=self._dtype, num_layers=layers, num_kv_heads=self._kv_heads,
                                   head_size=self._head_size, block_size=self.block_size, tp_rank=tp_rank,
                                   tp_size=self._tp_size, pp_stage=stage, mla=self._mla, extra_key=extra_key,
                                   head_major=self._layout == "flashinfer_hnd")

    @property
    def role(self) -> Any:
        return self._role

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a future miss, never a request to recompute."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        """Layer-wise loads and saves need vLLM to run Python between graph pieces; the
        whole-step mode (``"layerwise": false``) does not."""
        return _flag((extra_config or {}).get("layerwise", True))

    def bind_connector_metadata(self, connector_metadata: CxlKvConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        self.pool.close()

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the pool holds for this request (whole blocks,
        every namespace's slice present), read from the shared index without pinning. Keeps no
        state: vLLM may ask again, or never allocate."""
        if not self._loads_enabled:
            return 0, False
        hashes = list(request.block_hashes)
        if len(hashes) <= num_computed_tokens // self.block_size:
            return 0, False
        try:
            held = min(self.pool.exists_prefix(ns, ns.keys_from_hashes(hashes)) for ns in self._lookup_namespaces)
        except _cxlkv.Error as e:  # the pool unreachable: a miss, and vLLM computes
            log.warning("cxlkv: looking up request %s failed: %s", request.request_id, e)
            return 0, False
        # vLLM must compute at least the last prompt token itself (it needs its logits).
        new = min(held * self.block_size, request.num_tokens - 1) - num_computed_tokens
        self._stats.data["lookups"] += 1
        self._stats.data["lookup_hit_tokens"] += max(new, 0)
        return max(new, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._planner.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> CxlKvConnectorMetadata:
        return self._planner.plan(scheduler_output, CxlKvConnectorMetadata())

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[dict]]:
        """Saves ran in the step that computed them: the blocks may be freed now (the next
        step's metadata releases them in the workers' stores before anything else moves)."""
        self._planner.finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: Tuple[List[int], ...]) -> Tuple[bool, Optional[dict]]:
        return self.request_finished(request, [])

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> CxlKvConnectorStats:
        return CxlKvConnectorStats(dict(data) if data else None)

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before the step's blocks are reused: releases preempted and finished requests' blocks
        in the stores (older vLLM passes the preempted ids; the bound metadata carries them)."""
        meta = kv_connector_metadata if isinstance(kv_connector_metadata, StepPlan) else self._connector_metadata
        if meta is not None:
            self._worker.apply_ownership(meta)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if meta is not None:
            self._worker.start_step(meta, whole_step=not self.layerwise or _full_graph_step(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return None, None  # loads and saves complete within their step

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> Optional[CxlKvConnectorStats]:
        stats = self._stats
        if self._worker is not None:
            stats.aggregate(CxlKvConnectorStats(self._worker.take_stats()))
        return None if stats.is_empty() else stats.clone_and_reset()

    # Counters for tests and logs (this worker's, since start).
    @property
    def loaded_blocks(self) -> int:
        return self._worker.totals["loaded_blocks"]

    @property
    def saved_blocks(self) -> int:
        return self._worker.totals["saved_blocks"]


# vLLM KV cache spec kinds (class names less "Spec") whose blocks hold the whole prefix.
_WHOLE_PREFIX_KINDS = {"full", "fullattention", "mlaattention"}


class _Group:
    """One KV cache group: its layers (in vLLM's order) and kind."""

    def __init__(self, layer_names: Optional[List[str]], kind: str):
        self.layer_names = layer_names
        self.kind = kind

    def layers_in_stage(self, stage: int, stage_layers: List[int]) -> int:
        # Group layers are named model.layers.<i>...: count those in the stage's range.
        lo = sum(stage_layers[:stage])
        hi = lo + stage_layers[stage]
        return sum(1 for n in self.layer_names or () if lo <= _layer_number(n) < hi)


def _layer_number(name: str) -> int:
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    raise _cxlkv.InvalidArgumentError(f"cxlkv: layer name {name!r} carries no layer number")


def _kv_cache_groups(kv_cache_config: Any) -> List[_Group]:
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return [_Group(None, "full")]
    out = []
    for g in groups:
        spec = getattr(g, "kv_cache_spec", None)
        kind = type(spec).__name__.replace("Spec", "").lower() if spec is not None else "full"
        out.append(_Group(list(g.layer_names), kind or "full"))
    return out


def _is_scheduler(role: Any) -> bool:
    return getattr(role, "name", None) == "SCHEDULER" or role == 0


def _total_layers(mc: Any, pc: Any) -> int:
    for name in ("get_total_num_hidden_layers", "get_num_layers"):
        fn = getattr(mc, name, None)
        if fn is not None:
            try:
                return int(fn() if name == "get_total_num_hidden_layers" else fn(pc))
            except TypeError:
                continue
    raise _cxlkv.InvalidArgumentError("cxlkv: vLLM's model config gives no layer count")


def _worker_ranks(vllm_config: Any, extra: Dict[str, Any]) -> Tuple[int, int]:
    """This worker's TP rank and PP stage: vLLM's process groups where vLLM runs, else the global
    rank in vLLM's order (ranks laid out [pp][tp] within a data-parallel replica)."""
    pc = vllm_config.parallel_config
    tp_size = int(getattr(pc, "tensor_parallel_size", 1))
    tp_rank = pp_stage = None
    try:  # pragma: no cover - only inside vLLM
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank  # type: ignore
        tp_rank, pp_stage = int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception:
        rank = int(getattr(pc, "rank", 0) or 0)
        tp_rank, pp_stage = rank % tp_size, rank // tp_size
    if "tp_rank" in extra:
        tp_rank = int(extra["tp_rank"])
    if "pp_stage" in extra:
        pp_stage = int(extra["pp_stage"])
    return tp_rank, pp_stage


def _full_graph_step(forward_context: Any) -> bool:
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", mode) == "FULL"
