//! The quantizer seam: the orchestrator hands every linear of one decoder
//! layer to a [`LinearQuantizer`] at once (so a GPU backend can batch the
//! experts, and a calibrated one can use the layer's Hessians), and writes
//! each result as soon as it is handed back.
//!
//! Data-free implementation here: [`RtnQuantizer`] (round to nearest on the
//! range grid, or on the MSE-refined grid). The calibrated GPTQ run plugs in
//! by implementing the same trait.

use std::borrow::Cow;

use forge_core::grid::{build_quant_grid, GridMode, GridSpec};
use forge_core::pack::{quantize_pack_awq, AwqTensors};
use forge_core::Element;
use forge_io::{Checkpoint, Dtype, TensorView};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::{Error, Result};

/// One linear of a layer job.
#[derive(Debug, Clone, Copy)]
pub struct LinearJob<'a> {
    /// Module name (`model.layers.3.mlp.experts.7.up_proj`).
    pub module: &'a str,
    /// The source weight `[N, K]` (any float dtype; FP8 with its scale).
    pub weight: TensorView<'a>,
    /// out_features `N`.
    pub n: usize,
    /// in_features `K`.
    pub k: usize,
}

/// All linears of one decoder layer to quantize, plus what a quantizer needs
/// to read them.
#[derive(Debug)]
pub struct LayerJob<'a> {
    /// `layer 3`.
    pub label: &'a str,
    /// Decoder layer index.
    pub layer: Option<usize>,
    /// The source checkpoint (for FP8 scales and anything else of the layer).
    pub checkpoint: &'a Checkpoint,
    /// The linears, in the plan's (name) order.
    pub linears: Vec<LinearJob<'a>>,
    /// Bits, group size, symmetry.
    pub spec: GridSpec,
}

/// A weight as the core maths takes it: borrowed from the mmap when its
/// dtype and alignment allow, else converted to f32.
#[derive(Debug)]
pub enum Weight<'a> {
    /// bf16, zero-copy.
    Bf16(&'a [bf16]),
    /// fp16, zero-copy.
    F16(&'a [f16]),
    /// f32, borrowed or converted (FP8 × block scale, unaligned data, f64).
    F32(Cow<'a, [f32]>),
}

impl<'a> LayerJob<'a> {
    /// Loads linear `i`'s weight (FP8 dequantized with its `weight_scale_inv`).
    pub fn weight(&self, i: usize) -> Result<Weight<'a>> {
        let l = &self.linears[i];
        let w = l.weight;
        Ok(match w.dtype {
            Dtype::BF16 => match bytemuck::try_cast_slice(w.bytes) {
                Ok(s) => Weight::Bf16(s),
                Err(_) => Weight::F32(Cow::Owned(w.to_f32()?)),
            },
            Dtype::F16 => match bytemuck::try_cast_slice(w.bytes) {
                Ok(s) => Weight::F16(s),
                Err(_) => Weight::F32(Cow::Owned(w.to_f32()?)),
            },
            Dtype::F32 => match bytemuck::try_cast_slice(w.bytes) {
                Ok(s) => Weight::F32(Cow::Borrowed(s)),
                Err(_) => Weight::F32(Cow::Owned(w.to_f32()?)),
            },
            _ => Weight::F32(Cow::Owned(self.checkpoint.dequantized_f32(w.name)?)),
        })
    }

    /// Linear `i`'s weight as stored when it is FP8 (`F8_E4M3` bytes `[N, K]`), with its
    /// block scales as f32 `[ceil(N/128), ceil(K/128)]`; `None` for other dtypes. NaN bytes
    /// and scales that are not finite or could overflow f32 (|s|·448) are refused, as the
    /// dequantized weight would be.
    pub fn fp8(&self, i: usize) -> Result<Option<(&'a [u8], Vec<f32>)>> {
        let w = self.linears[i].weight;
        if w.dtype != Dtype::F8_E4M3 {
            return Ok(None);
        }
        if let Some(index) = w.bytes.iter().position(|b| b & 0x7F == 0x7F) {
            let e = forge_core::Error::NonFinite {
                name: "weight".into(),
                index,
                value: f32::NAN,
            };
            return Err(self.core_error(i, e));
        }
        let (s, _) = self.checkpoint.fp8_scale(w.name)?;
        let scales = s.to_f32()?;
        if let Some(j) = scales.iter().position(|v| !(v.abs() * 448.0).is_finite()) {
            return Err(Error::Quantize {
                file: s.file.into(),
                tensor: format!("{}_scale_inv", w.name),
                source: Box::new(forge_core::Error::Param {
                    name: "weight_scale_inv".into(),
                    message: format!("block scale {j} is not finite or overflows the weight"),
                    value: scales[j].to_string(),
                }),
            });
        }
        Ok(Some((w.bytes, scales)))
    }

    /// Wraps a core error with the tensor's file and name (row/column for NaN).
    pub fn core_error(&self, i: usize, e: forge_core::Error) -> Error {
        let l = &self.linears[i];
        match e {
            forge_core::Error::NonFinite { index, value, .. } if l.k > 0 => Error::NonFinite {
                file: l.weight.file.into(),
                tensor: l.weight.name.into(),
                row: index / l.k,
                col: index % l.k,
                value,
            },
            source => Error::Quantize {
                file: l.weight.file.into(),
                tensor: l.weight.name.into(),
                source: Box::new(source),
            },
        }
    }
}

/// Receives each finished linear: `(index into LayerJob::linears, tensors)`.
/// Called from any thread, in any order; the orchestrator writes at once.
pub type Sink<'s> = &'s (dyn Fn(usize, AwqTensors) -> Result<()> + Sync);

/// Quantizes the linears of one decoder layer into the AWQ layout.
///
/// The orchestrator calls [`LinearQuantizer::quantize_layer`] once per layer,
/// in layer order, and every linear of `job` must reach `sink` exactly once
/// before it returns `Ok`. The output must be a deterministic function of the
/// inputs (a resumed run must write the same bytes).
pub trait LinearQuantizer: Sync {
    /// Short name for messages and the manifest (`rtn-range`).
    fn name(&self) -> String;
    /// Quantizes every linear of `job`, handing each result to `sink`.
    fn quantize_layer(&self, job: &LayerJob<'_>, sink: Sink<'_>) -> Result<()>;
}

/// Data-free round-to-nearest on the range or MSE grid, parallel over the
/// linears (and over rows inside each).
#[derive(Debug, Clone, Copy)]
pub struct RtnQuantizer {
    /// Which grid.
    pub mode: GridMode,
}

fn rtn<T: Element>(
    w: &[T],
    n: usize,
    k: usize,
    spec: &GridSpec,
    mode: GridMode,
) -> forge_core::Result<AwqTensors> {
    let (qmeta, _, _) = build_quant_grid(w, n, k, spec, mode)?;
    quantize_pack_awq(w, &qmeta, n, k, spec)
}

impl RtnQuantizer {
    /// Quantizes one linear (also usable on its own).
    pub fn quantize_one(&self, job: &LayerJob<'_>, i: usize) -> Result<AwqTensors> {
        let l = &job.linears[i];
        let r = match job.weight(i)? {
            Weight::Bf16(w) => rtn(w, l.n, l.k, &job.spec, self.mode),
            Weight::F16(w) => rtn(w, l.n, l.k, &job.spec, self.mode),
            Weight::F32(w) => rtn(&w, l.n, l.k, &job.spec, self.mode),
        };
        r.map_err(|e| job.core_error(i, e))
    }
}

impl LinearQuantizer for RtnQuantizer {
    fn name(&self) -> String {
        match self.mode {
            GridMode::Range => "rtn-range".into(),
            GridMode::Mse(_) => "rtn-mse".into(),
        }
    }

    fn quantize_layer(&self, job: &LayerJob<'_>, sink: Sink<'_>) -> Result<()> {
        (0..job.linears.len())
            .into_par_iter()
            .try_for_each(|i| self.quantize_one(job, i).and_then(|t| sink(i, t)))
    }
}
