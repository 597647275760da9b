"""How the SGLang backend (cxlkv.sglang) names and finds HiCache pages: namespaces, piece keys,
and the zero-copy plan that turns host-pool indices into addresses.

A zero-copy page is read and written where SGLang's host KV pool keeps it. The host pool says
where through its own ``get_page_buffer_meta(indices)`` (what every zero-copy backend upstream
uses): a list of (address, size) pieces per page — one for an MLA page-first page, K and V for
an MHA page-first one, K and V of every layer for a layer-first one. Each piece is one pool
block, under the page's hash with a piece tag, so a whole batch goes to the core in one call
(all or nothing) with no staging copy. Pages of layouts whose bytes differ never share a block:
the layout is part of the namespace and the piece count part of every key.
"""
from __future__ import annotations

import hashlib
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from . import _buffers, _cxlkv
from .pool import Namespace, Pool

# A namespace's model id and extra key must fit the pool's slot (96 and 64 bytes, with a NUL).
_MODEL_ID_MAX = 95
_EXTRA_KEY_MAX = 63


class RankPlace(NamedTuple):
    """What makes this rank's pages differ from another rank's (read from HiCacheStorageConfig)."""
    model: str
    mla: bool  # rank-replicated (MLA, DeepSeek V4): one copy serves every TP rank
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    tp_lcm_size: int  # 0: unset


def _int(config: Any, name: str, default: int) -> int:
    value = getattr(config, name, None) if config is not None else None
    return default if value is None else int(value)


def rank_place(config: Any, extra: dict) -> RankPlace:
    """getattr with defaults: older SGLang configs lack the pp, cp, dp and tp_lcm fields.

    Not part of it, on purpose: dp_rank. Under attention DP, tp_rank/tp_size are the attention-TP
    coordinates, and two DP replicas with the same attention-TP rank hold the same heads of the
    same tokens — the same bytes — so they share pages (that is the point of an L3 cache)."""
    model = getattr(config, "model_name", None) if config is not None else None
    model = str(model or extra.get("model_name") or "sglang")
    mla = bool(getattr(config, "is_mla_model", False)) if config is not None else False
    return RankPlace(model, mla, _int(config, "tp_rank", 0), _int(config, "tp_size", 1), _int(config, "pp_rank", 0),
                     _int(config, "pp_size", 1), _int(config, "attn_cp_rank", 0), _int(config, "attn_cp_size", 1),
                     _int(config, "tp_lcm_size", 0))


def _model_id(model: str) -> str:
    if len(model.encode()) <= _MODEL_ID_MAX:
        return model
    # A long local path: its tail names the model; the digest keeps two long paths apart.
    digest = hashlib.sha256(model.encode()).hexdigest()[:16]
    return digest + ":" + model.encode()[-(_MODEL_ID_MAX - 17):].decode(errors="ignore")


def open_namespace(pool: Pool, place: RankPlace, *, layout: Optional[str], dtype: Any, page_size: int,
                   heads_lcm: int = 0) -> Namespace:
    """The namespace of this rank's pages. TP rank/size are in it except for rank-replicated
    models and for the heads scheme (where the head group is in each key instead); PP rank is
    the pool's pp stage. The extra key holds the rest: host layout, dtype and page size (so two
    engines that differ in them get their own namespaces rather than a layout mismatch), PP
    size, and CP rank/size (context-parallel ranks hold disjoint slices of every page)."""
    name = str(dtype).replace("torch.", "")
    try:
        code_dtype = _buffers.DTYPE_NAMES[_buffers.dtype_code(dtype)]
    except _cxlkv.InvalidArgumentError:
        code_dtype = "uint8"  # pages are opaque bytes: int8 or fp4 pools still get their own namespace, by name
    parts = ["hicache", layout or "pages", name, f"p{page_size}"]
    if place.pp_size > 1:
        parts.append(f"pp{place.pp_size}")
    if place.cp_size > 1:
        parts.append(f"cp{place.cp_rank}of{place.cp_size}")
    if heads_lcm:
        parts.append(f"heads{heads_lcm}")
    extra_key = "/".join(parts)
    if len(extra_key.encode()) > _EXTRA_KEY_MAX:
        extra_key = "hicache/" + hashlib.sha256(extra_key.encode()).hexdigest()[:32]
    shared = place.mla or heads_lcm
    return pool.namespace(_model_id(place.model), dtype=code_dtype, block_size=page_size,
                          tp_rank=0 if shared else place.tp_rank, tp_size=1 if shared else place.tp_size,
                          pp_stage=place.pp_rank, extra_key=extra_key)


def host_ranges(host: Any) -> List[Tuple[int, int]]:
    """(address, nbytes) of every tensor the host pool registers for zero-copy I/O."""
    getter = getattr(host, "get_hybrid_pool_buffer", None)
    buffers = list(getter()) if callable(getter) else []
    if not buffers:
        kv = getattr(host, "kv_buffer", None)
        buffers = list(kv) if isinstance(kv, (tuple, list)) else [kv]
    return [(int(t.data_ptr()), int(t.numel() * t.element_size())) for t in buffers if t is not None]


class ZeroCopyPlan(NamedTuple):
    """How batch_get_v1/batch_set_v1 move a page: ``pieces`` blocks of ``piece_bytes`` each."""
    namespace: Namespace
    page_size: int  # tokens: host indices per key
    pieces: int
    piece_bytes: int
    tags: Tuple[str, ...]  # per piece, appended to the page hash
    split: int  # > 1: get_split_heads_page_buffer_meta(indices, split); else get_page_buffer_meta
    within: Tuple[Tuple[int, int], ...]

    @property
    def page_bytes(self) -> int:
        return self.pieces * self.piece_bytes

    def keys(self, hashes: Sequence[str]) -> Any:
        if self.tags == ("",):
            return self.namespace.keys_from_hashes(hashes)
        return self.namespace.keys_from_hashes([h + t for h in hashes for t in self.tags])

    def addresses(self, host: Any, host_indices: Any, pages: int) -> List[int]:
        """Each piece's address, page after page, from the host pool's own buffer metadata."""
        if host_indices is None or len(host_indices) != pages * self.page_size:
            got = "no" if host_indices is None else len(host_indices)
            raise _cxlkv.InvalidArgumentError(
                f"{pages} keys but {got} host indices: HiCache passes page_size ({self.page_size}) indices per key")
        if self.split > 1:
            ptrs, sizes = host.get_split_heads_page_buffer_meta(host_indices, self.split)
        else:
            ptrs, sizes = host.get_page_buffer_meta(host_indices)
        if len(ptrs) != pages * self.pieces or list(sizes).count(self.piece_bytes) != len(sizes):
            raise _cxlkv.InvalidArgumentError(
                f"the host pool described {len(ptrs)} pieces for {pages} pages; registration found "
                f"{self.pieces} of {self.piece_bytes} bytes per page")
        return [int(p) for p in ptrs]


def heads_split(place: RankPlace, layout: Optional[str]) -> int:
    """> 0 where pages are kept per head group of the TP LCM (SGLang's tp_lcm_size, for engines
    of different TP sizes sharing pages): page_head host layout, not rank-replicated. The split
    is tp_lcm_size / tp_size (1 for an engine whose TP size is the LCM: it still keys its pages
    per head group, so split engines find them)."""
    lcm = place.tp_lcm_size
    if not lcm or place.mla or layout != "page_head" or lcm % max(place.tp_size, 1):
        return 0
    return lcm // place.tp_size


def plan_zero_copy(pool: Pool, place: RankPlace, host: Any, layout: Optional[str], dtype: Any) -> ZeroCopyPlan:
    """Probes the host pool's buffer metadata with one page; raises NotSupportedError saying why
    a pool's pages cannot move zero-copy."""
    import torch

    if getattr(host, "kv_buffer", None) is None:
        raise _cxlkv.NotSupportedError(
            "the host pool has no KV buffer of its own (a hybrid model's logical anchor): its pages live in "
            "side pools, which need HiCache's v2 interface, which cxlkv does not implement")
    page = int(getattr(host, "page_size", 0) or 0)
    if page <= 0:
        raise _cxlkv.NotSupportedError("the host pool has no page_size")
    split = heads_split(place, layout)
    probe = torch.arange(page, dtype=torch.int64)
    try:
        if split > 1:
            ptrs, sizes = host.get_split_heads_page_buffer_meta(probe, split)
        else:
            ptrs, sizes = host.get_page_buffer_meta(probe)
    except Exception as e:  # AttributeError (an older host pool), ValueError (a layout it has no meta for)
        raise _cxlkv.NotSupportedError(
            f"the host pool ({type(host).__name__}, layout {layout!r}) gives no page buffer metadata: "
            f"{type(e).__name__}: {e}") from e
    pieces, distinct = len(ptrs), sorted({int(s) for s in sizes})
    if pieces == 0 or len(distinct) != 1 or len(sizes) != pieces:
        raise _cxlkv.NotSupportedError(
            f"a page of this host pool ({type(host).__name__}, layout {layout!r}) is {pieces} pieces of "
            f"{distinct} bytes; cxlkv moves a batch as equal-sized blocks in one call (K and V of different head "
            f"dims are not supported): drop interface_v1 to use the copying path")
    if split:
        if pieces != 2 * split:
            raise _cxlkv.NotSupportedError(
                f"page_head pages split {split} ways should be {2 * split} pieces (K and V per head group), "
                f"the host pool gives {pieces}")
        base = place.tp_rank * split
        tags = tuple(f"/h{base + g}of{place.tp_lcm_size}{kv}" for g in range(split) for kv in "kv")
    else:
        tags = ("",) if pieces == 1 else tuple(f"/{j}of{pieces}" for j in range(pieces))
    ns = open_namespace(pool, place, layout=layout, dtype=dtype, page_size=page,
                        heads_lcm=place.tp_lcm_size if split else 0)
    return ZeroCopyPlan(ns, page, pieces, distinct[0], tags, split, tuple(host_ranges(host)))
