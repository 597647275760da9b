"""The vLLM connector's scheduler side: what each request holds and what each step moves.

``Planner`` follows vLLM's scheduler output step by step (vllm/v1/core/sched/output.py):
new requests bring their block tables; cached requests append ``new_block_ids`` to theirs,
except those in ``resumed_req_ids`` (back from preemption), whose ``new_block_ids`` *replace*
the table; ``preempted_req_ids`` lost every block. From that it builds the step's metadata:
which request gave up its blocks and which holds which (so the workers' stores can refuse any
copy from or into a block its request does not hold), the loads the matches turned into, and
the saves of blocks that became full.

Owners are this scheduler's request numbers (1, 2, ...): one per request life, so a resumed
request's new blocks never pass for its old ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set


@dataclass
class BlockTransfer:
    """One request's blocks to move in this step: ``block_hashes[i]`` <-> engine block
    ``block_ids[g][i]`` of each KV cache group ``g``."""
    req_id: str
    owner: int
    block_hashes: List[bytes]
    block_ids: List[List[int]]


@dataclass
class BlockGrant:
    """Request ``owner`` now holds these blocks of each group (``block_ids[g]``)."""
    owner: int
    block_ids: List[List[int]]


@dataclass
class StepPlan:
    """What the workers do at the start of a step, in this order: ``released`` owners give up
    every block, ``granted`` blocks change hands, then ``loads`` and ``saves``."""
    released: List[int] = field(default_factory=list)
    granted: List[BlockGrant] = field(default_factory=list)
    loads: List[BlockTransfer] = field(default_factory=list)
    saves: List[BlockTransfer] = field(default_factory=list)
    failed_loads: List[List[int]] = field(default_factory=list)  # per group: blocks to report failed
    preempted_req_ids: Set[str] = field(default_factory=set)


@dataclass
class _Tracked:
    request: Any
    owner: int
    tables: List[List[int]]
    stored_blocks: int = 0                 # leading blocks the pool has (loaded or saved)
    load: Optional[tuple] = None           # (first block, blocks) vLLM allocated a load for
    load_unknown: bool = False             # a load whose range could not be told: fail it whole


def local_computed_blocks(blocks: Any, group: int) -> Optional[int]:
    """Leading blocks of ``blocks`` (vLLM's KVCacheBlocks) that vLLM's own prefix cache hit:
    cached blocks carry their hash, fresh ones none. None where the blocks do not say."""
    groups = getattr(blocks, "blocks", None)
    if groups is None or group >= len(groups):
        return None
    n = 0
    for b in groups[group]:
        if not hasattr(b, "block_hash"):
            return None
        if b.block_hash is None or getattr(b, "is_null", False):
            break
        n += 1
    return n


def _group_ids(block_ids: Any, groups: int) -> List[List[int]]:
    """vLLM's per-group tuple of block id lists, checked against the groups the connector knows."""
    ids = [list(g) for g in block_ids]
    if len(ids) != groups:
        raise ValueError(f"cxlkv: vLLM gave block ids of {len(ids)} KV cache groups, the connector knows {groups}")
    return ids


class Planner:
    def __init__(self, block_size: int, groups: int, *, saves: bool = True, prefix_caching: bool = True):
        self.block_size = block_size
        self.groups = groups
        self.saves = saves
        self.prefix_caching = prefix_caching
        self._tracked: Dict[str, _Tracked] = {}
        self._next_owner = 1
        self._released: List[int] = []  # owners whose requests finished since the last step

    def tracked(self) -> int:
        return len(self._tracked)

    def _track(self, request: Any) -> _Tracked:
        st = self._tracked.get(request.request_id)
        if st is None:
            st = _Tracked(request, self._new_owner(), [[] for _ in range(self.groups)])
            self._tracked[request.request_id] = st
        st.request = request
        return st

    def _new_owner(self) -> int:
        owner = self._next_owner
        self._next_owner += 1
        return owner

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated for ``num_external_tokens`` tokens from the pool: plan their load."""
        st = self._track(request)
        st.load, st.load_unknown = None, False
        if num_external_tokens <= 0:
            return
        local = local_computed_blocks(blocks, 0)
        if local is None:
            local = None if self.prefix_caching else 0
        if local is None:  # where the external range starts cannot be told: recompute, never guess
            st.load_unknown = True
            return
        bs = self.block_size
        end = -(-(local * bs + num_external_tokens) // bs)  # the last, possibly capped, block counts
        st.load = (local, end - local)

    def finished(self, request_id: str) -> None:
        st = self._tracked.pop(request_id, None)
        if st is not None:
            self._released.append(st.owner)

    def plan(self, so: Any, plan: Optional[StepPlan] = None) -> StepPlan:
        """This step's plan, filled into ``plan`` (a fresh StepPlan, or the connector's metadata)."""
        plan = plan if plan is not None else StepPlan()
        plan.released, self._released = self._released, []
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            plan.preempted_req_ids.add(req_id)
            st = self._tracked.get(req_id)
            if st is None:
                continue
            # Every block is gone; the request comes back (resumed) as a new owner.
            plan.released.append(st.owner)
            st.owner = self._new_owner()
            st.tables = [[] for _ in range(self.groups)]
            st.stored_blocks, st.load, st.load_unknown = 0, None, False
        scheduled = so.num_scheduled_tokens
        for new in so.scheduled_new_reqs:
            st = self._tracked.get(new.req_id)
            if st is None:  # never asked about (not a connector-visible request): nothing to move
                continue
            st.tables = _group_ids(new.block_ids, self.groups)
            plan.granted.append(BlockGrant(st.owner, [list(t) for t in st.tables]))
            self._plan_request(st, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0), plan)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._tracked.get(req_id)
            if st is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in resumed:
                # The whole table anew (vLLM: "new_block_ids will be used as the request's block
                # IDs instead of appending"); a preemption in an earlier step released the old one.
                fresh = _group_ids(added, self.groups) if added is not None else [[] for _ in range(self.groups)]
                if st.tables != fresh and any(st.tables):
                    plan.released.append(st.owner)
                    st.owner = self._new_owner()
                    st.stored_blocks = 0
                st.tables = fresh
                plan.granted.append(BlockGrant(st.owner, [list(t) for t in fresh]))
            elif added is not None:
                more = _group_ids(added, self.groups)
                for table, extra in zip(st.tables, more):
                    table.extend(extra)
                plan.granted.append(BlockGrant(st.owner, more))
            self._plan_request(st, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), plan)
        for req_id in getattr(so, "finished_req_ids", ()) or ():
            self.finished(req_id)  # request_finished missed (aborted early): release it next step
        return plan

    def _plan_request(self, st: _Tracked, req_id: str, computed_after: int, plan: StepPlan) -> None:
        hashes = list(st.request.block_hashes)
        if st.load_unknown:
            plan.failed_loads.append([list(t) for t in st.tables])
            st.load_unknown = False
        if st.load is not None:
            first, n = st.load
            n = min(n, len(hashes) - first, *(len(t) - first for t in st.tables))
            if n > 0:
                plan.loads.append(BlockTransfer(req_id, st.owner, hashes[first:first + n],
                                                [t[first:first + n] for t in st.tables]))
                st.stored_blocks = max(st.stored_blocks, first + n)
            st.load = None
        if not self.saves:
            return
        # Content-addressed: only hashes the engine says may be published (EAGLE keeps the last
        # one back until its successor is known).
        publishable = getattr(st.request, "num_publishable_block_hashes", None)
        limit = len(hashes) if publishable is None else min(len(hashes), int(publishable))
        full = min(computed_after // self.block_size, limit, *(len(t) for t in st.tables))
        if full > st.stored_blocks:
            plan.saves.append(BlockTransfer(req_id, st.owner, hashes[st.stored_blocks:full],
                                            [t[st.stored_blocks:full] for t in st.tables]))
            st.stored_blocks = full


def pp_layer_counts(total_layers: int, pp_size: int, partition: Optional[str] = None) -> List[int]:
    """Layers of each pipeline stage, as vLLM splits them (vllm/distributed/utils.py
    get_pp_indices: VLLM_PP_LAYER_PARTITION when set, else equal parts with the remainder on
    the stages before the last)."""
    if partition:
        counts = [int(x) for x in partition.split(",")]
        if len(counts) != pp_size or sum(counts) != total_layers:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION={partition!r} does not split {total_layers} layers "
                             f"over {pp_size} stages")
        return counts
    counts = [total_layers // pp_size] * pp_size
    for i in range(2, total_layers % pp_size + 2):
        counts[-i] += 1
    return counts
