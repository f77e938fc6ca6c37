//! One integration binary (one link step): the engine against mlx_lm's references, the CLI.

mod common;
mod engine_vs_mlx;
