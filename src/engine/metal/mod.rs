//! The Metal backend: the kernel plan (which MSL kernel and launch geometry for a shape, plain
//! Rust, tested off-device through `shim`'s C++ runner) is always compiled; the candle ops
//! that dispatch the kernels exist only where Metal does (`bot_metal`).

pub mod plan;
#[cfg(bot_metal)]
pub mod quant;
#[cfg(bot_metal)]
pub mod sample;
#[cfg(test)]
pub(crate) mod shim;
