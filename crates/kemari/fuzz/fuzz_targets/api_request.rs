//! Arbitrary bytes on the API socket: the HTTP parser and the router must
//! answer with an error or an action, never panic or allocate without bound.
#![no_main]

use kemari::api::http::read_request;
use kemari::api::routes::{route, MAX_BODY};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r = std::io::BufReader::new(data);
    if let Ok(req) = read_request(&mut r, MAX_BODY) {
        assert!(req.body.len() <= MAX_BODY);
        let _ = route(&req.method, &req.path, &req.body);
    }
});
