//! The `bot` binary: parse, dispatch, print the error chain and exit non-zero on failure.

use clap::Parser;

use bot::cli::{Cli, Command, ConfigCommand, DebugCommand, QueueCommand, ScheduleCommand};

fn run(cli: Cli) -> anyhow::Result<()> {
    let config = cli.config.as_deref();
    let profile = cli.profile.as_deref();
    match cli.command {
        Command::Generate(args) => bot::commands::generate(config, profile, &args),
        Command::Config(ConfigCommand::Show) => bot::commands::config_show(config, profile),
        Command::Post(args) => bot::posting::post(config, profile, &args),
        Command::Delete(args) => bot::posting::delete(config, profile, &args),
        Command::Draft(args) => bot::queue::draft(config, profile, &args),
        Command::Queue(QueueCommand::List { json, status }) => {
            bot::queue::list(config, profile, json, status.as_deref())
        }
        Command::Queue(QueueCommand::Approve { ids }) => {
            bot::queue::decide(config, profile, &ids, true)
        }
        Command::Queue(QueueCommand::Reject { ids }) => {
            bot::queue::decide(config, profile, &ids, false)
        }
        Command::Queue(QueueCommand::Clear) => bot::queue::clear(config, profile),
        Command::Review(args) => bot::queue::review(config, profile, &args),
        Command::Run(args) => bot::schedule::run(config, profile, &args),
        Command::Schedule(ScheduleCommand::Install(spec)) => {
            bot::schedule::install(config, profile, &spec)
        }
        Command::Schedule(ScheduleCommand::Show { target }) => {
            bot::schedule::show(config, profile, target)
        }
        Command::Schedule(ScheduleCommand::Remove { target }) => {
            bot::schedule::remove(config, profile, target)
        }
        Command::Log(args) => bot::schedule::log(config, profile, args.n),
        Command::Whoami(args) => bot::posting::whoami(config, profile, &args),
        Command::LabelBot(args) => bot::posting::label_bot(config, profile, &args),
        Command::Bench(args) => bot::bench::run(&args),
        Command::Doctor => bot::doctor::run(config, profile),
        Command::Debug(DebugCommand::Forward(args)) => bot::debug::forward(&args),
    }
}

fn main() {
    bot::engine::device::init_process();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(bot::exit::code(&e));
    }
}
