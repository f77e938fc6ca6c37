#![no_main]
//! `bot::fuzz::schedule` under libFuzzer; the plist it renders must parse.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((_, plist)) = bot::fuzz::schedule(data) {
        plist::from_bytes::<plist::Value>(plist.as_bytes()).expect("the plist parses");
    }
});
