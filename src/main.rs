//! The `bot` binary: parse, dispatch, print the error chain and exit non-zero on failure.

use clap::Parser;

use bot::cli::{Cli, Command, ConfigCommand, DebugCommand};

fn run(cli: Cli) -> anyhow::Result<()> {
    let config = cli.config.as_deref();
    let profile = cli.profile.as_deref();
    match cli.command {
        Command::Generate(args) => bot::commands::generate(config, profile, &args),
        Command::Config(ConfigCommand::Show) => bot::commands::config_show(config, profile),
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
