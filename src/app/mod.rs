//! The application services under the commands: settings, the SQLite store, drafts,
//! publishing, the duplicate guard, scheduling, Hugging Face downloads. Nothing here parses a
//! command line or prints the product.

pub mod dedup;
pub mod drafts;
pub mod hub;
pub mod mentions;
pub mod publish;
pub mod sandbox;
pub mod sandbox_pds;
pub mod schedule;
pub mod settings;
pub mod store;
