"""A GPU memory budget for the benches: the memory of a larger card held back, so that a run on
an H200 (141 GB) sees what an 80 GB H100 has, and a bench that would run out of memory there
runs out here too.

The rest of the card is taken with one ``cuMemAlloc`` through the CUDA driver, outside torch's
caching allocator: ``torch.cuda.mem_get_info`` and the native library's own allocations then see
the smaller card, and ``torch.cuda.max_memory_allocated`` does not count what is held. What the
process already uses (its CUDA context) counts against the budget, as it would on the smaller
card. ``get_device_properties().total_memory`` still reports the whole card, so the shares that
forge sizes from the total (the 15 % kept free for the expert solves) come out larger than on
the smaller card: the emulation errs toward less room, not more.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_held: list[int] = []  # device pointers kept for the life of the process


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def hold_beyond(gib: float | None) -> int:
    """Holds all of the current device's memory beyond ``gib`` GiB of its total; returns the
    bytes held (0 when the card is no larger, or ``gib`` is None)."""
    if gib is None:
        return 0
    if gib <= 0:
        raise ValueError(f"--gpu-gib must be positive, got {gib}")
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    free, total = torch.cuda.mem_get_info()
    hold = total - int(gib * 2**30)
    if hold <= 0:
        return 0
    if hold > free:
        raise RuntimeError(
            f"cannot hold the GPU down to {gib} GiB: {hold} bytes to hold but only {free} free "
            f"of {total} (another process uses the card?)"
        )
    ptr = ctypes.c_uint64(0)
    rc = _driver().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(hold))
    if rc != 0:
        raise RuntimeError(
            f"cuMemAlloc of {hold} bytes (holding the GPU down to {gib} GiB) failed: CUDA error {rc}"
        )
    _held.append(ptr.value)
    free_after, _ = torch.cuda.mem_get_info()
    print(
        f"GPU budget {gib} GiB: {hold / 2**30:.1f} GiB of {total / 2**30:.1f} held back, "
        f"{free_after / 2**30:.1f} GiB free",
        flush=True,
    )
    return hold


def release() -> None:
    """Frees what ``hold_beyond`` holds."""
    while _held:
        rc = _driver().cuMemFree_v2(ctypes.c_uint64(_held.pop()))
        if rc != 0:
            raise RuntimeError(f"cuMemFree of the held GPU memory failed: CUDA error {rc}")


def add_argument(ap) -> None:
    """The benches' ``--gpu-gib`` option."""
    ap.add_argument(
        "--gpu-gib",
        type=float,
        default=None,
        help="hold back all GPU memory beyond this many GiB of the card's total, to check on a "
        "larger card that the bench fits a smaller one (an 80 GB H100 has 79.1 GiB)",
    )
