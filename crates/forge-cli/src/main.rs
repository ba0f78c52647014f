//! `forge-rs`: the command-line front door of 4bit-forge. All logic lives in
//! [`forge_run::cli`], which the Python package calls too (`python -m forge`).

fn main() {
    std::process::exit(forge_run::cli::main_native(std::env::args_os()));
}
