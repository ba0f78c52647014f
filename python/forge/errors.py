"""Exceptions raised by 4bit-forge. One place, one hierarchy.

Every error is a :class:`ForgeError`; each also subclasses the built-in exception a Python
user would expect (``ValueError`` for bad values and shapes, ``TypeError`` for wrong types,
``RuntimeError`` for kernel failures), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "ForgeError",
    "ShapeError",
    "InvalidValueError",
    "DTypeError",
    "DeviceError",
    "HessianError",
    "CheckpointError",
    "KernelError",
    "CudaUnavailableError",
]


class ForgeError(Exception):
    """Base class of every 4bit-forge error."""


class ShapeError(ForgeError, ValueError):
    """A tensor has the wrong shape, or a size does not divide (group size, pack factor)."""


class InvalidValueError(ForgeError, ValueError):
    """A parameter is out of range, or an input holds NaN/Inf."""


class DTypeError(ForgeError, TypeError):
    """An argument has the wrong type or an unsupported dtype."""


class DeviceError(ForgeError, ValueError):
    """Tensors are on the wrong device, or on different devices."""


class HessianError(ForgeError, ValueError):
    """The Hessian cannot be factorised even after extra damping."""


class CheckpointError(ForgeError, ValueError):
    """A checkpoint on disk is missing, corrupt, truncated or inconsistent."""


class KernelError(ForgeError, RuntimeError):
    """A native kernel failed (an internal error; please report it)."""


class CudaUnavailableError(ForgeError, RuntimeError):
    """A CUDA path was requested but no usable GPU, driver or NVRTC was found."""
