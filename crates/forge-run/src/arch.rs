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
