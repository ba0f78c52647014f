"""Every bad-input path of the Python API raises a forge.errors class (a ValueError or
TypeError subclass) whose message names the argument; never a Rust PanicException."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda

import forge
from forge.errors import DeviceError, DTypeError, ForgeError, HessianError, InvalidValueError, ShapeError

NAN, INF = float("nan"), float("inf")


def u8(*shape):
    return torch.zeros(*shape, dtype=torch.uint8)


def qm(n, groups, zero=8, sym=False, scale=0.1):
    return forge.encode_qmeta(
        torch.full((n, groups), scale), torch.full((n, groups), zero, dtype=torch.uint8), sym
    )


def W(n=8, k=64, dtype=torch.float32):
    return torch.randn(n, k).to(dtype)


def with_value(t: torch.Tensor, value: float, index=(0, 1)) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def awq(k=64, n=8, g=32):
    return forge.pack_awq(u8(k, n), qm(n, k // g), g)


def gptq_packed(k=64, n=8, g=32):
    return forge.pack_gptq(u8(k, n), qm(n, k // g), g)


EYE = torch.eye(64)

# (id, callable, expected exception class, regex the message must contain)
CASES = [
    # --- build_quant_grid: weight
    ("grid-weight-list", lambda: forge.build_quant_grid([[1.0] * 64], 32), DTypeError, "weight"),
    (
        "grid-weight-int",
        lambda: forge.build_quant_grid(torch.ones(4, 64, dtype=torch.int32), 32),
        DTypeError,
        "weight",
    ),
    ("grid-weight-f64", lambda: forge.build_quant_grid(W(dtype=torch.float64), 32), DTypeError, "weight"),
    (
        "grid-weight-complex",
        lambda: forge.build_quant_grid(W().to(torch.complex64), 32),
        DTypeError,
        "weight",
    ),
    ("grid-weight-1d", lambda: forge.build_quant_grid(torch.randn(64), 32), ShapeError, "weight"),
    ("grid-weight-3d", lambda: forge.build_quant_grid(torch.randn(2, 4, 64), 32), ShapeError, "weight"),
    ("grid-weight-empty", lambda: forge.build_quant_grid(torch.empty(4, 0), 32), ShapeError, "weight"),
    ("grid-weight-norows", lambda: forge.build_quant_grid(torch.empty(0, 64), 32), ShapeError, "weight"),
    (
        "grid-weight-nan",
        lambda: forge.build_quant_grid(with_value(W(), NAN), 32),
        InvalidValueError,
        "weight",
    ),
    (
        "grid-weight-inf",
        lambda: forge.build_quant_grid(with_value(W(), INF), 32),
        InvalidValueError,
        "weight",
    ),
    (
        "grid-weight-ninf",
        lambda: forge.build_quant_grid(with_value(W(), -INF), 32),
        InvalidValueError,
        "weight",
    ),
    (
        "grid-weight-f16-inf",
        lambda: forge.build_quant_grid(with_value(W(dtype=torch.float16), INF), 32),
        InvalidValueError,
        "weight",
    ),
    (
        "grid-weight-bf16-nan",
        lambda: forge.build_quant_grid(with_value(W(dtype=torch.bfloat16), NAN), 32),
        InvalidValueError,
        "weight",
    ),
    (
        "grid-weight-fp8-nan",
        lambda: forge.build_quant_grid(with_value(W(dtype=torch.float8_e4m3fn), NAN), 32),
        InvalidValueError,
        "weight",
    ),
    (
        "grid-weight-nan-mse",
        lambda: forge.build_quant_grid(with_value(W(), NAN), 32, mode="mse"),
        InvalidValueError,
        "weight",
    ),
    (
        "grid-weight-meta-device",
        lambda: forge.build_quant_grid(torch.empty(4, 64, device="meta"), 32),
        DeviceError,
        "weight",
    ),
    # --- build_quant_grid: parameters
    ("grid-group-48", lambda: forge.build_quant_grid(W(), 48), InvalidValueError, "group_size"),
    ("grid-group-16", lambda: forge.build_quant_grid(W(), 16), InvalidValueError, "group_size"),
    ("grid-group-0", lambda: forge.build_quant_grid(W(), 0), InvalidValueError, "group_size"),
    ("grid-group-2048", lambda: forge.build_quant_grid(W(), 2048), InvalidValueError, "group_size"),
    ("grid-bits-1", lambda: forge.build_quant_grid(W(), 32, 1), InvalidValueError, "bits"),
    ("grid-bits-9", lambda: forge.build_quant_grid(W(), 32, 9), InvalidValueError, "bits"),
    ("grid-bits-0", lambda: forge.build_quant_grid(W(), 32, 0), InvalidValueError, "bits"),
    ("grid-mode", lambda: forge.build_quant_grid(W(), 32, 4, False, "l2"), InvalidValueError, "mode"),
    (
        "grid-shrink-1",
        lambda: forge.build_quant_grid(W(), 32, 4, False, "mse", 1.0),
        InvalidValueError,
        "quant_max_shrink",
    ),
    (
        "grid-shrink-neg",
        lambda: forge.build_quant_grid(W(), 32, 4, False, "mse", -0.1),
        InvalidValueError,
        "quant_max_shrink",
    ),
    (
        "grid-shrink-nan",
        lambda: forge.build_quant_grid(W(), 32, 4, False, "mse", NAN),
        InvalidValueError,
        "quant_max_shrink",
    ),
    (
        "grid-ngrid-0",
        lambda: forge.build_quant_grid(W(), 32, 4, False, "mse", 0.2, 0),
        InvalidValueError,
        "quant_n_grid",
    ),
    (
        "grid-ngrid-big",
        lambda: forge.build_quant_grid(W(), 32, 4, False, "mse", 0.2, 5000),
        InvalidValueError,
        "quant_n_grid",
    ),
    (
        "grid-norm-0",
        lambda: forge.build_quant_grid(W(), 32, 4, False, "mse", 0.2, 100, 0.0),
        InvalidValueError,
        "quant_norm",
    ),
    (
        "grid-norm-neg",
        lambda: forge.build_quant_grid(W(), 32, 4, False, "mse", 0.2, 100, -2.0),
        InvalidValueError,
        "quant_norm",
    ),
    (
        "grid-norm-inf",
        lambda: forge.build_quant_grid(W(), 32, 4, False, "mse", 0.2, 100, INF),
        InvalidValueError,
        "quant_norm",
    ),
    # wrong Python types for scalars: PyO3's TypeError, the argument named in a note
    ("grid-group-float", lambda: forge.build_quant_grid(W(), 32.5), TypeError, "group_size"),
    ("grid-group-str", lambda: forge.build_quant_grid(W(), "32"), TypeError, "group_size"),
    ("grid-mode-int", lambda: forge.build_quant_grid(W(), 32, 4, False, 3), TypeError, "mode"),
    ("solve-bits-none", lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), None, 32), TypeError, "bits"),
    # --- quantize_rtn
    ("rtn-qmeta-shape", lambda: forge.quantize_rtn(W(), u8(8, 1, 4), 4, 32), ShapeError, "qmeta"),
    ("rtn-qmeta-last", lambda: forge.quantize_rtn(W(), u8(8, 2, 3), 4, 32), ShapeError, "qmeta"),
    (
        "rtn-qmeta-dtype",
        lambda: forge.quantize_rtn(W(), torch.zeros(8, 2, 4, dtype=torch.int32), 4, 32),
        DTypeError,
        "qmeta",
    ),
    ("rtn-qmeta-list", lambda: forge.quantize_rtn(W(), [0, 0, 0, 0], 4, 32), DTypeError, "qmeta"),
    (
        "rtn-weight-nan",
        lambda: forge.quantize_rtn(with_value(W(), NAN), qm(8, 2), 4, 32),
        InvalidValueError,
        "weight",
    ),
    (
        "rtn-weight-int",
        lambda: forge.quantize_rtn(torch.ones(8, 64, dtype=torch.int64), qm(8, 2), 4, 32),
        DTypeError,
        "weight",
    ),
    ("rtn-bits", lambda: forge.quantize_rtn(W(), qm(8, 2), 12, 32), InvalidValueError, "bits"),
    ("rtn-group", lambda: forge.quantize_rtn(W(), qm(8, 2), 4, 40), InvalidValueError, "group_size"),
    # --- prepare_hessian
    ("hess-list", lambda: forge.prepare_hessian([[1.0]]), DTypeError, "hessian"),
    ("hess-f64", lambda: forge.prepare_hessian(torch.eye(4, dtype=torch.float64)), DTypeError, "hessian"),
    ("hess-f16", lambda: forge.prepare_hessian(torch.eye(4, dtype=torch.float16)), DTypeError, "hessian"),
    ("hess-nonsquare", lambda: forge.prepare_hessian(torch.ones(4, 5)), ShapeError, "hessian"),
    ("hess-1d", lambda: forge.prepare_hessian(torch.ones(4)), ShapeError, "hessian"),
    ("hess-3d", lambda: forge.prepare_hessian(torch.ones(2, 4, 4)), ShapeError, "hessian"),
    ("hess-empty", lambda: forge.prepare_hessian(torch.empty(0, 0)), ShapeError, "hessian"),
    ("hess-nan", lambda: forge.prepare_hessian(with_value(torch.eye(4), NAN)), InvalidValueError, "hessian"),
    (
        "hess-batched-nan",
        lambda: forge.prepare_hessian_batched(with_value(torch.eye(4).repeat(3, 1, 1), NAN, (2, 3, 1))),
        InvalidValueError,
        "hessian",
    ),
    (
        "hess-batched-neg-inf",
        lambda: forge.prepare_hessian_batched(with_value(torch.eye(4).repeat(3, 1, 1), -INF, (0, 0, 3))),
        InvalidValueError,
        "hessian",
    ),
    (
        "hess-inf",
        lambda: forge.prepare_hessian(with_value(torch.eye(4), INF, (2, 2))),
        InvalidValueError,
        "hessian",
    ),
    (
        "hess-negdiag",
        lambda: forge.prepare_hessian(with_value(torch.eye(4), -1.0, (1, 1))),
        InvalidValueError,
        "hessian",
    ),
    ("hess-percdamp-neg", lambda: forge.prepare_hessian(torch.eye(4), -0.01), InvalidValueError, "percdamp"),
    ("hess-percdamp-nan", lambda: forge.prepare_hessian(torch.eye(4), NAN), InvalidValueError, "percdamp"),
    ("hess-percdamp-inf", lambda: forge.prepare_hessian(torch.eye(4), INF), InvalidValueError, "percdamp"),
    (
        "hess-not-pd",
        lambda: forge.prepare_hessian(torch.tensor([[1.0, 1e9], [1e9, 1.0]])),
        HessianError,
        "hessian",
    ),
    # --- gptq_solve (weight_t (C, R) = (64, 8), group 32)
    (
        "solve-weight-int",
        lambda: forge.gptq_solve(torch.ones(64, 8, dtype=torch.int32), EYE, qm(8, 2), 4, 32),
        DTypeError,
        "weight",
    ),
    (
        "solve-weight-f64",
        lambda: forge.gptq_solve(torch.ones(64, 8, dtype=torch.float64), EYE, qm(8, 2), 4, 32),
        DTypeError,
        "weight",
    ),
    ("solve-weight-1d", lambda: forge.gptq_solve(torch.ones(64), EYE, qm(8, 2), 4, 32), ShapeError, "weight"),
    (
        "solve-weight-nan",
        lambda: forge.gptq_solve(with_value(W(64, 8), NAN), EYE, qm(8, 2), 4, 32),
        InvalidValueError,
        "weight",
    ),
    (
        "solve-weight-inf",
        lambda: forge.gptq_solve(with_value(W(64, 8), -INF), EYE, qm(8, 2), 4, 32),
        InvalidValueError,
        "weight",
    ),
    ("solve-weight-list", lambda: forge.gptq_solve([[0.0]], EYE, qm(8, 2), 4, 32), DTypeError, "weight"),
    (
        "solve-hinv-shape",
        lambda: forge.gptq_solve(W(64, 8), torch.eye(32), qm(8, 2), 4, 32),
        ShapeError,
        "hinv_chol|hessian_inv",
    ),
    (
        "solve-hinv-f64",
        lambda: forge.gptq_solve(W(64, 8), EYE.double(), qm(8, 2), 4, 32),
        DTypeError,
        "hinv_chol|hessian_inv",
    ),
    (
        "solve-hinv-nan",
        lambda: forge.gptq_solve(W(64, 8), with_value(EYE, NAN), qm(8, 2), 4, 32),
        InvalidValueError,
        "hinv_chol|hessian_inv",
    ),
    (
        "solve-hinv-diag",
        lambda: forge.gptq_solve(W(64, 8), -EYE, qm(8, 2), 4, 32),
        InvalidValueError,
        "hinv_chol|hessian_inv",
    ),
    ("solve-qmeta-shape", lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 1), 4, 32), ShapeError, "qmeta"),
    (
        "solve-qmeta-transposed",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(64, 1), 4, 32),
        ShapeError,
        "qmeta",
    ),
    (
        "solve-qmeta-dtype",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2).to(torch.int8), 4, 32),
        DTypeError,
        "qmeta",
    ),
    ("solve-bits", lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), 1, 32), InvalidValueError, "bits"),
    (
        "solve-group",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), 4, 31),
        InvalidValueError,
        "group_size",
    ),
    (
        "solve-block-0",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), 4, 32, 0),
        InvalidValueError,
        "block_size",
    ),
    (
        "solve-perm-dup",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), 4, 32, 32, torch.zeros(64, dtype=torch.int64)),
        ShapeError,
        "perm",
    ),
    (
        "solve-perm-range",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), 4, 32, 32, torch.arange(64) + 1),
        InvalidValueError,
        "perm",
    ),
    (
        "solve-perm-neg",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), 4, 32, 32, torch.arange(64) - 1),
        InvalidValueError,
        "perm",
    ),
    (
        "solve-perm-len",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), 4, 32, 32, torch.arange(63)),
        ShapeError,
        "perm",
    ),
    (
        "solve-perm-dtype",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), 4, 32, 32, torch.arange(64, dtype=torch.int32)),
        DTypeError,
        "perm",
    ),
    (
        "solve-perm-list",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), 4, 32, 32, list(range(64))),
        DTypeError,
        "perm",
    ),
    ("class-maxq", lambda: forge.GPTQ(4, 32).solver(W(64, 8), EYE, qm(8, 2), 7), InvalidValueError, "maxq"),
    (
        "quantize-hessian-shape",
        lambda: forge.gptq_quantize(W(8, 64), torch.eye(32), group_size=32),
        ShapeError,
        "hess",
    ),
    (
        "quantize-hessian-nan",
        lambda: forge.gptq_quantize(W(8, 64), with_value(EYE, NAN), group_size=32),
        InvalidValueError,
        "hessian",
    ),
    (
        "quantize-weight-nan",
        lambda: forge.gptq_quantize(with_value(W(8, 64), NAN), EYE, group_size=32),
        InvalidValueError,
        "weight",
    ),
    # --- pack_awq / pack_gptq / quantize_pack_awq
    (
        "pack-codes-int32",
        lambda: forge.pack_awq(torch.zeros(64, 8, dtype=torch.int32), qm(8, 2), 32),
        DTypeError,
        "codes",
    ),
    ("pack-codes-1d", lambda: forge.pack_awq(u8(64), qm(8, 2), 32), ShapeError, "codes"),
    ("pack-codes-list", lambda: forge.pack_awq([[0] * 8] * 64, qm(8, 2), 32), DTypeError, "codes"),
    (
        "pack-codes-16",
        lambda: forge.pack_awq(with_value(u8(64, 8), 16), qm(8, 2), 32),
        InvalidValueError,
        "codes",
    ),
    (
        "pack-codes-255",
        lambda: forge.pack_gptq(with_value(u8(64, 8), 255), qm(8, 2), 32),
        InvalidValueError,
        "codes",
    ),
    ("pack-n-not-8", lambda: forge.pack_awq(u8(64, 12), qm(12, 2), 32), ShapeError, "out_features|N"),
    ("pack-k-not-g", lambda: forge.pack_awq(u8(48, 8), qm(8, 1), 32), ShapeError, "in_features|group"),
    ("pack-group-48", lambda: forge.pack_awq(u8(96, 8), qm(8, 2), 48), InvalidValueError, "group_size"),
    ("pack-group-16", lambda: forge.pack_gptq(u8(64, 8), qm(8, 4), 16), InvalidValueError, "group_size"),
    ("pack-qmeta-shape", lambda: forge.pack_awq(u8(64, 8), qm(8, 1), 32), ShapeError, "qmeta"),
    (
        "pack-qmeta-dtype",
        lambda: forge.pack_awq(u8(64, 8), qm(8, 2).to(torch.int32), 32),
        DTypeError,
        "qmeta",
    ),
    (
        "pack-scale-fp16-overflow",
        lambda: forge.pack_awq(u8(64, 8), qm(8, 2, scale=1e6), 32),
        InvalidValueError,
        "qmeta",
    ),
    ("pack-gptq-zero0", lambda: forge.pack_gptq(u8(64, 8), qm(8, 2, zero=0), 32), InvalidValueError, "zero"),
    ("pack-gptq-n", lambda: forge.pack_gptq(u8(64, 4), qm(4, 2), 32), ShapeError, "out_features|N"),
    (
        "qpack-weight-nan",
        lambda: forge.quantize_pack_awq(with_value(W(8, 64), NAN), qm(8, 2), 32),
        InvalidValueError,
        "weight",
    ),
    (
        "qpack-weight-inf",
        lambda: forge.quantize_pack_awq(with_value(W(8, 64), INF), qm(8, 2), 32),
        InvalidValueError,
        "weight",
    ),
    (
        "qpack-weight-f64",
        lambda: forge.quantize_pack_awq(W(8, 64, torch.float64), qm(8, 2), 32),
        DTypeError,
        "weight",
    ),
    (
        "qpack-weight-int",
        lambda: forge.quantize_pack_awq(torch.ones(8, 64, dtype=torch.int8), qm(8, 2), 32),
        DTypeError,
        "weight",
    ),
    ("qpack-n", lambda: forge.quantize_pack_awq(W(12, 64), qm(12, 2), 32), ShapeError, "out_features|N"),
    ("qpack-k", lambda: forge.quantize_pack_awq(W(8, 80), qm(8, 3), 32), ShapeError, "in_features|group"),
    # --- unpack / dequantize / matmul
    (
        "unpack-qweight-int64",
        lambda: forge.unpack_awq(
            torch.zeros(64, 1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int32), 32
        ),
        DTypeError,
        "qweight",
    ),
    (
        "unpack-qzeros-uint8",
        lambda: forge.unpack_awq(torch.zeros(64, 1, dtype=torch.int32), u8(2, 1), 32),
        DTypeError,
        "qzeros",
    ),
    (
        "unpack-qzeros-shape",
        lambda: forge.unpack_awq(
            torch.zeros(64, 1, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.int32), 32
        ),
        ShapeError,
        "qzeros",
    ),
    (
        "unpack-qweight-1d",
        lambda: forge.unpack_awq(
            torch.zeros(64, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 32
        ),
        ShapeError,
        "qweight",
    ),
    (
        "unpack-group-divide",
        lambda: forge.unpack_awq(
            torch.zeros(80, 1, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 64
        ),
        ShapeError,
        "group_size",
    ),
    (
        "unpack-group-0",
        lambda: forge.unpack_awq(
            torch.zeros(64, 1, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 0
        ),
        ValueError,
        "group_size",
    ),
    (
        "unpack-group-16",
        lambda: forge.unpack_awq(
            torch.zeros(64, 1, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.int32), 16
        ),
        InvalidValueError,
        "group_size",
    ),
    (
        "unpack-gptq-shape",
        lambda: forge.unpack_gptq(
            torch.zeros(8, 8, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32), 32
        ),
        ShapeError,
        "qzeros",
    ),
    ("deq-scales-f32", lambda: forge.dequantize_awq(*awq()[:2], awq()[2].float(), 32), DTypeError, "scales"),
    (
        "deq-scales-shape",
        lambda: forge.dequantize_awq(*awq()[:2], awq()[2].T.contiguous(), 32),
        ShapeError,
        "scales",
    ),
    ("deq-scales-list", lambda: forge.dequantize_awq(*awq()[:2], [1.0], 32), DTypeError, "scales"),
    (
        "deqg-gidx-len",
        lambda: forge.dequantize_gptq(*gptq_packed()[:3], torch.zeros(32, dtype=torch.int32), 32),
        ShapeError,
        "g_idx",
    ),
    (
        "deqg-gidx-range",
        lambda: forge.dequantize_gptq(*gptq_packed()[:3], torch.full((64,), 2, dtype=torch.int32), 32),
        InvalidValueError,
        "g_idx",
    ),
    (
        "deqg-gidx-neg",
        lambda: forge.dequantize_gptq(*gptq_packed()[:3], torch.full((64,), -1, dtype=torch.int32), 32),
        InvalidValueError,
        "g_idx",
    ),
    (
        "deqg-gidx-int64",
        lambda: forge.dequantize_gptq(*gptq_packed()[:3], torch.zeros(64, dtype=torch.int64), 32),
        DTypeError,
        "g_idx",
    ),
    (
        "deqg-scales-f32",
        lambda: forge.dequantize_gptq(*gptq_packed()[:2], gptq_packed()[2].float(), gptq_packed()[3], 32),
        DTypeError,
        "scales",
    ),
    ("matmul-x-k", lambda: forge.awq_matmul(torch.randn(2, 65), *awq(), 32), ShapeError, "x"),
    (
        "matmul-scales",
        lambda: forge.awq_matmul(torch.randn(2, 64), *awq()[:2], awq()[2].float(), 32),
        DTypeError,
        "scales",
    ),
    ("matmul-group", lambda: forge.awq_matmul(torch.randn(2, 64), *awq(), 48), ShapeError, "group_size"),
    # the dense dequantization is a CUDA kernel: CPU tensors and other dtypes are named
    ("deq-dense-cpu", lambda: forge.dequantize_awq_dense(*awq(), 32), DTypeError, "qweight"),
    ("deq-dense-dtype", lambda: forge.dequantize_awq_dense(*awq(), 32, torch.int8), DTypeError, "dtype"),
]


@pytest.mark.parametrize("call, exc, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_named_forge_error(call, exc, name):
    with pytest.raises(exc, match=name) as info:  # match also searches __notes__
        call()
    err = info.value
    assert isinstance(err, (ValueError, TypeError))
    if exc is not TypeError:  # plain TypeError: PyO3's own argument conversion
        assert isinstance(err, ForgeError), type(err)


def test_error_hierarchy():
    for cls in (ShapeError, InvalidValueError, DeviceError, HessianError):
        assert issubclass(cls, ValueError) and issubclass(cls, ForgeError)
    assert issubclass(DTypeError, TypeError) and issubclass(DTypeError, ForgeError)


def test_message_states_expected_value():
    with pytest.raises(InvalidValueError, match=r"group_size.*multiple of 32.*48"):
        forge.build_quant_grid(W(), 48)
    with pytest.raises(ShapeError, match=r"qmeta.*\[8, 2, 4\].*\[8, 1, 4\]"):
        forge.quantize_rtn(W(), u8(8, 1, 4), 4, 32)
    with pytest.raises(DTypeError, match=r"weight.*float32.*int32"):
        forge.build_quant_grid(torch.ones(4, 64, dtype=torch.int32), 32)
    with pytest.raises(InvalidValueError, match=r"weight.*non-finite.*index 1"):
        forge.build_quant_grid(with_value(W(), NAN), 32)


def test_non_contiguous_inputs_are_accepted():
    w = torch.randn(64, 8).t()  # (8, 64) view, not contiguous
    assert not w.is_contiguous()
    a = forge.build_quant_grid(w, 32)[0]
    assert torch.equal(a, forge.build_quant_grid(w.contiguous(), 32)[0])


# ----------------------------------------------------------------------------- integer ranges

INT_RANGE_CASES = [
    # out-of-range Python ints must not surface as a bare OverflowError
    ("grid-bits-neg", lambda: forge.build_quant_grid(W(), 32, -1), InvalidValueError, "bits"),
    ("grid-bits-300", lambda: forge.build_quant_grid(W(), 32, 300), InvalidValueError, "bits"),
    ("grid-group-neg", lambda: forge.build_quant_grid(W(), -32), InvalidValueError, "group_size"),
    (
        "grid-ngrid-neg",
        lambda: forge.build_quant_grid(W(), 32, 4, False, "mse", 0.2, -1),
        InvalidValueError,
        "quant_n_grid",
    ),
    (
        "solve-block-neg",
        lambda: forge.gptq_solve(W(64, 8), EYE, qm(8, 2), 4, 32, -1),
        InvalidValueError,
        "block_size",
    ),
    # the Python wrappers must not touch the argument before the native validation
    ("matmul-x-list", lambda: forge.awq_matmul([[0.0] * 64], *awq(), 32), DTypeError, "x"),
    ("matmul-x-0d", lambda: forge.awq_matmul(torch.tensor(1.0), *awq(), 32), ShapeError, "x"),
]


@pytest.mark.parametrize(
    "call, exc, name", [c[1:] for c in INT_RANGE_CASES], ids=[c[0] for c in INT_RANGE_CASES]
)
def test_int_ranges_and_wrapper_validation(call, exc, name):
    with pytest.raises(exc, match=name):
        call()


def test_no_panic_on_garbage_shapes():
    """Random small shapes and dtypes: only ordinary exceptions, never a PanicException
    (pyo3_runtime.PanicException derives from BaseException, not Exception)."""
    gen = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.float16, torch.uint8, torch.int32, torch.int64, torch.bool]

    def rand_tensor():
        nd = int(torch.randint(0, 4, (1,), generator=gen))
        shape = torch.randint(0, 70, (nd,), generator=gen).tolist()
        dt = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=gen))]
        return torch.zeros(shape, dtype=dt) if dt != torch.float32 else torch.randn(shape, generator=gen)

    fns = [
        (forge.build_quant_grid, 1, (32,)),
        (forge.quantize_rtn, 2, (4, 32)),
        (forge.encode_qmeta, 3, ()),
        (forge.decode_qmeta, 1, ()),
        (forge.prepare_hessian, 1, ()),
        (forge.gptq_solve, 3, (4, 32, 32)),
        (forge.pack_awq, 2, (32,)),
        (forge.quantize_pack_awq, 2, (32,)),
        (forge.unpack_awq, 2, (32,)),
        (forge.dequantize_awq, 3, (32,)),
        (forge.pack_gptq, 2, (32,)),
        (forge.unpack_gptq, 2, (32,)),
        (forge.dequantize_gptq, 4, (32,)),
    ]
    for _ in range(30):
        for fn, nt, extra in fns:
            args = [rand_tensor() for _ in range(nt)]
            try:
                fn(*args, *extra)
            except (ForgeError, ValueError, TypeError):
                pass
            except Exception as e:  # AttributeError, IndexError, ... are bugs too
                raise AssertionError(f"{fn.__name__}: {type(e).__name__}: {e}") from e


@requires_cuda
@pytest.mark.cuda
def test_cuda_inputs_give_the_cpu_result():
    """CUDA tensors are accepted everywhere (a kernel, or a round trip through host memory for
    CPU-only ops) and give the CPU path's result on the input's device."""
    w = torch.randn(8, 64)
    q = qm(8, 2)
    got = forge.quantize_rtn(w.cuda(), q.cuda(), 4, 32)
    assert got.is_cuda and torch.equal(got.cpu(), forge.quantize_rtn(w, q, 4, 32))
    h = torch.eye(4) * 2 + 0.1
    fc, fg = forge.prepare_hessian(h), forge.prepare_hessian(h.cuda())
    assert fg.hinv_chol.is_cuda
    assert torch.allclose(fg.hinv_chol.cpu(), fc.hinv_chol, rtol=1e-5, atol=1e-6)


def test_quantize_model_device_errors(tmp_path):
    with pytest.raises(ValueError, match="device"):
        forge.quantize_model(tmp_path / "model", tmp_path / "out", device="gpu", progress=False)
    if not forge.cuda_status()["available"]:
        with pytest.raises(ValueError, match="cuda"):
            forge.quantize_model(tmp_path / "model", tmp_path / "out", device="cuda", progress=False)
