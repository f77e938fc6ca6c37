#![no_main]
//! `bot::fuzz::config` under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| bot::fuzz::config(data));
