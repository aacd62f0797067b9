"""Linear layers whose CPU matmuls run on numpy's BLAS (``model.cpu_matmul=numpy``).

PyTorch's CPU wheels multiply float32 matrices with Intel MKL. On AMD processors MKL's
sgemm is slower than the OpenBLAS that numpy's wheels carry: on this project's 2-core AMD
EPYC VMs, one thread, the training products of a 25M Llama at 1152 tokens run at 75–80
GFLOP/s through ``torch.mm`` and at 82–85 through ``numpy.matmul``, 6–12 % faster
(``benchmarks/cpu_matmul.py``). Matmuls are ~80 % of a PPO iteration at that size, so the
library that multiplies is worth a switch. For a handful of rows (sampling: one token per
sequence) MKL is the faster one, so below :data:`MIN_ROWS` rows the layer keeps
``torch``'s path.

The layers are the same ``nn.Linear`` modules with another ``forward`` (their class is
swapped in place, parameters and state-dict names unchanged). Forward and backward are the
same three products autograd runs for a Linear — ``x·Wᵀ``, ``g·W`` and ``gᵀ·x`` — written
into tensors PyTorch allocates; nothing is recomputed and autograd keeps the same input.
Results equal torch's to float rounding (another summation order), not bit for bit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

import torch
from torch import nn

from rlhflab.config.base import ConfigError

log = logging.getLogger(__name__)

# fewer rows than this (sampling's one token per sequence) stay on torch.mm, which is
# faster there (benchmarks/cpu_matmul.py); more go to numpy's BLAS
MIN_ROWS = 64
DTYPES = (torch.float32, torch.float64)


class _ArrayInterface:
    """Describes a tensor's memory to numpy (``__array_interface__``, version 3)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, t: torch.Tensor):
        self.__array_interface__ = {
            "version": 3,
            "shape": tuple(t.shape),
            "typestr": _TYPESTR[t.dtype],
            "data": (t.data_ptr(), False),
            "strides": tuple(s * t.element_size() for s in t.stride()),
        }


# numpy's type strings, spelled out so that importing this module does not import numpy
# (only a run with model.cpu_matmul=numpy multiplies through it)
_ENDIAN = "<" if sys.byteorder == "little" else ">"
_TYPESTR = {torch.float32: _ENDIAN + "f4", torch.float64: _ENDIAN + "f8"}


def _ndarray(t: torch.Tensor):
    """A numpy view of CPU tensor ``t``'s memory, valid while ``t`` lives.

    Not ``t.numpy()``: that marks the tensor's storage as not resizable for good, and
    FSDP2 frees a gathered weight by resizing its storage to zero after each forward
    ("Trying to resize storage that is not resizable" under ``dist.strategy: fsdp``)."""
    import numpy as np  # imported once, on the first numpy matmul

    return np.asarray(_ArrayInterface(t))


def numpy_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) → (M, N) through ``numpy.matmul`` into a torch-allocated tensor.

    Both operands on the CPU in one of :data:`DTYPES`; transposed views pass to BLAS as
    they are (numpy hands their layout to gemm), other strides are copied first. The
    operands' storages are left as they were (see :func:`_ndarray`).
    """
    import numpy as np

    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    np.matmul(_ndarray(a.detach()), _ndarray(b.detach()), out=_ndarray(out))
    return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def numpy_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x (..., K)·Wᵀ + b → (..., N) through :func:`numpy_mm`, outside autograd (the
    forward of :class:`_NumpyLinearFn` and of lean.py's fused SwiGLU down projection)."""
    y = numpy_mm(_flat(x), weight.t())
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], weight.shape[0])


class _NumpyLinearFn(torch.autograd.Function):
    """y = x·Wᵀ + b for x (..., K), W (N, K), b (N,) or None; keeps x and W, as torch's
    Linear does, and returns the three gradients from two products and a sum."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return numpy_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = _flat(grad)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = numpy_mm(g, weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = numpy_mm(g.t(), _flat(x))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


def takes_numpy_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a Linear product of x (..., K) with W goes to numpy's BLAS."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and type(weight.data) is torch.Tensor  # not a DTensor shard or a quantised weight
        and x.numel() >= MIN_ROWS * x.shape[-1]
        and not torch.is_autocast_enabled("cpu")
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with the product on numpy's BLAS where :func:`takes_numpy_path`."""
    if takes_numpy_path(x, weight):
        return _NumpyLinearFn.apply(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


class NumpyBlasLinear(nn.Linear):
    """An ``nn.Linear`` whose large CPU products run on numpy's BLAS (see the module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_numpy_blas(model: nn.Module) -> int:
    """Give every plain ``nn.Linear`` of ``model`` the numpy-BLAS forward, in place (same
    parameters, same state-dict keys). Quantised, LoRA or other Linear subclasses are left
    as they are. Returns how many layers were switched."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = NumpyBlasLinear
            n += 1
    return n


_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
    "MKL_Set_Num_Threads",
)


def set_numpy_blas_threads(n: int) -> bool:
    """Ask the BLAS library numpy loaded to use ``n`` threads, as torch does; True when a
    known library answered. Reads ``/proc/self/maps`` (Linux); elsewhere the library
    follows its own environment (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``)."""
    import numpy  # noqa: F401 - loads the BLAS library this looks for

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "blas" in line.lower() and ".so" in line}
    except OSError:
        return False
    for path in sorted(paths):
        if not os.path.exists(path):
            continue
        lib = ctypes.CDLL(path)
        for name in _SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                return True
    return False


def apply_cpu_matmul(choice: str, device, models) -> int:
    """``model.cpu_matmul`` for ``models`` (nn.Modules; None and non-modules are skipped).
    Returns how many Linear layers now multiply on numpy's BLAS."""
    if choice == "torch":
        return 0
    if choice != "numpy":
        raise ConfigError(f"model.cpu_matmul: {choice!r} is not one of ['torch', 'numpy']")
    if torch.device(device).type != "cpu":
        raise ConfigError(
            f"model.cpu_matmul: 'numpy' multiplies on the CPU, and this run's device is "
            f"{device}; use 'torch'"
        )
    n = sum(use_numpy_blas(m) for m in models if isinstance(m, nn.Module))
    if not set_numpy_blas_threads(torch.get_num_threads()):
        log.warning(
            "model.cpu_matmul=numpy: could not set numpy's BLAS thread count; it follows "
            "OPENBLAS_NUM_THREADS / OMP_NUM_THREADS"
        )
    return n
