//! Round-to-nearest on the GPU: the same grid and packing as [`crate::RtnQuantizer`]
//! through the CUDA kernels of `forge-cuda`, which are bit-exact with forge-core, so a run
//! on either device writes the same bytes (and a run can be resumed on the other one).

use forge_core::grid::{GridMode, GridSpec};
use forge_core::pack::AwqTensors;
use forge_cuda::{ops as cu, synchronize, DeviceBuf};
use half::f16;

use crate::quantizer::{LayerJob, LinearQuantizer, Sink, Weight};
use crate::{Error, Result};

/// Data-free RTN on the range or MSE grid, one linear at a time on CUDA device `device`.
#[derive(Debug, Clone, Copy)]
pub struct CudaRtnQuantizer {
    /// Which grid.
    pub mode: GridMode,
    /// CUDA device ordinal.
    pub device: usize,
}

impl CudaRtnQuantizer {
    /// Checks that the device is usable before a run starts.
    pub fn new(mode: GridMode, device: usize) -> Result<Self> {
        let st = forge_cuda::status();
        if !st.available {
            return Err(Error::Options {
                option: "--device cuda".into(),
                reason: st.reason.unwrap_or_else(|| "CUDA is not available".into()),
            });
        }
        if device >= st.device_count {
            return Err(Error::Options {
                option: "--device".into(),
                reason: format!(
                    "cuda:{device} requested, {} device(s) present",
                    st.device_count
                ),
            });
        }
        Ok(CudaRtnQuantizer { mode, device })
    }

    fn one(&self, job: &LayerJob<'_>, i: usize) -> Result<AwqTensors> {
        let l = &job.linears[i];
        let (n, k, spec): (usize, usize, GridSpec) = (l.n, l.k, job.spec);
        let cuda = |e: forge_cuda::CudaError| Error::Quantize {
            file: l.weight.file.into(),
            tensor: l.weight.name.into(),
            source: Box::new(forge_core::Error::Param {
                name: "cuda".into(),
                message: e.to_string(),
                value: format!("device {}", self.device),
            }),
        };
        // Upload the weight as stored: bf16/f16/f32, or FP8 bytes with their f32 block
        // scales (the kernels apply them, bit-identical to the CPU's dequantization).
        let fp8 = job.fp8(i)?;
        let (buf, dtype, block_scale) = if let Some((bytes, scales)) = &fp8 {
            (
                DeviceBuf::from_slice(self.device, bytes).map_err(cuda)?,
                cu::DType::F8E4M3,
                Some(DeviceBuf::from_slice(self.device, scales).map_err(cuda)?),
            )
        } else {
            let (buf, dtype) = match job.weight(i)? {
                Weight::Bf16(w) => {
                    forge_core::dtype::check_finite("weight", w)
                        .map_err(|e| job.core_error(i, e))?;
                    (
                        DeviceBuf::from_slice(self.device, w).map_err(cuda)?,
                        cu::DType::Bf16,
                    )
                }
                Weight::F16(w) => {
                    forge_core::dtype::check_finite("weight", w)
                        .map_err(|e| job.core_error(i, e))?;
                    (
                        DeviceBuf::from_slice(self.device, w).map_err(cuda)?,
                        cu::DType::F16,
                    )
                }
                Weight::F32(w) => {
                    forge_core::dtype::check_finite("weight", &w[..])
                        .map_err(|e| job.core_error(i, e))?;
                    (
                        DeviceBuf::from_slice(self.device, &w[..]).map_err(cuda)?,
                        cu::DType::F32,
                    )
                }
            };
            (buf, dtype, None)
        };
        let block_scale_ptr = block_scale.as_ref().map_or(0, |b| b.ptr());
        let ng = spec.groups(k);
        let qmeta = DeviceBuf::zeroed(self.device, n * ng * 4).map_err(cuda)?;
        let qweight = DeviceBuf::zeroed(self.device, k * n / 8 * 4).map_err(cuda)?;
        let qzeros =
            DeviceBuf::zeroed(self.device, (k / spec.group_size) * n / 8 * 4).map_err(cuda)?;
        let scales = DeviceBuf::zeroed(self.device, (k / spec.group_size) * n * 2).map_err(cuda)?;
        let grid = cu::QmetaGrid {
            x: buf.ptr(),
            dtype,
            rows: n,
            cols: k,
            spec,
            qmeta: qmeta.ptr(),
            block_scale: block_scale_ptr,
        };
        let args = cu::QuantizePack {
            w: buf.ptr(),
            dtype,
            n,
            k,
            qmeta: qmeta.ptr(),
            spec,
            block_scale: block_scale_ptr,
        };
        let out = cu::PackedOut {
            qweight: qweight.ptr(),
            qzeros: qzeros.ptr(),
            scales: scales.ptr(),
        };
        let s = cu::Stream::default_of(self.device);
        // SAFETY: every buffer is a live device allocation of the size the op requires.
        unsafe {
            cu::qmeta_range(&grid, s).map_err(cuda)?;
            if let GridMode::Mse(m) = self.mode {
                cu::qmeta_mse(&grid, &m, s).map_err(cuda)?;
            }
            cu::awq_quantize_pack(&args, &out, s).map_err(cuda)?;
        }
        synchronize(self.device).map_err(cuda)?;
        let scales: Vec<f16> = scales.download().map_err(cuda)?;
        if let Some(j) = scales.iter().position(|v| !v.is_finite()) {
            return Err(job.core_error(
                i,
                forge_core::Error::Param {
                    name: "qmeta".into(),
                    message: format!("scale of group {} does not fit fp16 (max 65504)", j),
                    value: "inf".into(),
                },
            ));
        }
        Ok(AwqTensors {
            qweight: qweight.download().map_err(cuda)?,
            qzeros: qzeros.download().map_err(cuda)?,
            scales,
        })
    }
}

impl LinearQuantizer for CudaRtnQuantizer {
    fn name(&self) -> String {
        // Same bytes as the CPU quantizer: same name, so a run resumes on either device.
        crate::RtnQuantizer { mode: self.mode }.name()
    }

    fn quantize_layer(&self, job: &LayerJob<'_>, sink: Sink<'_>) -> Result<()> {
        for i in 0..job.linears.len() {
            let t = self.one(job, i)?;
            sink(i, t)?;
        }
        Ok(())
    }
}
