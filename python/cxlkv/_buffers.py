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


def describe(obj: Any, *, writable: bool, what: str, with_dtype: bool = False) -> Described:
    """Address and size of `obj`'s bytes, or a clear cxlkv error saying what is wrong with it.
    ``with_dtype``: also cxlkv's dtype code of its elements (None where it has none)."""
    if _torch_tensor(obj):
        if obj.device.type != "cpu":
            raise _cxlkv.NotSupportedError(
                f"{what} is a {obj.device.type} tensor: this module moves CPU tensors (engines stage GPU KV "
                f"through pinned host buffers; the CUDA transfer path is the C++ CudaTransfer)")
        if not obj.is_contiguous():
            raise _cxlkv.InvalidArgumentError(f"{what} is not contiguous: pass tensor.contiguous()")
        code = _code_or_none(obj.dtype) if with_dtype else None
        return Described(obj.data_ptr(), obj.numel() * obj.element_size(), tuple(obj.shape), code,
                         obj.element_size(), obj)
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
