#![no_main]
//! `bot::fuzz::safetensors` under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| bot::fuzz::safetensors(data));
