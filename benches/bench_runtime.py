"""Decode tokens/s of a forged checkpoint (forge.load_quantized, W4A16) vs its bf16 original,
and the per-call cost of one AwqLinear vs a bf16 nn.Linear.

    python benches/bench_runtime.py FORGED_DIR ORIG_DIR [--device cpu|cuda] [--batch 1 16]
        [--new-tokens 32] [--no-graphs] [--eager-too] [--micro] [--moe-micro]
        [--models w4a16 bf16] [--json out.json]
    python benches/bench_runtime.py --micro-only [--json out.json]

Decode: greedy ``model.generate`` (``min_new_tokens = max_new_tokens``, so every row decodes
the same count) after a 16-token prompt; tokens/s = batch * new_tokens / (wall time of the
generate call minus the prefill-only call). On CUDA both models use a static KV cache, with
which generate compiles the forward itself with ``mode="reduce-overhead"`` (CUDA graphs;
mode ``graphs``); mode ``graph_step`` replays one hand-captured CUDA graph of a greedy decode
step over a StaticCache (no generate loop: the models' own decode speed); ``--eager-too``
adds eager generate rows (``disable_compile=True``).

MoE layer (CUDA, ``--moe-micro``): one AwqExperts layer of the bench's DeepSeek-V3-like MoE
(``--moe-shape``, default 64 experts, hidden 2048, expert 1408, top-6; G = 128, bf16) at T tokens, through the grouped
GEMV (``grouped``: eager and inside a CUDA graph; up to 4096 pairs), through its tensor-core
form (``grouped_tc``, ``GROUPED_TC_MIN_SHARE = 0``: the same two launches, segments of 16-256
rows (256 only for enough pairs an expert and long enough K: ``GROUPED_TC_WIDE``); ``tc_kernel`` says which GEMM: ``wgmma`` on sm_90, ``mma.sync`` elsewhere or with
``FORGE_GEMM_WG=0`` in the environment, which times the other GPUs' kernels on an H100 / H200),
through the per-expert loop (``loop``, ``GROUPED_MAX_PAIRS = 0``, ``GROUPED_TC = False``; eager
only, it reads the counts back) and, as the peers, the same layer in bf16 (the dequantized
weights) as a loop of bf16 matmuls (``bf16 loop``) and as two ``torch._grouped_mm`` calls
(``bf16 grouped_mm``), T = 1 to 16384: the data behind ``forge.runtime.GROUPED_MAX_PAIRS``
and ``GROUPED_TC_MIN_SHARE``. W4A16 decode rows of a model with AwqExperts say which path
its experts take (``moe_path``: ``grouped``, ``grouped_tc`` or ``loop``).

Micro (CUDA, ``--micro``): M = 1 bf16 activations, K x N = 4096 x 4096 and 7168 x 2048
(in_features x out_features), G = 128. ``eager_us``: wall time per call of back-to-back
eager calls (the host cost when the GPU keeps up); ``graph_us``: per call inside one CUDA
graph of 64 calls (GPU time plus in-graph launch gaps). AwqLinear is timed through
``module(x)`` (eager fast path), ``torch.ops.forge.awq_gemm`` (the dispatcher, as
torch.compile calls it) and ``forge.awq_matmul`` (the validating functional API).

Every (model, decode mode) pair, and each micro bench, runs in its own child process, so a
crash in one keeps the others' rows and no mode inherits another's state (compiled `generate`
run right after `graph_step` in one process measured 342 tok/s against 490 in a fresh one,
H100 2026-11-27); each row is appended to the JSON file as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def decode_rate(model, batch: int, new_tokens: int, device: str, vocab: int, graphs: bool) -> float:
    ids = torch.randint(0, vocab, (batch, 16), generator=torch.Generator().manual_seed(0)).to(device)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    if device.startswith("cuda"):
        # a static cache on CUDA makes generate compile the forward itself (transformers'
        # CompileConfig: inductor, mode="reduce-overhead", i.e. CUDA graphs); wrapping the
        # forward in another torch.compile on top crashed (segfault in torch 2.11's static
        # Triton launcher, or a Triton launcher TypeError), for bf16 and W4A16 alike
        kw["cache_implementation"] = "static"
        kw["disable_compile"] = not graphs
    for _ in range(2):  # warm-up: compiles, records the graphs (prefill and decode shapes)
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
    times = {}
    for n in (1, new_tokens + 1):
        best = float("inf")
        for _ in range(2):
            _sync(device)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        times[n] = best
    return batch * new_tokens / (times[new_tokens + 1] - times[1])


@torch.no_grad()
def graph_step_rate(model, batch: int, new_tokens: int, vocab: int) -> float:
    """Greedy decode steps replayed from one hand-captured CUDA graph (forward over a
    StaticCache, argmax into the next input, position + 1): the model's own decode speed,
    without generate's per-token Python. tokens/s = batch * steps / wall time."""
    from transformers import StaticCache

    prompt = 16
    steps = new_tokens
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0)).cuda()
    cache = StaticCache(config=model.config, max_cache_len=prompt + 2 * steps + 8)
    out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt, device="cuda"))
    next_ids = out.logits[:, -1:].argmax(-1)
    pos = torch.tensor([prompt], device="cuda")

    def step():
        logits = model(input_ids=next_ids, past_key_values=cache, cache_position=pos).logits
        next_ids.copy_(logits[:, -1:].argmax(-1))
        pos.add_(1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def _emit(row: dict) -> None:
    print("ROW " + json.dumps(row), flush=True)


def run_model(args) -> None:
    import forge
    from forge.evaluate import load_reference

    name, mode = args.one.split(":")
    if name == "w4a16":
        model = forge.load_quantized(args.forged, device=args.device, tokenizer=False)[0]
    else:
        model = load_reference(args.original, device=args.device)[0]
    model = model.eval()
    vocab = model.config.get_text_config().vocab_size
    top_k = moe_top_k(model)
    from forge.runtime import GROUPED_TC_ROWS, AwqExperts

    experts = next((m for m in model.modules() if isinstance(m, AwqExperts)), None)
    for batch in args.batch:
        row = {"bench": "decode", "model": name, "mode": mode, "device": args.device, "batch": batch}
        row["new_tokens"] = args.new_tokens
        if top_k and experts is not None:
            x = torch.empty(batch, experts.hidden_dim, device=args.device)
            rows = experts._grouped_rows(x, batch * top_k)
            row["moe_path"] = (
                "loop" if rows is None else "grouped_tc" if rows in GROUPED_TC_ROWS else "grouped"
            )
        try:
            if mode == "graph_step":
                rate = graph_step_rate(model, batch, args.new_tokens, vocab)
            else:
                rate = decode_rate(model, batch, args.new_tokens, args.device, vocab, mode == "graphs")
            row["tokens_per_s"] = round(rate, 2)
        except Exception as e:  # keep the other rows
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        if args.device.startswith("cuda"):
            row["gpu"] = torch.cuda.get_device_name()
        _emit(row)


def decode_modes(args) -> list[str]:
    """The decode modes timed: on CUDA with graphs ``graph_step`` and ``graphs`` (then
    ``eager`` with ``--eager-too``), else ``eager``."""
    if args.device.startswith("cuda") and args.graphs:
        return ["graph_step", "graphs"] + (["eager"] if args.eager_too else [])
    return ["eager"]


def moe_top_k(model) -> int:
    """top_k of the model's AwqExperts layers (0 when it has none)."""
    from forge.runtime import AwqExperts

    if not any(isinstance(m, AwqExperts) for m in model.modules()):
        return 0
    cfg = model.config.get_text_config()
    return int(getattr(cfg, "num_experts_per_tok", 0) or getattr(cfg, "top_k", 0) or 0)


@torch.no_grad()
def run_moe_micro(args) -> None:
    import forge
    from forge import runtime
    from forge.runtime import AwqExperts

    e, h, i, top_k = (int(v) for v in args.moe_shape.split("x"))
    g = 128
    # built on the GPU: DeepSeek-V3's 256 experts of 2048 (hidden 7168) are 2.8 GB of words
    gen = torch.Generator("cuda").manual_seed(0)
    mod = AwqExperts(e, h, i, g, "silu", dtype=torch.bfloat16, device="cuda")
    for prefix, (k, n) in (("gate_up", (h, 2 * i)), ("down", (i, h))):
        for part, shape in (("qweight", (e, k, n // 8)), ("qzeros", (e, k // g, n // 8))):
            words = getattr(mod, f"{prefix}_{part}")
            words.copy_(
                torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, device="cuda", dtype=torch.int32)
            )
        getattr(mod, f"{prefix}_scales").copy_(
            (torch.rand(e, k // g, n, generator=gen, device="cuda") * 0.02 + 0.001).half()
        )
    # The peer: the same layer in bf16 (the dequantized weights), as a loop of bf16 matmuls over
    # the experts that got tokens (AwqExperts' own loop with unquantized projections).
    bf16 = AwqExperts(
        e, h, i, g, "silu", quantized_gate_up=False, quantized_down=False, dtype=torch.bfloat16, device="cuda"
    )
    for prefix in ("gate_up", "down"):
        parts = [getattr(mod, f"{prefix}_{p}") for p in ("qweight", "qzeros", "scales")]
        proj = getattr(bf16, f"{prefix}_proj")
        for j in range(e):
            proj[j].copy_(forge.dequantize_awq(*(t[j] for t in parts), g).to(torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    w_gu, w_dn = bf16.gate_up_proj, bf16.down_proj  # (E, 2I, H), (E, H, I)
    # impl -> the runtime settings that send every call of AwqExperts down one path
    settings = {
        "grouped": {"GROUPED_MAX_PAIRS": 1 << 30, "GROUPED_TC": False},
        "grouped_tc": {"GROUPED_TC": True, "GROUPED_TC_MIN_SHARE": 0},
        "loop": {"GROUPED_MAX_PAIRS": 0, "GROUPED_TC": False},
    }
    dev = torch.device("cuda")
    tc_rows = min(runtime.grouped_tc_max_rows(dev, h, 2 * i, g), runtime.grouped_tc_max_rows(dev, i, h, g))
    # the mma.sync GEMM's tiles stop at 64 rows, the wgmma GEMM's go past it
    tc_kernel = None if tc_rows == 0 else "mma.sync" if tc_rows <= 64 else "wgmma"
    default = {name: getattr(runtime, name) for d in settings.values() for name in d}
    for tokens in (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 16384):
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, e, generator=gen).cuda()
        w, idx = torch.topk(logits.softmax(-1), top_k, dim=-1)
        ref = bf16(x, idx, w).float()
        calls = 200 if tokens <= 256 else 20
        for impl in ("grouped", "grouped_tc", "loop", "bf16 loop", "bf16 grouped_mm"):
            if impl == "grouped" and tokens * top_k > 4 * 1024:
                continue  # the SIMT GEMV re-reads an expert's weights every 4 rows
            if impl == "grouped_tc" and tc_kernel is None:
                continue  # no tensor-core form on this GPU for this shape
            row = {"bench": "moe_layer", "impl": impl, "tokens": tokens, "pairs": tokens * top_k}
            row.update({"experts": e, "hidden": h, "intermediate": i, "top_k": top_k, "group_size": g})
            if impl == "grouped_tc":
                row["tc_kernel"] = tc_kernel
            for name, value in settings.get(impl, {}).items():
                setattr(runtime, name, value)
            layer = bf16 if impl == "bf16 loop" else mod
            try:
                if impl == "bf16 grouped_mm":
                    fn = lambda x: _grouped_mm_moe(x, idx, w, w_gu, w_dn)  # noqa: E731
                else:
                    fn = lambda x, layer=layer: layer(x, idx, w)  # noqa: E731
                row["eager_us"] = round(_time_eager(fn, x, calls=calls), 2)
                if impl in ("grouped", "grouped_tc"):
                    row["graph_us"] = round(_time_graph(fn, x, inner=16 if tokens <= 256 else 2), 2)
                row["max_rel_err_vs_bf16"] = float((fn(x).float() - ref).abs().max() / ref.abs().max())
            except Exception as ex:
                row["error"] = f"{type(ex).__name__}: {ex}"[:500]
            finally:
                for name, value in default.items():
                    setattr(runtime, name, value)
            row["gpu"] = torch.cuda.get_device_name()
            _emit(row)


def _grouped_mm_moe(x, idx, w, w_gu, w_dn):
    """The bf16 peer the way grouped-GEMM MoE layers run (transformers' ``grouped_mm`` experts):
    pairs sorted by expert, each projection one ``torch._grouped_mm`` over the experts' row
    ranges, the top-k sum in float32. Routing stays on the GPU (no host read)."""
    e, k = w_gu.shape[0], idx.shape[-1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
    xs = x.index_select(0, order // k)
    gate, up = torch._grouped_mm(xs, w_gu.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    ys = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w_dn.transpose(-2, -1), offs=offs)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, ys.float() * w.reshape(-1)[order, None])
    return out.to(x.dtype)


def _time_eager(fn, x, calls: int = 2000) -> float:
    for _ in range(50):
        fn(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _time_graph(fn, x, inner: int = 64, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * inner) * 1e3


@torch.no_grad()
def run_micro(args) -> None:
    import forge
    from forge.runtime import AwqLinear

    g = 128
    gen = torch.Generator().manual_seed(0)
    for k, n in ((4096, 4096), (7168, 2048)):
        qweight = torch.randint(-(2**31), 2**31, (k, n // 8), generator=gen, dtype=torch.int64).to(
            torch.int32
        )
        qzeros = torch.randint(-(2**31), 2**31, (k // g, n // 8), generator=gen, dtype=torch.int64)
        scales = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
        awq = AwqLinear.from_tensors(qweight, qzeros.to(torch.int32), scales, g).cuda()
        dense = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        qw, qz, sc = awq.qweight, awq.qzeros, awq.scales
        contestants = {
            "AwqLinear": awq,
            "torch.ops.forge.awq_gemm": lambda x: torch.ops.forge.awq_gemm(x, qw, qz, sc, g),
            "forge.awq_matmul": lambda x: forge.awq_matmul(x, qw, qz, sc, g),
            "nn.Linear bf16": dense,
        }
        for name, fn in contestants.items():
            row = {"bench": "per_call", "impl": name, "m": 1, "k": k, "n": n, "group_size": g}
            try:
                row["eager_us"] = round(_time_eager(fn, x), 2)
                row["graph_us"] = round(_time_graph(fn, x), 2)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            row["gpu"] = torch.cuda.get_device_name()
            _emit(row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("forged", nargs="?")
    p.add_argument("original", nargs="?")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--no-graphs", dest="graphs", action="store_false", help="eager (no torch.compile / CUDA graphs)"
    )
    p.add_argument("--eager-too", action="store_true", help="also eager rows after the CUDA-graph ones")
    p.add_argument("--micro", action="store_true", help="also the per-call AwqLinear vs nn.Linear rows")
    p.add_argument("--micro-only", action="store_true")
    p.add_argument("--moe-micro", action="store_true", help="also one AwqExperts layer: grouped vs loop")
    p.add_argument(
        "--moe-shape",
        default="64x2048x1408x6",
        help="the --moe-micro layer: EXPERTSxHIDDENxINTERMEDIATExTOP_K (DeepSeek-V3: 256x7168x2048x8)",
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=["w4a16", "bf16"],
        choices=["w4a16", "bf16"],
        help="decode rows of these",
    )
    p.add_argument("--json", default="bench_runtime.json")
    p.add_argument("--one", help=argparse.SUPPRESS)  # child: micro | moe_micro | MODEL:MODE
    args = p.parse_args()

    if args.one == "micro":
        return run_micro(args)
    if args.one == "moe_micro":
        return run_moe_micro(args)
    if args.one:
        return run_model(args)

    out = Path(args.json)
    rows: list[dict] = json.loads(out.read_text()) if out.exists() else []
    children = []
    if args.micro or args.micro_only:
        children.append("micro")
    if args.moe_micro:
        children.append("moe_micro")
    if not args.micro_only:
        children += [f"{m}:{mode}" for m in args.models for mode in decode_modes(args)]
    for child in children:
        cmd = [sys.executable, "-X", "faulthandler", __file__, *sys.argv[1:], "--one", child]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
                out.write_text(json.dumps(rows, indent=2))
            print(line, end="", flush=True)
        rc = proc.wait()
        print(f"[{child}: exit {rc} after {time.perf_counter() - t0:.0f} s]", flush=True)
        if rc != 0:
            rows.append({"bench": child, "error": f"child exited with {rc}"})
            out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
