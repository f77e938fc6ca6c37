#![no_main]
//! `bot::fuzz::postprocess` under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| bot::fuzz::postprocess(data));
