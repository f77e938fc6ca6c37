//! Drafts for the review queue, saved with what made them (prompt, seed, model, adapter).

use std::time::SystemTime;

use crate::app::settings::Settings;
use crate::app::store::Store;
use crate::bluesky::record;
use crate::generate::Post;

pub fn save_draft(store: &Store, p: &Post, settings: &Settings) -> anyhow::Result<i64> {
    Ok(store.add_draft(
        &p.text,
        Some(&p.raw),
        Some(&p.prompt),
        Some(p.seed as i64),
        Some(&settings.model.value),
        settings.adapter.value.as_deref(),
        &record::timestamp(SystemTime::now()),
    )?)
}
