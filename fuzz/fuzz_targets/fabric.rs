#![no_main]
use libfuzzer_sys::{fuzz_target, Corpus};

fuzz_target!(|data: &[u8]| -> Corpus {
    if omw_fuzz_harness::fabric::run(data) {
        Corpus::Keep
    } else {
        Corpus::Reject
    }
});
