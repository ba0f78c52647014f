"""The benches' command lines: ``--shapes`` of benches/bench_cuda.py and ab_gemm.py."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
import bench_cuda  # noqa: E402


def test_shapes_are_k_by_n_pairs():
    assert bench_cuda.parse_shapes("4096x14336") == [(4096, 14336)]
    assert bench_cuda.parse_shapes("7168x2048, 2048X7168") == [(7168, 2048), (2048, 7168)]


@pytest.mark.parametrize("text", ["", "4096", "4096x", "4096x0", "4096x-8", "4x4x4", "ax4", "4096x14336,"])
def test_malformed_shapes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected KxN"):
        bench_cuda.parse_shapes(text)
