//! The Metal backend. Always compiled, plain Rust, tested on every platform: whether this Mac
//! can run it (`guard`), which MSL kernel and grid a shape gets (`plan`), the load-time
//! self-test of those kernels (`selftest`, run off-device through `shim`'s C++ runner), and the
//! fused decode step as a list of dispatches (`step`). The code that dispatches the kernels
//! exists only where Metal does (`bot_metal`).

pub mod guard;
pub mod plan;
#[cfg(bot_metal)]
pub mod quant;
#[cfg(bot_metal)]
pub mod sample;
pub mod selftest;
#[cfg(test)]
pub(crate) mod shim;
#[cfg_attr(not(bot_metal), allow(dead_code))]
pub mod step;
