"""Device memory for the capacity-layout decoders (:mod:`dspark_runtime.backends.device_decoder`): allocation, pinned
host buffers, asynchronous copies on one stream, and the strided copies that write new K/V into the cache, behind one
interface (:class:`DeviceMemory`) with two implementations. :class:`CudaMemory`: an NVIDIA GPU through cuda-python
(``cuda.bindings.runtime``; no torch): ``cudaMalloc``, pinned ``cudaHostAlloc`` buffers, one non-blocking stream,
``cudaMemcpy{,2D,3D}Async``. :class:`HostMemory`: the same calls on numpy host buffers, copies done at once, so the
decoders' buffer planning, bindings and cache writes run without a GPU (the CPU tests). Pointers are plain ints;
sizes and offsets are bytes.
"""
from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod

import numpy as np

from dspark_runtime.errors import DSparkError


def cuda_runtime():
    """``cuda.bindings.runtime`` (cuda-python). Raises DSparkError naming the install when it is missing."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as e:
        raise DSparkError(f"the GPU backends need cuda-python ({e}); pip install 'cuda-python>=13,<14' "
                          "(the `cuda` or `trt` extra)") from e
    return cudart


def cuda_check(res, what: str):
    """Unpack a cuda-python result tuple; raise DSparkError naming the call on an error."""
    cudart = cuda_runtime()
    err, *rest = res if isinstance(res, tuple) else (res,)
    if err != cudart.cudaError_t.cudaSuccess:
        _, msg = cudart.cudaGetErrorString(err)
        raise DSparkError(f"CUDA {what} failed: {err.name} ({msg.decode() if isinstance(msg, bytes) else msg})")
    return rest[0] if len(rest) == 1 else (rest or None)


class DeviceMemory(ABC):
    """Buffers and copies on one device and one stream (the module docstring).

    ``device_type`` / ``device_id``: how ONNX Runtime's IOBinding names the device ("cuda", 0 / "cpu", 0);
    ``stream``: the stream handle as an int (0 on the host)."""

    device_type: str
    device_id: int = 0
    stream: int = 0

    @abstractmethod
    def malloc(self, nbytes: int) -> int:
        """A device buffer of ``nbytes`` (contents undefined)."""

    @abstractmethod
    def free(self, ptr: int) -> None:
        """Free a buffer of :meth:`malloc`."""

    @abstractmethod
    def zero(self, ptr: int, nbytes: int) -> None:
        """Set ``nbytes`` bytes at device address ``ptr`` to 0 (asynchronous)."""

    @abstractmethod
    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A uint8 host buffer of ``nbytes`` that asynchronous copies may use (pinned on a GPU)."""

    @abstractmethod
    def free_host(self, buf: np.ndarray) -> None:
        """Free a buffer of :meth:`host_buffer`."""

    @abstractmethod
    def to_device(self, dst: int, src: np.ndarray) -> None:
        """Copy the bytes of ``src`` (a view of a :meth:`host_buffer`) to device address ``dst`` (asynchronous)."""

    @abstractmethod
    def to_host(self, dst: np.ndarray, src: int) -> None:
        """Copy ``dst.nbytes`` bytes from device address ``src`` into ``dst`` (a view of a :meth:`host_buffer`;
        asynchronous: read it after :meth:`synchronize`)."""

    @abstractmethod
    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        """Device to device: ``height`` rows of ``width`` bytes, rows ``spitch`` / ``dpitch`` bytes apart."""

    @abstractmethod
    def copy_3d(self, dst: int, dpitch: int, dslice: int, src: int, spitch: int, sslice: int, width: int,
                height: int, depth: int) -> None:
        """Device to device: ``depth`` slices of ``height`` rows of ``width`` bytes; rows ``spitch`` / ``dpitch``
        bytes apart, slices ``sslice`` / ``dslice`` bytes apart (each a multiple of its pitch)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for every copy and kernel issued on the stream."""

    @abstractmethod
    def close(self) -> None:
        """Release the stream (buffers are freed by their owners first)."""


class CudaMemory(DeviceMemory):
    """:class:`DeviceMemory` on CUDA device ``device_id`` with a non-blocking stream of its own. Raises DSparkError
    when cuda-python or a GPU is missing."""

    device_type = "cuda"

    def __init__(self, device_id: int = 0):
        cudart = cuda_runtime()
        self._rt = cudart
        n = cuda_check(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
        if device_id >= n:
            raise DSparkError(f"CUDA device {device_id} does not exist ({n} visible)")
        cuda_check(cudart.cudaSetDevice(device_id), "cudaSetDevice")
        self.device_id = device_id
        self._stream = cuda_check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking), "cudaStreamCreate")
        self.stream = int(self._stream)
        self.handle = self._stream  # the cudaStream_t object, for cuda-python calls by the decoders
        self._host: dict = {}  # pinned buffer address -> pointer
        k = cudart.cudaMemcpyKind
        self._h2d, self._d2h, self._d2d = (k.cudaMemcpyHostToDevice, k.cudaMemcpyDeviceToHost,
                                           k.cudaMemcpyDeviceToDevice)

    def malloc(self, nbytes: int) -> int:
        return int(cuda_check(self._rt.cudaMalloc(max(int(nbytes), 1)), f"cudaMalloc({nbytes} bytes)"))

    def free(self, ptr: int) -> None:
        self._rt.cudaFree(ptr)

    def zero(self, ptr: int, nbytes: int) -> None:
        cuda_check(self._rt.cudaMemsetAsync(ptr, 0, nbytes, self._stream), "cudaMemsetAsync")

    def host_buffer(self, nbytes: int) -> np.ndarray:
        n = max(int(nbytes), 1)
        ptr = int(cuda_check(self._rt.cudaHostAlloc(n, self._rt.cudaHostAllocDefault), f"cudaHostAlloc({n})"))
        buf = np.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=np.uint8)
        self._host[buf.ctypes.data] = ptr
        return buf

    def free_host(self, buf: np.ndarray) -> None:
        ptr = self._host.pop(buf.ctypes.data, None)
        if ptr is not None:
            self._rt.cudaFreeHost(ptr)

    def to_device(self, dst: int, src: np.ndarray) -> None:
        cuda_check(self._rt.cudaMemcpyAsync(dst, src.ctypes.data, src.nbytes, self._h2d, self._stream),
                   "cudaMemcpyAsync (host to device)")

    def to_host(self, dst: np.ndarray, src: int) -> None:
        cuda_check(self._rt.cudaMemcpyAsync(dst.ctypes.data, src, dst.nbytes, self._d2h, self._stream),
                   "cudaMemcpyAsync (device to host)")

    def copy_2d(self, dst, dpitch, src, spitch, width, height) -> None:
        cuda_check(self._rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, self._d2d, self._stream),
                   "cudaMemcpy2DAsync")

    def copy_3d(self, dst, dpitch, dslice, src, spitch, sslice, width, height, depth) -> None:
        rt = self._rt
        p = rt.cudaMemcpy3DParms()
        p.srcPtr = rt.make_cudaPitchedPtr(src, spitch, width, sslice // spitch)
        p.dstPtr = rt.make_cudaPitchedPtr(dst, dpitch, width, dslice // dpitch)
        p.srcPos = rt.make_cudaPos(0, 0, 0)
        p.dstPos = rt.make_cudaPos(0, 0, 0)
        p.extent = rt.make_cudaExtent(width, height, depth)
        p.kind = self._d2d
        cuda_check(rt.cudaMemcpy3DAsync(p, self._stream), "cudaMemcpy3DAsync")

    def synchronize(self) -> None:
        cuda_check(self._rt.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def close(self) -> None:
        for ptr in self._host.values():
            self._rt.cudaFreeHost(ptr)
        self._host.clear()
        if self._stream is not None:
            self._rt.cudaStreamDestroy(self._stream)
            self._stream = None


class HostMemory(DeviceMemory):
    """:class:`DeviceMemory` on host memory (the CPU stand-in): buffers are numpy arrays held here, copies happen
    at once."""

    device_type = "cpu"

    def __init__(self):
        self._bufs: dict = {}  # address -> array (keeps it alive)

    def malloc(self, nbytes: int) -> int:
        a = np.empty(max(int(nbytes), 1), np.uint8)
        self._bufs[a.ctypes.data] = a
        return a.ctypes.data

    def free(self, ptr: int) -> None:
        self._bufs.pop(ptr, None)

    def zero(self, ptr: int, nbytes: int) -> None:
        ctypes.memset(ptr, 0, nbytes)

    def host_buffer(self, nbytes: int) -> np.ndarray:
        return np.empty(max(int(nbytes), 1), np.uint8)

    def free_host(self, buf: np.ndarray) -> None:
        pass

    def to_device(self, dst: int, src: np.ndarray) -> None:
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)

    def to_host(self, dst: np.ndarray, src: int) -> None:
        ctypes.memmove(dst.ctypes.data, src, dst.nbytes)

    def copy_2d(self, dst, dpitch, src, spitch, width, height) -> None:
        if dst == src and dpitch == spitch:
            return
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    def copy_3d(self, dst, dpitch, dslice, src, spitch, sslice, width, height, depth) -> None:
        for z in range(depth):
            self.copy_2d(dst + z * dslice, dpitch, src + z * sslice, spitch, width, height)

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self._bufs.clear()
