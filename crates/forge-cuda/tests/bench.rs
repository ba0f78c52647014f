//! Kernel timings with CUDA events (run with FORGE_BENCH=1 on a GPU; otherwise a no-op).
//! Prints microseconds and effective bandwidth; the comparison against cuBLAS lives in the
//! Python benchmarks.

#![allow(clippy::unwrap_used)]

mod common;

use common::{gpu, Lcg};
use forge_core::grid::GridSpec;
use forge_cuda::ops::{self, DType, Stream};
use forge_cuda::{copy_d2d, time_ms, DeviceBuf};

const S: Stream = Stream {
    device: 0,
    handle: 0,
};

fn enabled() -> bool {
    gpu() && std::env::var_os("FORGE_BENCH").is_some()
}

/// FORGE_BENCH=gemm: only the GEMM table; FORGE_BENCH=ncu: one launch of each big GEMM
/// (for a profiler); anything else: everything.
fn mode() -> String {
    std::env::var("FORGE_BENCH").unwrap_or_default()
}

fn rand_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut r = Lcg(seed);
    (0..n).map(|_| r.next_u32() as u8).collect()
}

#[test]
fn bench_all() {
    if !enabled() {
        eprintln!("bench skipped (needs a GPU and FORGE_BENCH=1)");
        return;
    }
    let mode = mode();
    if mode == "ncu" {
        let (k, n, g) = (7168usize, 18432usize, 128usize);
        let qw = DeviceBuf::from_slice(0, &rand_bytes(k * n / 2, 1)).unwrap();
        let qz = DeviceBuf::from_slice(0, &rand_bytes(k / g * n / 2, 2)).unwrap();
        let scales: Vec<u16> = (0..k / g * n)
            .map(|i| half::f16::from_f32(0.01 + 1e-5 * (i % 100) as f32).to_bits())
            .collect();
        let sc = DeviceBuf::from_slice(0, &scales).unwrap();
        for m in [1usize, 16, 128] {
            let xs: Vec<u16> = (0..m * k)
                .map(|i| half::f16::from_f32(((i % 17) as f32 - 8.0) / 8.0).to_bits())
                .collect();
            let x = DeviceBuf::from_slice(0, &xs).unwrap();
            let y = DeviceBuf::zeroed(0, m * n * 2).unwrap();
            let a = ops::W4a16Gemm {
                x: x.ptr(),
                act: DType::F16,
                m,
                n,
                k,
                group_size: g,
                qweight: qw.ptr(),
                qzeros: qz.ptr(),
                scales: sc.ptr(),
                y: y.ptr(),
                workspace: 0,
                workspace_bytes: 0,
            };
            unsafe { ops::w4a16_gemm_awq(&a, S) }.unwrap();
            forge_cuda::synchronize(0).unwrap();
        }
        return;
    }
    if mode == "gptq" {
        bench_gptq_batched();
        return;
    }
    // Device-to-device copy: the bandwidth yardstick.
    let bytes = 1usize << 30;
    let a = DeviceBuf::zeroed(0, bytes).unwrap();
    let b = DeviceBuf::zeroed(0, bytes).unwrap();
    let ms = time_ms(0, 0, 3, 10, || unsafe {
        copy_d2d(0, b.ptr(), a.ptr(), bytes, 0)
    })
    .unwrap();
    let copy_bw = 2.0 * bytes as f64 / (ms as f64 * 1e-3) / 1e12;
    println!(
        "BENCH d2d copy 1 GiB: {:.1} us, {:.2} TB/s (read+write)",
        ms * 1e3,
        copy_bw
    );
    drop((a, b));

    // W4A16 GEMM.
    for (k, n) in [(7168usize, 18432usize), (7168, 2048), (2048, 7168)] {
        let g = 128;
        let qw = DeviceBuf::from_slice(0, &rand_bytes(k * n / 2, 1)).unwrap();
        let mut r = Lcg(2);
        let zeros: Vec<u32> = (0..k / g * n / 8)
            .map(|_| 0x8888_8888u32 ^ (r.next_u32() & 0x1111_1111))
            .collect();
        let qz = DeviceBuf::from_slice(0, &zeros).unwrap();
        let scales: Vec<u16> = (0..k / g * n)
            .map(|_| half::f16::from_f32(0.01 + 0.001 * r.f()).to_bits())
            .collect();
        let sc = DeviceBuf::from_slice(0, &scales).unwrap();
        let wbytes = (k * n / 2 + k / g * n / 8 * 4 + k / g * n * 2) as f64;
        for act in [DType::F16, DType::Bf16] {
            for m in [1usize, 4, 16, 128] {
                let xs: Vec<u16> = (0..m * k)
                    .map(|_| half::f16::from_f32(r.f()).to_bits())
                    .collect();
                let x = DeviceBuf::from_slice(0, &xs).unwrap();
                let y = DeviceBuf::zeroed(0, m * n * 2).unwrap();
                let wsb = ops::w4a16_workspace_bytes(0, m, n, k, g).unwrap();
                let ws = DeviceBuf::zeroed(0, wsb.max(16)).unwrap();
                let a = ops::W4a16Gemm {
                    x: x.ptr(),
                    act,
                    m,
                    n,
                    k,
                    group_size: g,
                    qweight: qw.ptr(),
                    qzeros: qz.ptr(),
                    scales: sc.ptr(),
                    y: y.ptr(),
                    workspace: ws.ptr(),
                    workspace_bytes: wsb,
                };
                let ms = time_ms(0, 0, 20, 50, || unsafe { ops::w4a16_gemm_awq(&a, S) }).unwrap();
                let tb = wbytes / (ms as f64 * 1e-3) / 1e12;
                let tf = 2.0 * (m * n * k) as f64 / (ms as f64 * 1e-3) / 1e12;
                println!(
                    "BENCH w4a16 {act:?} M={m:<4} K={k} N={n} G={g}: {:8.1} us  weights {:.2} TB/s  {:.1} TFLOP/s",
                    ms * 1e3,
                    tb,
                    tf
                );
            }
        }
    }

    if mode == "gemm" {
        return;
    }
    // Fused AWQ quantize+pack of a bf16 weight 18432 x 7168.
    let (n, k) = (18432usize, 7168usize);
    let spec = GridSpec {
        bits: 4,
        group_size: 128,
        symmetric: false,
    };
    let w = DeviceBuf::from_slice(
        0,
        &rand_bytes(n * k * 2, 3)
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1] & 0x3F]))
            .collect::<Vec<u16>>(),
    )
    .unwrap();
    let qm = DeviceBuf::zeroed(0, n * k / 128 * 4).unwrap();
    let grid = ops::QmetaGrid {
        x: w.ptr(),
        dtype: DType::Bf16,
        rows: n,
        cols: k,
        spec,
        qmeta: qm.ptr(),
        block_scale: 0,
    };
    unsafe { ops::qmeta_range(&grid, S) }.unwrap();
    let ms_range = time_ms(0, 0, 2, 10, || unsafe { ops::qmeta_range(&grid, S) }).unwrap();
    let rb = (n * k * 2 + n * k / 128 * 4) as f64;
    println!(
        "BENCH qmeta_range bf16 {n}x{k}: {:.1} us, {:.2} TB/s",
        ms_range * 1e3,
        rb / (ms_range as f64 * 1e-3) / 1e12
    );
    let mse = forge_core::grid::MseSpec::default();
    let ms_mse = time_ms(0, 0, 1, 3, || unsafe { ops::qmeta_mse(&grid, &mse, S) }).unwrap();
    println!(
        "BENCH qmeta_mse bf16 {n}x{k} (100 candidates, norm 2.4): {:.1} us",
        ms_mse * 1e3
    );
    let qw = DeviceBuf::zeroed(0, k * n / 2).unwrap();
    let qz = DeviceBuf::zeroed(0, k / 128 * n / 2).unwrap();
    let sc = DeviceBuf::zeroed(0, k / 128 * n * 2).unwrap();
    let a = ops::QuantizePack {
        w: w.ptr(),
        dtype: DType::Bf16,
        n,
        k,
        qmeta: qm.ptr(),
        spec,
        block_scale: 0,
    };
    let out = ops::PackedOut {
        qweight: qw.ptr(),
        qzeros: qz.ptr(),
        scales: sc.ptr(),
    };
    let ms = time_ms(0, 0, 3, 20, || unsafe {
        ops::awq_quantize_pack(&a, &out, S)
    })
    .unwrap();
    let moved =
        (n * k * 2 + n * k / 128 * 4 + k * n / 2 + k / 128 * n / 2 + k / 128 * n * 2) as f64;
    let bw = moved / (ms as f64 * 1e-3) / 1e12;
    println!(
        "BENCH awq_quantize_pack bf16 {n}x{k}: {:.1} us, {:.2} TB/s = {:.0}% of d2d copy",
        ms * 1e3,
        bw,
        100.0 * bw / copy_bw
    );

    // The same from FP8 bytes with DeepSeek's 128x128 block scales, as the streaming run
    // uploads them (no f32 copy of the weight on the host or the device).
    let w8 = DeviceBuf::from_slice(
        0,
        &rand_bytes(n * k, 5)
            .iter()
            .map(|b| b & 0x77) // finite E4M3 (|x| <= 240)
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    let bs = DeviceBuf::from_slice(0, &vec![0.01f32; n.div_ceil(128) * k.div_ceil(128)]).unwrap();
    let grid8 = ops::QmetaGrid {
        x: w8.ptr(),
        dtype: DType::F8E4M3,
        block_scale: bs.ptr(),
        ..grid
    };
    unsafe { ops::qmeta_range(&grid8, S) }.unwrap();
    let a8 = ops::QuantizePack {
        w: w8.ptr(),
        dtype: DType::F8E4M3,
        block_scale: bs.ptr(),
        ..a
    };
    let ms = time_ms(0, 0, 3, 20, || unsafe {
        ops::awq_quantize_pack(&a8, &out, S)
    })
    .unwrap();
    let moved = (n * k
        + n * k / 128 / 128 * 4
        + n * k / 128 * 4
        + k * n / 2
        + k / 128 * n / 2
        + k / 128 * n * 2) as f64;
    let bw = moved / (ms as f64 * 1e-3) / 1e12;
    println!(
        "BENCH awq_quantize_pack fp8+block scales {n}x{k}: {:.1} us, {:.2} TB/s = {:.0}% of d2d copy",
        ms * 1e3,
        bw,
        100.0 * bw / copy_bw
    );

    // Hessian 7168 x 7168 from 4096 bf16 tokens.
    let (t, d) = (4096usize, 7168usize);
    let x = DeviceBuf::from_slice(
        0,
        &rand_bytes(t * d * 2, 4)
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1] & 0x3F]))
            .collect::<Vec<u16>>(),
    )
    .unwrap();
    let h = DeviceBuf::zeroed(0, d * d * 4).unwrap();
    let ms = time_ms(0, 0, 1, 3, || unsafe {
        ops::hessian_update(
            &ops::HessianUpdate {
                x: x.ptr(),
                dtype: DType::Bf16,
                d,
                rows: ops::HessianRows::All { t },
                h: h.ptr(),
                alpha: 1.0,
                overwrite: false,
                kernel: ops::HessianKernel::Auto,
            },
            S,
        )
    })
    .unwrap();
    println!(
        "BENCH hessian bf16 T={t} D={d}: {:.2} ms, {:.1} TFLOP/s (symmetric half counted once)",
        ms,
        (t * d * d) as f64 / (ms as f64 * 1e-3) / 1e12
    );
    drop((x, h));

    // GPTQ: 4 experts of 2048 x 7168 (R = N = 2048, C = K = 7168).
    let (e, c, rr) = (4usize, 7168usize, 2048usize);
    let mut r = Lcg(9);
    let wv: Vec<f32> = (0..e * c * rr).map(|_| r.f() * 0.02).collect();
    let mut u = vec![0f32; c * c];
    for i in 0..c {
        u[i * c + i] = 1.0;
        for j in i + 1..(i + 8).min(c) {
            u[i * c + j] = 0.01 * r.f();
        }
    }
    let us: Vec<f32> = (0..e).flat_map(|_| u.iter().copied()).collect();
    let spec = GridSpec {
        bits: 4,
        group_size: 128,
        symmetric: true,
    };
    let qmv: Vec<u32> = vec![0x0108_F95B; e * rr * c / 128];
    let dw = DeviceBuf::from_slice(0, &wv).unwrap();
    let du = DeviceBuf::from_slice(0, &us).unwrap();
    let dq = DeviceBuf::from_slice(0, &qmv).unwrap();
    let dc = DeviceBuf::zeroed(0, e * c * rr).unwrap();
    let de = DeviceBuf::zeroed(0, ops::gptq_workspace_bytes(e, c, rr, 128)).unwrap();
    let a = gptq_args([&dw, &du, &dq, &dc, &de], e, c, rr, spec);
    let ms = time_ms(0, 0, 0, 1, || unsafe { ops::gptq_solve(&a, S) }).unwrap();
    println!(
        "BENCH gptq_solve {e} experts of C={c} R={rr}: {:.1} ms ({:.2} ms per matrix)",
        ms,
        ms / e as f32
    );
}

/// A GPTQ solve of `e` matrices of `c × rr` on the buffers `[w, u, qmeta, codes, err_ws]`,
/// in the natural order, 128 columns a block.
fn gptq_args(
    bufs: [&DeviceBuf; 5],
    e: usize,
    c: usize,
    rr: usize,
    spec: GridSpec,
) -> ops::GptqSolve {
    let [w, u, qmeta, codes, err_ws] = bufs;
    ops::GptqSolve {
        w: w.ptr(),
        u: u.ptr(),
        qmeta: qmeta.ptr(),
        perm: 0,
        codes: codes.ptr(),
        err_ws: err_ws.ptr(),
        experts: e,
        c,
        r: rr,
        spec,
        block_size: 128,
    }
}

/// Batched GPTQ at the anchor shapes (anchors.md: torch.bmm reference 28.5 ms per matrix for
/// 48 experts of N=2048, K=7168 and 13 ms per matrix for 64 experts of N=7168, K=2048).
fn bench_gptq_batched() {
    for (e, c, rr) in [(48usize, 7168usize, 2048usize), (64, 2048, 7168)] {
        let mut r = Lcg(9);
        let wv: Vec<f32> = (0..c * rr).map(|_| r.f() * 0.02).collect();
        let mut u = vec![0f32; c * c];
        for i in 0..c {
            u[i * c + i] = 1.0;
            for j in i + 1..(i + 8).min(c) {
                u[i * c + j] = 0.01 * r.f();
            }
        }
        let spec = GridSpec {
            bits: 4,
            group_size: 128,
            symmetric: true,
        };
        let qmv: Vec<u32> = vec![0x0108_F95B; rr * c / 128];
        let w1 = DeviceBuf::from_slice(0, &wv).unwrap();
        let u1 = DeviceBuf::from_slice(0, &u).unwrap();
        let q1 = DeviceBuf::from_slice(0, &qmv).unwrap();
        let dw = DeviceBuf::zeroed(0, e * c * rr * 4).unwrap();
        let du = DeviceBuf::zeroed(0, e * c * c * 4).unwrap();
        let dq = DeviceBuf::zeroed(0, e * rr * c / 128 * 4).unwrap();
        for i in 0..e {
            unsafe {
                copy_d2d(
                    0,
                    dw.ptr() + (i * c * rr * 4) as u64,
                    w1.ptr(),
                    c * rr * 4,
                    0,
                )
                .unwrap();
                copy_d2d(0, du.ptr() + (i * c * c * 4) as u64, u1.ptr(), c * c * 4, 0).unwrap();
                copy_d2d(
                    0,
                    dq.ptr() + (i * rr * c / 128 * 4) as u64,
                    q1.ptr(),
                    rr * c / 128 * 4,
                    0,
                )
                .unwrap();
            }
        }
        let dc = DeviceBuf::zeroed(0, e * c * rr).unwrap();
        let de = DeviceBuf::zeroed(0, ops::gptq_workspace_bytes(e, c, rr, 128)).unwrap();
        let a = gptq_args([&dw, &du, &dq, &dc, &de], e, c, rr, spec);
        let ms = time_ms(0, 0, 1, 2, || unsafe { ops::gptq_solve(&a, S) }).unwrap();
        let tf = (e * rr * c * c) as f64 / (ms as f64 * 1e-3) / 1e12;
        println!(
            "BENCH gptq_solve {e} experts of C={c} R={rr}: {:.1} ms ({:.3} ms per matrix, {:.1} TFLOP/s counting R*C^2)",
            ms,
            ms / e as f32,
            tf
        );
    }
}
