//! The `bot` binary: parse, dispatch, print the error chain and exit non-zero on failure.

use clap::Parser;

use bot::cli::{Cli, Command, ConfigCommand, DebugCommand};

fn run(cli: Cli) -> anyhow::Result<()> {
    let config = cli.config.as_deref();
    let profile = cli.profile.as_deref();
    match cli.command {
        Command::Generate(args) => bot::commands::generate(config, profile, &args),
        Command::Config(ConfigCommand::Show) => bot::commands::config_show(config, profile),
        Command::Post(args) => bot::posting::post(config, profile, &args),
        Command::Delete(args) => bot::posting::delete(config, profile, &args),
        Command::Whoami(args) => bot::posting::whoami(config, profile, &args),
        Command::LabelBot(args) => bot::posting::label_bot(config, profile, &args),
        Command::Bench(args) => bot::bench::run(&args),
        Command::Debug(DebugCommand::Forward(args)) => bot::debug::forward(&args),
    }
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(bot::exit::code(&e));
    }
}
