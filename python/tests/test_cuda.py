"""GPU memory through the CUDA transfer path: a round trip where a GPU is usable (memory from
the CUDA runtime, handed over by the CUDA array interface, as CuPy and CUDA torch tensors do);
elsewhere registration is refused with the reason, and whole-block put/get refuse GPU memory."""
import ctypes
import glob

import numpy as np
import pytest

import cxlkv


def cudart():
    for path in sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*")) + ["libcudart.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class DeviceArray:
    """GPU memory behind the CUDA array interface (what CuPy, Numba and torch expose)."""

    def __init__(self, rt, shape, typestr, address=None):
        self.rt, self.shape, self.typestr = rt, tuple(shape), typestr
        self.nbytes = int(np.prod(shape)) * np.dtype(typestr).itemsize
        if address is None:
            ptr = ctypes.c_void_p()
            if rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(self.nbytes)) != 0:
                raise RuntimeError("cudaMalloc failed")
            address = ptr.value
        self.address = address
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": typestr, "data": (address, False),
                                         "strides": None, "version": 3}

    def copy_from(self, host):
        assert self.rt.cudaMemcpy(ctypes.c_void_p(self.address), host.ctypes.data_as(ctypes.c_void_p),
                                  ctypes.c_size_t(self.nbytes), 1) == 0  # host to device

    def to_host(self):
        out = np.empty(self.shape, np.dtype(self.typestr))
        assert self.rt.cudaMemcpy(out.ctypes.data_as(ctypes.c_void_p), ctypes.c_void_p(self.address),
                                  ctypes.c_size_t(self.nbytes), 2) == 0  # device to host
        return out


def usable_gpu(rt):
    if rt is None or not cxlkv.cuda_built():
        return False
    count = ctypes.c_int(0)
    return rt.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0


def test_gpu_tensors_round_trip_or_are_refused_with_the_reason(pool):
    ns = pool.namespace("gpu", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, block_size=16)
    shape = (2, 8, 16, 2, 64)
    rt = cudart()
    if not usable_gpu(rt):
        fake = [DeviceArray(rt, shape, "<f2", address=0x10000) for _ in range(2)]
        with pytest.raises(cxlkv.NotSupportedError, match="CUDA"):
            pool.register_kv_caches(ns, fake)
        with pytest.raises(cxlkv.NotSupportedError, match="put/get take host memory"):
            pool.put(ns, ns.keys_from_hashes([b"k"]), [fake[0]])
        with pytest.raises(cxlkv.InvalidArgumentError, match="all on one device"):
            pool.register_kv_caches(ns, [fake[0], np.zeros(shape, np.float16)])
        return
    rng = np.random.default_rng(3)
    host = [rng.standard_normal(shape).astype(np.float16) for _ in range(2)]
    src = [DeviceArray(rt, shape, "<f2") for _ in range(2)]
    dst = [DeviceArray(rt, shape, "<f2") for _ in range(2)]
    for d, h in zip(src, host):
        d.copy_from(h)
    for d in dst:
        d.copy_from(np.zeros(shape, np.float16))
    a, b = pool.register_kv_caches(ns, src), pool.register_kv_caches(ns, dst)
    keys = ns.keys_from_hashes([b"g0", b"g1", b"g2"])
    assert a.put_many(keys, [7, 0, 3]) == cxlkv.PutResult(3, 0)
    assert b.get_many_into(keys, [1, 2, 4]) == 3
    for layer in range(2):
        back = dst[layer].to_host()
        assert np.array_equal(back[:, [1, 2, 4]], host[layer][:, [7, 0, 3]])
    for arr in src + dst:
        rt.cudaFree(ctypes.c_void_p(arr.address))
