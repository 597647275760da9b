"""What the native module needs to know of a tensor or buffer: its address, size, shape and dtype.

Checked here, once, so the native side only moves bytes: a CPU torch tensor (contiguous), a
NumPy array (C-contiguous), or any object with the buffer protocol (bytes for reading,
bytearray/memoryview for writing). The returned ``keep`` must stay referenced while the address
is used.
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from . import _cxlkv

# cxlkv's dtype codes (cxlkv::KvDtype): 0 fp16, 1 bf16, 2 fp8, 3 fp32.
FP16, BF16, FP8, FP32 = 0, 1, 2, 3
DTYPE_NAMES = {FP16: "float16", BF16: "bfloat16", FP8: "float8", FP32: "float32"}
DTYPE_BYTES = {FP16: 2, BF16: 2, FP8: 1, FP32: 4}
_BY_NAME = {
    "float16": FP16, "fp16": FP16, "half": FP16,
    "bfloat16": BF16, "bf16": BF16,
    "float8": FP8, "fp8": FP8, "float8_e4m3fn": FP8, "float8_e5m2": FP8, "uint8": FP8,
    "float32": FP32, "fp32": FP32, "float": FP32,
}


class Described(NamedTuple):
    address: int
    nbytes: int
    shape: Tuple[int, ...]
    dtype: Optional[int]  # cxlkv's code, or None when the element type is not a KV dtype
    itemsize: int
    keep: Any
    device: Optional[int] = None  # the CUDA device of GPU memory; None: host memory


def dtype_code(dtype: Any) -> int:
    """cxlkv's code for a torch dtype, a NumPy dtype or a name ("float16", "bf16", "fp8"...)."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    elif not isinstance(dtype, str):
        try:
            name = np.dtype(dtype).name  # np.float16, np.dtype("float32")...
        except TypeError:
            pass
    if name in _BY_NAME:
        return _BY_NAME[name]
    raise _cxlkv.InvalidArgumentError(
        f"dtype {dtype!r} is not a KV dtype cxlkv stores: use float16, bfloat16, float8 (e4m3fn/e5m2, or uint8 "
        f"storage) or float32")


def _code_or_none(dtype: Any) -> Optional[int]:
    try:
        return dtype_code(dtype)
    except _cxlkv.InvalidArgumentError:
        return None


def _torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def describe(obj: Any, *, writable: bool, what: str, with_dtype: bool = False, allow_device: bool = False) -> Described:
    """Address and size of `obj`'s bytes, or a clear cxlkv error saying what is wrong with it.
    ``with_dtype``: also cxlkv's dtype code of its elements (None where it has none).
    ``allow_device``: GPU memory is accepted (a CUDA torch tensor, or any object with
    ``__cuda_array_interface__``: CuPy, Numba...), with its device in ``device``."""
    if _torch_tensor(obj):
        kind = obj.device.type
        if kind != "cpu" and not (allow_device and kind == "cuda"):
            raise _cxlkv.NotSupportedError(
                f"{what} is a {kind} tensor: " + ("register GPU tensors with Pool.register_kv_caches (the CUDA "
                                                  "transfer path); whole-block put/get take host memory"
                                                  if kind == "cuda" else "cxlkv moves CPU and CUDA tensors"))
        if not obj.is_contiguous():
            raise _cxlkv.InvalidArgumentError(f"{what} is not contiguous: pass tensor.contiguous()")
        code = _code_or_none(obj.dtype) if with_dtype else None
        device = (obj.device.index or 0) if kind == "cuda" else None
        return Described(obj.data_ptr(), obj.numel() * obj.element_size(), tuple(obj.shape), code,
                         obj.element_size(), obj, device)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if not allow_device:
            raise _cxlkv.NotSupportedError(f"{what} is GPU memory: register GPU tensors with "
                                           f"Pool.register_kv_caches; whole-block put/get take host memory")
        return _describe_cuda_array(obj, cai, writable, what, with_dtype)
    if isinstance(obj, np.ndarray):
        arr = obj
    else:
        try:
            view = memoryview(obj)
        except TypeError:
            raise _cxlkv.InvalidArgumentError(
                f"{what} is a {type(obj).__name__}: pass a torch.Tensor, a NumPy array or a buffer "
                f"(bytes, bytearray, memoryview)") from None
        if not view.c_contiguous:
            raise _cxlkv.InvalidArgumentError(f"{what} is not C-contiguous")
        arr = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
        if writable and view.readonly:
            raise _cxlkv.InvalidArgumentError(f"{what} is read-only: pass a bytearray, a writable array or tensor")
    if not arr.flags.c_contiguous:
        raise _cxlkv.InvalidArgumentError(f"{what} is not C-contiguous: pass np.ascontiguousarray(...)")
    if writable and not arr.flags.writeable:
        raise _cxlkv.InvalidArgumentError(f"{what} is read-only: pass a writable array")
    code = _code_or_none(arr.dtype) if with_dtype else None
    return Described(arr.__array_interface__["data"][0], arr.nbytes, tuple(arr.shape), code, arr.itemsize, (obj, arr))


def _describe_cuda_array(obj: Any, cai: dict, writable: bool, what: str, with_dtype: bool) -> Described:
    """The CUDA array interface (version 2 and later): data (address, read-only), shape, typestr,
    strides (None: C-contiguous). Its device is the current CUDA device; cxlkv takes device 0
    unless the object names one in a ``device`` attribute holding an int."""
    address, readonly = cai["data"]
    if writable and readonly:
        raise _cxlkv.InvalidArgumentError(f"{what} is read-only GPU memory")
    shape = tuple(int(x) for x in cai["shape"])
    dt = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    if strides is not None:
        expect, step = [], dt.itemsize
        for dim in reversed(shape):
            expect.append(step)
            step *= dim
        if tuple(strides) != tuple(reversed(expect)):
            raise _cxlkv.InvalidArgumentError(f"{what} is not C-contiguous GPU memory")
    nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
    code = _code_or_none(dt) if with_dtype else None
    device = getattr(obj, "device", 0)
    return Described(int(address), nbytes, shape, code, dt.itemsize, obj, device if isinstance(device, int) else 0)
