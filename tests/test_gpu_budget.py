"""benches/gpu_budget.py: a larger card held down to a smaller card's memory for the benches."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
import gpu_budget  # noqa: E402


def test_no_budget_holds_nothing():
    assert gpu_budget.hold_beyond(None) == 0


@pytest.mark.parametrize("gib", [0, -1.5])
def test_budget_must_be_positive(gib):
    with pytest.raises(ValueError, match="--gpu-gib must be positive"):
        gpu_budget.hold_beyond(gib)


@pytest.mark.cuda
def test_budget_holds_the_rest_of_the_card():
    torch.zeros(1, device="cuda")
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    used = total - free0
    budget = (used + (2 << 30)) / 2**30  # what is in use now plus 2 GiB
    try:
        held = gpu_budget.hold_beyond(budget)
        free, _ = torch.cuda.mem_get_info()
        assert abs(held - (free0 - (2 << 30))) < (1 << 20)  # what was free, less the 2 GiB left
        assert abs(free - (2 << 30)) < (64 << 20), free
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
        ok = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del ok
    finally:
        gpu_budget.release()
        torch.cuda.empty_cache()
    free1, _ = torch.cuda.mem_get_info()
    assert abs(free1 - free0) < (64 << 20)


@pytest.mark.cuda
def test_budget_larger_than_the_card_holds_nothing():
    _, total = torch.cuda.mem_get_info()
    assert gpu_budget.hold_beyond(total / 2**30 + 1) == 0
