//! One integration binary (one link step): the engine against mlx_lm's references, bad input,
//! the CLI.

mod bad_input;
mod bluesky_pds;
mod cli;
mod common;
mod engine_vs_mlx;
mod eval_vs_mlx;
mod fuzz_corpus;
mod generate;
mod hardening;
mod hub;
mod replies;
mod sandbox;
mod workflow;
