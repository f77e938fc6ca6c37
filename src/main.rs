//! The `bot` binary: parse, dispatch, print the error chain and exit non-zero on failure.

use clap::Parser;

use bot::cli::{Cli, Command, DebugCommand};

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Bench(args) => bot::bench::run(&args),
        Command::Debug(DebugCommand::Forward(args)) => bot::debug::forward(&args),
    }
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
