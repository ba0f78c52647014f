"""forge.runtime: AwqLinear and AwqExperts against dequantize-then-matmul in plain PyTorch.

The reference unpacks the vLLM AWQ words with its own few lines (nibble i of a word holds
column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; W[n, k] = (q - z) * s), nothing from forge.

Tolerances, as max |y - ref| / max |ref| against a float32 reference on the same tensors:
float32 activations 1e-5 (both sides are fp32 GEMMs), float16 4e-3, bfloat16 2e-2 (the
activations, the int4pack scale/zero pair and the output are rounded to the 16-bit type).
"""

from __future__ import annotations

import pytest
import torch

from forge.runtime import AwqExperts, AwqLinear, cpu_int4_supported, moe_max_segments, moe_rows, moe_segments

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def ref_unpack(packed: torch.Tensor) -> torch.Tensor:
    """(..., R, N/8) int32 -> (..., R, N) int64 nibbles in AWQ column order."""
    w = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(*w.shape[:-1], w.shape[-1] * 8, dtype=torch.int64, device=w.device)
    for i, col in enumerate(AWQ_ORDER):
        out[..., col::8] = (w >> (4 * i)) & 0xF
    return out


def kernel_weight(qweight, qzeros, scales, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``W (..., K, N)`` of ``dtype`` as forge's W4A16 kernels take it: ``(q - z) * s`` in
    float32 rounded once, the scale first rounded to bfloat16 for a bfloat16 result."""
    q = ref_unpack(qweight)
    z = ref_unpack(qzeros).repeat_interleave(group, dim=-2)
    s = scales.float()
    if dtype == torch.bfloat16:
        s = s.bfloat16().float()
    return ((q - z).float() * s.repeat_interleave(group, dim=-2)).to(dtype)


def ref_weight(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """W (..., N, K) float32."""
    return kernel_weight(qweight, qzeros, scales, group, torch.float32).transpose(-1, -2)


def random_awq(k: int, n: int, group: int, *lead: int, gen=None):
    """Random AWQ tensors: every bit pattern of the words is a valid code."""
    qweight = torch.randint(-(2**31), 2**31, (*lead, k, n // 8), generator=gen, dtype=torch.int64)
    qzeros = torch.randint(-(2**31), 2**31, (*lead, k // group, n // 8), generator=gen, dtype=torch.int64)
    scales = (torch.rand(*lead, k // group, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
    return qweight.to(torch.int32), qzeros.to(torch.int32), scales


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "k,n,group",
    [(256, 160, 128), (128, 64, 32), (512, 96, 256), (64, 40, 32), (1024, 32, 512)],
    ids=["int4pack-g128", "int4pack-g32", "int4pack-g256", "fallback-n40", "fallback-g512"],
)
def test_awq_linear_cpu_matches_dequant_matmul(k, n, group, dtype):
    qweight, qzeros, scales = random_awq(k, n, group)
    bias = torch.randn(n).to(dtype)
    mod = AwqLinear.from_tensors(qweight, qzeros, scales, group, bias)
    x = torch.randn(2, 5, k).to(dtype)
    y = mod(x)
    ref = x.float() @ ref_weight(qweight, qzeros, scales, group).T + bias.float()
    assert y.shape == (2, 5, n) and y.dtype == dtype
    assert rel_err(y, ref) < TOL[dtype]
    # the int4pack form (or the dense fallback: fp32, unsupported shapes) is built once
    assert ("int4pack" in mod._cache) == cpu_int4_supported(k, n, group, dtype)
    assert ("dense" in mod._cache) != cpu_int4_supported(k, n, group, dtype)


def test_awq_linear_rebuilds_after_load_state_dict():
    k, n, group = 128, 64, 32
    mod = AwqLinear(k, n, group, dtype=torch.float32)
    x = torch.randn(3, k)
    mod(x)
    new = random_awq(k, n, group)
    mod.load_state_dict(dict(zip(("qweight", "qzeros", "scales"), new, strict=True)))
    assert rel_err(mod(x), x @ ref_weight(*new, group).T) < TOL[torch.float32]


def test_awq_linear_rejects_bad_shapes():
    from forge.errors import ShapeError

    qweight, qzeros, scales = random_awq(128, 64, 32)
    with pytest.raises(ShapeError, match="qzeros"):
        AwqLinear.from_tensors(qweight, qzeros[:2], scales, 32, name="layer.q_proj")
    with pytest.raises(ShapeError, match="group_size must be a multiple of 32"):
        AwqLinear(64, 32, 16)
    with pytest.raises(ShapeError, match="x: expected last dim 128"):
        AwqLinear.from_tensors(qweight, qzeros, scales, 32)(torch.randn(2, 64))


def test_compiled_linear_hands_its_tile_copy_to_the_op():
    """Under torch.compile an AwqLinear passes the tile copy made before compiling to the
    custom op (which runs the tiled GEMV with it on CUDA; the CPU reference ignores it), and
    traces without it when there is none; load_state_dict drops the copy, and prepare_decode
    makes none off CUDA."""
    from forge import runtime, tile_awq

    qweight, qzeros, scales = random_awq(128, 64, 64)
    x = torch.randn(2, 128)
    tiles = tile_awq(qweight)
    torch.library.opcheck(torch.ops.forge.awq_gemm.default, (x, qweight, qzeros, scales, 64, tiles))
    mod = AwqLinear.from_tensors(qweight, qzeros, scales, 64)
    assert runtime.prepare_decode(mod) == 0 and not mod._cache  # CPU: no copy
    runtime._current_tiles(mod.qweight, mod._cache)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(mod, backend=backend, fullgraph=True)
    assert rel_err(compiled(x), x @ ref_weight(qweight, qzeros, scales, 64).T) < TOL[torch.float32]
    calls = [n for n in graphs[-1].graph.nodes if "awq_gemm" in str(n.target)]
    assert len(calls) == 1 and len(calls[0].args) == 6 and isinstance(calls[0].args[5], torch.fx.Node)
    mod.load_state_dict(mod.state_dict())
    assert "tiled" not in mod._cache
    compiled(x)  # recompiles: the dict no longer holds the copy
    calls = [n for n in graphs[-1].graph.nodes if "awq_gemm" in str(n.target)]
    assert len(graphs) == 2 and len(calls) == 1 and calls[0].args[5:] in ((), (None,))


def test_awq_gemm_custom_op_opcheck_and_compile():
    """The custom op's fake implementation agrees with the real one; torch.compile traces it."""
    qweight, qzeros, scales = random_awq(128, 64, 32)
    x = torch.randn(4, 128)
    torch.library.opcheck(torch.ops.forge.awq_gemm.default, (x, qweight, qzeros, scales, 32))
    mod = AwqLinear.from_tensors(qweight, qzeros, scales, 32)
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=True)
    assert rel_err(compiled(x), x @ ref_weight(qweight, qzeros, scales, 32).T) < TOL[torch.float32]


def ref_experts(x, top_k_index, top_k_weights, w_gate_up, w_down):
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)), token by token in float32."""
    out = torch.zeros(x.shape[0], w_down.shape[1])
    for t in range(x.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            gate, up = (w_gate_up[e] @ x[t].float()).chunk(2)
            out[t] += float(top_k_weights[t, j]) * (w_down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantized_down", [True, False])
def test_awq_experts_matches_reference(dtype, quantized_down):
    e, h, i, group, tokens, top_k = 4, 64, 32, 32, 9, 2
    gu = random_awq(h, 2 * i, group, e)
    dn = random_awq(i, h, group, e)
    mod = AwqExperts(e, h, i, group, "silu", True, quantized_down, dtype=dtype)
    for part, t in zip(("qweight", "qzeros", "scales"), gu, strict=True):
        getattr(mod, f"gate_up_{part}").copy_(t)
    w_down = ref_weight(*dn, group)
    if quantized_down:
        for part, t in zip(("qweight", "qzeros", "scales"), dn, strict=True):
            getattr(mod, f"down_{part}").copy_(t)
    else:
        mod.down_proj.data.copy_(w_down.to(dtype))
        w_down = w_down.to(dtype).float()
    x = torch.randn(tokens, h).to(dtype)
    top_k_index = torch.randint(0, e - 1, (tokens, top_k))  # expert e-1 gets no token
    top_k_weights = torch.rand(tokens, top_k)
    y = mod(x, top_k_index, top_k_weights)
    ref = ref_experts(x, top_k_index, top_k_weights, ref_weight(*gu, group), w_down)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, ref) < TOL[dtype] * 2


def test_awq_experts_is_a_drop_in_for_transformers_experts():
    """Same call and result as transformers' DeepseekV3Experts holding the dequantized weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    config = transformers.DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4)
    e, h, i, group = 4, 64, 32, 32
    gu, dn = random_awq(h, 2 * i, group, e), random_awq(i, h, group, e)
    ours = AwqExperts(e, h, i, group, config.hidden_act, dtype=torch.float32)
    for prefix, tensors in (("gate_up", gu), ("down", dn)):
        for part, t in zip(("qweight", "qzeros", "scales"), tensors, strict=True):
            getattr(ours, f"{prefix}_{part}").copy_(t)
    theirs = DeepseekV3Experts(config)
    with torch.no_grad():
        theirs.gate_up_proj.copy_(ref_weight(*gu, group))
        theirs.down_proj.copy_(ref_weight(*dn, group))
    x = torch.randn(7, h)
    idx = torch.stack([torch.randperm(e)[:2] for _ in range(7)])
    w = torch.rand(7, 2)
    ref = theirs(x, idx, w)
    assert rel_err(ours(x, idx, w), ref) < TOL[torch.float32]
    # ids outside [0, E) (expert-parallel masking) contribute nothing, as in transformers
    idx[0, 0] = e
    assert rel_err(ours(x, idx, w), theirs(x, idx, w)) < TOL[torch.float32]


def random_experts(e: int, h: int, i: int, group: int, dtype=torch.float32, seed: int = 0) -> AwqExperts:
    gen = torch.Generator().manual_seed(seed)
    mod = AwqExperts(e, h, i, group, "silu", dtype=dtype)
    for prefix, tensors in (
        ("gate_up", random_awq(h, 2 * i, group, e, gen=gen)),
        ("down", random_awq(i, h, group, e, gen=gen)),
    ):
        for part, t in zip(("qweight", "qzeros", "scales"), tensors, strict=True):
            getattr(mod, f"{prefix}_{part}").copy_(t)
    return mod


def routing(tokens: int, top_k: int, e: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, expert 0 shared by most tokens (runs longer than a segment),
    and masked ids (-1 and E) on some pairs."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)])
    for t in range(0, tokens, 2):  # expert 0 in half the tokens
        if not (idx[t] == 0).any():
            idx[t, 0] = 0
    if tokens > 1:
        idx[1, -1] = -1
        idx[tokens - 1, 0] = e
    return idx, torch.rand(tokens, top_k, generator=gen)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_moe_segments_cover_every_pair_once(rows):
    e = 8
    idx, _ = routing(16, 6, e)
    order, seg = moe_segments(idx, e, rows)
    flat = idx.reshape(-1)
    bucket = torch.where((flat >= 0) & (flat < e), flat, e)
    assert order.dtype == seg.dtype == torch.int32
    assert seg.shape == (moe_max_segments(flat.numel(), e, rows), 3)
    # sorted by expert, stable (pair order kept within an expert)
    assert torch.equal(order.long(), torch.argsort(bucket, stable=True))
    seen = torch.zeros(flat.numel(), dtype=torch.int64)
    real = seg[seg[:, 1] > 0]
    assert (seg[len(real) :] == 0).all()  # unused rows: count 0, at the end
    for first, count, ex in real.tolist():
        assert 1 <= count <= rows
        pairs = order[first : first + count].long()
        assert (bucket[pairs] == ex).all()
        seen[pairs] += 1
    assert (seen == 1).all()
    # runs are cut at `rows`: an expert with c pairs has ceil(c / rows) segments
    counts = torch.bincount(bucket, minlength=e + 1)
    assert len(real) == int(((counts + rows - 1) // rows).sum())


def test_moe_max_segments_matches_the_kernel_launch_bound():
    """The table size Python allocates is the bound the CUDA routing launch checks (Rust)."""
    from forge import _native

    for pairs in (1, 2, 5, 8, 48, 384, 8192):
        for e in (1, 3, 8, 64, 256, 1024):
            for rows in (1, 2, 3, 4):
                assert moe_max_segments(pairs, e, rows) == _native.moe_max_segments(pairs, e, rows)


def route_reference(ids: list[list[int]], e: int, rows: int, nseg: int):
    """The routing table from its definition, in plain Python: pairs ``t*k + j`` sorted
    stably by bucket (the id, or ``e`` for ids outside ``[0, e)``), each bucket's run cut into
    segments of at most ``rows`` (first sorted position, count, bucket), zero rows up to
    ``nseg``."""
    k = len(ids[0])
    pairs = [(b if 0 <= b < e else e, t * k + j) for t, row in enumerate(ids) for j, b in enumerate(row)]
    ranked = sorted(pairs, key=lambda bp: bp[0])  # sorted() is stable
    order, buckets = [p for _, p in ranked], [b for b, _ in ranked]
    segs, pos = [], 0
    while pos < len(order):
        end = pos
        while end < len(order) and buckets[end] == buckets[pos]:
            end += 1
        for first in range(pos, end, rows):
            segs.append([first, min(rows, end - first), buckets[pos]])
        pos = end
    segs += [[0, 0, 0]] * (nseg - len(segs))
    return order, [p // k for p in order], segs


@pytest.mark.parametrize("group", [16, 32, 48, 64, 96, 128, 192, 256, 1024])
def test_grouped_gemv_shape_rule(group):
    # The SIMT grouped GEMV's rule, written out here: a power-of-two group of at least 32,
    # whole groups of in features, out features a positive multiple of 32. The runtime asks the
    # native layer, whose launch validation applies the same rule.
    from forge.runtime import grouped_gemv_shape_ok

    for k in (0, 16, 32, 96, 128, 384, 1408, 2048, 7168):
        for n in (0, 8, 32, 96, 100, 2816, 7168):
            want = (
                group >= 32
                and group & (group - 1) == 0
                and k > 0
                and k % group == 0
                and n > 0
                and n % 32 == 0
            )
            assert grouped_gemv_shape_ok(k, n, group) == want, (k, n, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_of_the_first_half_times_the_second(dtype):
    """forge.runtime.silu_mul on the CPU: g / (1 + exp(-g)) of gate = the first half of the last
    dimension (gate_up's column order), rounded to the type, times up = the second half, any
    leading dimensions; against that formula in float64, each step rounded to the type (within
    an ulp or two of the type: torch computes each step in float32)."""
    from forge.runtime import silu_mul

    x = (torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    g, u = x[..., :8].double(), x[..., 8:].double()
    want = ((g / (1 + torch.exp(-g))).to(dtype).double() * u).to(dtype)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(silu_mul(x), want, rtol=2 * eps, atol=0)
    torch.testing.assert_close(silu_mul(x.view(6, 16)), want.view(6, 8), rtol=2 * eps, atol=0)


def test_moe_tc_rows_is_the_smallest_tile_holding_an_experts_share():
    from forge.runtime import GROUPED_TC_ROWS, moe_tc_rows

    assert GROUPED_TC_ROWS == (16, 32, 64, 128, 256)
    short, long = 1408, 2816  # mean in features: Qwen3-30B-A3B's experts; Qwen3-235B-A22B's
    pairs = (385, 512, 513, 1024, 1025, 2048, 2049, 10**6)
    # the wgmma GEMM's tiles up to 128 rows, and 256 only for enough pairs an expert and long K
    assert [moe_tc_rows(p, 16, 128, long) for p in pairs] == [32, 32, 64, 64, 128, 128, 128, 128]
    assert [moe_tc_rows(p, 16, 256, short) for p in pairs] == [32, 32, 64, 64, 128, 128, 128, 128]
    assert [moe_tc_rows(p, 16, 256, long) for p in pairs] == [32, 32, 64, 64, 128, 128, 128, 256]
    assert [moe_tc_rows(p, 16, 256, long) for p in (8176, 8177, 8192)] == [128, 256, 256]
    # GROUPED_TC_WIDE's pairs: 512 pairs an expert from K = 2560, 1024 from 2048, 2048 from 1536
    for share, k in ((512, 2560), (1024, 2048), (2048, 1536)):
        assert moe_tc_rows(16 * share, 16, 256, k) == 256
        assert moe_tc_rows(16 * share, 16, 256, k - 1) == 128
        assert moe_tc_rows(16 * share - 16, 16, 256, k) == 128  # one pair an expert fewer
    assert moe_tc_rows(16 * 10**5, 16, 256, 1535) == 128
    assert [moe_tc_rows(p, 256, 128, long) for p in (400, 4096, 4097, 16384, 16385)] == [16, 16, 32, 64, 128]
    # the mma.sync GEMM's tiles stop at 64 rows
    assert [moe_tc_rows(p, 16, 64, long) for p in pairs] == [32, 32, 64, 64, 64, 64, 64, 64]
    assert [moe_tc_rows(p, 16, 16, long) for p in pairs] == [16] * len(pairs)
    with pytest.raises(ValueError, match="smallest tile"):
        moe_tc_rows(512, 16, 0, long)


def test_awq_experts_off_cuda_takes_no_grouped_launch():
    """On the CPU every call runs the per-expert loop, whatever the pair count."""
    mod = random_experts(16, 64, 32, 32)
    x = torch.randn(100, 64)
    assert mod._grouped_rows(x, 6) is None and mod._grouped_rows(x, 600) is None


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_moe_route_off_cuda_is_the_torch_ops(rows):
    from forge.runtime import moe_route

    idx, _ = routing(16, 6, 8)
    order, tokens, seg = moe_route(idx, 8, rows)
    want_order, want_seg = moe_segments(idx, 8, rows)
    assert torch.equal(order, want_order) and torch.equal(seg, want_seg)
    assert tokens.dtype == torch.int32 and torch.equal(tokens, want_order // 6)
    # and against the definition, written out independently
    ref_order, ref_tokens, ref_segs = route_reference(idx.tolist(), 8, rows, seg.shape[0])
    assert order.tolist() == ref_order and tokens.tolist() == ref_tokens and seg.tolist() == ref_segs


@pytest.mark.parametrize("tokens,top_k", [(1, 6), (3, 6), (16, 6), (16, 8)])
def test_awq_experts_grouped_algorithm_matches_loop(tokens, top_k):
    """The grouped path's algorithm (segment table, pair rows, masked ids, weighted sum), run
    on the CPU through the op's reference implementation, agrees with the per-expert loop."""
    e, h, i, group = 16, 64, 32, 32
    mod = random_experts(e, h, i, group)
    idx, w = routing(tokens, top_k, e)
    x = torch.randn(tokens, h)
    loop = mod(x, idx, w)  # CPU: the loop
    rows = moe_rows(tokens, tokens * top_k, e)  # the SIMT GEMV's segments
    grouped = mod._forward_grouped(x, idx, w, rows)
    assert grouped.shape == x.shape and grouped.dtype == x.dtype
    assert rel_err(grouped, loop) < TOL[torch.float32]
    # a masked id contributes nothing even with a non-finite weight
    w2 = w.clone()
    if tokens > 1:
        w2[1, -1] = float("nan")
        assert torch.isfinite(mod._forward_grouped(x, idx, w2, rows)).all()


def test_awq_moe_gemv_opcheck_and_compile():
    """The grouped op's fake implementation agrees with the real one, and the whole grouped
    forward (segment table included) traces into one graph: no data-dependent host read."""
    e, h, i, group = 8, 64, 32, 32
    mod = random_experts(e, h, i, group)
    idx, w = routing(5, 4, e)
    x = torch.randn(5, h)
    order, seg = moe_segments(idx, e, 2)
    tokens = torch.div(order, 4, rounding_mode="floor")
    args = (x, tokens, order, seg, mod.gate_up_qweight, mod.gate_up_qzeros, mod.gate_up_scales, group, 2)
    torch.library.opcheck(torch.ops.forge.awq_moe_gemv.default, args)
    torch.library.opcheck(torch.ops.forge.moe_route.default, (idx, e, 2))
    y = torch.randn(5 * 4, h)
    torch.library.opcheck(torch.ops.forge.moe_combine.default, (y, w, idx, e))
    torch._dynamo.reset()
    compiled = torch.compile(mod._forward_grouped, backend="aot_eager", fullgraph=True)
    for tokens in (5, 1, 16, 3):  # new token counts: recompiles, then a dynamic-shape graph
        idx, w = routing(tokens, 4, e, seed=tokens)
        x = torch.randn(tokens, h)
        rows = moe_rows(tokens, tokens * 4, e)
        assert rel_err(compiled(x, idx, w, rows), mod(x, idx, w)) < TOL[torch.float32]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_awq_linear_cuda_kernel_graph_and_compile(dtype):
    k, n, group = 512, 256, 128
    qweight, qzeros, scales = random_awq(k, n, group)
    mod = AwqLinear.from_tensors(qweight, qzeros, scales, group).cuda()
    x = torch.randn(3, k, device="cuda", dtype=dtype)
    ref = x.float().cpu() @ ref_weight(qweight, qzeros, scales, group).T
    assert rel_err(mod(x).cpu(), ref) < TOL[dtype]
    # CUDA graph capture and replay
    static_x = x.clone()
    mod(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = mod(static_x)
    static_x.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(static_y.cpu(), 2 * ref) < TOL[dtype]
    compiled = torch.compile(mod, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        y = compiled(x)
    assert rel_err(y.cpu(), ref) < TOL[dtype]


@pytest.mark.cuda
def test_awq_experts_cuda():
    e, h, i, group = 4, 256, 128, 128
    gu, dn = random_awq(h, 2 * i, group, e), random_awq(i, h, group, e)
    mod = AwqExperts(e, h, i, group, dtype=torch.bfloat16)
    for prefix, tensors in (("gate_up", gu), ("down", dn)):
        for part, t in zip(("qweight", "qzeros", "scales"), tensors, strict=True):
            getattr(mod, f"{prefix}_{part}").copy_(t)
    mod = mod.cuda()
    x = torch.randn(6, h, dtype=torch.bfloat16)
    idx, w = torch.randint(0, e, (6, 2)), torch.rand(6, 2)
    y = mod(x.cuda(), idx.cuda(), w.cuda()).cpu()
    ref = ref_experts(x, idx, w, ref_weight(*gu, group), ref_weight(*dn, group))
    assert rel_err(y, ref) < TOL[torch.bfloat16] * 2
