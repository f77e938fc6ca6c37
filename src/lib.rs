//! `bot`: writes short posts in the user's voice with a LoRA-tuned Qwen3 stored in MLX's
//! quantized format, on the user's own machine. The binary (`main.rs`) only parses and
//! dispatches; everything it runs lives here so tests can call it directly.

pub mod app;
pub mod bluesky;
pub mod cmd;
pub mod engine;
pub mod eval;
pub mod exit;
pub mod fuzz;
pub mod generate;
