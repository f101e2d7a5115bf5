//! Sessions on in-memory streams: option handling, errors, metadata
//! contexts, block status and the TLS policy.

use super::*;
use crate::backend::{FileBackend, MemBackend};
use nbd_client::protocol::*;

fn exports() -> ServerConfig {
    let mut e = Exports::new();
    e.add("a", Arc::new(MemBackend::new(1 << 20, false)));
    e.add("ro", Arc::new(MemBackend::new(4096, true)));
    ServerConfig::new(e)
}

fn go(name: &str) -> Vec<u8> {
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(encode_option(OPT_STRUCTURED_REPLY, &[]));
    v.extend(encode_option(OPT_GO, &encode_info_request(name, &[])));
    v
}

#[test]
fn bad_request_magic_closes_with_error() {
    let mut v = go("a");
    v.extend_from_slice(&[0xde; 28]);
    let (_, r) = run_session_on_bytes(&v, &exports());
    assert!(matches!(r, Err(ServerError::Protocol(_))));
}

#[test]
fn out_of_range_and_read_only_get_errors() {
    let mut v = go("ro");
    let rd = Request {
        flags: 0,
        command: CMD_READ,
        cookie: 1,
        offset: 4000,
        len: 200,
    };
    v.extend(rd.encode());
    let wr = Request {
        command: CMD_WRITE,
        cookie: 2,
        offset: 0,
        len: 4,
        ..rd
    };
    v.extend(wr.encode());
    v.extend([1, 2, 3, 4]);
    let (out, r) = run_session_on_bytes(&v, &exports());
    assert!(r.is_ok(), "{r:?}");
    // Last reply is the simple EPERM reply for the write.
    assert_eq!(&out[out.len() - 16..], &encode_simple_reply(EPERM, 2));
}

#[test]
fn huge_write_is_refused() {
    let mut v = go("a");
    let wr = Request {
        flags: 0,
        command: CMD_WRITE,
        cookie: 3,
        offset: 0,
        len: u32::MAX,
    };
    v.extend(wr.encode());
    let (_, r) = run_session_on_bytes(&v, &exports());
    assert!(r.is_err());
}

#[test]
fn unknown_option_and_meta_context_order() {
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(encode_option(0x1234, &[]));
    v.extend(encode_option(OPT_SET_META_CONTEXT, &[]));
    v.extend(encode_option(OPT_ABORT, &[]));
    let (out, r) = run_session_on_bytes(&v, &exports());
    assert!(r.is_ok());
    let h = decode_option_reply_header(&out[18..], 1000).unwrap();
    assert_eq!(h.reply_type, REP_ERR_UNSUP);
    let at = 18 + 20 + h.len as usize;
    let h = decode_option_reply_header(&out[at..], 1000).unwrap();
    assert_eq!(h.reply_type, REP_ERR_INVALID);
}

/// The option replies after the 18-byte greeting: (option, type, data).
fn option_replies(out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
    let mut v = Vec::new();
    let mut at = HANDSHAKE_LEN;
    while let Ok(h) = decode_option_reply_header(&out[at..], 1 << 20) {
        let d = out[at + OPTION_REPLY_HEADER_LEN..at + OPTION_REPLY_HEADER_LEN + h.len as usize]
            .to_vec();
        at += OPTION_REPLY_HEADER_LEN + h.len as usize;
        v.push((h.option, h.reply_type, d));
    }
    v
}

fn types(replies: &[(u32, u32, Vec<u8>)]) -> Vec<u32> {
    replies.iter().map(|r| r.1).collect()
}

#[test]
fn meta_contexts_list_and_set_base_allocation_only() {
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(encode_option(OPT_STRUCTURED_REPLY, &[]));
    v.extend(encode_option(
        OPT_LIST_META_CONTEXT,
        &encode_meta_context_request("a", &[]),
    ));
    v.extend(encode_option(
        OPT_LIST_META_CONTEXT,
        &encode_meta_context_request("a", &["qemu:"]),
    ));
    v.extend(encode_option(
        OPT_LIST_META_CONTEXT,
        &encode_meta_context_request("a", &["base:"]),
    ));
    v.extend(encode_option(
        OPT_SET_META_CONTEXT,
        &encode_meta_context_request("a", &["qemu:dirty-bitmap:x", META_BASE_ALLOCATION]),
    ));
    v.extend(encode_option(
        OPT_SET_META_CONTEXT,
        &encode_meta_context_request("nope", &[]),
    ));
    v.extend(encode_option(OPT_SET_META_CONTEXT, &[0, 0, 0]));
    v.extend(encode_option(OPT_ABORT, &[]));
    let (out, r) = run_session_on_bytes(&v, &exports());
    assert!(r.is_ok(), "{r:?}");
    let replies = option_replies(&out);
    assert_eq!(
        types(&replies),
        vec![
            REP_ACK,
            REP_META_CONTEXT,
            REP_ACK,
            REP_ACK,
            REP_META_CONTEXT,
            REP_ACK,
            REP_META_CONTEXT,
            REP_ACK,
            REP_ERR_UNKNOWN,
            REP_ERR_INVALID,
            REP_ACK,
        ]
    );
    assert_eq!(
        decode_meta_context_reply(&replies[1].2).unwrap(),
        (0, META_BASE_ALLOCATION.to_string())
    );
    assert_eq!(
        decode_meta_context_reply(&replies[6].2).unwrap(),
        (
            negotiate::BASE_ALLOCATION_ID,
            META_BASE_ALLOCATION.to_string()
        )
    );
}

/// A 1 MiB sparse image: data at [0, 8 KiB) and [512 KiB, 516 KiB).
fn sparse_image(tag: &str) -> (std::path::PathBuf, Arc<dyn Backend>) {
    use std::os::unix::fs::FileExt;
    let path = std::env::temp_dir().join(format!("knbd-sparse-{tag}-{}", std::process::id()));
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(1 << 20).unwrap();
    f.write_all_at(&[1u8; 8192], 0).unwrap();
    f.write_all_at(&[2u8; 4096], 512 << 10).unwrap();
    f.sync_all().unwrap();
    let b: Arc<dyn Backend> = Arc::new(FileBackend::open(&path, true).unwrap());
    (path, b)
}

fn block_status_session(backend: Arc<dyn Backend>, set: bool, requests: &[Request]) -> Vec<u8> {
    let mut e = Exports::new();
    e.add("s", backend);
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(encode_option(OPT_STRUCTURED_REPLY, &[]));
    if set {
        v.extend(encode_option(
            OPT_SET_META_CONTEXT,
            &encode_meta_context_request("s", &[META_BASE_ALLOCATION]),
        ));
    }
    v.extend(encode_option(OPT_GO, &encode_info_request("s", &[])));
    for r in requests {
        v.extend(r.encode());
    }
    let (out, r) = run_session_on_bytes(&v, &ServerConfig::new(e));
    assert!(r.is_ok(), "{r:?}");
    // The transmission replies: after the last option reply.
    let replies = option_replies(&out);
    let skip: usize = replies
        .iter()
        .map(|r| OPTION_REPLY_HEADER_LEN + r.2.len())
        .sum();
    out[HANDSHAKE_LEN + skip..].to_vec()
}

fn status_request(cookie: u64, offset: u64, len: u32, flags: u16) -> Request {
    Request {
        flags,
        command: CMD_BLOCK_STATUS,
        cookie,
        offset,
        len,
    }
}

#[test]
fn block_status_reports_the_holes_of_a_sparse_file() {
    let (path, b) = sparse_image("map");
    let out = block_status_session(
        b,
        true,
        &[
            status_request(1, 0, 1 << 20, 0),
            status_request(2, 4096, 1 << 20, CMD_FLAG_REQ_ONE),
        ],
    );
    let _ = std::fs::remove_file(&path);
    let h = decode_reply_header(&out).unwrap();
    let ReplyHeader::Structured {
        flags,
        reply_type,
        cookie,
        len,
    } = h
    else {
        panic!("{h:?}")
    };
    assert_eq!(
        (flags, reply_type, cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 1)
    );
    let body = &out[20..20 + len as usize];
    let (id, d) = decode_block_status(body).unwrap();
    assert_eq!(id, negotiate::BASE_ALLOCATION_ID);
    let hole = STATE_HOLE | STATE_ZERO;
    assert_eq!(
        d,
        vec![
            BlockDescriptor {
                len: 8192,
                flags: 0
            },
            BlockDescriptor {
                len: (512 << 10) - 8192,
                flags: hole
            },
            BlockDescriptor {
                len: 4096,
                flags: 0
            },
            BlockDescriptor {
                len: (508 << 10),
                flags: hole
            },
        ]
    );
    // Beyond the end: an error chunk, not a disconnect.
    let rest = &out[20 + len as usize..];
    let h = decode_reply_header(rest).unwrap();
    let ReplyHeader::Structured {
        reply_type, cookie, ..
    } = h
    else {
        panic!("{h:?}")
    };
    assert_eq!((reply_type, cookie), (REPLY_TYPE_ERROR, 2));
}

#[test]
fn block_status_with_req_one_and_without_a_context() {
    let (path, b) = sparse_image("one");
    let out = block_status_session(
        b.clone(),
        true,
        &[status_request(1, 4096, 8192, CMD_FLAG_REQ_ONE)],
    );
    let (_, d) = decode_block_status(&out[20..]).unwrap();
    assert_eq!(
        d,
        vec![BlockDescriptor {
            len: 4096,
            flags: 0
        }]
    );
    let out = block_status_session(b, false, &[status_request(1, 0, 4096, 0)]);
    let _ = std::fs::remove_file(&path);
    let h = decode_reply_header(&out).unwrap();
    assert!(
        matches!(
            h,
            ReplyHeader::Structured {
                reply_type: REPLY_TYPE_ERROR,
                ..
            }
        ),
        "{h:?}"
    );
    assert_eq!(u32::from_be_bytes(out[20..24].try_into().unwrap()), EINVAL);
}

fn with_tls(mode: TlsMode) -> ServerConfig {
    let mut c = exports();
    let keys = crate::tls::PskKeys::parse("alice:000102030405060708090a0b0c0d0e0f\n").unwrap();
    let server = Arc::new(crate::tls::TlsServer::with_psk(keys).unwrap());
    c.tls = Tls::new(mode, Some(server)).unwrap();
    c
}

#[test]
fn tls_require_answers_only_starttls_and_abort() {
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(encode_option(OPT_LIST, &[]));
    v.extend(encode_option(OPT_STRUCTURED_REPLY, &[]));
    v.extend(encode_option(OPT_GO, &encode_info_request("a", &[])));
    v.extend(encode_option(OPT_STARTTLS, &[1]));
    v.extend(encode_option(OPT_STARTTLS, &[]));
    let (out, r) = run_session_on_bytes(&v, &with_tls(TlsMode::Require));
    assert!(r.is_ok(), "{r:?}");
    let t = types(&option_replies(&out));
    assert_eq!(
        t,
        vec![
            REP_ERR_TLS_REQD,
            REP_ERR_TLS_REQD,
            REP_ERR_TLS_REQD,
            REP_ERR_INVALID,
            REP_ACK
        ]
    );
    // EXPORT_NAME has no error reply: the server hangs up.
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(encode_option(OPT_EXPORT_NAME, b"a"));
    let (_, r) = run_session_on_bytes(&v, &with_tls(TlsMode::Require));
    assert!(matches!(r, Err(ServerError::TlsRequired)), "{r:?}");
}

#[test]
fn tls_on_serves_plain_clients_and_off_refuses_starttls() {
    let (out, r) = run_session_on_bytes(&go("a"), &with_tls(TlsMode::On));
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(*types(&option_replies(&out)).last().unwrap(), REP_ACK);
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(encode_option(OPT_STARTTLS, &[]));
    v.extend(encode_option(OPT_ABORT, &[]));
    let (out, _) = run_session_on_bytes(&v, &exports());
    assert_eq!(types(&option_replies(&out)), vec![REP_ERR_UNSUP, REP_ACK]);
}

/// A session with one export answering `requests`; the transmission
/// phase's output.
fn read_session(backend: Arc<dyn Backend>, structured: bool, requests: &[Request]) -> Vec<u8> {
    let mut e = Exports::new();
    e.add("f", backend);
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    if structured {
        v.extend(encode_option(OPT_STRUCTURED_REPLY, &[]));
    }
    v.extend(encode_option(OPT_GO, &encode_info_request("f", &[])));
    for r in requests {
        v.extend(r.encode());
    }
    let (out, r) = run_session_on_bytes(&v, &ServerConfig::new(e));
    assert!(r.is_ok(), "{r:?}");
    let skip: usize = option_replies(&out)
        .iter()
        .map(|r| OPTION_REPLY_HEADER_LEN + r.2.len())
        .sum();
    out[HANDSHAKE_LEN + skip..].to_vec()
}

#[test]
fn large_reads_are_exact_from_the_page_cache_and_from_helpers() {
    use std::os::unix::fs::FileExt;
    let path = std::env::temp_dir().join(format!("knbd-large-read-{}", std::process::id()));
    let size = 3 << 20;
    let data: Vec<u8> = (0..size as u32).map(|i| (i * 7 + i / 4093) as u8).collect();
    let f = std::fs::File::create(&path).unwrap();
    f.write_all_at(&data, 0).unwrap();
    // Just written: in the page cache, so a file export takes the inline
    // (preadv2 RWF_NOWAIT) path; a memory export, which cannot tell, the
    // helper threads. At odd offsets, up to the export's end.
    let mem = MemBackend::new(size, false);
    mem.write_at(&data, 0, false).unwrap();
    let mem: Arc<dyn Backend> = Arc::new(mem);
    let file: Arc<dyn Backend> = Arc::new(FileBackend::open(&path, false).unwrap());
    let reads = [
        (0u64, 1u32 << 20),
        (4097, 300_000),
        (size as u64 - (256 << 10), 256 << 10),
        (12_345, 4096),
    ];
    let requests: Vec<Request> = reads
        .iter()
        .enumerate()
        .map(|(i, &(offset, len))| Request {
            flags: 0,
            command: CMD_READ,
            cookie: i as u64 + 1,
            offset,
            len,
        })
        .collect();
    for (backend, structured) in [(&file, true), (&file, false), (&mem, true), (&mem, false)] {
        let out = read_session(backend.clone(), structured, &requests);
        // Helper threads may answer in any order: split the replies by
        // cookie (a simple reply's length is its request's).
        let mut got = std::collections::BTreeMap::new();
        let mut at = 0;
        while at < out.len() {
            let cookie = u64::from_be_bytes(out[at + 8..at + 16].try_into().unwrap());
            let len = if structured {
                STRUCTURED_REPLY_HEADER_LEN
                    + u32::from_be_bytes(out[at + 16..at + 20].try_into().unwrap()) as usize
            } else {
                SIMPLE_REPLY_LEN + requests[cookie as usize - 1].len as usize
            };
            got.insert(cookie, out[at..at + len].to_vec());
            at += len;
        }
        assert_eq!(got.len(), requests.len(), "structured {structured}");
        for r in &requests {
            let d = &data[r.offset as usize..(r.offset + u64::from(r.len)) as usize];
            let mut want = Vec::new();
            if structured {
                want.extend(encode_structured_header(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_OFFSET_DATA,
                    r.cookie,
                    8 + r.len,
                ));
                want.extend(r.offset.to_be_bytes());
            } else {
                want.extend(encode_simple_reply(0, r.cookie));
            }
            want.extend_from_slice(d);
            assert!(
                got[&r.cookie] == want,
                "structured {structured}, cookie {}",
                r.cookie
            );
        }
    }
    let _ = std::fs::remove_file(&path);
}
