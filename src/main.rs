//! The `bot` binary: parse, dispatch, print the error chain and exit non-zero on failure.

use clap::Parser;

use bot::cmd::cli::{Cli, Command, ConfigCommand, DebugCommand, QueueCommand, ScheduleCommand};

fn run(cli: Cli) -> anyhow::Result<()> {
    let config = cli.config.as_deref();
    let profile = cli.profile.as_deref();
    match cli.command {
        Command::Generate(args) => bot::cmd::generate::generate(config, profile, &args),
        Command::Config(ConfigCommand::Show) => bot::cmd::generate::config_show(config, profile),
        Command::Post(args) => bot::cmd::post::post(config, profile, &args),
        Command::Reply(args) => bot::cmd::reply::reply(config, profile, &args),
        Command::Thread(args) => bot::cmd::reply::thread(config, profile, &args),
        Command::Sandbox(c) => bot::cmd::sandbox::run(config, &c),
        Command::Delete(args) => bot::cmd::post::delete(config, profile, &args),
        Command::Draft(args) => bot::cmd::queue::draft(config, profile, &args),
        Command::Queue(QueueCommand::List { json, status }) => {
            bot::cmd::queue::list(config, profile, json, status.as_deref())
        }
        Command::Queue(QueueCommand::Approve { ids }) => {
            bot::cmd::queue::decide(config, profile, &ids, true)
        }
        Command::Queue(QueueCommand::Reject { ids }) => {
            bot::cmd::queue::decide(config, profile, &ids, false)
        }
        Command::Queue(QueueCommand::Clear) => bot::cmd::queue::clear(config, profile),
        Command::Review(args) => bot::cmd::queue::review(config, profile, &args),
        Command::Run(args) => bot::cmd::schedule::run(config, profile, &args),
        Command::Schedule(ScheduleCommand::Install(spec)) => {
            bot::cmd::schedule::install(config, profile, &spec)
        }
        Command::Schedule(ScheduleCommand::Show { target }) => {
            bot::cmd::schedule::show(config, profile, target)
        }
        Command::Schedule(ScheduleCommand::Remove { target }) => {
            bot::cmd::schedule::remove(config, profile, target)
        }
        Command::Log(args) => bot::cmd::schedule::log(config, profile, args.n),
        Command::Whoami(args) => bot::cmd::post::whoami(config, profile, &args),
        Command::LabelBot(args) => bot::cmd::post::label_bot(config, profile, &args),
        Command::Eval(args) => bot::cmd::eval::run(config, profile, &args),
        Command::Bench(args) => bot::cmd::bench::run(&args),
        Command::Doctor => bot::cmd::doctor::run(config, profile),
        Command::Debug(DebugCommand::Forward(args)) => bot::cmd::debug::forward(&args),
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
