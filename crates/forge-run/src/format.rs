//! The output checkpoint format, as one type: the tensors of a quantized
//! linear (names, dtypes, shapes), how codes and grids are packed into them,
//! the `quantization_config` block of `config.json`, and what `verify` expects.
//! Facts: shared/notes/formats.md.
//!
//! | format | tensors of a quantized linear `X` (`K` in, `N` out, `G` group) |
//! |---|---|
//! | `awq` | `X.qweight` i32 `[K, N/8]`, `X.qzeros` i32 `[K/G, N/8]`, `X.scales` f16 `[K/G, N]` |
//! | `gptq` (v1) | `X.qweight` i32 `[K/8, N]`, `X.qzeros` i32 `[K/G, N/8]` (z − 1), `X.scales` f16 `[K/G, N]`, `X.g_idx` i32 `[K]` |
//! | `compressed-tensors` | `X.weight_packed` i32 `[N, K/8]`, `X.weight_scale` f16 `[N, K/G]`, `X.weight_shape` i64 `[2]`, `X.weight_zero_point` i32 `[N/8, K/G]` (asymmetric only) |
//!
//! compressed-tensors scales are written as fp16 (the very values the other
//! two formats store, so all three dequantize identically); vLLM casts them to
//! the activation dtype when it loads them.

use forge_core::pack::{
    awq_to_parts, compressed_from_parts, gptq_from_parts, pack_awq, pack_compressed, pack_gptq,
    AwqTensors, CompressedTensors, GptqTensors,
};
use forge_core::{GridSpec, QMeta};
use forge_io::{Dtype, TensorSpec};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::plan::QuantOptions;

/// Which checkpoint layout the run writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutputFormat {
    /// AutoAWQ "gemm" (vLLM `awq` / `awq_marlin`).
    #[default]
    Awq,
    /// GPTQ v1, symmetric, `desc_act: false` (vLLM `gptq` / `gptq_marlin`).
    Gptq,
    /// compressed-tensors `pack-quantized` W4A16 (llm-compressor's output).
    CompressedTensors,
}

/// One packed tensor of a quantized linear: suffix (`qweight`) and little-endian bytes.
pub type PackedTensor = (&'static str, Vec<u8>);

fn le_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn le_f16(v: &[half::f16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The tensors of a quantized linear as a loader reads them (any format).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearShape {
    /// out_features.
    pub n: usize,
    /// in_features.
    pub k: usize,
}

impl OutputFormat {
    /// Every format, for messages and tests.
    pub const ALL: [OutputFormat; 3] = [
        OutputFormat::Awq,
        OutputFormat::Gptq,
        OutputFormat::CompressedTensors,
    ];

    /// The option value (`awq`, `gptq`, `compressed-tensors`).
    pub fn name(self) -> &'static str {
        match self {
            OutputFormat::Awq => "awq",
            OutputFormat::Gptq => "gptq",
            OutputFormat::CompressedTensors => "compressed-tensors",
        }
    }

    /// The format a `quantization_config.quant_method` names.
    pub fn from_quant_method(m: &str) -> Option<OutputFormat> {
        OutputFormat::ALL.into_iter().find(|f| f.name() == m)
    }

    /// The suffix of the tensor that marks a quantized linear (`qweight`, `weight_packed`).
    pub fn primary(self) -> &'static str {
        match self {
            OutputFormat::Awq | OutputFormat::Gptq => "qweight",
            OutputFormat::CompressedTensors => "weight_packed",
        }
    }

    /// Every suffix this format can write next to a module (to find strays).
    pub fn all_suffixes(self) -> &'static [&'static str] {
        match self {
            OutputFormat::Awq => &["qweight", "qzeros", "scales"],
            OutputFormat::Gptq => &["qweight", "qzeros", "scales", "g_idx"],
            OutputFormat::CompressedTensors => &[
                "weight_packed",
                "weight_scale",
                "weight_shape",
                "weight_zero_point",
            ],
        }
    }

    /// Suffixes that belong to any supported quantized layout (a source holding
    /// one of them is already quantized; a tensor with one in an output of
    /// another format is a stray).
    pub fn any_quantized_suffix(name: &str) -> bool {
        OutputFormat::ALL.iter().any(|f| {
            f.all_suffixes()
                .iter()
                .any(|s| name.ends_with(&format!(".{s}")))
        })
    }

    /// The exact output tensors of quantized linear `module` (`n` out, `k` in).
    pub fn specs(
        self,
        module: &str,
        n: usize,
        k: usize,
        group_size: usize,
        symmetric: bool,
    ) -> Vec<TensorSpec> {
        let ng = k / group_size.max(1);
        let t = |s: &str, d: Dtype, shape: Vec<usize>| {
            TensorSpec::new(format!("{module}.{s}"), d, shape)
        };
        match self {
            OutputFormat::Awq => vec![
                t("qweight", Dtype::I32, vec![k, n / 8]),
                t("qzeros", Dtype::I32, vec![ng, n / 8]),
                t("scales", Dtype::F16, vec![ng, n]),
            ],
            OutputFormat::Gptq => vec![
                t("qweight", Dtype::I32, vec![k / 8, n]),
                t("qzeros", Dtype::I32, vec![ng, n / 8]),
                t("scales", Dtype::F16, vec![ng, n]),
                t("g_idx", Dtype::I32, vec![k]),
            ],
            OutputFormat::CompressedTensors => {
                let mut v = vec![
                    t("weight_packed", Dtype::I32, vec![n, k / 8]),
                    t("weight_scale", Dtype::F16, vec![n, ng]),
                    t("weight_shape", Dtype::I64, vec![2]),
                ];
                if !symmetric {
                    v.push(t("weight_zero_point", Dtype::I32, vec![n / 8, ng]));
                }
                v
            }
        }
    }

    /// `(n, k)` of a quantized linear from the shape of its primary tensor.
    pub fn shape_from_primary(self, shape: &[usize]) -> Option<LinearShape> {
        match (self, shape) {
            (OutputFormat::Awq, &[k, n8]) => Some(LinearShape { n: n8 * 8, k }),
            (OutputFormat::Gptq, &[k8, n]) => Some(LinearShape { n, k: k8 * 8 }),
            (OutputFormat::CompressedTensors, &[n, k8]) => Some(LinearShape { n, k: k8 * 8 }),
            _ => None,
        }
    }

    /// Packs codes `K × N` (one per byte) with their grid `N × K/G` into this format.
    pub fn pack(
        self,
        codes: &[u8],
        qmeta: &[QMeta],
        k: usize,
        n: usize,
        spec: &GridSpec,
    ) -> forge_core::Result<Vec<PackedTensor>> {
        Ok(match self {
            OutputFormat::Awq => awq_tensors(&pack_awq(codes, qmeta, k, n, spec)?),
            OutputFormat::Gptq => gptq_tensors(&pack_gptq(codes, qmeta, k, n, spec)?),
            OutputFormat::CompressedTensors => {
                ct_tensors(&pack_compressed(codes, qmeta, k, n, spec)?)
            }
        })
    }

    /// Converts a linear already packed in the AWQ layout (the fused RTN
    /// quantizers' output) into this format, exactly.
    pub fn from_awq(
        self,
        t: &AwqTensors,
        k: usize,
        n: usize,
        spec: &GridSpec,
    ) -> forge_core::Result<Vec<PackedTensor>> {
        if self == OutputFormat::Awq {
            return Ok(awq_tensors(t));
        }
        let g = spec.group_size;
        let (codes, zeros, scales) = awq_to_parts(t, k, n, g)?;
        Ok(match self {
            OutputFormat::Awq => awq_tensors(t),
            OutputFormat::Gptq => gptq_tensors(&gptq_from_parts(&codes, &zeros, scales, k, n, g)?),
            OutputFormat::CompressedTensors => ct_tensors(&compressed_from_parts(
                &codes,
                &zeros,
                &scales,
                k,
                n,
                g,
                spec.symmetric,
            )?),
        })
    }

    /// Whether an entry of the format's skip list (AWQ `modules_to_not_convert`:
    /// substring; GPTQ negative `dynamic` rule: the module or anything under it;
    /// compressed-tensors `ignore`: the exact name) leaves `module` unquantized in vLLM.
    pub fn skips(self, entry: &str, module: &str) -> bool {
        match self {
            OutputFormat::Awq => module.contains(entry),
            OutputFormat::Gptq => {
                module == entry
                    || module
                        .strip_prefix(entry)
                        .is_some_and(|r| r.starts_with('.'))
            }
            OutputFormat::CompressedTensors => module == entry,
        }
    }

    /// Where the config lists unquantized modules (for messages).
    pub fn skip_list_name(self) -> &'static str {
        match self {
            OutputFormat::Awq => "modules_to_not_convert",
            OutputFormat::Gptq => "dynamic (negative rules)",
            OutputFormat::CompressedTensors => "ignore",
        }
    }

    /// Checks that the options can be written in this format.
    pub fn check_options(self, symmetric: bool) -> std::result::Result<(), String> {
        if self == OutputFormat::Gptq && !symmetric {
            return Err(
                "format gptq needs a symmetric grid: vLLM loads GPTQ v1 checkpoints only with sym: true; pass symmetric=true (--sym), or use format awq or compressed-tensors for an asymmetric grid".into(),
            );
        }
        Ok(())
    }

    /// The `quantization_config` block of `config.json`. `not_convert` are the
    /// modules left unquantized (full names, as the plan lists them);
    /// `has_lm_head` adds `lm_head` to compressed-tensors' `ignore`.
    pub fn quantization_config(
        self,
        opts: &QuantOptions,
        not_convert: &[String],
        has_lm_head: bool,
    ) -> Value {
        match self {
            OutputFormat::Awq => json!({
                "quant_method": "awq",
                "bits": 4,
                "group_size": opts.group_size,
                "zero_point": true,
                "version": "gemm",
                "modules_to_not_convert": not_convert,
            }),
            OutputFormat::Gptq => {
                // vLLM's GPTQ configs skip modules through negative `dynamic` rules
                // (`-:regex`, matched from the start of the module name).
                let dynamic: serde_json::Map<String, Value> = not_convert
                    .iter()
                    .map(|m| (gptq_skip_rule(m), json!({})))
                    .collect();
                json!({
                    "quant_method": "gptq",
                    "bits": 4,
                    "group_size": opts.group_size,
                    "desc_act": false,
                    "sym": true,
                    "checkpoint_format": "gptq",
                    "lm_head": false,
                    "dynamic": dynamic,
                })
            }
            OutputFormat::CompressedTensors => {
                let mut ignore: Vec<String> = Vec::new();
                if has_lm_head {
                    ignore.push("lm_head".into());
                }
                ignore.extend(not_convert.iter().cloned());
                json!({
                    "quant_method": "compressed-tensors",
                    "format": "pack-quantized",
                    "quantization_status": "compressed",
                    "config_groups": {
                        "group_0": {
                            "targets": ["Linear"],
                            "weights": {
                                "num_bits": 4,
                                "type": "int",
                                "symmetric": opts.symmetric,
                                "strategy": "group",
                                "group_size": opts.group_size,
                                "dynamic": false,
                                "actorder": null,
                            },
                            "input_activations": null,
                            "output_activations": null,
                        }
                    },
                    "ignore": ignore,
                    "kv_cache_scheme": null,
                })
            }
        }
    }
}

/// The GPTQ `dynamic` rule that leaves `module` (and anything under it) unquantized.
pub fn gptq_skip_rule(module: &str) -> String {
    let mut s = String::from("-:");
    for c in module.chars() {
        if !(c.is_ascii_alphanumeric() || c == '_') {
            s.push('\\');
        }
        s.push(c);
    }
    s.push_str(r"(?:\.|$)");
    s
}

/// The module of a rule written by [`gptq_skip_rule`] (`None` for any other rule).
pub fn parse_gptq_skip_rule(rule: &str) -> Option<String> {
    let body = rule.strip_prefix("-:")?.strip_suffix(r"(?:\.|$)")?;
    let mut out = String::new();
    let mut it = body.chars();
    while let Some(c) = it.next() {
        match c {
            '\\' => out.push(it.next()?),
            c if c.is_ascii_alphanumeric() || c == '_' => out.push(c),
            _ => return None,
        }
    }
    Some(out)
}

fn awq_tensors(t: &AwqTensors) -> Vec<PackedTensor> {
    vec![
        ("qweight", le_i32(&t.qweight)),
        ("qzeros", le_i32(&t.qzeros)),
        ("scales", le_f16(&t.scales)),
    ]
}

fn gptq_tensors(t: &GptqTensors) -> Vec<PackedTensor> {
    vec![
        ("qweight", le_i32(&t.qweight)),
        ("qzeros", le_i32(&t.qzeros)),
        ("scales", le_f16(&t.scales)),
        ("g_idx", le_i32(&t.g_idx)),
    ]
}

fn ct_tensors(t: &CompressedTensors) -> Vec<PackedTensor> {
    let mut v = vec![
        ("weight_packed", le_i32(&t.weight_packed)),
        ("weight_scale", le_f16(&t.weight_scale)),
        (
            "weight_shape",
            t.weight_shape
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
    ];
    if let Some(z) = &t.weight_zero_point {
        v.push(("weight_zero_point", le_i32(z)));
    }
    v
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use forge_core::grid::{build_quant_grid, GridMode};

    #[test]
    fn names_round_trip() {
        for f in OutputFormat::ALL {
            assert_eq!(OutputFormat::from_quant_method(f.name()), Some(f));
            let v: OutputFormat = serde_json::from_value(json!(f.name())).unwrap();
            assert_eq!(v, f);
        }
        assert!(OutputFormat::Gptq.check_options(false).is_err());
        assert!(OutputFormat::Gptq.check_options(true).is_ok());
        assert!(OutputFormat::CompressedTensors.check_options(false).is_ok());
    }

    #[test]
    fn skip_rules_round_trip() {
        let m = "model.layers.3.mlp.experts";
        let r = gptq_skip_rule(m);
        assert_eq!(r, r"-:model\.layers\.3\.mlp\.experts(?:\.|$)");
        assert_eq!(parse_gptq_skip_rule(&r).as_deref(), Some(m));
        assert_eq!(parse_gptq_skip_rule("-:.*gate"), None);
        let f = OutputFormat::Gptq;
        assert!(f.skips(m, "model.layers.3.mlp.experts.0.up_proj"));
        assert!(f.skips(m, m));
        assert!(!f.skips("model.layers.3.mlp.gate", "model.layers.3.mlp.gate_proj"));
        assert!(OutputFormat::Awq.skips("model.layers.3.mlp.gate", "model.layers.3.mlp.gate_proj"));
        assert!(!OutputFormat::CompressedTensors.skips(m, "model.layers.3.mlp.experts.0.up_proj"));
    }

    #[test]
    fn pack_and_from_awq_agree_and_match_specs() {
        let (n, k, g) = (16usize, 64usize, 32usize);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        for sym in [true, false] {
            let spec = GridSpec {
                bits: 4,
                group_size: g,
                symmetric: sym,
            };
            let (qmeta, _, _) = build_quant_grid(&w, n, k, &spec, GridMode::Range).unwrap();
            let awq = forge_core::pack::quantize_pack_awq(&w, &qmeta, n, k, &spec).unwrap();
            let (codes, _) =
                forge_core::pack::unpack_awq(&awq.qweight, &awq.qzeros, k, n, g).unwrap();
            for f in OutputFormat::ALL {
                if f.check_options(sym).is_err() {
                    continue;
                }
                let a = f.pack(&codes, &qmeta, k, n, &spec).unwrap();
                let b = f.from_awq(&awq, k, n, &spec).unwrap();
                assert_eq!(a, b, "{f:?} sym {sym}");
                let specs = f.specs("m", n, k, g, sym);
                assert_eq!(a.len(), specs.len());
                for ((suffix, bytes), s) in a.iter().zip(&specs) {
                    assert_eq!(s.name, format!("m.{suffix}"));
                    let elems: usize = s.shape.iter().product();
                    assert_eq!(bytes.len(), elems * s.dtype.size(), "{}", s.name);
                }
                let p = f.shape_from_primary(&specs[0].shape).unwrap();
                assert_eq!((p.n, p.k), (n, k));
            }
        }
    }
}
