//! Architectures as data: which weights of a decoder layer are linears, which
//! modules are routers, which linears vLLM fuses (all-or-none), what is left
//! unquantized by default, and where the expert count lives in config.json.
//!
//! A family is one [`Architecture`] constant in [`FAMILIES`]; nothing else in
//! the crate branches on the model type. Unknown models get [`GENERIC`], which
//! works for Llama-like checkpoints.

use serde_json::Value;

/// Linears that vLLM loads into one fused module: quantize all or none of the
/// members that share a parent module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedGroup {
    /// Leaf names of the members (`["q_proj", "k_proj", "v_proj"]`).
    pub members: &'static [&'static str],
    /// vLLM's name of the fused module under the same parent (`qkv_proj`),
    /// also listed in `modules_to_not_convert` when the group stays
    /// unquantized, for vLLM versions that match the fused name.
    pub fused_name: &'static str,
}

/// The description of one model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Architecture {
    /// Family name shown by `inspect` and stored in the manifest.
    pub name: &'static str,
    /// `config.json` `model_type` values of this family.
    pub model_types: &'static [&'static str],
    /// `config.json` `architectures` entries of this family.
    pub architectures: &'static [&'static str],
    /// Module-name suffixes (whole dotted segments) of routers: never
    /// quantized, always listed in `modules_to_not_convert`.
    pub routers: &'static [&'static str],
    /// Segments that mark a 2-D weight as not a linear (norms, embeddings).
    pub non_linear: &'static [&'static str],
    /// Fused groups.
    pub fused: &'static [FusedGroup],
    /// Patterns left unquantized unless the user turns default exclusions off.
    pub default_exclude: &'static [&'static str],
    /// Segment naming the routed experts (`experts` → `<parent>.experts.<e>.`).
    pub experts_segment: &'static str,
    /// `config.json` keys holding the number of routed experts, first found wins.
    pub expert_count_keys: &'static [&'static str],
    /// Whether layers with index ≥ `num_hidden_layers` are MTP layers
    /// (copied unquantized).
    pub has_mtp: bool,
}

const QKV: FusedGroup = FusedGroup {
    members: &["q_proj", "k_proj", "v_proj"],
    fused_name: "qkv_proj",
};
const GATE_UP: FusedGroup = FusedGroup {
    members: &["gate_proj", "up_proj"],
    fused_name: "gate_up_proj",
};
const MLA_A: FusedGroup = FusedGroup {
    members: &["q_a_proj", "kv_a_proj_with_mqa"],
    fused_name: "fused_qkv_a_proj",
};
const W1_W3: FusedGroup = FusedGroup {
    members: &["w1", "w3"],
    fused_name: "w13",
};
const NON_LINEAR: &[&str] = &["norm", "layernorm", "embed", "embed_tokens", "rotary_emb"];

/// DeepSeek-V2/V3/R1, Kimi-K2: MLA + MoE + dense first layers + MTP layers.
pub const DEEPSEEK: Architecture = Architecture {
    name: "deepseek",
    model_types: &["deepseek_v3", "deepseek_v2", "kimi_k2", "deepseek_v32"],
    architectures: &[
        "DeepseekV3ForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV32ForCausalLM",
    ],
    routers: &["mlp.gate"],
    non_linear: NON_LINEAR,
    fused: &[MLA_A, QKV, GATE_UP],
    default_exclude: &["kv_b_proj"],
    experts_segment: "experts",
    expert_count_keys: &["n_routed_experts"],
    has_mtp: true,
};

/// Qwen2-MoE / Qwen3-MoE / OLMoE: `mlp.gate` router, `mlp.experts.{e}`,
/// optional shared expert with its `shared_expert_gate`.
pub const QWEN_MOE: Architecture = Architecture {
    name: "qwen-moe",
    model_types: &["qwen3_moe", "qwen2_moe", "olmoe"],
    architectures: &[
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "OlmoeForCausalLM",
    ],
    routers: &["mlp.gate", "mlp.shared_expert_gate"],
    non_linear: NON_LINEAR,
    fused: &[QKV, GATE_UP],
    default_exclude: &[],
    experts_segment: "experts",
    // transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
    expert_count_keys: &["num_experts", "num_local_experts"],
    has_mtp: false,
};

/// Mixtral: `block_sparse_moe.gate` router, experts `w1`/`w3`/`w2`.
pub const MIXTRAL: Architecture = Architecture {
    name: "mixtral",
    model_types: &["mixtral"],
    architectures: &["MixtralForCausalLM"],
    routers: &["block_sparse_moe.gate"],
    non_linear: NON_LINEAR,
    fused: &[QKV, W1_W3],
    default_exclude: &[],
    experts_segment: "experts",
    expert_count_keys: &["num_local_experts"],
    has_mtp: false,
};

/// Fallback for Llama-like models (and anything unknown): every 2-D weight in
/// a decoder layer that is not a norm, an embedding or a common router name.
pub const GENERIC: Architecture = Architecture {
    name: "generic",
    model_types: &[],
    architectures: &[],
    routers: &[
        "mlp.gate",
        "block_sparse_moe.gate",
        "mlp.shared_expert_gate",
    ],
    non_linear: NON_LINEAR,
    fused: &[QKV, GATE_UP, MLA_A, W1_W3],
    default_exclude: &[],
    experts_segment: "experts",
    expert_count_keys: &["n_routed_experts", "num_local_experts", "num_experts"],
    has_mtp: false,
};

/// Known families, tried in order.
pub const FAMILIES: &[Architecture] = &[DEEPSEEK, QWEN_MOE, MIXTRAL];

impl Architecture {
    /// Picks the family from `config.json`: `model_type` first (also inside
    /// `text_config`), then `architectures`; [`GENERIC`] otherwise.
    pub fn detect(config: &Value) -> Architecture {
        let model_type = |c: &Value| {
            c.get("model_type")
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        let types = [
            model_type(config),
            config.get("text_config").and_then(model_type),
        ];
        for t in types.iter().flatten() {
            if let Some(a) = FAMILIES
                .iter()
                .find(|a| a.model_types.contains(&t.as_str()))
            {
                return *a;
            }
        }
        let archs: Vec<&str> = config
            .get("architectures")
            .and_then(Value::as_array)
            .map(|v| v.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        FAMILIES
            .iter()
            .find(|a| archs.iter().any(|x| a.architectures.contains(x)))
            .copied()
            .unwrap_or(GENERIC)
    }

    /// Whether `module` (a full name without `.weight`) is a router.
    pub fn is_router(&self, module: &str) -> bool {
        self.routers.iter().any(|r| ends_with_segments(module, r))
    }

    /// Whether a tensor of a decoder layer is a linear weight: a 2-D
    /// `*.weight` whose module is neither a router nor a norm/embedding.
    pub fn is_linear(&self, name: &str, shape: &[usize]) -> bool {
        let Some(module) = name.strip_suffix(".weight") else {
            return false;
        };
        shape.len() == 2
            && !self.is_router(module)
            && !module.split('.').any(|seg| {
                self.non_linear
                    .iter()
                    .any(|n| seg == *n || seg.ends_with("norm"))
            })
    }

    /// The number of routed experts from `config.json` (top level or `text_config`).
    pub fn expert_count(&self, config: &Value) -> Option<usize> {
        let lookup = |c: &Value| {
            self.expert_count_keys
                .iter()
                .find_map(|k| c.get(*k).and_then(Value::as_u64))
        };
        lookup(config)
            .or_else(|| config.get("text_config").and_then(lookup))
            .and_then(|n| usize::try_from(n).ok())
    }

    /// `(experts module, expert id)` when `module` is `<p>.<experts>.<e>.<leaf>`.
    pub fn expert_of<'m>(&self, module: &'m str) -> Option<(&'m str, usize)> {
        let key = format!(".{}.", self.experts_segment);
        let pos = module.rfind(&key)?;
        let rest = &module[pos + key.len()..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || rest.as_bytes().get(digits) != Some(&b'.') {
            return None;
        }
        let e = rest[..digits].parse().ok()?;
        Some((&module[..pos + key.len() - 1], e))
    }

    /// The fused group (and its parent module) that `module` belongs to.
    pub fn fused_group_of<'m>(&self, module: &'m str) -> Option<(&'m str, &'static FusedGroup)> {
        let (parent, leaf) = module.rsplit_once('.')?;
        self.fused
            .iter()
            .find(|g| g.members.contains(&leaf))
            .map(|g| (parent, g))
    }
}

/// Largest value accepted for any count or dimension read from `config.json`
/// by [`expected_linears`] (anything above is a corrupt or hostile config).
pub const MAX_CONFIG_DIM: usize = 1 << 24;

/// A linear that `config.json` says a decoder layer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedLinear {
    /// Module name relative to the layer (`mlp.experts.3.down_proj`).
    pub module: String,
    /// out_features.
    pub n: usize,
    /// in_features.
    pub k: usize,
}

/// A config value: top level, else `text_config`.
fn cfg<'a>(config: &'a Value, key: &str) -> Option<&'a Value> {
    config
        .get(key)
        .filter(|v| !v.is_null())
        .or_else(|| config.get("text_config").and_then(|t| t.get(key)))
        .filter(|v| !v.is_null())
}

/// Reads a positive count/dimension, bounded by [`MAX_CONFIG_DIM`].
/// `Ok(None)` when absent; `Err` when present but not a plausible integer.
pub fn config_dim(config: &Value, key: &str) -> Result<Option<usize>, String> {
    match cfg(config, key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n as u128 <= MAX_CONFIG_DIM as u128 => Ok(Some(n as usize)),
            _ => Err(format!(
                "config.json {key} = {v} is not an integer between 0 and {MAX_CONFIG_DIM}"
            )),
        },
    }
}

/// Largest routed-expert count [`expected_linears`] accepts (DeepSeek-V3 has 256).
pub const MAX_EXPERTS: usize = 1 << 16;

fn check_experts(n: usize) -> Result<(), String> {
    if n > MAX_EXPERTS {
        return Err(format!(
            "config.json declares {n} routed experts; more than {MAX_EXPERTS} is not a real model"
        ));
    }
    Ok(())
}

/// `model_type` values whose decoder layer is the plain Llama layout
/// (q/k/v/o_proj, gate/up/down_proj).
const LLAMA_LIKE: &[&str] = &["llama", "mistral", "qwen2", "qwen3"];

/// The linears of decoder layer `layer` implied by `config.json`, with their
/// shapes: `Ok(None)` when the family's layout is not known well enough (or the
/// config lacks a dimension) to say, so callers skip the check; `Err` when the
/// config holds an implausible value. MTP layers (index ≥ `num_hidden_layers`)
/// are not described. Read-only: used by `verify`, usable at plan time.
pub fn expected_linears(
    arch: &Architecture,
    config: &Value,
    layer: usize,
) -> Result<Option<Vec<ExpectedLinear>>, String> {
    let d = |k: &str| config_dim(config, k);
    let mut out = Vec::new();
    let mut push = |module: String, n: usize, k: usize| out.push(ExpectedLinear { module, n, k });
    let model_type = cfg(config, "model_type")
        .and_then(Value::as_str)
        .unwrap_or("");
    let Some(hidden) = d("hidden_size")? else {
        return Ok(None);
    };
    let Some(heads) = d("num_attention_heads")? else {
        return Ok(None);
    };
    if arch.name == DEEPSEEK.name {
        let (Some(nope), Some(rope), Some(v), Some(kv_lora)) = (
            d("qk_nope_head_dim")?,
            d("qk_rope_head_dim")?,
            d("v_head_dim")?,
            d("kv_lora_rank")?,
        ) else {
            return Ok(None);
        };
        let qk = nope + rope;
        match d("q_lora_rank")? {
            Some(r) => {
                push("self_attn.q_a_proj".into(), r, hidden);
                push("self_attn.q_b_proj".into(), heads * qk, r);
            }
            None => push("self_attn.q_proj".into(), heads * qk, hidden),
        }
        push(
            "self_attn.kv_a_proj_with_mqa".into(),
            kv_lora + rope,
            hidden,
        );
        push("self_attn.kv_b_proj".into(), heads * (nope + v), kv_lora);
        push("self_attn.o_proj".into(), hidden, heads * v);
        let first_dense = d("first_k_dense_replace")?.unwrap_or(0);
        let freq = d("moe_layer_freq")?.unwrap_or(1).max(1);
        let experts = d("n_routed_experts")?.unwrap_or(0);
        if experts == 0 || layer < first_dense || !layer.is_multiple_of(freq) {
            let Some(inter) = d("intermediate_size")? else {
                return Ok(None);
            };
            for m in ["gate_proj", "up_proj"] {
                push(format!("mlp.{m}"), inter, hidden);
            }
            push("mlp.down_proj".into(), hidden, inter);
        } else {
            let Some(moe) = d("moe_intermediate_size")? else {
                return Ok(None);
            };
            check_experts(experts)?;
            for e in 0..experts {
                push(format!("mlp.experts.{e}.gate_proj"), moe, hidden);
                push(format!("mlp.experts.{e}.up_proj"), moe, hidden);
                push(format!("mlp.experts.{e}.down_proj"), hidden, moe);
            }
            let shared = d("n_shared_experts")?.unwrap_or(0);
            if shared > 0 {
                let i = moe * shared;
                push("mlp.shared_experts.gate_proj".into(), i, hidden);
                push("mlp.shared_experts.up_proj".into(), i, hidden);
                push("mlp.shared_experts.down_proj".into(), hidden, i);
            }
        }
        return Ok(Some(out));
    }
    // Llama-like attention (also Qwen-MoE and Mixtral).
    let kv_heads = d("num_key_value_heads")?.unwrap_or(heads);
    let head_dim = match d("head_dim")? {
        Some(h) => h,
        None if heads > 0 && hidden.is_multiple_of(heads) => hidden / heads,
        None => return Ok(None),
    };
    let attn = |push: &mut dyn FnMut(String, usize, usize)| {
        push("self_attn.q_proj".into(), heads * head_dim, hidden);
        push("self_attn.k_proj".into(), kv_heads * head_dim, hidden);
        push("self_attn.v_proj".into(), kv_heads * head_dim, hidden);
        push("self_attn.o_proj".into(), hidden, heads * head_dim);
    };
    if arch.name == MIXTRAL.name {
        let (Some(inter), Some(experts)) = (d("intermediate_size")?, d("num_local_experts")?)
        else {
            return Ok(None);
        };
        check_experts(experts)?;
        attn(&mut push);
        for e in 0..experts {
            push(format!("block_sparse_moe.experts.{e}.w1"), inter, hidden);
            push(format!("block_sparse_moe.experts.{e}.w3"), inter, hidden);
            push(format!("block_sparse_moe.experts.{e}.w2"), hidden, inter);
        }
        return Ok(Some(out));
    }
    if arch.name == GENERIC.name && LLAMA_LIKE.contains(&model_type) {
        let Some(inter) = d("intermediate_size")? else {
            return Ok(None);
        };
        attn(&mut push);
        push("mlp.gate_proj".into(), inter, hidden);
        push("mlp.up_proj".into(), inter, hidden);
        push("mlp.down_proj".into(), hidden, inter);
        return Ok(Some(out));
    }
    Ok(None)
}

/// Reads `num_hidden_layers` (top level or `text_config`).
pub fn num_hidden_layers(config: &Value) -> Option<usize> {
    let get = |c: &Value| c.get("num_hidden_layers").and_then(Value::as_u64);
    get(config)
        .or_else(|| config.get("text_config").and_then(get))
        .and_then(|n| usize::try_from(n).ok())
}

/// Whether `name` ends with the dotted segments of `suffix` (whole segments).
pub fn ends_with_segments(name: &str, suffix: &str) -> bool {
    name == suffix
        || name
            .strip_suffix(suffix)
            .is_some_and(|head| head.ends_with('.'))
}

/// A user pattern selecting modules by name.
///
/// - With `*` or `?`, a glob over the whole module name (`*` matches any run
///   of characters, dots included).
/// - Otherwise a sequence of whole dotted segments anywhere in the name:
///   `kv_b_proj` matches `model.layers.3.self_attn.kv_b_proj`, `self_attn`
///   matches every attention projection, `mlp.experts` every routed expert,
///   but `gate` does not match `gate_proj`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern(String);

impl Pattern {
    /// Builds a pattern; it must be non-empty and have no leading/trailing dot.
    pub fn new(p: &str) -> Option<Pattern> {
        let p = p.trim();
        (!p.is_empty() && !p.starts_with('.') && !p.ends_with('.')).then(|| Pattern(p.to_owned()))
    }

    /// The pattern text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the pattern selects `module`.
    pub fn matches(&self, module: &str) -> bool {
        if self.0.contains(['*', '?']) {
            glob(self.0.as_bytes(), module.as_bytes())
        } else {
            let padded = format!(".{module}.");
            padded.contains(&format!(".{}.", self.0))
        }
    }
}

fn glob(p: &[u8], s: &[u8]) -> bool {
    // Iterative wildcard matching with backtracking to the last `*`.
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        match p.get(pi) {
            Some(b'*') => {
                star = Some((pi, si));
                pi += 1;
            }
            Some(&c) if c == b'?' || c == s[si] => {
                pi += 1;
                si += 1;
            }
            _ => match star {
                Some((sp, ss)) => {
                    pi = sp + 1;
                    si = ss + 1;
                    star = Some((sp, ss + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn detect_families() {
        assert_eq!(
            Architecture::detect(&json!({"model_type": "deepseek_v3"})).name,
            "deepseek"
        );
        assert_eq!(
            Architecture::detect(&json!({"model_type": "qwen3_moe"})).name,
            "qwen-moe"
        );
        assert_eq!(
            Architecture::detect(&json!({"architectures": ["MixtralForCausalLM"]})).name,
            "mixtral"
        );
        assert_eq!(
            Architecture::detect(&json!({"model_type": "llama"})).name,
            "generic"
        );
    }

    #[test]
    fn linears_and_routers() {
        let a = DEEPSEEK;
        assert!(a.is_linear("model.layers.3.mlp.experts.0.gate_proj.weight", &[8, 8]));
        assert!(!a.is_linear("model.layers.3.mlp.gate.weight", &[8, 8]));
        assert!(!a.is_linear("model.layers.3.self_attn.kv_a_layernorm.weight", &[8]));
        assert!(!a.is_linear("model.layers.3.input_layernorm.weight", &[8, 8]));
        assert!(!a.is_linear("model.layers.3.mlp.gate.e_score_correction_bias", &[8]));
        assert!(a.is_linear(
            "model.layers.3.mlp.shared_experts.gate_proj.weight",
            &[8, 8]
        ));
        assert_eq!(
            a.expert_of("model.layers.3.mlp.experts.12.up_proj"),
            Some(("model.layers.3.mlp.experts", 12))
        );
        assert_eq!(
            a.expert_of("model.layers.3.mlp.shared_experts.up_proj"),
            None
        );
        assert!(QWEN_MOE.is_router("model.layers.0.mlp.shared_expert_gate"));
        assert!(!QWEN_MOE.is_router("model.layers.0.mlp.gate_proj"));
    }

    #[test]
    fn expected_deepseek_layout() {
        let c = json!({"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 2,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32,
            "q_lora_rank": 48, "first_k_dense_replace": 1, "intermediate_size": 96,
            "moe_intermediate_size": 24, "n_routed_experts": 4, "n_shared_experts": 1});
        let dense = expected_linears(&DEEPSEEK, &c, 0).unwrap().unwrap();
        assert!(dense.contains(&ExpectedLinear {
            module: "mlp.down_proj".into(),
            n: 64,
            k: 96
        }));
        assert!(dense.contains(&ExpectedLinear {
            module: "self_attn.q_b_proj".into(),
            n: 48,
            k: 48
        }));
        let moe = expected_linears(&DEEPSEEK, &c, 1).unwrap().unwrap();
        assert_eq!(moe.len(), 5 + 4 * 3 + 3);
        assert!(moe.contains(&ExpectedLinear {
            module: "mlp.experts.3.down_proj".into(),
            n: 64,
            k: 24
        }));
        let huge = json!({"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 2,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32,
            "moe_intermediate_size": 24, "n_routed_experts": 1u64 << 60});
        assert!(expected_linears(&DEEPSEEK, &huge, 1).is_err());
        let many = json!({"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 2,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32,
            "moe_intermediate_size": 24, "n_routed_experts": 1u64 << 20});
        assert!(expected_linears(&DEEPSEEK, &many, 1).is_err());
        assert_eq!(
            expected_linears(
                &GENERIC,
                &json!({"model_type": "phi3", "hidden_size": 8, "num_attention_heads": 2}),
                0
            ),
            Ok(None)
        );
    }

    #[test]
    fn patterns() {
        let p = |s| Pattern::new(s).unwrap_or_else(|| Pattern(String::new()));
        assert!(p("kv_b_proj").matches("model.layers.3.self_attn.kv_b_proj"));
        assert!(!p("gate").matches("model.layers.3.mlp.gate_proj"));
        assert!(p("gate").matches("model.layers.3.mlp.gate"));
        assert!(p("mlp.experts").matches("model.layers.3.mlp.experts.7.w1"));
        assert!(!p("mlp.experts").matches("model.layers.3.mlp.shared_experts.w1"));
        assert!(p("*.layers.1.*").matches("model.layers.1.self_attn.o_proj"));
        assert!(!p("*.layers.1.*").matches("model.layers.11.self_attn.o_proj"));
        assert!(p("*proj").matches("a.b_proj"));
        assert!(Pattern::new(" ").is_none());
    }
}
