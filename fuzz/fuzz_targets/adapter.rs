#![no_main]
//! `bot::fuzz::adapter` under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| bot::fuzz::adapter(data));
