"""``python -m cxlkv.bench [--json] [--quick] [--reps N]``: the Python module's cost over the C++ core.

Figures, each next to the C++ figure of ``cxlkv bench cache`` measured in the same run on the
same machine (the CLI is run as a subprocess: ``$CXLKV_CLI`` or the build tree's):

* ``py_put/2MiB``  Pool.put of one 2 MiB block per call (reserve + copy + commit) vs C++ put/2MiB
* ``py_get/2MiB``  Pool.get of one 2 MiB block per call (lookup + copy + release) vs C++ get/2MiB
* ``py_exists_prefix/chain256``  exists_prefix of a 256-block chain, ns per block, vs C++ probe_only
* ``py_put_many`` / ``py_get_many_into``  a registered Llama-8B-shaped engine (32 layers, 8 KV
  heads, head size 128, fp16, 16-token blocks: 2 MiB a block), 16 blocks per call, vs the C++
  non-temporal copy into the pool and memcpy out of it

Goal: put and get from Python >= 0.9 of the C++ figures. Medians of several
repetitions; ratios with ``higher_is_better``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import numpy as np

from . import Pool, create_pool

BLOCK = 2 << 20


def _cli() -> str:
    path = os.environ.get("CXLKV_CLI")
    if path:
        return path
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = glob.glob(os.path.join(repo, "build", "*", "tools", "cxlkv", "cxlkv"))
    if found:
        return max(found, key=os.path.getmtime)  # the newest build
    raise SystemExit("cxlkv.bench: the cxlkv CLI is not found: build it (scripts/build) or set CXLKV_CLI")


def _cxx_figures(reps: int, quick: bool, workdir: str) -> Dict[str, dict]:
    cmd = [_cli(), "bench", "cache", "--json", "--reps", str(reps), "--workdir", workdir]
    if quick:
        cmd.append("--quick")
    doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900).stdout)
    return {r["name"]: r for r in doc["results"]}


def _figure(name: str, unit: str, higher: bool, samples: List[float], reference: str,
            ref: Optional[dict], note: str) -> dict:
    median = statistics.median(samples)
    ref_median = ref["median"] if ref else None
    ratio = None
    if ref_median:
        ratio = median / ref_median if higher else ref_median / median
    return {"name": name, "unit": unit, "higher_is_better": True if ref_median else higher, "median": median,
            "samples": samples, "reference": reference, "reference_median": ref_median, "ratio": ratio, "note": note}


def run(reps: int = 5, quick: bool = False, workdir: str = "/dev/shm") -> dict:
    blocks = 8 if quick else 48
    path = os.path.join(workdir, f"cxlkv-bench-python-{os.getpid()}")
    create_pool(path, (128 if quick else 512) << 20, max_nodes=2, overwrite=True)
    results = []
    try:
        with Pool(path, node_id=0) as pool:
            ns = pool.namespace("bench-python", dtype="fp16")  # block size left open, as the C++ bench
            src = [np.frombuffer(np.random.default_rng(b).bytes(BLOCK), dtype=np.uint8) for b in range(blocks)]
            dst = np.empty(BLOCK, dtype=np.uint8)
            keys = ns.chain_keys(np.arange(16 * blocks, dtype=np.int32) + 99)
            put, get = [], []
            for _ in range(reps):
                pool.evict_all()
                t0 = time.perf_counter()
                for b in range(blocks):
                    pool.put(ns, keys[b:b + 1], [src[b]])
                put.append(blocks * BLOCK / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                for b in range(blocks):
                    if pool.get(ns, keys[b:b + 1], [dst]) != 1:
                        raise RuntimeError("cxlkv.bench: a block did not hit")
                get.append(blocks * BLOCK / (time.perf_counter() - t0) / 1e9)
                if not np.array_equal(dst, src[-1]):
                    raise RuntimeError("cxlkv.bench: read back wrong bytes")
            # The scheduler's question over a 256-block chain of small blocks.
            chain = pool.namespace("bench-python-chain", dtype="fp16")
            ckeys = chain.chain_keys(np.arange(256 * 16, dtype=np.int32))
            pool.put(chain, ckeys, [np.zeros(64, np.uint8)] * 256)
            iters = 20 if quick else 200
            probe = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(iters):
                    if pool.exists_prefix(chain, ckeys) != 256:
                        raise RuntimeError("cxlkv.bench: the chain did not hit in full")
                probe.append((time.perf_counter() - t0) * 1e9 / (iters * 256))
            # A registered engine, Llama-8B shaped: 2 MiB a block, 16 blocks per call.
            import torch

            pool.evict_all()
            layers, per_call = 32, 16
            engine_blocks = 2 * per_call
            eng = pool.namespace("bench-llama8b", dtype=torch.float16, num_layers=layers, num_kv_heads=8,
                                 head_size=128, block_size=16)
            a = [torch.randn(2, engine_blocks, 16, 8, 128).half() for _ in range(layers)]
            b = [torch.zeros_like(t) for t in a]
            sa = pool.register_kv_caches(eng, a)
            sb = pool.register_kv_caches(eng, b)
            put_many, get_many = [], []
            for r in range(reps):
                pool.evict_all()
                ekeys = eng.keys_from_hashes([f"{r}-{i}".encode() for i in range(per_call)])
                ids = list(range(per_call))
                t0 = time.perf_counter()
                if sa.put_many(ekeys, ids).written != per_call:
                    raise RuntimeError("cxlkv.bench: put_many wrote less than asked")
                put_many.append(per_call * eng.block_bytes / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                if sb.get_many_into(ekeys, [per_call + i for i in ids]) != per_call:
                    raise RuntimeError("cxlkv.bench: get_many_into loaded less than asked")
                get_many.append(per_call * eng.block_bytes / (time.perf_counter() - t0) / 1e9)
            if not torch.equal(b[5][:, per_call:], a[5][:, :per_call]):
                raise RuntimeError("cxlkv.bench: get_many_into read back wrong bytes")
    finally:
        if os.path.exists(path):
            os.unlink(path)
    cxx = _cxx_figures(reps, quick, workdir)
    results.append(_figure("py_put/2MiB", "GB/s", True, put, "C++ put/2MiB", cxx.get("put/2MiB"),
                           "Pool.put of one 2 MiB block per call; goal >= 0.9 of the C++ figure"))
    results.append(_figure("py_get/2MiB", "GB/s", True, get, "C++ get/2MiB", cxx.get("get/2MiB"),
                           "Pool.get of one 2 MiB block per call; goal >= 0.9 of the C++ figure"))
    results.append(_figure("py_exists_prefix/chain256", "ns/block", False, probe, "C++ probe_only/chain256",
                           cxx.get("probe_only/chain256"), "exists_prefix of a 256-block chain, per block"))
    results.append(_figure("py_put_many/llama8b", "GB/s", True, put_many, "C++ nt_copy/2MiB",
                           cxx.get("nt_copy/2MiB"), "KvStore.put_many, 16 blocks of 2 MiB per call"))
    results.append(_figure("py_get_many_into/llama8b", "GB/s", True, get_many, "C++ memcpy_out/2MiB",
                           cxx.get("memcpy_out/2MiB"), "KvStore.get_many_into, 16 blocks of 2 MiB per call"))
    return {"suite": "python", "repetitions": reps, "blocks": blocks,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "node": platform.node()},
            "results": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cxlkv.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--quick", action="store_true", help="small sizes, 2 repetitions: a smoke run")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per figure (the median is reported)")
    ap.add_argument("--workdir", default="/dev/shm", help="where the pool file goes")
    a = ap.parse_args(argv)
    report = run(2 if a.quick else a.reps, a.quick, a.workdir)
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'figure':32} {'median':>10} {'unit':9} {'reference':26} {'ref median':>10} {'ratio':>6}")
    for r in report["results"]:
        ref = f"{r['reference_median']:.2f}" if r["reference_median"] is not None else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(f"{r['name']:32} {r['median']:10.2f} {r['unit']:9} {r['reference']:26} {ref:>10} {ratio:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
