//! The `forge-rs` command line (`quantize`, `inspect`, `verify`), shared by
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
use forge_core::grid::GridMode;
use forge_core::MseSpec;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::arch::Pattern;
use crate::inspect::human_bytes;
use crate::plan::QuantOptions;
use crate::run::{Progress, RunOptions};
use crate::{Error, Result};

#[derive(Parser, Debug)]
#[command(
    name = "forge-rs",
    version,
    about = "Quantize Hugging Face checkpoints to 4-bit AWQ that stock vLLM loads, streaming layer by layer."
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

#[derive(Subcommand, Debug)]
enum Command {
    /// Quantize MODEL_DIR into OUT_DIR (AWQ "gemm", 4 bits).
    Quantize {
        /// Source checkpoint folder (safetensors, bf16/fp16/fp32 or DeepSeek FP8).
        model_dir: PathBuf,
        /// Output folder (created; must be empty unless --overwrite or --resume).
        out_dir: PathBuf,
        /// Group size along the input dimension (32, 64, 128).
        #[arg(long, default_value_t = 128)]
        group_size: usize,
        /// Symmetric grid (zero point 8).
        #[arg(long, conflicts_with = "asym")]
        sym: bool,
        /// Asymmetric grid (the default).
        #[arg(long)]
        asym: bool,
        /// How to choose scales.
        #[arg(long, value_enum, default_value_t = Grid::Range)]
        grid: Grid,
        /// MSE grid: number of candidate scales.
        #[arg(long, default_value_t = 100)]
        mse_grid: usize,
        /// MSE grid: candidates span [1 - s, 1 + s] times the range scale.
        #[arg(long, default_value_t = 0.2)]
        mse_shrink: f32,
        /// MSE grid: exponent p of the loss Σ|e|^p.
        #[arg(long, default_value_t = 2.4)]
        mse_norm: f32,
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
        #[arg(long, default_value = "5GB")]
        max_shard_size: String,
        /// Continue an interrupted run in OUT_DIR.
        #[arg(long)]
        resume: bool,
        /// Replace the files of a non-empty OUT_DIR.
        #[arg(long)]
        overwrite: bool,
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Where to quantize: `cpu` (default), `cuda` or `cuda:N` (same output bytes).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// No progress bar.
        #[arg(long)]
        no_progress: bool,
        /// Print the final report as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Show layers, experts, dtypes, sizes and quantization status of a checkpoint folder.
    Inspect {
        /// Checkpoint folder.
        dir: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Check that an output folder is a complete, consistent AWQ checkpoint.
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

fn run_cli(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Quantize {
            model_dir,
            out_dir,
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
            resume,
            overwrite,
            threads,
            device,
            no_progress,
            json,
        } => {
            let grid = match grid {
                Grid::Range => GridMode::Range,
                Grid::Mse => {
                    let m = MseSpec {
                        max_shrink: mse_shrink,
                        n_grid: mse_grid,
                        norm: mse_norm,
                    };
                    m.validate()
                        .map_err(|e| Error::options("--grid mse", e.to_string()))?;
                    GridMode::Mse(m)
                }
            };
            if let Some(n) = threads {
                check_threads(n)?;
            }
            if NATIVE.load(Ordering::Relaxed) {
                install_interrupt_hint();
            }
            let opts = RunOptions {
                quant: QuantOptions {
                    group_size,
                    symmetric: sym,
                    grid,
                    include: patterns("--include", &include)?,
                    exclude: patterns("--exclude", &exclude)?,
                    default_excludes: !no_default_excludes,
                    skip_unpackable,
                    max_shard_bytes: parse_size(&max_shard_size)?,
                },
                resume,
                overwrite,
                threads,
                cuda_device: parse_device(&device)?,
            };
            let bar = BarProgress::new(!no_progress);
            let report = crate::run::quantize(&model_dir, &out_dir, &opts, &bar)?;
            drop(bar);
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report.to_json()).unwrap_or_default()
                );
            } else {
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
                    out_dir.display()
                );
            }
            Ok(())
        }
        Command::Inspect { dir, json } => {
            let v = crate::inspect::inspect(&dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                print!("{}", crate::inspect::render(&v));
            }
            Ok(())
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
                Ok(())
            } else {
                Err(Error::Verify {
                    dir,
                    problems: r.problems,
                })
            }
        }
    }
}

/// Runs the CLI on `argv` (program name first) and returns the exit code.
/// Never panics into the caller.
pub fn main<I, T>(argv: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => {
            let code = e.exit_code();
            let _ = e.print();
            return code;
        }
    };
    match std::panic::catch_unwind(|| run_cli(cli)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            eprintln!("forge-rs: error: {e}");
            1
        }
        Err(_) => {
            eprintln!("forge-rs: internal error (panic); please report it");
            1
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
