//! The `forge-rs` command line (`quantize`, `prune`, `inspect`, `verify`), shared by
//! the `forge-rs` binary and `python -m forge`. Argument parsing only: the
//! work is [`crate::run`], [`crate::inspect`] and [`crate::verify`].
//!
//! Exit codes: 0 success, 1 error (one line on stderr), 2 bad usage.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::arch::Pattern;
use crate::inspect::human_bytes;
use crate::run::Progress;
use crate::{Error, Result};

#[derive(Parser, Debug)]
#[command(
    name = "forge-rs",
    version,
    about = "Quantize Hugging Face checkpoints to 4-bit (AWQ, GPTQ or compressed-tensors) that stock vLLM loads, streaming layer by layer."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Grid {
    /// min/max of each group
    Range,
    /// range, refined by the MSE / L^p shrink search
    Mse,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FormatArg {
    /// AutoAWQ "gemm" (default)
    Awq,
    /// GPTQ v1 (symmetric only: needs --sym)
    Gptq,
    /// compressed-tensors pack-quantized (llm-compressor's W4A16)
    CompressedTensors,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum MethodArg {
    /// round to nearest (data-free)
    Rtn,
    /// GPTQ with calibration data
    Gptq,
    /// no quantization (a bf16/unchanged copy, e.g. pruned only)
    None,
}

/// The flags of a run (`quantize` and `prune`).
#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Source checkpoint folder (safetensors, bf16/fp16/fp32 or DeepSeek FP8).
    model_dir: PathBuf,
    /// Output folder (created; must be empty unless --overwrite or --resume).
    out_dir: PathBuf,
    /// `rtn` (data-free, default), `gptq` (calibrated; needs the Python package) or `none`
    /// (no quantization: a bf16/unchanged copy, e.g. pruned only).
    #[arg(long, value_enum)]
    method: Option<MethodArg>,
    /// Output format: awq (default), gptq (needs --sym) or compressed-tensors.
    #[arg(long, value_enum)]
    format: Option<FormatArg>,
    /// Group size along the input dimension (32, 64, 128; default 128).
    #[arg(long)]
    group_size: Option<usize>,
    /// Symmetric grid (zero point 8).
    #[arg(long, conflicts_with = "asym")]
    sym: bool,
    /// Asymmetric grid (the default).
    #[arg(long)]
    asym: bool,
    /// How to choose scales (default range).
    #[arg(long, value_enum)]
    grid: Option<Grid>,
    /// MSE grid: number of candidate scales.
    #[arg(long)]
    mse_grid: Option<usize>,
    /// MSE grid: candidates span [1 - s, 1 + s] times the range scale.
    #[arg(long)]
    mse_shrink: Option<f32>,
    /// MSE grid: exponent p of the loss Σ|e|^p.
    #[arg(long)]
    mse_norm: Option<f32>,
    /// Leave matching linears unquantized (dotted segments like `kv_b_proj`, `self_attn`, or a glob with `*`). Repeatable.
    #[arg(long, value_name = "PATTERN")]
    exclude: Vec<String>,
    /// Quantize only matching linears (e.g. `mlp.experts` for experts only). Repeatable.
    #[arg(long, value_name = "PATTERN")]
    include: Vec<String>,
    /// Also quantize what the family leaves unquantized by default (DeepSeek: kv_b_proj).
    #[arg(long)]
    no_default_excludes: bool,
    /// Leave linears whose shape cannot be packed unquantized instead of failing.
    #[arg(long)]
    skip_unpackable: bool,
    /// Maximum tensor bytes per output shard (`5GB`, `500MB`, `2GiB`, bytes).
    #[arg(long)]
    max_shard_size: Option<String>,
    /// GPTQ: calibration file (plain text, .jsonl with a "text" field, or token ids).
    #[arg(long)]
    calib: Option<PathBuf>,
    /// GPTQ: calibration windows (default 128).
    #[arg(long)]
    nsamples: Option<usize>,
    /// GPTQ: tokens per window (default 512).
    #[arg(long)]
    seqlen: Option<usize>,
    /// GPTQ: seed of the window sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// GPTQ: relative damping (default 0.01).
    #[arg(long)]
    damp: Option<f32>,
    /// GPTQ: process inputs in activation order (static groups).
    #[arg(long)]
    act_order: bool,
    /// GPTQ: columns per lazy-update block (default 128).
    #[arg(long)]
    block_size: Option<usize>,
    /// GPTQ: solve a layer's linears all from the unquantized layer's inputs.
    #[arg(long)]
    no_true_sequential: bool,
    /// GPTQ: `full` (default) or `block` (block-diagonal) Hessians.
    #[arg(long)]
    hessian: Option<String>,
    /// GPTQ: experts with too few tokens: `pooled` (default) or `rtn`.
    #[arg(long)]
    few_tokens: Option<String>,
    /// GPTQ: routed-token count under which an expert takes the fallback (default K/8).
    #[arg(long)]
    few_tokens_threshold: Option<usize>,
    /// GPTQ: tokens per forward chunk.
    #[arg(long)]
    chunk_tokens: Option<usize>,
    /// GPTQ: where activations live: auto, gpu, cpu, disk.
    #[arg(long)]
    activations: Option<String>,
    /// GPTQ: folder for activations on disk.
    #[arg(long)]
    offload_dir: Option<PathBuf>,
    /// Continue an interrupted run in OUT_DIR.
    #[arg(long)]
    resume: bool,
    /// Replace the files of a non-empty OUT_DIR.
    #[arg(long)]
    overwrite: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Where to quantize: `cpu` (default), `cuda` or `cuda:N`.
    #[arg(long)]
    device: Option<String>,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Print the final report as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Pruning: routed experts kept per MoE layer.
    #[arg(long, help_heading = "Expert pruning")]
    keep_experts: Option<usize>,
    /// Pruning: fraction of routed experts pruned, in (0, 1) (with n_group, balanced per group).
    #[arg(long, help_heading = "Expert pruning", conflicts_with = "keep_experts")]
    prune_ratio: Option<f32>,
    /// Pruning: rank experts by reap (default), frequency, mass or random.
    #[arg(long, help_heading = "Expert pruning")]
    criterion: Option<String>,
    /// Pruning: remap layout (router untouched, per-layer counts; needs the runtime patch)
    /// instead of the compact layout stock vLLM loads.
    #[arg(long, help_heading = "Expert pruning")]
    remap: bool,
    /// Pruning (remap, with --router-stats): keep per layer the fewest experts covering this
    /// fraction of the layer's total score, in (0, 1].
    #[arg(long, help_heading = "Expert pruning")]
    keep_mass: Option<f32>,
    /// Calibration forward without the routed experts (not with criterion reap).
    #[arg(long, help_heading = "Expert pruning")]
    sparse_forward: bool,
    /// Only collect router statistics (forge/router_stats.safetensors); needs --calib.
    #[arg(long, help_heading = "Expert pruning")]
    stats_only: bool,
    /// Prune from the router_stats.safetensors of an earlier run (no calibration needed).
    #[arg(long, help_heading = "Expert pruning", value_name = "FILE")]
    router_stats: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once per process
enum Command {
    /// Quantize MODEL_DIR into OUT_DIR (4 bits; AWQ "gemm" unless --format). Absent flags take
    /// the defaults of `forge.default_options()` (defined once, in the run's options).
    Quantize(RunArgs),
    /// Prune routed experts of MODEL_DIR into OUT_DIR (and quantize, unless --method none).
    /// With --router-stats it runs natively; with --calib (or --stats-only, --method gptq) the
    /// calibration forward runs in the Python package.
    Prune(RunArgs),
    /// Show layers, experts, dtypes, sizes and quantization status of a checkpoint folder.
    Inspect {
        /// Checkpoint folder.
        dir: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Check that an output folder is a complete, consistent 4-bit checkpoint (AWQ, GPTQ, compressed-tensors).
    Verify {
        /// Output folder of `forge-rs quantize`.
        dir: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// Parses a size: plain bytes, or a number with kB/MB/GB/TB (powers of 1000)
/// or KiB/MiB/GiB/TiB (powers of 1024), as Hugging Face's `max_shard_size`.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(Error::options(
            "max_shard_size",
            format!("{s:?} is negative; give a positive size such as 5GB, 500MB or 2GiB"),
        ));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" | "k" => 1e3,
        "mb" | "m" => 1e6,
        "gb" | "g" => 1e9,
        "tb" | "t" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0f64.powi(4),
        other => {
            return Err(Error::options(
                "max_shard_size",
                format!("unknown unit {other:?} in {s:?} (use e.g. 5GB, 500MB, 2GiB)"),
            ))
        }
    };
    let v: f64 = num
        .parse()
        .map_err(|_| Error::options("max_shard_size", format!("{s:?} is not a size")))?;
    let bytes = (v * mult).round();
    if !(1.0..1.8e19).contains(&bytes) {
        return Err(Error::options(
            "max_shard_size",
            format!("{s:?} must be at least 1 byte"),
        ));
    }
    Ok(bytes as u64)
}

/// Builds patterns, naming the bad one.
pub fn patterns(option: &str, v: &[String]) -> Result<Vec<Pattern>> {
    v.iter()
        .map(|p| {
            Pattern::new(p)
                .ok_or_else(|| Error::options(option, format!("{p:?} is not a module pattern")))
        })
        .collect()
}

/// indicatif progress bar on stderr (hidden when stderr is not a terminal).
pub struct BarProgress {
    bar: ProgressBar,
    bytes: AtomicU64,
}

impl BarProgress {
    /// A bar, drawn only when `enabled` and stderr is a terminal.
    pub fn new(enabled: bool) -> Self {
        let target = if enabled && std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(None, target);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} units  {msg}  eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        BarProgress {
            bar,
            bytes: AtomicU64::new(0),
        }
    }
    fn rate(&self, bytes: u64) -> String {
        let secs = self.bar.elapsed().as_secs_f64().max(1e-3);
        format!("{}/s", human_bytes((bytes as f64 / secs) as u64))
    }
}

impl Progress for BarProgress {
    fn start(&self, units: usize, _bytes: u64, done_units: usize, _done_bytes: u64) {
        self.bytes.store(0, Ordering::Relaxed);
        self.bar.set_length(units as u64);
        self.bar.set_position(done_units as u64);
        self.bar.reset_eta();
        if done_units > 0 {
            self.bar.println(format!(
                "resuming: {done_units} of {units} units already done"
            ));
        }
    }
    fn unit_done(&self, label: &str, bytes: u64) -> bool {
        let total = self.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.bar.inc(1);
        self.bar
            .set_message(format!("{label} done, {}", self.rate(total)));
        true
    }
    fn note(&self, msg: &str) {
        if self.bar.is_hidden() {
            eprintln!("note: {msg}");
        } else {
            self.bar.println(format!("note: {msg}"));
        }
    }
    fn finishing(&self) {
        self.bar.set_message("writing index and config");
    }
}

impl Drop for BarProgress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// What the command line asks of its caller.
#[derive(Debug)]
pub enum Outcome {
    /// Done; exit with this code.
    Exit(i32),
    /// A run the Python package performs (the calibration forward, and every pruning run
    /// with its reports): the caller runs it with these options, then reports like
    /// `quantize` does.
    Calibrate {
        /// Source folder.
        model_dir: PathBuf,
        /// Output folder.
        out_dir: PathBuf,
        /// The options as JSON (validated).
        options: serde_json::Value,
        /// Print the report as JSON.
        json: bool,
    },
}

fn print_report(report: &crate::RunReport, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.to_json()).unwrap_or_default()
        );
        return;
    }
    eprintln!(
        "quantized {} linears ({} family, {}) in {:.1}s: {} -> {} in {} shard(s){}",
        report.quantized,
        report.arch,
        report.quantizer,
        report.seconds,
        human_bytes(report.bytes_in),
        human_bytes(report.bytes_out),
        report.shards,
        if report.resumed_units > 0 {
            format!(
                ", {} of {} units resumed",
                report.resumed_units, report.units
            )
        } else {
            String::new()
        }
    );
    eprintln!(
        "{} modules left unquantized (modules_to_not_convert); output: {}",
        report.not_convert.len(),
        report.out_dir.display()
    );
}

/// Runs `quantize` (or `prune`, which must be asked to prune) with the given flags.
fn run_args(a: RunArgs, prune: bool) -> Result<Outcome> {
    let RunArgs {
        model_dir,
        out_dir,
        method,
        format,
        group_size,
        sym,
        asym: _,
        grid,
        mse_grid,
        mse_shrink,
        mse_norm,
        exclude,
        include,
        no_default_excludes,
        skip_unpackable,
        max_shard_size,
        calib,
        nsamples,
        seqlen,
        seed,
        damp,
        act_order,
        block_size,
        no_true_sequential,
        hessian,
        few_tokens,
        few_tokens_threshold,
        chunk_tokens,
        activations,
        offload_dir,
        resume,
        overwrite,
        threads,
        device,
        no_progress,
        json,
        keep_experts,
        prune_ratio,
        criterion,
        remap,
        keep_mass,
        sparse_forward,
        stats_only,
        router_stats,
    } = a;
    // Only what was given: the defaults live in `Options`.
    let mut m = serde_json::Map::new();
    let mut put = |k: &str, v: serde_json::Value| {
        if !v.is_null() {
            m.insert(k.into(), v);
        }
    };
    use serde_json::json;
    put(
        "method",
        json!(method.map(|x| match x {
            MethodArg::Rtn => "rtn",
            MethodArg::Gptq => "gptq",
            MethodArg::None => "none",
        })),
    );
    put(
        "format",
        json!(format.map(|f| match f {
            FormatArg::Awq => crate::OutputFormat::Awq.name(),
            FormatArg::Gptq => crate::OutputFormat::Gptq.name(),
            FormatArg::CompressedTensors => crate::OutputFormat::CompressedTensors.name(),
        })),
    );
    put("group_size", json!(group_size));
    if sym {
        put("symmetric", json!(true));
    }
    put(
        "grid",
        json!(grid.map(|g| match g {
            Grid::Range => "range",
            Grid::Mse => "mse",
        })),
    );
    put("mse_grid", json!(mse_grid));
    put("mse_shrink", json!(mse_shrink));
    put("mse_norm", json!(mse_norm));
    if !exclude.is_empty() {
        put("exclude", json!(exclude));
    }
    if !include.is_empty() {
        put("include", json!(include));
    }
    if no_default_excludes {
        put("default_excludes", json!(false));
    }
    if skip_unpackable {
        put("skip_unpackable", json!(true));
    }
    put("max_shard_size", json!(max_shard_size));
    put("calib", json!(calib.map(|p| p.display().to_string())));
    put("nsamples", json!(nsamples));
    put("seqlen", json!(seqlen));
    put("seed", json!(seed));
    put("damp", json!(damp));
    if act_order {
        put("act_order", json!(true));
    }
    put("block_size", json!(block_size));
    if no_true_sequential {
        put("true_sequential", json!(false));
    }
    put("hessian", json!(hessian));
    put("few_tokens", json!(few_tokens));
    put("few_tokens_threshold", json!(few_tokens_threshold));
    put("chunk_tokens", json!(chunk_tokens));
    put("activations", json!(activations));
    put(
        "offload_dir",
        json!(offload_dir.map(|p| p.display().to_string())),
    );
    if resume {
        put("resume", json!(true));
    }
    if overwrite {
        put("overwrite", json!(true));
    }
    put("threads", json!(threads));
    put("device", json!(device));
    if no_progress {
        put("progress", json!(false));
    }
    put("keep_experts", json!(keep_experts));
    put("prune_ratio", json!(prune_ratio));
    put("criterion", json!(criterion));
    if remap {
        put("remap", json!(true));
    }
    put("keep_mass", json!(keep_mass));
    if sparse_forward {
        put("sparse_forward", json!(true));
    }
    if stats_only {
        put("stats_only", json!(true));
    }
    put(
        "router_stats",
        json!(router_stats.map(|p| p.display().to_string())),
    );
    if let Some(n) = threads {
        check_threads(n)?;
    }
    let opts = crate::Options::from_json(&serde_json::Value::Object(m))?;
    if prune && !opts.prunes() && !opts.stats_only {
        return Err(Error::options(
            "prune",
            "says what to keep: give --keep-experts, --prune-ratio or --keep-mass (or --stats-only to collect router statistics)",
        ));
    }
    // The calibration forward, and every pruning run (its reports), run in the Python package.
    if opts.uses_calibration() || opts.prunes() {
        return Ok(Outcome::Calibrate {
            model_dir,
            out_dir,
            options: opts.to_json(),
            json,
        });
    }
    if NATIVE.load(Ordering::Relaxed) {
        install_interrupt_hint();
    }
    let bar = BarProgress::new(opts.progress);
    let report = crate::run::quantize(&model_dir, &out_dir, &opts, &bar)?;
    drop(bar);
    print_report(&report, json);
    Ok(Outcome::Exit(0))
}

fn run_cli(cli: Cli) -> Result<Outcome> {
    match cli.command {
        Command::Quantize(a) => run_args(a, false),
        Command::Prune(a) => run_args(a, true),
        Command::Inspect { dir, json } => {
            let v = crate::inspect::inspect(&dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                print!("{}", crate::inspect::render(&v));
            }
            Ok(Outcome::Exit(0))
        }
        Command::Verify { dir, json } => {
            let r = crate::verify::check(&dir)?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&r.to_json()).unwrap_or_default()
                );
            } else if r.problems.is_empty() {
                println!(
                    "OK: {} ({} tensors in {} shard(s), {} quantized linears, group size {}, {} unquantized linear-like modules)",
                    dir.display(),
                    r.tensors,
                    r.shards,
                    r.quantized,
                    r.group_size,
                    r.unquantized
                );
            } else {
                for p in &r.problems {
                    println!("problem: {p}");
                }
            }
            if r.problems.is_empty() {
                Ok(Outcome::Exit(0))
            } else {
                Err(Error::Verify {
                    dir,
                    problems: r.problems,
                })
            }
        }
    }
}

/// Runs the CLI on `argv` (program name first) and returns what the caller
/// must do next. Never panics into the caller.
pub fn dispatch<I, T>(argv: I) -> Outcome
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => {
            let code = e.exit_code();
            let _ = e.print();
            return Outcome::Exit(code);
        }
    };
    match std::panic::catch_unwind(|| run_cli(cli)) {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => {
            eprintln!("forge-rs: error: {e}");
            Outcome::Exit(1)
        }
        Err(_) => {
            eprintln!("forge-rs: internal error (panic); please report it");
            Outcome::Exit(1)
        }
    }
}

/// Runs the CLI on `argv` and returns the exit code. A calibrated run
/// (`--method gptq`) is handed to the Python package: `python3 -m forge` with
/// the same arguments (`FORGE_PYTHON` names another interpreter).
pub fn main<I, T>(argv: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    match dispatch(args.clone()) {
        Outcome::Exit(c) => c,
        Outcome::Calibrate { .. } => {
            let python = std::env::var_os("FORGE_PYTHON").unwrap_or_else(|| "python3".into());
            let status = std::process::Command::new(&python)
                .arg("-m")
                .arg("forge")
                .args(args.iter().skip(1))
                .status();
            match status {
                Ok(s) => s.code().unwrap_or(1),
                Err(e) => {
                    eprintln!(
                        "forge-rs: error: the calibration forward (--method gptq, --calib pruning, --stats-only) runs in the Python package (pip install 4bit-forge), but {} could not be started: {e}",
                        std::path::Path::new(&python).display()
                    );
                    1
                }
            }
        }
    }
}

/// Most worker threads `--threads` accepts, whatever the machine.
pub const MAX_THREADS: usize = 4096;

/// Rejects `--threads` above [`MAX_THREADS`] or above 64 × the available cores
/// (thread stacks and per-thread buffers would exhaust memory long before any gain).
pub fn check_threads(n: usize) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let cap = MAX_THREADS.min(64 * cores);
    if n > cap {
        return Err(Error::options(
            "--threads",
            format!("{n} is too many: at most {cap} (64 × the {cores} available cores, and never more than {MAX_THREADS})"),
        ));
    }
    Ok(())
}

/// Set by [`main_native`]: the process is the `forge-rs` binary, so the CLI may
/// own its signal handlers.
static NATIVE: AtomicBool = AtomicBool::new(false);

/// [`main`] for the native `forge-rs` binary: also prints a one-line
/// "interrupted; rerun with --resume" hint when `quantize` gets Ctrl-C or SIGTERM.
/// (Python's `python -m forge` keeps its own handling, and gets
/// [`Error::Interrupted`]'s message.)
pub fn main_native<I, T>(argv: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    NATIVE.store(true, Ordering::Relaxed);
    main(argv)
}

/// On SIGINT/SIGTERM: write the hint and exit at once with 128 + signal, as the
/// default action would. Exiting mid-layer is safe: the run is resumable after a
/// kill by design (manifest of finished units, `.partial` files), and the OS
/// releases the output-directory lock.
#[cfg(unix)]
fn install_interrupt_hint() {
    extern "C" fn on_signal(sig: libc::c_int) {
        const MSG: &[u8] = b"\nforge-rs: interrupted; rerun with --resume to continue\n";
        // SAFETY: write(2) and _exit(2) are async-signal-safe; MSG is a static buffer.
        unsafe {
            libc::write(2, MSG.as_ptr().cast(), MSG.len());
            libc::_exit(128 + sig);
        }
    }
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: installs a handler that only calls async-signal-safe functions.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

#[cfg(not(unix))]
fn install_interrupt_hint() {}

/// `cpu` → `None`, `cuda` → `Some(0)`, `cuda:N` → `Some(N)`.
pub fn parse_device(s: &str) -> Result<Option<usize>> {
    match s {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Some)
            .ok_or_else(|| {
                Error::options(
                    "--device",
                    format!("expected cpu, cuda or cuda:N, got {s:?}"),
                )
            }),
    }
}
