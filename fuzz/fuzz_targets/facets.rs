#![no_main]
//! `bot::fuzz::facets` under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| bot::fuzz::facets(data));
