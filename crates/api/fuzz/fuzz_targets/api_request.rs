//! Arbitrary bytes on the API socket: the HTTP parser and the router must
//! answer with an error or an action, never panic or allocate without bound;
//! the server's request buffer, fed the same bytes in pieces, must decide as
//! the parser does on the whole.
#![no_main]

use kemari_api::http::{read_request, Progress, RequestBuffer};
use kemari_api::routes::{route, MAX_BODY};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let whole = read_request(&mut std::io::BufReader::new(data), MAX_BODY);
    if let Ok(req) = &whole {
        assert!(req.body.len() <= MAX_BODY);
        if let Ok(routed) = route(&req.method, &req.path, &req.body) {
            // What routes also encodes back to a call to the same route.
            if let Ok(call) = routed.request.to_http() {
                assert_eq!(call.method.as_str(), req.method.to_ascii_uppercase());
            }
        }
    }
    // Piece sizes from the first byte, so the fuzzer explores them too.
    let piece = data.first().map_or(1, |&b| usize::from(b % 16) + 1);
    let mut buffer = RequestBuffer::new(MAX_BODY);
    let mut decided = None;
    for chunk in data.chunks(piece) {
        match buffer.push(chunk) {
            Progress::Incomplete => {}
            other => {
                decided = Some(other);
                break;
            }
        }
    }
    let decided = decided.unwrap_or_else(|| buffer.finish());
    match (decided, whole) {
        (Progress::Complete(a), Ok(b)) => assert_eq!(a, b),
        (Progress::Failed(a), Err(b)) => assert_eq!(a, b),
        (a, b) => panic!("the buffer decided {a:?}, the parser {b:?}"),
    }
});
