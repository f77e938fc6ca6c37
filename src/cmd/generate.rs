//! `bot generate` (posts on stdout) and `bot config show`.

use super::*;
use crate::app::drafts::save_draft;
use crate::app::settings::process_env;

pub fn generate(
    config: Option<&Path>,
    profile: Option<&str>,
    args: &GenerateArgs,
) -> anyhow::Result<()> {
    let settings = load_settings(config, profile, &overrides(&args.model, &args.sampling))?;
    let verbose = !args.quiet;
    let (mut generator, _) = load_generator(&settings, &args.model, verbose)?;
    let base_seed = args
        .sampling
        .seed
        .unwrap_or_else(|| rand::random::<u32>() as u64);
    let progress = Progress::new(verbose);
    let store = if args.save {
        Some(crate::app::store::Store::open(&settings.paths.data_dir)?)
    } else {
        None
    };
    let mut out = std::io::stdout().lock();
    for i in 0..args.count {
        let req = post_request(&settings, &args.sampling, base_seed.wrapping_add(i as u64))?;
        let label = format!("post {}/{}", i + 1, args.count);
        let post = generator.post(&req, &mut |e| progress.event(&label, &e));
        progress.finish();
        let post = post?;
        if verbose {
            report_post(&post, i, args.count);
        }
        if let Some(store) = &store {
            let id = save_draft(store, &post, &settings)?;
            if verbose {
                eprintln!("saved as draft {id}");
            }
        }
        if args.json {
            writeln!(out, "{}", serde_json::to_string(&post)?)?;
        } else if args.null {
            write!(out, "{}\0", post.text)?;
        } else {
            if i > 0 {
                writeln!(out, "---")?;
            }
            writeln!(out, "{}", post.text)?;
        }
        out.flush()?;
    }
    say_notes(&mut generator.model);
    Ok(())
}

pub fn config_show(config: Option<&Path>, profile: Option<&str>) -> anyhow::Result<()> {
    let settings = load_settings(config, profile, &Overrides::default())?;
    let pw = process_env("BOT_BSKY_APP_PASSWORD").is_some_and(|s| !s.is_empty());
    print!("{}", settings.render(pw));
    Ok(())
}
