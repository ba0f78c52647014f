//! GPU-vs-CPU tests: every kernel against forge-core. They are `#[ignore]`d, so a machine
//! without a GPU shows them as ignored (never as passed); on a GPU machine run them with
//! `cargo test -p forge-cuda --release -- --ignored`, where a missing GPU fails them.

#![allow(clippy::unwrap_used)]

mod common;

use common::{gpu, u32s_of, Lcg};
use forge_core::grid::{build_range, refine_mse, GridSpec, MseSpec};
use forge_core::qmeta::QMeta;
use forge_core::{Element, F8E4M3};
use forge_cuda::ops::{self, DType, Stream};
use forge_cuda::{status, synchronize, DeviceBuf};
use half::{bf16, f16};

const S: Stream = Stream {
    device: 0,
    handle: 0,
};

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn compile_every_module() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let st = status();
    eprintln!(
        "device: {:?} cc {:?} nvrtc {:?}",
        st.device_name, st.compute_capability, st.nvrtc_version
    );
    let t = std::time::Instant::now();
    ops::compile_all(0).expect("every module compiles and every kernel is found");
    eprintln!("compile_all: {:.2} s", t.elapsed().as_secs_f64());
}

/// Test matrices: random plus adversarial rows (zeros, all-equal, huge, tiny, subnormal,
/// one outlier), as f32.
fn test_matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = Lcg(seed);
    let mut x = vec![0f32; rows * cols];
    for (i, row) in x.chunks_mut(cols).enumerate() {
        match i % 8 {
            0 => row.iter_mut().for_each(|v| *v = r.n()),
            1 => {} // zeros
            2 => row.iter_mut().for_each(|v| *v = 0.37),
            3 => row.iter_mut().for_each(|v| *v = r.f() * 3.0e4),
            4 => row.iter_mut().for_each(|v| *v = r.f() * 1e-6),
            5 => row.iter_mut().for_each(|v| *v = r.f() * 1e-40), // f32 subnormals
            6 => {
                row.iter_mut().for_each(|v| *v = r.n() * 0.01);
                row[cols / 2] = 5.0;
            }
            _ => row.iter_mut().for_each(|v| *v = r.f().abs() + 0.5), // all positive
        }
    }
    x
}

trait Host: Element + Copy {
    const DT: DType;
    fn from_f32(v: f32) -> Self;
}
impl Host for f32 {
    const DT: DType = DType::F32;
    fn from_f32(v: f32) -> Self {
        v
    }
}
impl Host for f16 {
    const DT: DType = DType::F16;
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}
impl Host for bf16 {
    const DT: DType = DType::Bf16;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl Host for F8E4M3 {
    const DT: DType = DType::F8E4M3;
    fn from_f32(v: f32) -> Self {
        // Nearest representable by search (test-only).
        let mut best = 0u8;
        let mut bd = f32::INFINITY;
        for b in 0..=255u8 {
            let f = F8E4M3(b).to_f32();
            if f.is_finite() && (f - v).abs() < bd {
                bd = (f - v).abs();
                best = b;
            }
        }
        F8E4M3(best)
    }
}

fn convert<T: Host>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

fn grid_case<T: Host>(rows: usize, cols: usize, spec: &GridSpec, mse: Option<&MseSpec>, seed: u64) {
    let x: Vec<T> = convert(&test_matrix(rows, cols, seed));
    let mut cpu = build_range(&x, rows, cols, spec).expect("cpu range");
    let ng = spec.groups(cols);
    let dx = DeviceBuf::from_slice(0, &x).unwrap();
    let dq = DeviceBuf::zeroed(0, rows * ng * 4).unwrap();
    let grid = ops::QmetaGrid {
        x: dx.ptr(),
        dtype: T::DT,
        rows,
        cols,
        spec: *spec,
        qmeta: dq.ptr(),
        block_scale: 0,
    };
    unsafe { ops::qmeta_range(&grid, S) }.unwrap();
    synchronize(0).unwrap();
    let gpu_range: Vec<u32> = dq.download().unwrap();
    let cpu_range = u32s_of(&cpu);
    let bad = cpu_range
        .iter()
        .zip(&gpu_range)
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(
        bad,
        0,
        "range grid {:?} {rows}x{cols} {spec:?}: {bad} of {} differ; first: {:?}",
        T::DT,
        cpu_range.len(),
        cpu_range
            .iter()
            .zip(&gpu_range)
            .enumerate()
            .find(|(_, (a, b))| a != b)
    );
    if let Some(mse) = mse {
        refine_mse(&x, rows, cols, spec, mse, &mut cpu).expect("cpu mse");
        unsafe { ops::qmeta_mse(&grid, mse, S) }.unwrap();
        synchronize(0).unwrap();
        let g: Vec<u32> = dq.download().unwrap();
        let c = u32s_of(&cpu);
        let bad = c.iter().zip(&g).filter(|(a, b)| a != b).count();
        assert_eq!(
            bad,
            0,
            "mse grid {:?} {rows}x{cols} {spec:?} {mse:?}: {bad} of {} differ; first: {:?}",
            T::DT,
            c.len(),
            c.iter().zip(&g).enumerate().find(|(_, (a, b))| a != b)
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn qmeta_grids_bit_exact() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mse = MseSpec::default(); // norm 2.4, 100 candidates
    let mse2 = MseSpec {
        max_shrink: 0.3,
        n_grid: 37,
        norm: 2.0,
    };
    let mse1 = MseSpec {
        max_shrink: 0.2,
        n_grid: 1,
        norm: 3.0,
    };
    for (bits, g, sym) in [
        (4u8, 128usize, false),
        (4, 128, true),
        (4, 32, false),
        (3, 64, true),
        (8, 256, false),
        (4, 96, false),  // 12 lanes of the range grid's 16 per group
        (4, 1024, true), // lanes loop over the group
    ] {
        let spec = GridSpec {
            bits,
            group_size: g,
            symmetric: sym,
        };
        // 300: not a multiple of 8 (element by element); 1000: a padded last group read 8
        // elements at a time; 13 × 512: whole groups read by octets of lanes, a warp's 32
        // groups spanning rows and the last warp part-filled.
        for (rows, cols) in [(16, 512), (13, 300), (8, 1000), (13, 512)] {
            grid_case::<f32>(rows, cols, &spec, Some(&mse), 1);
            grid_case::<f16>(rows, cols, &spec, Some(&mse2), 2);
            grid_case::<bf16>(rows, cols, &spec, Some(&mse), 3);
            grid_case::<F8E4M3>(rows, cols, &spec, Some(&mse1), 4);
        }
    }
    // A bigger one.
    let spec = GridSpec {
        bits: 4,
        group_size: 128,
        symmetric: false,
    };
    grid_case::<bf16>(512, 2048, &spec, Some(&mse), 5);
    eprintln!("qmeta range + mse: bit-exact on all cases");
}

fn qpack_case<T: Host>(n: usize, k: usize, spec: &GridSpec, seed: u64) {
    let w: Vec<T> = convert(&test_matrix(n, k, seed));
    let qmeta = build_range(&w, n, k, spec).unwrap();
    let cpu = forge_core::pack::quantize_pack_awq(&w, &qmeta, n, k, spec).unwrap();
    let dw = DeviceBuf::from_slice(0, &w).unwrap();
    let dm = DeviceBuf::from_slice(0, &qmeta).unwrap();
    let a = ops::QuantizePack {
        w: dw.ptr(),
        dtype: T::DT,
        n,
        k,
        qmeta: dm.ptr(),
        spec: *spec,
        block_scale: 0,
    };
    assert_quantize_pack(&a, &cpu);
}

/// Runs the fused quantize + pack of `a` and checks its three tensors equal `want`.
fn assert_quantize_pack(a: &ops::QuantizePack, want: &forge_core::pack::AwqTensors) {
    let (n, k, dt) = (a.n, a.k, a.dtype);
    let ng = k / a.spec.group_size;
    let qw = DeviceBuf::zeroed(0, k * n / 8 * 4).unwrap();
    let qz = DeviceBuf::zeroed(0, ng * n / 8 * 4).unwrap();
    let sc = DeviceBuf::zeroed(0, ng * n * 2).unwrap();
    let out = ops::PackedOut {
        qweight: qw.ptr(),
        qzeros: qz.ptr(),
        scales: sc.ptr(),
    };
    unsafe { ops::awq_quantize_pack(a, &out, S) }.unwrap();
    synchronize(0).unwrap();
    let scaled = a.block_scale != 0;
    assert_eq!(
        qw.download::<i32>().unwrap(),
        want.qweight,
        "qweight {dt:?} (block scales {scaled}) {n}x{k}"
    );
    assert_eq!(
        qz.download::<i32>().unwrap(),
        want.qzeros,
        "qzeros {dt:?} (block scales {scaled}) {n}x{k}"
    );
    let s: Vec<u16> = sc.download().unwrap();
    let cs: Vec<u16> = want.scales.iter().map(|h| h.to_bits()).collect();
    assert_eq!(s, cs, "scales {dt:?} (block scales {scaled}) {n}x{k}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn awq_quantize_pack_bit_exact() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    // 96: groups starting inside the kernel's tiles (64 inputs; FP8's 256, three groups a tile);
    // k = 160 and 480: a half last tile (FP8: five and seven of its eight 32-input quarters), and
    // for FP8 k = 384 too (four); 32: FP8's eight groups a tile; 520, 264 and 40 rows: a partial
    // row tile (256 rows; FP8's 64).
    for (g, sym) in [
        (128usize, false),
        (128, true),
        (32, false),
        (64, true),
        (96, false),
    ] {
        let spec = GridSpec {
            bits: 4,
            group_size: g,
            symmetric: sym,
        };
        for (n, k) in [
            (256, 256),
            (40, 512),
            (520, 384),
            (8, 128),
            (40, 160),
            (264, 480),
        ] {
            if k % g != 0 {
                continue;
            }
            qpack_case::<f32>(n, k, &spec, 11);
            qpack_case::<f16>(n, k, &spec, 12);
            qpack_case::<bf16>(n, k, &spec, 13);
            qpack_case::<F8E4M3>(n, k, &spec, 14);
        }
    }
    eprintln!("awq quantize+pack: bit-exact on all cases");
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn pack_codes_bit_exact() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mut r = Lcg(21);
    for (k, n, g, sym) in [
        (256usize, 64usize, 128usize, true),
        (384, 520, 128, false),
        (64, 8, 32, false),
    ] {
        let spec = GridSpec {
            bits: 4,
            group_size: g,
            symmetric: sym,
        };
        let w = test_matrix(n, k, 22);
        let mut qmeta = build_range(&w, n, k, &spec).unwrap();
        if !sym {
            // v1 cannot store zero point 0: keep zeros in 1..=15 for the GPTQ comparison.
            for m in qmeta.iter_mut() {
                if m.zero() == 0 {
                    *m = QMeta::new(m.log2_q88(), 1, m.flags());
                }
            }
        }
        let codes: Vec<u8> = (0..k * n).map(|_| r.below(16) as u8).collect();
        let cpu = forge_core::pack::pack_awq(&codes, &qmeta, k, n, &spec).unwrap();
        let dc = DeviceBuf::from_slice(0, &codes).unwrap();
        let dm = DeviceBuf::from_slice(0, &qmeta).unwrap();
        let ng = k / g;
        let qw = DeviceBuf::zeroed(0, k * n / 8 * 4).unwrap();
        let qz = DeviceBuf::zeroed(0, ng * n / 8 * 4).unwrap();
        let sc = DeviceBuf::zeroed(0, ng * n * 2).unwrap();
        let a = ops::PackCodes {
            codes: dc.ptr(),
            qmeta: dm.ptr(),
            n,
            k,
            spec,
        };
        let out = ops::PackedOut {
            qweight: qw.ptr(),
            qzeros: qz.ptr(),
            scales: sc.ptr(),
        };
        unsafe { ops::awq_pack_codes(&a, &out, S) }.unwrap();
        synchronize(0).unwrap();
        assert_eq!(qw.download::<i32>().unwrap(), cpu.qweight);
        assert_eq!(qz.download::<i32>().unwrap(), cpu.qzeros);
        assert_eq!(
            sc.download::<u16>().unwrap(),
            cpu.scales.iter().map(|h| h.to_bits()).collect::<Vec<_>>()
        );

        let cpu = forge_core::pack::pack_gptq(&codes, &qmeta, k, n, &spec).unwrap();
        let flag = DeviceBuf::zeroed(0, 4).unwrap();
        unsafe { ops::gptq_pack_codes(&a, &out, flag.ptr(), S) }.unwrap();
        synchronize(0).unwrap();
        let qwv: Vec<i32> = qw.download().unwrap();
        assert_eq!(&qwv[..k / 8 * n], &cpu.qweight[..]);
        assert_eq!(qz.download::<i32>().unwrap(), cpu.qzeros);
        assert_eq!(
            sc.download::<u16>().unwrap(),
            cpu.scales.iter().map(|h| h.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(flag.download::<u32>().unwrap(), vec![0]);
    }
    eprintln!("awq / gptq v1 packing of codes: bit-exact");
}

/// Random AWQ layer (N, K, G) built through forge-core.
fn awq_layer(n: usize, k: usize, g: usize, seed: u64) -> forge_core::pack::AwqTensors {
    let spec = GridSpec {
        bits: 4,
        group_size: g,
        symmetric: seed.is_multiple_of(2),
    };
    let mut r = Lcg(seed);
    let w: Vec<f32> = (0..n * k).map(|_| r.n() * 0.05).collect();
    let qmeta = build_range(&w, n, k, &spec).unwrap();
    forge_core::pack::quantize_pack_awq(&w, &qmeta, n, k, &spec).unwrap()
}

/// The value of a 16-bit result of dtype `act` (F16, else Bf16).
fn half_value(act: DType, bits: u16) -> f32 {
    if act == DType::F16 {
        f16::from_bits(bits).to_f32()
    } else {
        bf16::from_bits(bits).to_f32()
    }
}

/// `xf` rounded to the activation dtype `act` (F16, else Bf16): the bits to upload and
/// their values as f32 for the CPU reference.
fn activations(act: DType, xf: &[f32]) -> (Vec<u16>, Vec<f32>) {
    match act {
        DType::F16 => xf
            .iter()
            .map(|&v| (f16::from_f32(v).to_bits(), f16::from_f32(v).to_f32()))
            .unzip(),
        _ => xf
            .iter()
            .map(|&v| (bf16::from_f32(v).to_bits(), bf16::from_f32(v).to_f32()))
            .unzip(),
    }
}

fn gemm_case(m: usize, k: usize, n: usize, g: usize, act: DType, seed: u64) {
    gemm_case_at(m, k, n, g, act, seed, 0);
}

/// [`gemm_case`] with the output `y_off` elements into its buffer (`y_off` odd: a y only
/// 2-byte aligned, as a view at an odd element offset is, which any wider store would fault
/// on or misplace).
fn gemm_case_at(m: usize, k: usize, n: usize, g: usize, act: DType, seed: u64, y_off: usize) {
    let awq = awq_layer(n, k, g, seed);
    let mut r = Lcg(seed + 100);
    let xf: Vec<f32> = (0..m * k).map(|_| r.n()).collect();
    let (xbits, xr) = activations(act, &xf);
    let w = forge_core::matmul::dequantize_awq(&awq.qweight, &awq.qzeros, &awq.scales, k, n, g)
        .unwrap();
    let dx = DeviceBuf::from_slice(0, &xbits).unwrap();
    let qw = DeviceBuf::from_slice(0, &awq.qweight).unwrap();
    let qz = DeviceBuf::from_slice(0, &awq.qzeros).unwrap();
    let sc = DeviceBuf::from_slice(0, &awq.scales).unwrap();
    let dy = DeviceBuf::zeroed(0, (m * n + y_off) * 2).unwrap();
    let a = ops::W4a16Gemm {
        x: dx.ptr(),
        act,
        m,
        n,
        k,
        group_size: g,
        qweight: qw.ptr(),
        qzeros: qz.ptr(),
        scales: sc.ptr(),
        y: dy.ptr() + (2 * y_off) as u64,
        workspace: 0,
        workspace_bytes: 0,
    };
    unsafe { ops::w4a16_gemm_awq(&a, S) }.unwrap();
    synchronize(0).unwrap();
    let y: Vec<u16> = dy.download().unwrap();
    assert!(y[..y_off].iter().all(|&v| v == 0), "written before y");
    check_w4a16("gemm", act, (m, k, n, g), &xr, &w, &y[y_off..]);
}

/// Checks a W4A16 output `y [M, N]` against the float64 product of the rounded activations
/// `xr` and the dequantized weight `w [N, K]`.
fn check_w4a16(
    what: &str,
    act: DType,
    (m, k, n, g): (usize, usize, usize, usize),
    xr: &[f32],
    w: &[f32],
    y: &[u16],
) {
    // Tolerance: the weight rounding to the activation dtype plus the output rounding.
    let (wrel, orel) = if act == DType::F16 {
        (2.0f64.powi(-10), 2.0f64.powi(-10))
    } else {
        (2.0f64.powi(-7), 2.0f64.powi(-7))
    };
    let mut worst = 0f64;
    for i in 0..m {
        for j in 0..n {
            let mut refv = 0f64;
            let mut mag = 0f64;
            for kk in 0..k {
                let p = xr[i * k + kk] as f64 * w[j * k + kk] as f64;
                refv += p;
                mag += p.abs();
            }
            let got = half_value(act, y[i * n + j]) as f64;
            let tol = wrel * mag + orel * refv.abs() + 1e-6;
            let err = (got - refv).abs();
            worst = worst.max(err / tol);
            assert!(
                err <= tol,
                "{what} {act:?} m{m} k{k} n{n} g{g}: y[{i},{j}] = {got}, want {refv} (tol {tol})"
            );
        }
    }
    eprintln!("{what} {act:?} m={m} k={k} n={n} g={g}: ok (worst err/tol {worst:.3})");
}

/// The tile repack (bit-identical to `forge_core::pack::tile_awq`) and the tiled GEMV on it
/// (against the float64 reference; two runs bit-identical).
fn tiled_case(m: usize, k: usize, n: usize, g: usize, act: DType, seed: u64) {
    let awq = awq_layer(n, k, g, seed);
    let mut r = Lcg(seed + 200);
    let xf: Vec<f32> = (0..m * k).map(|_| r.n()).collect();
    let (xbits, xr) = activations(act, &xf);
    let w = forge_core::matmul::dequantize_awq(&awq.qweight, &awq.qzeros, &awq.scales, k, n, g)
        .unwrap();
    let qw = DeviceBuf::from_slice(0, &awq.qweight).unwrap();
    let qt = DeviceBuf::zeroed(0, awq.qweight.len() * 4).unwrap();
    unsafe { ops::w4a16_tile_repack(qw.ptr(), qt.ptr(), n, k, S) }.unwrap();
    synchronize(0).unwrap();
    let tiled: Vec<i32> = qt.download().unwrap();
    assert_eq!(
        tiled,
        forge_core::pack::tile_awq(&awq.qweight, k, n).unwrap(),
        "tile repack k{k} n{n}"
    );
    let dx = DeviceBuf::from_slice(0, &xbits).unwrap();
    let qz = DeviceBuf::from_slice(0, &awq.qzeros).unwrap();
    let sc = DeviceBuf::from_slice(0, &awq.scales).unwrap();
    let dy = DeviceBuf::zeroed(0, m * n * 2).unwrap();
    let a = ops::TiledGemv {
        x: dx.ptr(),
        act,
        m,
        n,
        k,
        group_size: g,
        qweight_tiled: qt.ptr(),
        qzeros: qz.ptr(),
        scales: sc.ptr(),
        y: dy.ptr(),
    };
    unsafe { ops::w4a16_gemv_tiled(&a, S) }.unwrap();
    synchronize(0).unwrap();
    let y: Vec<u16> = dy.download().unwrap();
    check_w4a16("tiled", act, (m, k, n, g), &xr, &w, &y);
    unsafe { ops::w4a16_gemv_tiled(&a, S) }.unwrap();
    synchronize(0).unwrap();
    assert_eq!(
        y,
        dy.download::<u16>().unwrap(),
        "tiled GEMV not deterministic"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn w4a16_tiled_gemv_matches_cpu() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mut seed = 71;
    for act in [DType::F16, DType::Bf16] {
        for m in 1..=ops::TILED_MAX_M {
            // G 64/128/256; 4 to 32 warps a tile (M <= 8: 32 at 4096x2048, 25 at 3200x256);
            // a warp with a ragged share of groups (7 groups over 4 warps); the smallest N.
            for (k, n, g) in [
                (512usize, 256usize, 128usize),
                (1024, 544, 64),
                (4096, 2048, 128),
                (3200, 256, 128),
                (1792, 48, 256),
                (896, 16, 128),
            ] {
                tiled_case(m, k, n, g, act, seed);
                seed += 1;
            }
        }
    }
    // Shapes the tile layout does not take are refused before the driver is touched.
    for (k, n, g) in [
        (512usize, 24usize, 128usize),
        (512, 256, 32),
        (512, 256, 96),
    ] {
        let a = ops::TiledGemv {
            x: 16,
            act: DType::F16,
            m: 1,
            n,
            k,
            group_size: g,
            qweight_tiled: 16,
            qzeros: 16,
            scales: 16,
            y: 16,
        };
        assert!(a.validate().is_err(), "k{k} n{n} g{g} accepted");
    }
}

/// The dense dequantization against forge-core's: f32 bit for bit `dequantize_awq`
/// transposed; f16 that value rounded once; bf16 `(q − z)·bf16(s)` rounded once (the W4A16
/// kernels' weights). Scales include adversarial f16 values (subnormal, huge, negative).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn awq_dequant_matches_cpu() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mut seed = 700;
    for (k, n, g) in [
        (256usize, 64usize, 128usize),
        (96, 24, 32),
        (192, 8, 64),
        (1024, 136, 256),
        (64, 4096, 64),
    ] {
        let mut awq = awq_layer(n, k, g, seed);
        let mut r = Lcg(seed + 1);
        for (i, s) in awq.scales.iter_mut().enumerate() {
            match i % 7 {
                1 => *s = f16::from_bits(1 + (r.f().abs() * 1000.0) as u16), // subnormal
                3 => *s = f16::from_f32(-r.f().abs() * 3.0 - 1e-3),
                5 => *s = f16::from_f32(6.0e4),
                _ => {}
            }
        }
        seed += 2;
        let (codes, zeros) =
            forge_core::pack::unpack_awq(&awq.qweight, &awq.qzeros, k, n, g).unwrap();
        let wt =
            forge_core::matmul::dequantize_awq(&awq.qweight, &awq.qzeros, &awq.scales, k, n, g)
                .unwrap(); // [N, K]
        let qw = DeviceBuf::from_slice(0, &awq.qweight).unwrap();
        let qz = DeviceBuf::from_slice(0, &awq.qzeros).unwrap();
        let sc = DeviceBuf::from_slice(0, &awq.scales).unwrap();
        for dt in [DType::F32, DType::F16, DType::Bf16] {
            let out = DeviceBuf::zeroed(0, k * n * dt.size()).unwrap();
            let a = ops::AwqDequant {
                n,
                k,
                group_size: g,
                qweight: qw.ptr(),
                qzeros: qz.ptr(),
                scales: sc.ptr(),
                out: out.ptr(),
                out_dtype: dt,
            };
            unsafe { ops::awq_dequant(&a, S) }.unwrap();
            synchronize(0).unwrap();
            let got32: Vec<u32> = match dt {
                DType::F32 => out.download::<u32>().unwrap(),
                _ => out
                    .download::<u16>()
                    .unwrap()
                    .into_iter()
                    .map(u32::from)
                    .collect(),
            };
            for kk in 0..k {
                for nn in 0..n {
                    let i = kk * n + nn;
                    let want = wt[nn * k + kk];
                    let d = codes[i] as f32 - zeros[(kk / g) * n + nn] as f32;
                    let s = awq.scales[(kk / g) * n + nn].to_f32();
                    let exp = match dt {
                        DType::F32 => want.to_bits(),
                        DType::F16 => u32::from(f16::from_f32(want).to_bits()),
                        _ => u32::from(bf16::from_f32(d * bf16::from_f32(s).to_f32()).to_bits()),
                    };
                    assert_eq!(got32[i], exp, "{dt:?} k{k} n{n} g{g} at ({kk}, {nn})");
                }
            }
        }
        eprintln!("awq_dequant k{k} n{n} g{g}: f32 / f16 / bf16 bit-exact");
    }
    // Shapes, dtypes and alignments it does not take are refused before the driver is touched.
    let base = ops::AwqDequant {
        n: 64,
        k: 256,
        group_size: 128,
        qweight: 16,
        qzeros: 16,
        scales: 16,
        out: 16,
        out_dtype: DType::F16,
    };
    assert!(base.validate().is_ok());
    for bad in [
        ops::AwqDequant { n: 60, ..base },
        ops::AwqDequant { k: 200, ..base },
        ops::AwqDequant {
            group_size: 0,
            ..base
        },
        ops::AwqDequant {
            out_dtype: DType::F8E4M3,
            ..base
        },
        ops::AwqDequant { scales: 8, ..base },
        ops::AwqDequant { out: 0, ..base },
    ] {
        assert!(bad.validate().is_err(), "{bad:?} accepted");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn w4a16_gemm_matches_cpu() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mut seed = 31;
    for act in [DType::F16, DType::Bf16] {
        for m in [1usize, 2, 3, 4, 8, 13, 16, 17, 40, 128, 200] {
            for (k, n, g) in [
                (512usize, 256usize, 128usize),
                (256, 96, 32),
                (1024, 544, 64),
            ] {
                gemm_case(m, k, n, g, act, seed);
                seed += 1;
            }
            if m <= 16 {
                // Long K (split-K, many batches per warp) and a non-power-of-two group
                // (the tiled fallback of the GEMV path).
                gemm_case(m, 4096, 2048, 128, act, seed);
                gemm_case(m, 2048, 160, 32, act, seed + 1);
                gemm_case(m, 960, 64, 96, act, seed + 2);
                seed += 3;
            }
            if m == 128 || m == 17 {
                // Hopper's wgmma kernel with K split (64 stages, 2 blocks of outputs), with all
                // its 128 rows and with 17; an odd stage count (9) with a new group every stage,
                // and groups of 3 stages (G = 192) that start mid-pair.
                gemm_case(m, 4096, 256, 128, act, seed);
                gemm_case(m, 576, 256, 64, act, seed + 1);
                gemm_case(m, 1152, 128, 192, act, seed + 2);
                seed += 3;
            }
            if m == 200 {
                // Hopper's 256-token tile, which the plan takes for these (ops.rs
                // gemm_plan_wgmma_shapes): whole tiles, and a partial third one (600 rows).
                for (m, k, n, g) in [(1024, 512, 4096, 128), (600, 512, 4096, 64)] {
                    let plan = ops::w4a16_plan(0, act, m, n, k, g).unwrap();
                    assert!(
                        !plan.starts_with("w4a16_wg_") || plan.contains("_t256 "),
                        "{plan}"
                    );
                    gemm_case(m, k, n, g, act, seed);
                    seed += 1;
                }
            }
            if m == 128 {
                // Wide enough for the 4-m16-tile kernel; and K split over enough outputs
                // (128 x 1024) for the reduction's four-at-a-time path.
                gemm_case(m, 256, 8448, 128, act, seed);
                gemm_case(m, 4096, 1024, 128, act, seed + 1);
                // Outputs only 2-byte aligned: the wgmma epilogue unsplit, and the
                // reduction's four-at-a-time path.
                gemm_case_at(m, 256, 8448, 128, act, seed + 2, 1);
                gemm_case_at(m, 4096, 1024, 128, act, seed + 3, 3);
                seed += 4;
            }
        }
    }
}

/// Host segment table of the grouped GEMV for routing `ids` (pair = token·top_k + j): pairs
/// sorted stably by expert (ids outside `[0, E)` in one bucket, given expert id `invalid`),
/// each run cut every `rows` pairs, padded with count-0 rows to the worst-case size
/// (padding first when `pad_first`). Returns (order, table, segments).
fn host_segments(
    ids: &[i32],
    experts: usize,
    rows: usize,
    invalid: i32,
    pad_first: bool,
) -> (Vec<i32>, Vec<i32>, usize) {
    let p = ids.len();
    let bucket = |v: i32| {
        if v >= 0 && (v as usize) < experts {
            v as usize
        } else {
            experts
        }
    };
    let mut order: Vec<usize> = (0..p).collect();
    order.sort_by_key(|&i| bucket(ids[i])); // stable
    let mut segs = Vec::new();
    let mut pos = 0;
    while pos < p {
        let b = bucket(ids[order[pos]]);
        let mut c = 0;
        while pos + c < p && c < rows && bucket(ids[order[pos + c]]) == b {
            c += 1;
        }
        let e = if b == experts { invalid } else { b as i32 };
        segs.push([pos as i32, c as i32, e]);
        pos += c;
    }
    let bound = p.min((p + (experts + 1).min(p) * (rows - 1)) / rows).max(1);
    assert!(
        segs.len() <= bound,
        "{} segments > bound {bound}",
        segs.len()
    );
    let pad = vec![[0i32; 3]; bound - segs.len()];
    let all: Vec<[i32; 3]> = if pad_first {
        pad.into_iter().chain(segs).collect()
    } else {
        segs.into_iter().chain(pad).collect()
    };
    let order = order.iter().map(|&i| i as i32).collect();
    (order, all.concat(), bound)
}

/// Grouped GEMV (MoE experts) against the CPU dequantization: `tokens` tokens routed to
/// `top_k` distinct experts each (expert 0 in every other token, masked ids on a few
/// pairs), x rows gathered by token, outputs at the pair index.
#[allow(clippy::too_many_arguments)]
fn grouped_case(
    rows: usize,
    tokens: usize,
    top_k: usize,
    experts: usize,
    k: usize,
    n: usize,
    g: usize,
    act: DType,
    seed: u64,
) {
    let layers: Vec<_> = (0..experts)
        .map(|e| awq_layer(n, k, g, seed * 1000 + e as u64))
        .collect();
    let qweight: Vec<i32> = layers.iter().flat_map(|l| l.qweight.clone()).collect();
    let qzeros: Vec<i32> = layers.iter().flat_map(|l| l.qzeros.clone()).collect();
    let scales: Vec<f16> = layers.iter().flat_map(|l| l.scales.clone()).collect();
    let w: Vec<Vec<f32>> = layers
        .iter()
        .map(|l| {
            forge_core::matmul::dequantize_awq(&l.qweight, &l.qzeros, &l.scales, k, n, g).unwrap()
        })
        .collect();
    let mut r = Lcg(seed + 7);
    let mut ids = Vec::with_capacity(tokens * top_k);
    for t in 0..tokens {
        let mut pick: Vec<i32> = Vec::new();
        if t % 2 == 0 {
            pick.push(0);
        }
        while pick.len() < top_k.min(experts) {
            let e = r.below(experts as u32) as i32;
            if !pick.contains(&e) {
                pick.push(e);
            }
        }
        pick.resize(top_k, -1);
        ids.extend(pick);
    }
    if tokens > 1 {
        ids[top_k + top_k - 1] = -1;
        ids[(tokens - 1) * top_k] = experts as i32;
    }
    let pairs = ids.len();
    let invalid = if seed.is_multiple_of(2) {
        experts as i32
    } else {
        -1
    };
    let (order, table, nseg) = host_segments(&ids, experts, rows, invalid, seed.is_multiple_of(3));
    let x_rows: Vec<i32> = order.iter().map(|&p| p / top_k as i32).collect();
    let xf: Vec<f32> = (0..tokens * k).map(|_| r.n()).collect();
    let (xbits, xr) = activations(act, &xf);
    let dx = DeviceBuf::from_slice(0, &xbits).unwrap();
    let dxr = DeviceBuf::from_slice(0, &x_rows).unwrap();
    let dor = DeviceBuf::from_slice(0, &order).unwrap();
    let dseg = DeviceBuf::from_slice(0, &table).unwrap();
    let qw = DeviceBuf::from_slice(0, &qweight).unwrap();
    let qz = DeviceBuf::from_slice(0, &qzeros).unwrap();
    let sc = DeviceBuf::from_slice(0, &scales).unwrap();
    let ws_bytes = ops::w4a16_grouped_workspace_bytes(0, rows, pairs, nseg, n, k, g).unwrap();
    let ws = DeviceBuf::zeroed(0, ws_bytes.max(16)).unwrap();
    let mut outs = Vec::new();
    for own_ws in [false, true] {
        // NaN-filled output: every element must be written
        let dy = DeviceBuf::from_slice(0, &vec![0x7E00u16; pairs * n]).unwrap();
        let a = ops::GroupedGemv {
            x: dx.ptr(),
            act,
            x_rows: dxr.ptr(),
            out_rows: dor.ptr(),
            pairs,
            segments: dseg.ptr(),
            num_segments: nseg,
            rows,
            experts,
            k,
            n,
            group_size: g,
            qweight: qw.ptr(),
            qzeros: qz.ptr(),
            scales: sc.ptr(),
            expert_strides: ops::GroupedGemv::dense_strides(k, n, g),
            y: dy.ptr(),
            workspace: if own_ws { ws.ptr() } else { 0 },
            workspace_bytes: if own_ws { ws_bytes } else { 0 },
        };
        unsafe { ops::w4a16_grouped_gemv_awq(&a, S) }.unwrap();
        synchronize(0).unwrap();
        outs.push(dy.download::<u16>().unwrap());
    }
    assert_eq!(outs[0], outs[1], "grouped gemv is deterministic");
    let y = &outs[0];
    let (wrel, orel) = if act == DType::F16 {
        (2.0f64.powi(-10), 2.0f64.powi(-10))
    } else {
        (2.0f64.powi(-7), 2.0f64.powi(-7))
    };
    let mut worst = 0f64;
    for (pair, &e) in ids.iter().enumerate() {
        let row = &y[pair * n..(pair + 1) * n];
        if e < 0 || e as usize >= experts {
            assert!(row.iter().all(|&b| b == 0), "masked pair {pair}: not zeros");
            continue;
        }
        let xt = &xr[(pair / top_k) * k..(pair / top_k + 1) * k];
        let we = &w[e as usize];
        for (j, &bits) in row.iter().enumerate() {
            let (mut refv, mut mag) = (0f64, 0f64);
            for (kk, &xv) in xt.iter().enumerate() {
                let p = xv as f64 * we[j * k + kk] as f64;
                refv += p;
                mag += p.abs();
            }
            let got = half_value(act, bits) as f64;
            let tol = wrel * mag + orel * refv.abs() + 1e-6;
            let err = (got - refv).abs();
            worst = worst.max(err / tol);
            assert!(
                err <= tol,
                "grouped {act:?} r{rows} T{tokens} k{top_k} E{experts} K{k} N{n} G{g}: \
                 y[pair {pair} (expert {e}), {j}] = {got}, want {refv} (tol {tol})"
            );
        }
    }
    eprintln!(
        "grouped {act:?} rows={rows} T={tokens} top_k={top_k} E={experts} K={k} N={n} G={g} \
         segments={nseg} workspace={ws_bytes}: ok (worst err/tol {worst:.3})"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn w4a16_grouped_gemv_matches_cpu() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mut seed = 501;
    for act in [DType::F16, DType::Bf16] {
        for rows in [1usize, 2, 4] {
            for (tokens, top_k) in [(1usize, 6usize), (3, 6), (16, 8)] {
                grouped_case(rows, tokens, top_k, 16, 512, 256, 128, act, seed);
                grouped_case(rows, tokens, top_k, 16, 256, 96, 32, act, seed + 1);
                seed += 2;
            }
        }
        // DeepSeek-V3-like shapes (hidden 2048, expert 1408): decode gate_up (K split),
        // batch-16 down, and long runs of few experts (every segment full).
        grouped_case(1, 1, 6, 16, 2048, 2816, 128, act, seed);
        grouped_case(2, 16, 6, 16, 1408, 2048, 128, act, seed + 1);
        grouped_case(4, 16, 8, 8, 2048, 512, 64, act, seed + 2);
        seed += 3;
    }
}

/// The grouped form on tensor cores (rows 16 to 128): the wgmma kernel on an sm_90 GPU for the
/// shapes it takes, the mma.sync kernel on other shapes and GPUs (and everywhere with
/// `FORGE_GEMM_WG=0`: run this test so too on an H100 / H200).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn w4a16_grouped_tc_matches_cpu() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let (k, n, g) = (512, 256, 128);
    let buf = DeviceBuf::zeroed(0, 256).unwrap();
    let args = |rows: usize, k: usize, n: usize, g: usize| ops::GroupedGemv {
        x: buf.ptr(),
        act: DType::Bf16,
        x_rows: buf.ptr(),
        out_rows: buf.ptr(),
        pairs: 8,
        segments: buf.ptr(),
        num_segments: 8,
        rows,
        experts: 8,
        k,
        n,
        group_size: g,
        qweight: buf.ptr(),
        qzeros: buf.ptr(),
        scales: buf.ptr(),
        expert_strides: ops::GroupedGemv::dense_strides(k, n, g),
        y: buf.ptr(),
        workspace: 0,
        workspace_bytes: 0,
    };
    // Refused with an error naming `rows` before anything is launched (the buffers are never
    // read): past the device's tiles for the shape.
    let refused = |rows: usize, k: usize, n: usize, g: usize| {
        let err = unsafe { ops::w4a16_grouped_gemv_awq(&args(rows, k, n, g), S) }.unwrap_err();
        assert!(
            matches!(
                err,
                forge_cuda::CudaError::InvalidArgument { name: "rows", .. }
            ),
            "{err}"
        );
        eprintln!("rows {rows} refused for K {k} N {n} G {g}: {err}");
    };
    let max = ops::grouped_tc_max_rows(0, n, k, g).unwrap();
    if max == 0 {
        refused(16, k, n, g); // before sm_80: no tensor-core form
        return;
    }
    let wgmma = max == 256;
    // A shape the wgmma kernel does not take (N % 128 != 0, G = 32) runs up to 64 rows.
    assert_eq!(ops::grouped_tc_max_rows(0, 96, k, 32).unwrap(), 64);
    assert_eq!(max, if wgmma { 256 } else { 64 });
    if !wgmma {
        refused(128, k, n, g);
        refused(256, k, n, g);
    }
    let mut seed = 901;
    for act in [DType::F16, DType::Bf16] {
        // rows, tokens, top_k, experts, K, N, G: runs cut into several segments, partial and
        // full tiles, masked ids, a group size that is not a power of two (192), and
        // DeepSeek-V3-like gate_up / down experts (hidden 2048, expert 1408); then shapes only
        // the mma.sync kernel takes (N not a multiple of 128 or 256, G = 32).
        for (rows, tokens, top_k, experts, k, n, g) in [
            (16, 64, 8, 16, 512, 256, 128),
            (32, 40, 6, 8, 256, 384, 64),
            (64, 100, 4, 4, 1024, 128, 128),
            (128, 200, 2, 4, 576, 256, 192),
            (256, 300, 2, 2, 1024, 256, 128),
            (256, 520, 4, 4, 512, 384, 64),
            (16, 3, 6, 16, 512, 256, 128),
            (64, 32, 6, 16, 2048, 2816, 128),
            (32, 32, 6, 16, 1408, 2048, 128),
            (16, 24, 6, 8, 256, 96, 32),
            (32, 40, 4, 8, 512, 160, 64),
            (64, 100, 4, 4, 1024, 288, 32),
            (64, 70, 8, 16, 768, 352, 96),
        ] {
            if rows <= ops::grouped_tc_max_rows(0, n, k, g).unwrap() {
                grouped_case(rows, tokens, top_k, experts, k, n, g, act, seed);
            } else {
                refused(rows, k, n, g);
            }
            seed += 1;
        }
    }
}

/// Every Hessian kernel that takes `dt` and `d` on this device (the automatic choice too).
fn hessian_kernels(dt: DType, d: usize) -> Vec<ops::HessianKernel> {
    use ops::HessianKernel as K;
    let mut v = vec![K::Auto, K::Simt];
    if dt != DType::F32 && d.is_multiple_of(8) {
        v.push(K::MmaSync);
        if status().compute_capability == Some((9, 0)) {
            v.push(K::Wgmma);
        }
    }
    v
}

/// `xf` stored as `dt` (F32, F16 or Bf16): its little-endian bytes and the f32 values they hold.
fn float_rows(dt: DType, xf: &[f32]) -> (Vec<u8>, Vec<f32>) {
    if dt == DType::F32 {
        return (
            xf.iter().flat_map(|v| v.to_le_bytes()).collect(),
            xf.to_vec(),
        );
    }
    let (bits, vals) = activations(dt, xf);
    (bits.iter().flat_map(|b| b.to_le_bytes()).collect(), vals)
}

/// Element `(i, j)` of `XᵀX` in float64 over `rows` of `x` (row-major, `d` columns), and the
/// sum of the products' magnitudes (the scale of fp32 rounding).
fn xtx_f64(
    x: &[f32],
    d: usize,
    rows: impl Iterator<Item = usize>,
    i: usize,
    j: usize,
) -> (f64, f64) {
    let (mut s, mut mag) = (0f64, 0f64);
    for r in rows {
        let p = x[r * d + i] as f64 * x[r * d + j] as f64;
        s += p;
        mag += p.abs();
    }
    (s, mag)
}

/// One Hessian update of `rows` of `x` into `h` with `kernel`, adding (`overwrite` false)
/// or writing a fresh product; returns the downloaded H.
#[allow(clippy::too_many_arguments)]
fn hessian_run(
    x: &DeviceBuf,
    dt: DType,
    d: usize,
    rows: ops::HessianRows,
    h: &DeviceBuf,
    alpha: f32,
    kernel: ops::HessianKernel,
    overwrite: bool,
) -> Vec<f32> {
    let a = ops::HessianUpdate {
        x: x.ptr(),
        dtype: dt,
        d,
        rows,
        h: h.ptr(),
        alpha,
        overwrite,
        kernel,
    };
    unsafe { ops::hessian_update(&a, S) }.unwrap();
    synchronize(0).unwrap();
    h.download().unwrap()
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn hessian_matches_f64() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mut r = Lcg(41);
    for dt in [DType::F32, DType::F16, DType::Bf16] {
        // 520 and 1032: several 128 × 256 Hopper tiles, partial ones, and (1032) more than
        // one of its 8 × 4 tile groups.
        for (t, d) in [
            (300usize, 200usize),
            (64, 64),
            (1000, 130),
            (200, 520),
            (90, 1032),
        ] {
            let xf: Vec<f32> = (0..t * d).map(|_| r.n()).collect();
            let (bytes, xr) = float_rows(dt, &xf);
            let dx = DeviceBuf::from_slice(0, &bytes).unwrap();
            // Start from a non-zero H to check the accumulation.
            let h0: Vec<f32> = (0..d * d).map(|i| ((i / d + i % d) % 7) as f32).collect();
            for kernel in hessian_kernels(dt, d) {
                let dh = DeviceBuf::from_slice(0, &h0).unwrap();
                let h = hessian_run(
                    &dx,
                    dt,
                    d,
                    ops::HessianRows::All { t },
                    &dh,
                    0.5,
                    kernel,
                    false,
                );
                for i in 0..d {
                    for j in 0..d {
                        let (s, mag) = xtx_f64(&xr, d, 0..t, i, j);
                        let want = h0[i * d + j] as f64 + 0.5 * s;
                        let tol = 1e-6 * (mag + h0[i * d + j] as f64) * (t as f64).sqrt().max(4.0);
                        assert!(
                            (h[i * d + j] as f64 - want).abs() <= tol,
                            "{dt:?} {kernel:?} H[{i},{j}] {} vs {want}",
                            h[i * d + j]
                        );
                        assert_eq!(h[i * d + j].to_bits(), h[j * d + i].to_bits(), "symmetry");
                    }
                }
            }
        }
    }
    // Segmented: 3 experts, random token lists (one empty); f32 runs the SIMT kernel, bf16
    // with D % 8 == 0 the tensor-core one (D = 264: two full 128-wide tiles and a partial one;
    // one list spans several 32-row steps and ends inside one).
    let (t, d) = (500usize, 264usize);
    let lists: Vec<Vec<i32>> = vec![
        (0..t as i32).filter(|i| i % 3 == 0).collect(),
        vec![],
        (0..t as i32)
            .rev()
            .filter(|i| i % 5 == 1 || i % 7 == 2)
            .collect(),
    ];
    let mut idx = Vec::new();
    let mut off = vec![0i32];
    for l in &lists {
        idx.extend_from_slice(l);
        off.push(idx.len() as i32);
    }
    for dt in [DType::F32, DType::Bf16] {
        let xf: Vec<f32> = (0..t * d).map(|_| r.n()).collect();
        let (bytes, x) = float_rows(dt, &xf);
        let dx = DeviceBuf::from_slice(0, &bytes).unwrap();
        let di = DeviceBuf::from_slice(0, &idx).unwrap();
        let doff = DeviceBuf::from_slice(0, &off).unwrap();
        for kernel in hessian_kernels(dt, d) {
            let dh = DeviceBuf::zeroed(0, 3 * d * d * 4).unwrap();
            let rows = ops::HessianRows::Routed {
                idx: di.ptr(),
                offsets: doff.ptr(),
                experts: 3,
            };
            let h = hessian_run(&dx, dt, d, rows, &dh, 1.0, kernel, false);
            for (e, l) in lists.iter().enumerate() {
                for i in 0..d {
                    for j in 0..d {
                        let (s, mag) = xtx_f64(&x, d, l.iter().map(|&r| r as usize), i, j);
                        let got = h[e * d * d + i * d + j] as f64;
                        assert!(
                            (got - s).abs() <= 1e-5 * mag + 1e-6,
                            "{dt:?} {kernel:?} expert {e} H[{i},{j}] {got} vs {s}"
                        );
                        assert_eq!(
                            got.to_bits(),
                            (h[e * d * d + j * d + i] as f64).to_bits(),
                            "symmetry"
                        );
                    }
                }
            }
        }
    }
    eprintln!("hessian (plain f32/f16/bf16 and segmented): within fp32 tolerance");
}

/// `overwrite`: every kernel writes `H = alpha · XᵀX` over an H full of NaN (so no element
/// is read and added), bit for bit what adding to a zeroed H gives, and zeros for an expert
/// without rows; plain rows too, at the sizes with partial and diagonal Hopper tiles.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn hessian_overwrite_is_a_fresh_product() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mut r = Lcg(43);
    let (t, experts) = (700usize, 4usize);
    let lists: Vec<Vec<i32>> = vec![
        (0..t as i32).filter(|i| i % 3 == 0).collect(),
        vec![],
        (0..t as i32).rev().filter(|i| i % 5 == 1).collect(),
        vec![7],
    ];
    let mut idx = Vec::new();
    let mut off = vec![0i32];
    for l in &lists {
        idx.extend_from_slice(l);
        off.push(idx.len() as i32);
    }
    let di = DeviceBuf::from_slice(0, &idx).unwrap();
    let doff = DeviceBuf::from_slice(0, &off).unwrap();
    for dt in [DType::F32, DType::Bf16] {
        for d in [264usize, 520, 1032] {
            let xf: Vec<f32> = (0..t * d).map(|_| r.n()).collect();
            let (bytes, _) = float_rows(dt, &xf);
            let dx = DeviceBuf::from_slice(0, &bytes).unwrap();
            for kernel in hessian_kernels(dt, d) {
                for (rows, n) in [
                    (ops::HessianRows::All { t }, 1usize),
                    (
                        ops::HessianRows::Routed {
                            idx: di.ptr(),
                            offsets: doff.ptr(),
                            experts,
                        },
                        experts,
                    ),
                ] {
                    let added = hessian_run(
                        &dx,
                        dt,
                        d,
                        rows,
                        &DeviceBuf::zeroed(0, n * d * d * 4).unwrap(),
                        0.25,
                        kernel,
                        false,
                    );
                    let nan = DeviceBuf::from_slice(0, &vec![f32::NAN; n * d * d]).unwrap();
                    let fresh = hessian_run(&dx, dt, d, rows, &nan, 0.25, kernel, true);
                    for (k, (a, b)) in added.iter().zip(&fresh).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{dt:?} D={d} {kernel:?} {rows:?} element {k}: {b} vs {a}"
                        );
                    }
                    if n == experts {
                        assert!(fresh[d * d..2 * d * d].iter().all(|v| v.to_bits() == 0));
                    }
                }
            }
        }
    }
    eprintln!("hessian overwrite: bit-identical to adding into zeros, empty experts zeroed");
}

/// The Hopper kernel updates H as float4s: with an H that is only 4-byte aligned, an explicit
/// `Wgmma` is refused naming `h`, and `Auto` takes another kernel, with the same sums (to
/// fp32 rounding) as on an aligned H.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn hessian_wgmma_needs_aligned_h() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    if status().compute_capability != Some((9, 0)) {
        eprintln!("not a compute capability 9.0 device: nothing to check");
        return;
    }
    let (t, d) = (200usize, 264usize);
    let mut r = Lcg(77);
    let xf: Vec<f32> = (0..t * d).map(|_| r.n()).collect();
    let (bytes, xr) = float_rows(DType::Bf16, &xf);
    let dx = DeviceBuf::from_slice(0, &bytes).unwrap();
    let dh = DeviceBuf::zeroed(0, (d * d + 1) * 4).unwrap();
    let mut a = ops::HessianUpdate {
        x: dx.ptr(),
        dtype: DType::Bf16,
        d,
        rows: ops::HessianRows::All { t },
        h: dh.ptr() + 4,
        alpha: 1.0,
        overwrite: false,
        kernel: ops::HessianKernel::Wgmma,
    };
    let err = unsafe { ops::hessian_update(&a, S) }
        .unwrap_err()
        .to_string();
    assert!(err.contains("16-byte aligned h"), "{err}");
    a.kernel = ops::HessianKernel::Auto;
    unsafe { ops::hessian_update(&a, S) }.unwrap();
    synchronize(0).unwrap();
    let got: Vec<f32> = dh.download().unwrap();
    let aligned = DeviceBuf::zeroed(0, d * d * 4).unwrap();
    let want = hessian_run(
        &dx,
        DType::Bf16,
        d,
        ops::HessianRows::All { t },
        &aligned,
        1.0,
        ops::HessianKernel::Wgmma,
        false,
    );
    assert_eq!(got[0], 0.0, "the float before H is untouched");
    // Against float64 (products of bf16 values are exact; fp32 sums of t terms).
    for i in 0..d {
        for j in 0..d {
            let (s, mag) = xtx_f64(&xr, d, 0..t, i, j);
            let g = got[1 + i * d + j] as f64;
            assert!(
                (g - s).abs() <= 1e-6 * mag * (t as f64).sqrt(),
                "H[{i},{j}] {g} vs {s}"
            );
        }
    }
    for (i, (&g, &w)) in got[1..].iter().zip(&want).enumerate() {
        // Both sum the same exact products of unit-scale inputs, in another order.
        assert!((g - w).abs() <= 4e-6 * t as f32, "H[{i}]: {g} vs {w}");
    }
}

fn gptq_problem(
    c: usize,
    r: usize,
    seed: u64,
    act_order: bool,
) -> (Vec<f32>, forge_core::gptq::reference::HessianFactor) {
    let mut rng = Lcg(seed);
    let w: Vec<f32> = (0..c * r).map(|_| rng.n() * 0.02).collect(); // weight_t [C, R]
                                                                    // Well-conditioned H = XᵀX / T with correlated inputs.
    let t = 4 * c;
    let mut x = vec![0f32; t * c];
    for row in x.chunks_mut(c) {
        let common = rng.n();
        for (i, v) in row.iter_mut().enumerate() {
            *v = rng.n() * (1.0 + (i % 5) as f32 * 0.3) + 0.3 * common;
        }
    }
    let mut h = vec![0f32; c * c];
    for i in 0..c {
        for j in 0..c {
            let mut s = 0f64;
            for tt in 0..t {
                s += x[tt * c + i] as f64 * x[tt * c + j] as f64;
            }
            h[i * c + j] = (s / t as f64) as f32;
        }
    }
    let f = forge_core::gptq::reference::prepare_hessian(&h, c, 0.01, act_order).unwrap();
    (w, f)
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn gptq_solver_matches_cpu() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    for (c, r, g, e, act) in [
        (256usize, 128usize, 128usize, 3usize, false),
        (384, 96, 64, 2, true),
        (200, 64, 32, 2, false),
        (198, 50, 32, 2, true), // C, R not multiples of 4: scalar paths of gptq_trail_tf32x3
        // Past one super-block (512 columns): the super-block's own trailing product.
        (640, 96, 128, 2, false),
        (650, 40, 64, 1, true),
        // One block (no trailing GEMM): bit-identical to the CPU. 100 = 12 sub-blocks of 8
        // and a partial one; the second expert has zero coefficients in U (the kernel's
        // tested path, as forge-core skips them).
        (120, 96, 32, 2, true),
        (100, 70, 32, 2, false),
    ] {
        let spec = GridSpec {
            bits: 4,
            group_size: g,
            symmetric: false,
        };
        let mut ws = Vec::new();
        let mut us = Vec::new();
        let mut qms = Vec::new();
        let mut perms: Vec<i32> = Vec::new();
        let mut cpu_codes = Vec::new();
        let mut cpu_w = Vec::new();
        for ei in 0..e {
            let (w, mut f) = gptq_problem(c, r, 51 + ei as u64, act);
            if c <= 128 && ei == 1 {
                for j in 0..c {
                    for k in (j + 1..c).step_by(7) {
                        f.hinv_chol[j * c + k] = 0.0;
                    }
                }
            }
            // qmeta of W = weight_t.T [R, C]
            let mut wt = vec![0f32; r * c];
            for i in 0..c {
                for j in 0..r {
                    wt[j * c + i] = w[i * r + j];
                }
            }
            let qm = build_range(&wt, r, c, &spec).unwrap();
            let mut wc = w.clone();
            let codes = forge_core::gptq::solve(
                &mut wc,
                c,
                r,
                &f.hinv_chol,
                &qm,
                &spec,
                128,
                f.perm.as_deref(),
            )
            .unwrap();
            ws.extend_from_slice(&w);
            us.extend_from_slice(&f.hinv_chol);
            qms.extend_from_slice(&qm);
            match &f.perm {
                Some(p) => perms.extend(p.iter().map(|&v| v as i32)),
                None => perms.extend(0..c as i32),
            }
            cpu_codes.extend_from_slice(&codes);
            cpu_w.extend_from_slice(&wc);
        }
        let dw = DeviceBuf::from_slice(0, &ws).unwrap();
        let du = DeviceBuf::from_slice(0, &us).unwrap();
        let dq = DeviceBuf::from_slice(0, &qms).unwrap();
        let dp = DeviceBuf::from_slice(0, &perms).unwrap();
        let dc = DeviceBuf::zeroed(0, e * c * r).unwrap();
        let de = DeviceBuf::zeroed(0, ops::gptq_workspace_bytes(e, c, r, 128)).unwrap();
        let pp = if act { dp.ptr() } else { 0 };
        unsafe {
            ops::gptq_solve(
                &ops::GptqSolve {
                    w: dw.ptr(),
                    u: du.ptr(),
                    qmeta: dq.ptr(),
                    perm: pp,
                    codes: dc.ptr(),
                    err_ws: de.ptr(),
                    experts: e,
                    c,
                    r,
                    spec,
                    block_size: 128,
                },
                S,
            )
        }
        .unwrap();
        synchronize(0).unwrap();
        let codes: Vec<u8> = dc.download().unwrap();
        let w_out: Vec<f32> = dw.download().unwrap();
        let same = codes.iter().zip(&cpu_codes).filter(|(a, b)| a == b).count();
        let frac = same as f64 / codes.len() as f64;
        let mut max_dw = 0f32;
        for (a, b) in w_out.iter().zip(&cpu_w) {
            max_dw = max_dw.max((a - b).abs());
        }
        eprintln!("gptq c{c} r{r} g{g} e{e} act_order={act}: equal codes {:.5}, max |W_gpu - W_cpu| {max_dw:.3e}", frac);
        if c <= 128 {
            assert_eq!(
                codes, cpu_codes,
                "c{c} r{r}: one block, codes must be identical"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&w_out) == bits(&cpu_w),
                "c{c} r{r}: one block, W must be identical"
            );
        }
        assert!(frac >= 0.999, "only {frac} of the codes agree");
    }
}

/// FP8 weights with DeepSeek's 128×128 block scales, read as stored (one byte per weight plus
/// the scales) by the range grid, the MSE search and the fused pack: bit-identical to the CPU
/// maths on the dequantized f32 weight `e4m3 · scale[r/128, c/128]`.
fn fp8_block_case(n: usize, k: usize, spec: &GridSpec, mse: &MseSpec, seed: u64) {
    let w: Vec<F8E4M3> = convert(&test_matrix(n, k, seed));
    let (rb, cb) = (n.div_ceil(ops::FP8_BLOCK), k.div_ceil(ops::FP8_BLOCK));
    let mut r = Lcg(seed + 100);
    let scales: Vec<f32> = (0..rb * cb)
        .map(|_| 10f32.powf(r.f() * 4.0 - 3.0))
        .collect();
    let x: Vec<f32> = (0..n * k)
        .map(|i| w[i].to_f32() * scales[(i / k) / ops::FP8_BLOCK * cb + (i % k) / ops::FP8_BLOCK])
        .collect();
    let mut cpu = build_range(&x, n, k, spec).unwrap();
    refine_mse(&x, n, k, spec, mse, &mut cpu).unwrap();
    let dw = DeviceBuf::from_slice(0, &w).unwrap();
    let ds = DeviceBuf::from_slice(0, &scales).unwrap();
    let dq = DeviceBuf::zeroed(0, n * spec.groups(k) * 4).unwrap();
    let grid = ops::QmetaGrid {
        x: dw.ptr(),
        dtype: DType::F8E4M3,
        rows: n,
        cols: k,
        spec: *spec,
        qmeta: dq.ptr(),
        block_scale: ds.ptr(),
    };
    unsafe { ops::qmeta_range(&grid, S) }.unwrap();
    unsafe { ops::qmeta_mse(&grid, mse, S) }.unwrap();
    synchronize(0).unwrap();
    let g: Vec<u32> = dq.download().unwrap();
    assert_eq!(g, u32s_of(&cpu), "fp8 block-scaled grid {n}x{k} {spec:?}");
    if !n.is_multiple_of(8) || !k.is_multiple_of(spec.group_size) {
        return;
    }
    let want = forge_core::pack::quantize_pack_awq(&x, &cpu, n, k, spec).unwrap();
    let a = ops::QuantizePack {
        w: dw.ptr(),
        dtype: DType::F8E4M3,
        n,
        k,
        qmeta: dq.ptr(),
        spec: *spec,
        block_scale: ds.ptr(),
    };
    assert_quantize_pack(&a, &want);
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn fp8_block_scales_read_by_the_kernels_bit_exact() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mse = MseSpec::default();
    for (g, sym) in [(128usize, false), (64, true), (32, false)] {
        let spec = GridSpec {
            bits: 4,
            group_size: g,
            symmetric: sym,
        };
        for (n, k) in [(256, 1024), (296, 640), (13, 300)] {
            fp8_block_case(n, k, &spec, &mse, 21);
        }
    }
    eprintln!("fp8 block scales: grid, mse and pack bit-exact");
}

/// Every non-NaN fp8 E4M3 byte (subnormals, both zeros, ±448) decodes on the GPU to
/// forge-core's value (itself checked byte by byte against the format's definition in
/// `forge_core::dtype`'s tests): row `b` holds byte `b` once in a group of zeros, so the range grid's
/// scale (log2 in 1/256 octaves) and zero point pin the decoded value, without and with a
/// block scale; the fused pack of the same rows is checked too.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn every_e4m3_byte_decodes_as_forge_core() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let (n, k) = (256usize, 128usize);
    let spec = GridSpec {
        bits: 4,
        group_size: 32,
        symmetric: false,
    };
    let mut w = vec![F8E4M3(0); n * k];
    for b in 0..n {
        let byte = if b & 0x7F == 0x7F { 0 } else { b as u8 };
        w[b * k + (b % 4) * 32 + b % 32] = F8E4M3(byte);
    }
    for scale in [None, Some(0.375f32)] {
        let (rb, cb) = (n.div_ceil(ops::FP8_BLOCK), k.div_ceil(ops::FP8_BLOCK));
        let scales: Vec<f32> = (0..rb * cb)
            .map(|i| scale.unwrap_or(1.0) * (1 + i) as f32)
            .collect();
        let x: Vec<f32> = (0..n * k)
            .map(|i| match scale {
                None => w[i].to_f32(),
                Some(_) => w[i].to_f32() * scales[(i / k) / ops::FP8_BLOCK * cb],
            })
            .collect();
        let cpu = build_range(&x, n, k, &spec).unwrap();
        let dw = DeviceBuf::from_slice(0, &w).unwrap();
        let ds = DeviceBuf::from_slice(0, &scales).unwrap();
        let dq = DeviceBuf::zeroed(0, n * spec.groups(k) * 4).unwrap();
        let bs = if scale.is_some() { ds.ptr() } else { 0 };
        let grid = ops::QmetaGrid {
            x: dw.ptr(),
            dtype: DType::F8E4M3,
            rows: n,
            cols: k,
            spec,
            qmeta: dq.ptr(),
            block_scale: bs,
        };
        unsafe { ops::qmeta_range(&grid, S) }.unwrap();
        synchronize(0).unwrap();
        let g: Vec<u32> = dq.download().unwrap();
        assert_eq!(g, u32s_of(&cpu), "e4m3 grid, block scale {scale:?}");
        let want = forge_core::pack::quantize_pack_awq(&x, &cpu, n, k, &spec).unwrap();
        let a = ops::QuantizePack {
            w: dw.ptr(),
            dtype: DType::F8E4M3,
            n,
            k,
            qmeta: dq.ptr(),
            spec,
            block_scale: bs,
        };
        assert_quantize_pack(&a, &want);
    }
    eprintln!("every e4m3 byte: grid and pack bit-exact");
}

/// The routing table by its definition: pairs sorted stably by bucket (ids outside
/// `[0, e)` under `e`), each bucket's run cut into segments of at most `rows`, zero rows to
/// `nseg`.
fn moe_route_reference(
    ids: &[i64],
    k: usize,
    e: usize,
    rows: usize,
    nseg: usize,
) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let bucket = |v: i64| {
        if (0..e as i64).contains(&v) {
            v as usize
        } else {
            e
        }
    };
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&p| bucket(ids[p])); // stable
    let mut segs = vec![0i32; 3 * nseg];
    let mut s = 0;
    let mut pos = 0;
    while pos < order.len() {
        let b = bucket(ids[order[pos]]);
        let mut end = pos;
        while end < order.len() && bucket(ids[order[end]]) == b {
            end += 1;
        }
        let mut first = pos;
        while first < end {
            let count = rows.min(end - first);
            segs[3 * s..3 * s + 3].copy_from_slice(&[first as i32, count as i32, b as i32]);
            s += 1;
            first += count;
        }
        pos = end;
    }
    let tokens = order.iter().map(|&p| (p / k) as i32).collect();
    (order.iter().map(|&p| p as i32).collect(), tokens, segs)
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn moe_route_matches_reference() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mut r = Lcg(91);
    // (tokens, k, experts, rows): decode and prefill sizes, one expert, more experts than a
    // scan round, a table at the most pairs; ids skewed to few experts, some masked.
    let cases = [
        (1usize, 1usize, 1usize, 1usize),
        (1, 8, 256, 1),
        (3, 6, 64, 2),
        (16, 8, 256, 4),
        (64, 6, 64, 4),
        (100, 8, 257, 2),
        (1024, 8, 1024, 4),
        (37, 2, 33, 3),
    ];
    for (t, k, e, rows) in cases {
        for ids64 in [true, false] {
            let pairs = t * k;
            let ids: Vec<i64> = (0..pairs)
                .map(|_| match r.below(10) {
                    0 => -1,
                    1 => e as i64 + r.below(3) as i64,
                    2..=5 => r.below(4.min(e as u32)) as i64,
                    _ => r.below(e as u32) as i64,
                })
                .collect();
            let nseg = ops::moe_max_segments(pairs, e, rows);
            let (want_order, want_tokens, want_segs) = moe_route_reference(&ids, k, e, rows, nseg);
            let dids = if ids64 {
                DeviceBuf::from_slice(0, &ids).unwrap()
            } else {
                DeviceBuf::from_slice(0, &ids.iter().map(|&v| v as i32).collect::<Vec<_>>())
                    .unwrap()
            };
            let order = DeviceBuf::zeroed(0, pairs * 4).unwrap();
            let tokens = DeviceBuf::zeroed(0, pairs * 4).unwrap();
            let segs = DeviceBuf::from_slice(0, &vec![-7i32; 3 * nseg]).unwrap(); // stale rows
            let a = ops::MoeRoute {
                ids: dids.ptr(),
                ids_i64: ids64,
                pairs,
                top_k: k,
                experts: e,
                rows,
                order: order.ptr(),
                tokens: tokens.ptr(),
                segments: segs.ptr(),
                num_segments: nseg,
            };
            unsafe { ops::moe_route(&a, S) }.unwrap();
            synchronize(0).unwrap();
            let case = format!("T={t} k={k} E={e} rows={rows} i64={ids64}");
            assert_eq!(
                order.download::<i32>().unwrap(),
                want_order,
                "{case}: order"
            );
            assert_eq!(
                tokens.download::<i32>().unwrap(),
                want_tokens,
                "{case}: tokens"
            );
            assert_eq!(
                segs.download::<i32>().unwrap(),
                want_segs,
                "{case}: segments"
            );
            // A table smaller than the bound, and sizes past the limits, are refused.
            let small = ops::MoeRoute {
                num_segments: nseg - 1,
                ..a
            };
            assert!(
                nseg == 1 || small.validate().is_err(),
                "{case}: short table accepted"
            );
        }
    }
    let base = ops::MoeRoute {
        ids: 8,
        ids_i64: true,
        pairs: 8,
        top_k: 8,
        experts: 4,
        rows: 1,
        order: 4,
        tokens: 4,
        segments: 4,
        num_segments: 8,
    };
    for bad in [
        ops::MoeRoute {
            pairs: ops::MOE_ROUTE_MAX_PAIRS + 8,
            ..base
        },
        ops::MoeRoute {
            experts: ops::MOE_ROUTE_MAX_EXPERTS + 1,
            ..base
        },
        ops::MoeRoute { top_k: 3, ..base },
        ops::MoeRoute { rows: 0, ..base },
        ops::MoeRoute { ids: 4, ..base },
    ] {
        assert!(bad.validate().is_err(), "{bad:?} accepted");
    }
    assert!(base.validate().is_ok());
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn silu_mul_matches_reference() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mut r = Lcg(94);
    for (rows, inter) in [(1usize, 2048usize), (6, 1408), (300, 8), (2, 24)] {
        for act in [DType::F16, DType::Bf16] {
            let to16 = |v: f64| match act {
                DType::F16 => f16::from_f64(v).to_bits(),
                _ => bf16::from_f64(v).to_bits(),
            };
            let of16 = |b: u16| match act {
                DType::F16 => f16::from_bits(b).to_f64(),
                _ => bf16::from_bits(b).to_f64(),
            };
            // Gate and up values: scaled normals, and the edges (signed zeros, values whose
            // exp(-g) overflows fp32 or underflows to 0, the type's largest).
            let big = if act == DType::F16 { 60000.0 } else { 1e30 };
            let edges = [0.0, -0.0, 90.0, -90.0, 120.0, -120.0, big, -big];
            let x: Vec<u16> = (0..rows * 2 * inter)
                .map(|i| {
                    if i % 97 < edges.len() {
                        to16(edges[i % 97])
                    } else {
                        to16(4.0 * r.n() as f64)
                    }
                })
                .collect();
            // The definition as torch computes it, each step in fp32 (its opmath type, so
            // exp(-g) overflows to inf for g < -88.7 where f64 would keep a tiny silu) and
            // rounded as torch rounds it: silu to the type, then the product to the type.
            // Rust's exp and CUDA's expf may differ by an fp32 ulp, which moves a value on a
            // rounding edge by one ulp of the type.
            let mut want = vec![0f64; rows * inter];
            for row in 0..rows {
                for c in 0..inter {
                    let g = of16(x[row * 2 * inter + c]) as f32;
                    let u = of16(x[row * 2 * inter + inter + c]) as f32;
                    let a = of16(to16((g / (1.0 + (-g).exp())) as f64)) as f32;
                    want[row * inter + c] = of16(to16((a * u) as f64));
                }
            }
            let dx = DeviceBuf::from_slice(0, &x).unwrap();
            let dout = DeviceBuf::zeroed(0, rows * inter * 2).unwrap();
            let a = ops::SiluMul {
                x: dx.ptr(),
                act,
                rows,
                inter,
                out: dout.ptr(),
            };
            unsafe { ops::silu_mul(&a, S) }.unwrap();
            synchronize(0).unwrap();
            let got: Vec<f64> = dout
                .download::<u16>()
                .unwrap()
                .into_iter()
                .map(of16)
                .collect();
            // An ulp relative to the value, or the type's smallest subnormal.
            let (ulp, tiny) = if act == DType::F16 {
                (2f64.powi(-10), 2f64.powi(-24))
            } else {
                (2f64.powi(-7), 2f64.powi(-133))
            };
            let mut exact = 0;
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                if g == w && g.is_sign_negative() == w.is_sign_negative() {
                    exact += 1;
                    continue;
                }
                assert!(
                    (g - w).abs() <= (2.0 * ulp * w.abs()).max(tiny),
                    "rows={rows} inter={inter} {act:?} [{i}]: {g} against {w}"
                );
            }
            // At most one output in a thousand (and at least one) off the definition.
            assert!(
                got.len() - exact <= (got.len() / 1000).max(1),
                "rows={rows} inter={inter} {act:?}: {exact} of {} exact",
                got.len()
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p forge-cuda --release -- --ignored"]
fn moe_combine_matches_reference() {
    assert!(gpu(), "no usable NVIDIA GPU: {:?}", status().reason);
    let mut r = Lcg(93);
    for (t, k, h, e) in [
        (1usize, 8usize, 2048usize, 256usize),
        (5, 6, 64, 16),
        (300, 2, 8, 4),
        (1, 1, 16, 1),
    ] {
        for act in [DType::F16, DType::Bf16] {
            for wt in [DType::F32, DType::Bf16, DType::F16] {
                let to16 = |v: f32| match act {
                    DType::F16 => f16::from_f32(v).to_bits(),
                    _ => bf16::from_f32(v).to_bits(),
                };
                let of16 = |b: u16| match act {
                    DType::F16 => f16::from_bits(b).to_f32(),
                    _ => bf16::from_bits(b).to_f32(),
                };
                let y: Vec<u16> = (0..t * k * h).map(|_| to16(r.n())).collect();
                let ids: Vec<i64> = (0..t * k)
                    .map(|_| match r.below(8) {
                        0 => -1,
                        1 => e as i64,
                        _ => r.below(e as u32) as i64,
                    })
                    .collect();
                // Masked pairs get a NaN weight: it must not reach the output.
                let w32: Vec<f32> = (0..t * k)
                    .map(|p| {
                        if (0..e as i64).contains(&ids[p]) {
                            r.f().abs()
                        } else {
                            f32::NAN
                        }
                    })
                    .collect();
                let (dw, wv): (DeviceBuf, Vec<f32>) = match wt {
                    DType::F32 => (DeviceBuf::from_slice(0, &w32).unwrap(), w32.clone()),
                    DType::Bf16 => {
                        let b: Vec<u16> =
                            w32.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
                        let v = b.iter().map(|&x| bf16::from_bits(x).to_f32()).collect();
                        (DeviceBuf::from_slice(0, &b).unwrap(), v)
                    }
                    _ => {
                        let b: Vec<u16> = w32.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
                        let v = b.iter().map(|&x| f16::from_bits(x).to_f32()).collect();
                        (DeviceBuf::from_slice(0, &b).unwrap(), v)
                    }
                };
                // The definition: fp32 products and sums in j order, rounded once.
                let mut want = vec![0u16; t * h];
                for tt in 0..t {
                    for c in 0..h {
                        let mut acc = 0f32;
                        for j in 0..k {
                            let p = tt * k + j;
                            let wj = if (0..e as i64).contains(&ids[p]) {
                                wv[p]
                            } else {
                                0.0
                            };
                            acc += wj * of16(y[p * h + c]);
                        }
                        want[tt * h + c] = to16(acc);
                    }
                }
                let for_ids: Vec<i32> = ids.iter().map(|&v| v as i32).collect();
                for ids64 in [true, false] {
                    let dy = DeviceBuf::from_slice(0, &y).unwrap();
                    let di = if ids64 {
                        DeviceBuf::from_slice(0, &ids).unwrap()
                    } else {
                        DeviceBuf::from_slice(0, &for_ids).unwrap()
                    };
                    let dout = DeviceBuf::zeroed(0, t * h * 2).unwrap();
                    let a = ops::MoeCombine {
                        y: dy.ptr(),
                        act,
                        weights: dw.ptr(),
                        weights_dtype: wt,
                        ids: di.ptr(),
                        ids_i64: ids64,
                        tokens: t,
                        top_k: k,
                        hidden: h,
                        experts: e,
                        out: dout.ptr(),
                    };
                    unsafe { ops::moe_combine(&a, S) }.unwrap();
                    synchronize(0).unwrap();
                    assert_eq!(
                        dout.download::<u16>().unwrap(),
                        want,
                        "T={t} k={k} H={h} {act:?} {wt:?} i64={ids64}"
                    );
                    let bad = ops::MoeCombine { hidden: 12, ..a };
                    assert!(bad.validate().is_err());
                    let fp8 = ops::MoeCombine {
                        weights_dtype: DType::F8E4M3,
                        ..a
                    };
                    assert!(fp8.validate().is_err());
                }
            }
        }
    }
}
