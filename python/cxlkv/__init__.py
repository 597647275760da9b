"""cxlkv: a rack-scale KV-cache pool over shared (CXL) memory, from Python.

Serving processes of a rack map one shared region (a CXL memory pool; on one host a file in
/dev/shm) and share a prefix-aware KV cache through it, with loads, stores and DMA — no network
stack. This package moves KV blocks between that pool and torch tensors (or NumPy arrays and
buffers) with no copy beyond the transfer itself.

Quick start::

    import cxlkv, torch
    cxlkv.create_pool("/dev/shm/kv", 1 << 30, overwrite=True)
    with cxlkv.Pool("/dev/shm/kv", node_id=0) as pool:
        ns = pool.namespace("llama-3.1-8b", dtype=torch.float16, num_layers=32,
                            num_kv_heads=8, head_size=128, block_size=16)
        kv_caches = [torch.zeros(2, 1024, 16, 8, 128, dtype=torch.float16) for _ in range(32)]
        store = pool.register_kv_caches(ns, kv_caches, layout="flash_attn")
        keys = ns.keys_from_hashes(block_hashes)       # the engine's own block hashes
        store.put_many(keys, block_ids)                # engine blocks -> pool (cached ones skipped)
        n = store.exists_prefix(keys)                  # scheduler: no pins, no copies
        store.get_many_into(keys[:n], other_block_ids) # pool -> engine blocks

Objects: Pool (an opened pool), Namespace (a model's KV layout; keys live in one), KvStore
(an engine's registered paged tensors; CUDA tensors go through the CUDA transfer path where the
build has one, see cuda_built()), KvLoad and KvSave (layer-wise transfers in flight:
KvStore.start_get_many_into / start_put_many). Whole-block put/get for per-page host tensors
(SGLang's HiCache) are Pool.put and Pool.get.

Adapters: cxlkv.vllm.CxlKvConnector (vLLM's KVConnectorBase_V1), cxlkv.sglang.CxlKvHiCacheStorage
(SGLang's HiCache storage backend); cxlkv.mini_engine drives them in vLLM's call order;
``python -m cxlkv.bench`` measures this module against the C++ core. docs/integrations.md has
the details. Failures raise cxlkv.Error subclasses named after the
core's status codes (InvalidArgumentError is also a ValueError, NotFoundError a LookupError,
TimeoutError the builtin TimeoutError...), with the core's message saying what to do.
"""
from ._cxlkv import (AlreadyExistsError, BusyError, CorruptedError, Error, InternalError, InvalidArgumentError,
                     IoError, LeaseExpiredError, NoSpaceError, NotFoundError, NotSupportedError, PermissionDeniedError,
                     TimeoutError, UnavailableError, VersionMismatchError, cuda_built)
from .pool import LAYOUTS, KvLoad, KvSave, KvStore, Namespace, Pool, PutResult, create_pool, stat

__all__ = [
    "Pool", "Namespace", "KvStore", "KvLoad", "KvSave", "PutResult", "LAYOUTS", "create_pool", "stat", "cuda_built",
    "Error", "InvalidArgumentError", "NotFoundError", "AlreadyExistsError", "CorruptedError", "VersionMismatchError",
    "NoSpaceError", "PermissionDeniedError", "IoError", "BusyError", "TimeoutError", "NotSupportedError",
    "InternalError", "LeaseExpiredError", "UnavailableError",
]
