"""Pools, namespaces and registered engine KV tensors (see ``help(cxlkv)``)."""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _buffers, _cxlkv

PathLike = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

# Engine paged-KV layouts (cxlkv::EngineLayoutKind) and the tensor shape each expects per layer.
LAYOUTS = {
    "flash_attn": 0,  # vLLM FlashAttention: [2, num_blocks, block_size, num_kv_heads, head_size]
    "flashinfer": 1,  # FlashInfer NHD:      [num_blocks, 2, block_size, num_kv_heads, head_size]
    "mla": 2,         # MLA latent:          [num_blocks, block_size, latent_dim]
    "flashinfer_hnd": 3,  # FlashInfer HND:  [num_blocks, 2, num_kv_heads, block_size, head_size]
                          # (pool block format 2: its namespace needs head_major=True)
}


class PutResult(NamedTuple):
    written: int  #: blocks copied and published by the call
    skipped: int  #: keys already cached (or being written by another writer): not copied


def _paths(path: PathLike) -> List[str]:
    if isinstance(path, (str, os.PathLike)):
        return [os.fspath(p) for p in os.fspath(path).split(",") if p]
    return [os.fspath(p) for p in path]


def _keys(keys: Any) -> np.ndarray:
    arr = np.ascontiguousarray(keys, dtype=np.uint64)
    if arr.ndim == 1 and arr.shape[0] == 2:
        arr = arr.reshape(1, 2)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise _cxlkv.InvalidArgumentError(
            f"keys must be of shape (n, 2) (uint64 lo, hi per key), got {arr.shape}: make them with "
            f"Namespace.chain_keys or Namespace.keys_from_hashes")
    return arr


def _block_ids(ids: Any, what: str) -> List[int]:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise _cxlkv.InvalidArgumentError(f"{what}: block ids must be in 0..2^32-1")
    return arr.tolist()


def _owner(owner: int) -> int:
    if not isinstance(owner, int) or not 0 < owner < 2**64:
        raise _cxlkv.InvalidArgumentError(f"a block owner is a request number in 1..2^64-1, got {owner!r}")
    return owner


def _checked_addresses(ns: "Namespace", addresses: Sequence[int], size: int, within: Sequence[Tuple[int, int]],
                       what: str) -> List[int]:
    """``addresses`` as ints, each [a, a + size) inside one range of ``within``, size a block's."""
    size = int(size)
    if size <= 0 or (ns.block_bytes and size != ns.block_bytes):
        raise _cxlkv.InvalidArgumentError(f"{what}: blocks of {size} bytes; a block of {ns!r} is {ns.block_bytes}")
    arr = np.asarray(addresses, dtype=np.uint64).reshape(-1)
    ok = np.zeros(arr.shape, dtype=bool)
    for start, nbytes in within:
        start, nbytes = int(start), int(nbytes)
        ok |= (arr >= np.uint64(start)) & (arr + np.uint64(size) <= np.uint64(start + nbytes))
    if not ok.all():
        bad = int(np.argmin(ok))
        ranges = ", ".join(f"[{int(s):#x}, +{int(n)})" for s, n in within) or "none"
        raise _cxlkv.InvalidArgumentError(
            f"{what}: block {bad} at {int(arr[bad]):#x} (+{size} bytes) is outside the registered host memory "
            f"({ranges}): the page index is out of range, or the host pool was not the one registered")
    return arr.tolist()


def _hash_bytes(h: Union[bytes, bytearray, memoryview, str, int]) -> bytes:
    """An engine's block hash as bytes: vLLM's digests are bytes (older vLLM: Python ints),
    SGLang's page hashes are hex strings."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, str):
        return h.encode()
    if isinstance(h, int):
        return h.to_bytes(max(1, (h.bit_length() + 8) // 8), "little", signed=True)
    raise _cxlkv.InvalidArgumentError(f"an engine block hash is a {type(h).__name__}: pass bytes, str or int")


def create_pool(path: PathLike, size: int, *, max_nodes: int = 16, overwrite: bool = False, checksum: bool = False,
                index_entries: int = 0, cache_capacity: int = 0) -> None:
    """Formats a pool of one region per path (a file in /dev/shm, or a CXL DAX device), each of
    ``size`` bytes, with a prefix KV-cache index. ``checksum`` keeps and verifies a checksum per
    block. Raises AlreadyExistsError unless ``overwrite``."""
    _cxlkv.create_pool(_paths(path), size, max_nodes, overwrite, checksum, index_entries, cache_capacity)


def stat(path: PathLike, *, watch_ms: int = 0) -> dict:
    """What ``cxlkv stat --json`` prints: nodes, lock manager, chunks, cache counters. Attaches
    without joining; ``watch_ms`` > 0 watches heartbeats that long to tell live nodes from silent."""
    return json.loads(_cxlkv.stat(_paths(path), watch_ms))


def is_permuted_hnd(tensor: Any) -> bool:
    """Whether ``tensor`` is vLLM's view of an HND cache: shaped NHD ([num_blocks, 2, block_size,
    num_kv_heads, head_size]) but laid out HND in memory, so its strides, not its shape, say HND
    (FlashInfer's backend allocates it so when its KV layout is HND). With one KV head or one
    token per block both orders are the same bytes, and the view is contiguous: see hnd_storage."""
    if not _buffers._torch_tensor(tensor) or tensor.dim() != 5 or tensor.is_contiguous():
        return False
    return tensor.permute(0, 1, 3, 2, 4).is_contiguous()


def hnd_storage(tensor: Any, block_size: int, num_kv_heads: int) -> Any:
    """An HND cache as its memory holds it, [num_blocks, 2, num_kv_heads, block_size, head_size]:
    vLLM's NHD-shaped view of it turned back (the same bytes, no copy); any other tensor as given.
    A contiguous tensor already shaped HND stays as it is (when block_size equals num_kv_heads the
    shape cannot tell the two apart, and memory order decides)."""
    if not _buffers._torch_tensor(tensor) or tensor.dim() != 5:
        return tensor
    nhd_shaped = tuple(tensor.shape[2:4]) == (block_size, num_kv_heads)
    hnd_shaped = tuple(tensor.shape[2:4]) == (num_kv_heads, block_size)
    if nhd_shaped and not (hnd_shaped and tensor.is_contiguous()) and tensor.permute(0, 1, 3, 2, 4).is_contiguous():
        return tensor.permute(0, 1, 3, 2, 4)
    return tensor


class Namespace:
    """A model's KV layout registered in the pool: keys are only meaningful within it.

    Two engines share blocks only when model id, extra key and every layout field (dtype, layers,
    heads, head size, block size, TP rank and size, PP stage) are equal; so the same engine hash
    under two TP ranks names two different blocks."""

    def __init__(self, native: Any, model_id: str, extra_key: str, dtype: int, num_layers: int, num_kv_heads: int,
                 head_size: int, block_size: int, tp_rank: int, tp_size: int, pp_stage: int, kv_parts: int,
                 head_major: bool = False):
        self._native = native
        self.model_id = model_id
        self.extra_key = extra_key
        self.dtype = _buffers.DTYPE_NAMES[dtype]
        self.dtype_code = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.block_size = block_size
        self.tp_rank, self.tp_size, self.pp_stage = tp_rank, tp_size, pp_stage
        self.kv_parts = kv_parts
        self.head_major = head_major  # pool block format 2

    @property
    def id(self) -> int:
        return self._native.id

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: kv_parts x layers x block_size x heads x head_size x dtype."""
        return self._native.block_bytes

    def chain_keys(self, tokens: Any) -> np.ndarray:
        """Keys of every full block of ``tokens`` (cxlkv's chained xxh3-128), shape (n, 2)."""
        return self._native.chain_keys(np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1))

    def keys_from_hashes(self, hashes: Iterable[Union[bytes, str, int]]) -> np.ndarray:
        """An engine's own block hashes (vLLM digests, SGLang hex page hashes) folded into this
        namespace, shape (n, 2)."""
        return self._native.keys_from_hashes([_hash_bytes(h) for h in hashes])

    def __repr__(self) -> str:
        return (f"Namespace({self.model_id!r}, id={self.id}, {self.dtype}, layers={self.num_layers}, "
                f"kv_heads={self.num_kv_heads}, head_size={self.head_size}, block_size={self.block_size}, "
                f"tp={self.tp_rank}/{self.tp_size}, pp={self.pp_stage}{', head-major' if self.head_major else ''})")


class KvLoad:
    """A layer-wise load in flight (KvStore.start_get_many_into). The loaded blocks stay pinned
    until close() (or the end of a ``with`` block), which first waits for the copy."""

    def __init__(self, native: Any, num_layers: int):
        self._native = native
        self.num_layers = num_layers

    @property
    def blocks(self) -> int:
        """Blocks being loaded: the longest cached prefix of the keys when the load started."""
        return self._native.blocks

    def wait_layer(self, layer: int) -> None:
        """Blocks until ``layer`` of every loaded block is in the engine's tensors."""
        self._native.wait_layer(layer)

    def wait(self) -> None:
        self._native.wait_layer(self.num_layers - 1)

    def close(self) -> None:
        self._native.close()

    def __enter__(self) -> "KvLoad":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class KvSave:
    """A layer-wise save in flight (KvStore.start_put_many): report each layer once the engine
    wrote it, then finish() publishes. Aborted (nothing published) if never finished."""

    def __init__(self, native: Any, num_layers: int):
        self._native = native
        self.num_layers = num_layers
        self._reported: set = set()

    def layer_computed(self, layer: int) -> None:
        self._native.layer_computed(layer)
        self._reported.add(layer)

    def unreported_layers(self) -> List[int]:
        """Layers not reported yet (an engine step whose per-layer hooks did not run)."""
        return [layer for layer in range(self.num_layers) if layer not in self._reported]

    def finish(self) -> PutResult:
        return PutResult(*self._native.finish())

    def abort(self) -> None:
        self._native.abort()

    def __enter__(self) -> "KvSave":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.abort()  # after finish() a no-op


class KvStore:
    """An engine's paged KV tensors, registered once; blocks then move by engine block id.

    Keeps the tensors referenced: they must not be reallocated while the store is used."""

    def __init__(self, native: Any, ns: Namespace, layout: str, num_blocks: int, tensors: List[Any]):
        self._native = native
        self.namespace = ns
        self.layout = layout
        self.num_blocks = num_blocks
        self._tensors = tensors  # keeps the engine's memory alive while its addresses are registered

    def exists_prefix(self, keys: Any) -> int:
        """How many leading keys the pool holds, without pinning anything (a scheduler's question)."""
        return self._native.exists_prefix(_keys(keys))

    # Block ownership: once an engine names which request holds which blocks (assign_blocks),
    # every load and save names its request (``owner``), and nothing is published from, or
    # loaded into, a block that request does not hold (InvalidArgumentError, nothing moved; a
    # save whose block is given up before its copies are done publishes nothing).

    def assign_blocks(self, owner: int, block_ids: Any) -> None:
        """Request ``owner`` (any nonzero number) now holds these engine blocks."""
        self._native.assign_blocks(_owner(owner), _block_ids(block_ids, "assign_blocks"))

    def release_blocks(self, owner: int, block_ids: Any) -> int:
        """Request ``owner`` gave these blocks up (before the engine reuses them): waits for its
        loads into them. Returns how many of them it held."""
        return self._native.release_blocks(_owner(owner), _block_ids(block_ids, "release_blocks"))

    def release_owner(self, owner: int) -> int:
        """Request ``owner`` gave every block up (finished, preempted); returns how many it held."""
        return self._native.release_owner(_owner(owner))

    def put_many(self, keys: Any, block_ids: Any, owner: int = 0) -> PutResult:
        """Engine blocks ``block_ids[i]`` -> the pool under ``keys[i]``; cached keys are skipped."""
        return PutResult(*self._native.put_many(_keys(keys), _block_ids(block_ids, "put_many"), owner))

    def get_many_into(self, keys: Any, block_ids: Any, owner: int = 0) -> int:
        """The longest cached prefix of ``keys`` -> engine blocks ``block_ids[:n]``; returns n.
        Blocks past n are untouched."""
        return self._native.get_many_into(_keys(keys), _block_ids(block_ids, "get_many_into"), owner)

    def start_get_many_into(self, keys: Any, block_ids: Any, owner: int = 0) -> KvLoad:
        """get_many_into layer by layer on a copy thread: returns once the prefix is pinned; wait
        per layer (KvLoad.wait_layer) before reading it, so layer l computes while l+1 moves."""
        native = self._native.start_get_many_into(_keys(keys), _block_ids(block_ids, "get_many_into"), owner)
        return KvLoad(native, self.namespace.num_layers)

    def start_put_many(self, keys: Any, block_ids: Any, owner: int = 0) -> KvSave:
        """put_many layer by layer: reserves now (cached keys skipped), copies each layer as it
        is reported, publishes at finish()."""
        return KvSave(self._native.start_put_many(_keys(keys), _block_ids(block_ids, "put_many"), owner),
                      self.namespace.num_layers)


class Pool:
    """A cxlkv pool opened by this process as node ``node_id`` (processes of one host share a node
    id; each host has its own). Use as a context manager or call close()."""

    def __init__(self, path: PathLike, *, node_id: int = 0, lease_ms: int = 2000, recovers: bool = True):
        self._native = _cxlkv._Pool(_paths(path), node_id, lease_ms, recovers)
        self.path = ",".join(_paths(path))
        self.node_id = node_id

    def close(self) -> None:
        """Leaves the pool; waits for calls in flight. Later calls (and its stores) raise."""
        self._native.close()

    @property
    def closed(self) -> bool:
        return self._native.closed

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def namespace(self, model_id: str, *, dtype: Any, num_layers: int = 0, num_kv_heads: int = 0, head_size: int = 0,
                  block_size: int = 16, tp_rank: int = 0, tp_size: int = 1, pp_stage: int = 0, mla: bool = False,
                  extra_key: str = "", head_major: bool = False) -> Namespace:
        """Registers (or finds) a model's KV layout. For MLA pass ``mla=True`` and the latent dim as
        ``head_size`` with ``num_kv_heads=1`` (the latent is the same on every TP rank, so the
        rank is left out of the namespace). ``head_major=True`` keeps blocks in pool block format 2
        (each KV head's rows of a block contiguous), for engines registered with layout
        ``flashinfer_hnd``; it is part of the namespace, so such blocks are never shared with a
        token-major engine's. With ``num_layers=0`` the block size is left open:
        whole blocks of any one size (opaque pages, as SGLang's HiCache stores them). Raises
        VersionMismatchError when the model id is
        registered with another layout."""
        code = _buffers.dtype_code(dtype)
        if mla:
            num_kv_heads, tp_rank, tp_size = 1, 0, 1
        kv_parts = 1 if mla else 2
        sig = _cxlkv._Layout(code, num_layers, num_kv_heads, head_size, block_size, tp_rank, tp_size, pp_stage,
                             kv_parts, 2 if head_major else 1)
        native = self._native.namespace(model_id, extra_key, sig)
        return Namespace(native, model_id, extra_key, code, num_layers, num_kv_heads, head_size, block_size, tp_rank,
                         tp_size, pp_stage, kv_parts, head_major)

    def exists_prefix(self, ns: Namespace, keys: Any) -> int:
        """How many leading keys the pool holds, without pinning anything (a scheduler's question)."""
        return self._native.exists(ns._native, _keys(keys))

    def put(self, ns: Namespace, keys: Any, values: Sequence[Any]) -> PutResult:
        """Whole blocks: ``values[i]`` (a tensor or buffer of ns.block_bytes bytes; any one size for
        all when the namespace's layout leaves it open) under ``keys[i]``. Keys already cached are
        skipped. All or nothing: on an error nothing of the call is published."""
        k = _keys(keys)
        descs = [_buffers.describe(v, writable=False, what=f"value {i}") for i, v in enumerate(values)]
        size = self._block_size_of(ns, descs, "put")
        return PutResult(*self._native.put_buffers(ns._native, k, [d.address for d in descs], size))

    def get(self, ns: Namespace, keys: Any, outs: Sequence[Any]) -> int:
        """The longest cached prefix of ``keys`` read into ``outs[:n]`` (writable tensors or buffers
        of a block's size); returns n. Checksums are verified when the pool keeps them."""
        k = _keys(keys)
        descs = [_buffers.describe(o, writable=True, what=f"destination {i}") for i, o in enumerate(outs)]
        size = self._block_size_of(ns, descs, "get")
        return self._native.get_buffers(ns._native, k, [d.address for d in descs], size)

    # Raw addresses, for adapters that index an engine's own registered host memory by page
    # (SGLang HiCache's zero-copy path): the same put/get, with each block's address given
    # instead of a tensor. ``within`` holds the (address, nbytes) ranges the engine registered;
    # every block must lie inside one of them, or nothing is done — so a bad index is an
    # InvalidArgumentError, never a copy to or from memory the engine does not own.

    def put_addresses(self, ns: Namespace, keys: Any, addresses: Sequence[int], size: int, *,
                      within: Sequence[Tuple[int, int]]) -> PutResult:
        """put of the ``size`` bytes at ``addresses[i]`` under ``keys[i]`` (all or nothing)."""
        k = _keys(keys)
        ptrs = _checked_addresses(ns, addresses, size, within, "put_addresses")
        return PutResult(*self._native.put_buffers(ns._native, k, ptrs, size))

    def get_addresses(self, ns: Namespace, keys: Any, addresses: Sequence[int], size: int, *,
                      within: Sequence[Tuple[int, int]]) -> int:
        """get of the longest cached prefix of ``keys`` into ``size`` bytes at each address; returns n."""
        k = _keys(keys)
        ptrs = _checked_addresses(ns, addresses, size, within, "get_addresses")
        return self._native.get_buffers(ns._native, k, ptrs, size)

    @staticmethod
    def _block_size_of(ns: Namespace, descs: List[_buffers.Described], what: str) -> int:
        size = ns.block_bytes or (descs[0].nbytes if descs else 0)
        for i, d in enumerate(descs):
            if d.nbytes != size or size == 0:
                raise _cxlkv.InvalidArgumentError(
                    f"{what}: buffer {i} holds {d.nbytes} bytes, a block of {ns!r} is {size}")
        return size

    def register_kv_caches(self, ns: Namespace, kv_caches: Sequence[Any], *, layout: str = "flash_attn",
                           copy_threads: int = 1) -> KvStore:
        """Registers an engine's paged KV tensors, one per layer (vLLM's ``kv_caches``), shaped as
        ``layout`` says (see LAYOUTS) with this namespace's dtype, heads, head size and block size.
        ``flashinfer_hnd`` also takes vLLM's NHD-shaped view of an HND cache (is_permuted_hnd).
        Later calls name engine block ids. ``copy_threads`` copy workers (the caller included).
        CUDA tensors (or objects with ``__cuda_array_interface__``) go through the CUDA transfer
        path: NotSupportedError where this build has none (cxlkv.cuda_built()) or no GPU is usable."""
        if layout not in LAYOUTS:
            raise _cxlkv.InvalidArgumentError(f"layout {layout!r} is not one of {sorted(LAYOUTS)}")
        kind = LAYOUTS[layout]
        if (kind == LAYOUTS["mla"]) != (ns.kv_parts == 1):
            raise _cxlkv.InvalidArgumentError(
                f"layout {layout!r} does not fit {ns!r}: MLA tensors need a namespace made with mla=True")
        if (kind == LAYOUTS["flashinfer_hnd"]) != ns.head_major:
            raise _cxlkv.InvalidArgumentError(
                f"layout {layout!r} does not fit {ns!r}: HND tensors (flashinfer_hnd), and only they, need a "
                f"namespace made with head_major=True")
        if len(kv_caches) != ns.num_layers:
            raise _cxlkv.InvalidArgumentError(
                f"{len(kv_caches)} layer tensors for a namespace of {ns.num_layers} layers")
        if kind == LAYOUTS["flashinfer_hnd"]:
            kv_caches = [hnd_storage(t, ns.block_size, ns.num_kv_heads) for t in kv_caches]
        descs = [_buffers.describe(t, writable=True, what=f"layer {i}'s KV tensor", with_dtype=True, allow_device=True)
                 for i, t in enumerate(kv_caches)]
        devices = {d.device for d in descs}
        if len(devices) != 1:
            raise _cxlkv.InvalidArgumentError(
                f"the layer tensors live on {sorted(devices, key=str)} (None: host memory): register one engine's "
                f"tensors, all on one device")
        device = devices.pop()
        first = descs[0].shape
        if kind == LAYOUTS["mla"]:
            expect_tail = (ns.block_size, ns.head_size)
            num_blocks = first[0] if len(first) == 3 else -1
            expect = (num_blocks, *expect_tail)
        else:
            expect_tail = (ns.block_size, ns.num_kv_heads, ns.head_size)
            if kind == LAYOUTS["flashinfer_hnd"]:
                expect_tail = (ns.num_kv_heads, ns.block_size, ns.head_size)
            num_blocks = (first[1] if kind == LAYOUTS["flash_attn"] else first[0]) if len(first) == 5 else -1
            expect = (2, num_blocks, *expect_tail) if kind == LAYOUTS["flash_attn"] else (num_blocks, 2, *expect_tail)
        for i, d in enumerate(descs):
            if d.shape != expect or num_blocks <= 0:
                raise _cxlkv.InvalidArgumentError(
                    f"layer {i}'s KV tensor is shaped {list(d.shape)}; {layout} for {ns!r} needs "
                    f"{['num_blocks' if x == num_blocks else x for x in expect]}")
            if d.dtype != ns.dtype_code and not (d.dtype is None and d.itemsize == _buffers.DTYPE_BYTES[ns.dtype_code]):
                got = _buffers.DTYPE_NAMES.get(d.dtype, f"{d.itemsize}-byte elements") if d.dtype is not None \
                    else f"{d.itemsize}-byte elements"
                raise _cxlkv.InvalidArgumentError(f"layer {i}'s KV tensor holds {got}; the namespace is {ns.dtype}")
        latent = ns.head_size if kind == LAYOUTS["mla"] else 0
        heads = 0 if kind == LAYOUTS["mla"] else ns.num_kv_heads
        head_size = 0 if kind == LAYOUTS["mla"] else ns.head_size
        native = self._native.register(ns._native, kind, ns.dtype_code, num_blocks, ns.block_size, heads, head_size,
                                       latent, ns.tp_rank, ns.tp_size, ns.pp_stage, [d.address for d in descs],
                                       copy_threads, -1 if device is None else device)
        return KvStore(native, ns, layout, num_blocks, [d.keep for d in descs])

    def evict_all(self) -> int:
        """Evicts every unpinned block of the pool; returns how many."""
        return self._native.evict_all()

    def evict_namespace(self, ns: Namespace) -> int:
        """Evicts every unpinned block of ``ns`` and nothing of any other namespace (one engine's
        "clear" on a pool the rack shares); returns how many."""
        return self._native.evict_namespace(ns._native)

    def stats(self, *, watch_ms: int = 0) -> dict:
        """The pool's ``cxlkv stat --json`` document (see cxlkv.stat)."""
        return stat(self.path, watch_ms=watch_ms)

    def __repr__(self) -> str:
        return f"Pool({self.path!r}, node_id={self.node_id}{', closed' if self.closed else ''})"
