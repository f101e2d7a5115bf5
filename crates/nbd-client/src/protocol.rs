//! The NBD wire protocol (fixed-newstyle handshake, options, requests,
//! simple and structured replies): pure encode/decode, no I/O.
//!
//! ```text
//!  client                                   server
//!    |  <-- "NBDMAGIC" "IHAVEOPT" u16 flags --  |   handshake (FIXED_NEWSTYLE|NO_ZEROES)
//!    |  --  u32 client flags              -->   |
//!    |  --  IHAVEOPT u32 opt u32 len data -->   |   option haggling, repeated:
//!    |  <-- REPLY_MAGIC u32 opt u32 type u32 len data --  |  STRUCTURED_REPLY, LIST, INFO,
//!    |                                          |   (kemari) ACCESS_COUNTS, ...
//!    |  --  OPT_STARTTLS                  -->   |   (optional) TLS handshake, then the
//!    |  <-- REP_ACK; ===== TLS handshake ===== |   haggling starts over inside TLS
//!    |  --  OPT_SET_META_CONTEXT(name, "base:allocation") --> | after STRUCTURED_REPLY
//!    |  <-- REP_META_CONTEXT(id, "base:allocation"), REP_ACK
//!    |  --  OPT_GO(name, info requests)   -->   |
//!    |  <-- REP_INFO(EXPORT size flags), REP_INFO(BLOCK_SIZE), REP_ACK
//!    |  ===== transmission phase =====          |
//!    |  --  REQUEST_MAGIC flags type cookie offset length [data] -->  (pipelined)
//!    |  <-- SIMPLE_REPLY_MAGIC error cookie [data]                  (any order)
//!    |  <-- STRUCTURED_REPLY_MAGIC flags type cookie len payload   (reads, if negotiated)
//!    |  --  CMD_BLOCK_STATUS offset length -->  |
//!    |  <-- structured BLOCK_STATUS: id, N × (u32 length, u32 HOLE|ZERO flags)
//!    |  --  CMD_DISC                      -->   |   close
//! ```
//!
//! Every decoder checks lengths against explicit limits so that a hostile
//! peer cannot make us allocate or read unbounded amounts of data.

use thiserror::Error;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1;
pub const FLAG_NO_ZEROES: u16 = 2;
pub const CLIENT_FIXED_NEWSTYLE: u32 = 1;
pub const CLIENT_NO_ZEROES: u32 = 2;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// kemari extension: per-group access counters of an export (see docs/nbd.md).
/// Data: u32 name length, name. Reply: `REP_KEMARI_ACCESS_COUNTS` then `REP_ACK`.
pub const OPT_KEMARI_ACCESS_COUNTS: u32 = 0x4b4d_4301;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
/// kemari extension reply: u64 group size, u32 count N, then N × (u64 reads, u64 writes).
pub const REP_KEMARI_ACCESS_COUNTS: u32 = 0x4b4d_4301;
pub const REP_FLAG_ERROR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
pub const REP_ERR_PLATFORM: u32 = REP_FLAG_ERROR | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;

// NBD_INFO types.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured reply.
pub const REPLY_FLAG_DONE: u16 = 1;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

// The `base:allocation` metadata context: its name and its status flags.
pub const META_BASE_ALLOCATION: &str = "base:allocation";
/// Not allocated (a hole).
pub const STATE_HOLE: u32 = 1;
/// Reads as zeroes.
pub const STATE_ZERO: u32 = 2;

// Errno values on the wire.
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Largest option payload we accept (names and info requests are small).
pub const MAX_OPTION_LEN: u32 = 64 * 1024;
/// Largest export name (the spec's limit is 4096 bytes).
pub const MAX_NAME_LEN: u32 = 4096;
/// Largest read or write payload a server accepts (advertised as the maximum block size).
pub const MAX_PAYLOAD: u32 = 32 * 1024 * 1024;

/// Longest metadata context query or name (the spec's limit).
pub const MAX_META_QUERY_LEN: u32 = 4096;
/// Most block status descriptors one reply carries (8 bytes each).
pub const MAX_BLOCK_STATUS_DESCRIPTORS: usize = 1 << 16;

pub const HANDSHAKE_LEN: usize = 18;
pub const OPTION_HEADER_LEN: usize = 16;
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
pub const REQUEST_LEN: usize = 28;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const STRUCTURED_REPLY_HEADER_LEN: usize = 20;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("bad magic {found:#x} in {what} (expected {expected:#x})")]
    BadMagic {
        what: &'static str,
        found: u64,
        expected: u64,
    },
    #[error("{what} length {len} exceeds limit {limit}")]
    TooLong {
        what: &'static str,
        len: u64,
        limit: u64,
    },
    #[error("{what}: need {need} bytes, have {have}")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    #[error("malformed {what}: {why}")]
    Malformed {
        what: &'static str,
        why: &'static str,
    },
}

type Result<T> = std::result::Result<T, ProtocolError>;

fn need(what: &'static str, buf: &[u8], n: usize) -> Result<()> {
    if buf.len() < n {
        Err(ProtocolError::Truncated {
            what,
            need: n,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// The server's first 18 bytes.
pub fn encode_handshake(flags: u16) -> [u8; HANDSHAKE_LEN] {
    let mut b = [0u8; HANDSHAKE_LEN];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&flags.to_be_bytes());
    b
}

/// Decodes the server's handshake; returns its handshake flags.
pub fn decode_handshake(b: &[u8]) -> Result<u16> {
    need("handshake", b, HANDSHAKE_LEN)?;
    let m = be64(b, 0);
    if m != NBDMAGIC {
        return Err(ProtocolError::BadMagic {
            what: "handshake",
            found: m,
            expected: NBDMAGIC,
        });
    }
    let m = be64(b, 8);
    if m != IHAVEOPT {
        // 0x00420281861253 is the oldstyle magic: not supported.
        return Err(ProtocolError::BadMagic {
            what: "handshake (only fixed newstyle is supported)",
            found: m,
            expected: IHAVEOPT,
        });
    }
    Ok(be16(b, 16))
}

/// Header of one option sent by the client; `len` bytes of data follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

pub fn encode_option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(OPTION_HEADER_LEN + data.len());
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

pub fn decode_option_header(b: &[u8]) -> Result<OptionHeader> {
    need("option header", b, OPTION_HEADER_LEN)?;
    let m = be64(b, 0);
    if m != IHAVEOPT {
        return Err(ProtocolError::BadMagic {
            what: "option",
            found: m,
            expected: IHAVEOPT,
        });
    }
    let option = be32(b, 8);
    let len = be32(b, 12);
    if len > MAX_OPTION_LEN {
        return Err(ProtocolError::TooLong {
            what: "option data",
            len: len.into(),
            limit: MAX_OPTION_LEN.into(),
        });
    }
    Ok(OptionHeader { option, len })
}

/// The data of NBD_OPT_INFO / NBD_OPT_GO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

pub fn encode_info_request(name: &str, requests: &[u16]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(name.len() as u32).to_be_bytes());
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(&(requests.len() as u16).to_be_bytes());
    for r in requests {
        b.extend_from_slice(&r.to_be_bytes());
    }
    b
}

pub fn decode_info_request(b: &[u8]) -> Result<InfoRequest> {
    let (name, rest) = decode_name_prefixed(b, "info request")?;
    need("info request count", rest, 2)?;
    let n = be16(rest, 0) as usize;
    let rest = &rest[2..];
    if rest.len() != n * 2 {
        return Err(ProtocolError::Malformed {
            what: "info request",
            why: "information request count does not match the option length",
        });
    }
    let requests = (0..n).map(|i| be16(rest, i * 2)).collect();
    Ok(InfoRequest { name, requests })
}

/// Decodes `u32 len, name` and returns the name and the bytes after it.
pub fn decode_name_prefixed<'a>(b: &'a [u8], what: &'static str) -> Result<(String, &'a [u8])> {
    need(what, b, 4)?;
    let len = be32(b, 0);
    if len > MAX_NAME_LEN {
        return Err(ProtocolError::TooLong {
            what: "export name",
            len: len.into(),
            limit: MAX_NAME_LEN.into(),
        });
    }
    let len = len as usize;
    need(what, b, 4 + len)?;
    let name = std::str::from_utf8(&b[4..4 + len])
        .map_err(|_| ProtocolError::Malformed {
            what,
            why: "export name is not UTF-8",
        })?
        .to_string();
    Ok((name, &b[4 + len..]))
}

/// Decodes the data of NBD_OPT_EXPORT_NAME (the whole payload is the name).
pub fn decode_export_name(b: &[u8]) -> Result<String> {
    if b.len() > MAX_NAME_LEN as usize {
        return Err(ProtocolError::TooLong {
            what: "export name",
            len: b.len() as u64,
            limit: MAX_NAME_LEN.into(),
        });
    }
    std::str::from_utf8(b)
        .map(str::to_string)
        .map_err(|_| ProtocolError::Malformed {
            what: "export name",
            why: "not UTF-8",
        })
}

/// The data of NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub export: String,
    /// Context names (SET) or queries such as `base:` (LIST).
    pub queries: Vec<String>,
}

pub fn encode_meta_context_request(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(export.len() as u32).to_be_bytes());
    b.extend_from_slice(export.as_bytes());
    b.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        b.extend_from_slice(&(q.len() as u32).to_be_bytes());
        b.extend_from_slice(q.as_bytes());
    }
    b
}

pub fn decode_meta_context_request(b: &[u8]) -> Result<MetaContextRequest> {
    let what = "meta context request";
    let (export, rest) = decode_name_prefixed(b, what)?;
    need(what, rest, 4)?;
    let n = be32(rest, 0) as usize;
    let mut rest = &rest[4..];
    // Each query takes at least its 4-byte length: bounds the count by the
    // option's length before anything is allocated for it.
    if n > rest.len() / 4 {
        return Err(ProtocolError::Malformed {
            what,
            why: "more queries than the option holds",
        });
    }
    let mut queries = Vec::with_capacity(n);
    for _ in 0..n {
        need(what, rest, 4)?;
        let len = be32(rest, 0);
        if len > MAX_META_QUERY_LEN {
            return Err(ProtocolError::TooLong {
                what: "meta context query",
                len: len.into(),
                limit: MAX_META_QUERY_LEN.into(),
            });
        }
        let len = len as usize;
        need(what, rest, 4 + len)?;
        let q = std::str::from_utf8(&rest[4..4 + len]).map_err(|_| ProtocolError::Malformed {
            what,
            why: "query is not UTF-8",
        })?;
        queries.push(q.to_string());
        rest = &rest[4 + len..];
    }
    if !rest.is_empty() {
        return Err(ProtocolError::Malformed {
            what,
            why: "bytes after the last query",
        });
    }
    Ok(MetaContextRequest { export, queries })
}

/// Payload of NBD_REP_META_CONTEXT: the context's id and name.
pub fn encode_meta_context_reply(id: u32, name: &str) -> Vec<u8> {
    let mut b = id.to_be_bytes().to_vec();
    b.extend_from_slice(name.as_bytes());
    b
}

pub fn decode_meta_context_reply(b: &[u8]) -> Result<(u32, String)> {
    need("meta context reply", b, 4)?;
    if b.len() - 4 > MAX_META_QUERY_LEN as usize {
        return Err(ProtocolError::TooLong {
            what: "meta context name",
            len: (b.len() - 4) as u64,
            limit: MAX_META_QUERY_LEN.into(),
        });
    }
    let name = std::str::from_utf8(&b[4..]).map_err(|_| ProtocolError::Malformed {
        what: "meta context reply",
        why: "name is not UTF-8",
    })?;
    Ok((be32(b, 0), name.to_string()))
}

/// One extent of a block status reply: its length and status flags
/// (for `base:allocation`, [`STATE_HOLE`] and [`STATE_ZERO`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockDescriptor {
    pub len: u32,
    pub flags: u32,
}

/// Payload of a `REPLY_TYPE_BLOCK_STATUS` chunk.
pub fn encode_block_status(context: u32, descriptors: &[BlockDescriptor]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + 8 * descriptors.len());
    b.extend_from_slice(&context.to_be_bytes());
    for d in descriptors {
        b.extend_from_slice(&d.len.to_be_bytes());
        b.extend_from_slice(&d.flags.to_be_bytes());
    }
    b
}

pub fn decode_block_status(b: &[u8]) -> Result<(u32, Vec<BlockDescriptor>)> {
    let what = "block status";
    need(what, b, 12)?;
    if !(b.len() - 4).is_multiple_of(8) {
        return Err(ProtocolError::Malformed {
            what,
            why: "descriptors are 8 bytes each",
        });
    }
    let n = (b.len() - 4) / 8;
    if n > MAX_BLOCK_STATUS_DESCRIPTORS {
        return Err(ProtocolError::TooLong {
            what: "block status descriptors",
            len: n as u64,
            limit: MAX_BLOCK_STATUS_DESCRIPTORS as u64,
        });
    }
    let descriptors = (0..n)
        .map(|i| BlockDescriptor {
            len: be32(b, 4 + 8 * i),
            flags: be32(b, 8 + 8 * i),
        })
        .collect();
    Ok((be32(b, 0), descriptors))
}

/// One option reply from the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply_type: u32,
    pub len: u32,
}

pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(OPTION_REPLY_HEADER_LEN + data.len());
    b.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&reply_type.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// `limit` bounds the reply payload the caller is prepared to read.
pub fn decode_option_reply_header(b: &[u8], limit: u32) -> Result<OptionReplyHeader> {
    need("option reply", b, OPTION_REPLY_HEADER_LEN)?;
    let m = be64(b, 0);
    if m != OPT_REPLY_MAGIC {
        return Err(ProtocolError::BadMagic {
            what: "option reply",
            found: m,
            expected: OPT_REPLY_MAGIC,
        });
    }
    let h = OptionReplyHeader {
        option: be32(b, 8),
        reply_type: be32(b, 12),
        len: be32(b, 16),
    };
    if h.len > limit {
        return Err(ProtocolError::TooLong {
            what: "option reply",
            len: h.len.into(),
            limit: limit.into(),
        });
    }
    Ok(h)
}

pub fn encode_info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b
}

pub fn encode_info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(14);
    b.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b.extend_from_slice(&min.to_be_bytes());
    b.extend_from_slice(&preferred.to_be_bytes());
    b.extend_from_slice(&max.to_be_bytes());
    b
}

/// A decoded NBD_REP_INFO payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Info {
    Export { size: u64, flags: u16 },
    BlockSize { min: u32, preferred: u32, max: u32 },
    Other(u16),
}

pub fn decode_info(b: &[u8]) -> Result<Info> {
    need("info", b, 2)?;
    match be16(b, 0) {
        INFO_EXPORT => {
            need("info export", b, 12)?;
            Ok(Info::Export {
                size: be64(b, 2),
                flags: be16(b, 10),
            })
        }
        INFO_BLOCK_SIZE => {
            need("info block size", b, 14)?;
            Ok(Info::BlockSize {
                min: be32(b, 2),
                preferred: be32(b, 6),
                max: be32(b, 10),
            })
        }
        t => Ok(Info::Other(t)),
    }
}

/// A transmission-phase request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
}

impl Request {
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    /// Decodes the fixed 28-byte header. Length limits are checked by the
    /// server per command (a READ of 1 GiB is an error reply, not a disconnect).
    pub fn decode(b: &[u8]) -> Result<Request> {
        need("request", b, REQUEST_LEN)?;
        let m = be32(b, 0);
        if m != REQUEST_MAGIC {
            return Err(ProtocolError::BadMagic {
                what: "request",
                found: m.into(),
                expected: REQUEST_MAGIC.into(),
            });
        }
        Ok(Request {
            flags: be16(b, 4),
            command: be16(b, 6),
            cookie: be64(b, 8),
            offset: be64(b, 16),
            len: be32(b, 24),
        })
    }

    /// Whether a data payload of `len` bytes follows the header.
    pub fn has_payload(&self) -> bool {
        self.command == CMD_WRITE
    }
}

pub fn encode_simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

pub fn encode_structured_header(
    flags: u16,
    reply_type: u16,
    cookie: u64,
    len: u32,
) -> [u8; STRUCTURED_REPLY_HEADER_LEN] {
    let mut b = [0u8; STRUCTURED_REPLY_HEADER_LEN];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&reply_type.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// Payload of a structured error chunk.
pub fn encode_error_chunk(error: u32, msg: &str) -> Vec<u8> {
    let msg = &msg.as_bytes()[..msg.len().min(4096)];
    let mut b = Vec::with_capacity(6 + msg.len());
    b.extend_from_slice(&error.to_be_bytes());
    b.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    b.extend_from_slice(msg);
    b
}

/// The first bytes of any transmission reply, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    Simple {
        error: u32,
        cookie: u64,
    },
    Structured {
        flags: u16,
        reply_type: u16,
        cookie: u64,
        len: u32,
    },
}

/// Decodes a reply header: `b` must hold at least 4 bytes (the magic); the
/// result says how many header bytes the reply has in total via [`reply_header_len`].
pub fn reply_header_len(magic: &[u8]) -> Result<usize> {
    need("reply magic", magic, 4)?;
    match be32(magic, 0) {
        SIMPLE_REPLY_MAGIC => Ok(SIMPLE_REPLY_LEN),
        STRUCTURED_REPLY_MAGIC => Ok(STRUCTURED_REPLY_HEADER_LEN),
        m => Err(ProtocolError::BadMagic {
            what: "reply",
            found: m.into(),
            expected: SIMPLE_REPLY_MAGIC.into(),
        }),
    }
}

pub fn decode_reply_header(b: &[u8]) -> Result<ReplyHeader> {
    let n = reply_header_len(b)?;
    need("reply", b, n)?;
    if n == SIMPLE_REPLY_LEN {
        Ok(ReplyHeader::Simple {
            error: be32(b, 4),
            cookie: be64(b, 8),
        })
    } else {
        let len = be32(b, 16);
        if len > MAX_PAYLOAD + 8 {
            return Err(ProtocolError::TooLong {
                what: "structured reply chunk",
                len: len.into(),
                limit: (MAX_PAYLOAD + 8).into(),
            });
        }
        Ok(ReplyHeader::Structured {
            flags: be16(b, 4),
            reply_type: be16(b, 6),
            cookie: be64(b, 8),
            len,
        })
    }
}

/// Per-group access counters (the kemari extension's reply payload).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessCounts {
    pub group_size: u64,
    /// (reads, writes) per group, in offset order.
    pub groups: Vec<(u64, u64)>,
}

/// Most groups a reply may carry (1 PiB at 16 MiB groups).
pub const MAX_ACCESS_GROUPS: u32 = 1 << 26;

impl AccessCounts {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(12 + self.groups.len() * 16);
        b.extend_from_slice(&self.group_size.to_be_bytes());
        b.extend_from_slice(&(self.groups.len() as u32).to_be_bytes());
        for (r, w) in &self.groups {
            b.extend_from_slice(&r.to_be_bytes());
            b.extend_from_slice(&w.to_be_bytes());
        }
        b
    }

    pub fn decode(b: &[u8]) -> Result<AccessCounts> {
        need("access counts", b, 12)?;
        let group_size = be64(b, 0);
        let n = be32(b, 8);
        if n > MAX_ACCESS_GROUPS {
            return Err(ProtocolError::TooLong {
                what: "access count groups",
                len: n.into(),
                limit: MAX_ACCESS_GROUPS.into(),
            });
        }
        if group_size == 0 {
            return Err(ProtocolError::Malformed {
                what: "access counts",
                why: "group size is zero",
            });
        }
        let n = n as usize;
        need("access counts", b, 12 + n * 16)?;
        let groups = (0..n)
            .map(|i| (be64(b, 12 + i * 16), be64(b, 20 + i * 16)))
            .collect();
        Ok(AccessCounts { group_size, groups })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_roundtrip() {
        let b = encode_handshake(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        assert_eq!(&b[0..8], b"NBDMAGIC");
        assert_eq!(&b[8..16], b"IHAVEOPT");
        assert_eq!(decode_handshake(&b).unwrap(), 3);
        let mut bad = b;
        bad[0] = 0;
        assert!(matches!(
            decode_handshake(&bad),
            Err(ProtocolError::BadMagic { .. })
        ));
        assert!(matches!(
            decode_handshake(&b[..5]),
            Err(ProtocolError::Truncated { .. })
        ));
    }

    #[test]
    fn option_header_limits() {
        let b = encode_option(OPT_GO, &encode_info_request("disk", &[INFO_BLOCK_SIZE]));
        let h = decode_option_header(&b).unwrap();
        assert_eq!(h.option, OPT_GO);
        let req = decode_info_request(&b[16..16 + h.len as usize]).unwrap();
        assert_eq!(req.name, "disk");
        assert_eq!(req.requests, vec![INFO_BLOCK_SIZE]);
        let mut huge = b.clone();
        huge[12..16].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            decode_option_header(&huge),
            Err(ProtocolError::TooLong { .. })
        ));
    }

    #[test]
    fn info_request_rejects_bad_counts_and_names() {
        let mut b = encode_info_request("x", &[1, 2]);
        b.pop();
        assert!(decode_info_request(&b).is_err());
        let mut b = vec![0xff, 0xff, 0xff, 0xff];
        b.extend_from_slice(&[0; 10]);
        assert!(matches!(
            decode_info_request(&b),
            Err(ProtocolError::TooLong { .. })
        ));
        let b = [0, 0, 0, 2, 0xff, 0xfe, 0, 0];
        assert!(decode_info_request(&b).is_err());
    }

    #[test]
    fn request_roundtrip_and_bad_magic() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            command: CMD_WRITE,
            cookie: 0x1122_3344_5566_7788,
            offset: 4096,
            len: 512,
        };
        let b = r.encode();
        assert_eq!(Request::decode(&b).unwrap(), r);
        let mut bad = b;
        bad[3] ^= 1;
        assert!(Request::decode(&bad).is_err());
    }

    #[test]
    fn replies() {
        let s = encode_simple_reply(EIO, 7);
        assert_eq!(
            decode_reply_header(&s).unwrap(),
            ReplyHeader::Simple {
                error: EIO,
                cookie: 7
            }
        );
        let h = encode_structured_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 9, 4104);
        assert_eq!(
            decode_reply_header(&h).unwrap(),
            ReplyHeader::Structured {
                flags: 1,
                reply_type: 1,
                cookie: 9,
                len: 4104
            }
        );
        let h = encode_structured_header(0, 1, 9, u32::MAX);
        assert!(decode_reply_header(&h).is_err());
        let r = encode_option_reply(OPT_GO, REP_ACK, &[]);
        let h = decode_option_reply_header(&r, 100).unwrap();
        assert_eq!((h.option, h.reply_type, h.len), (OPT_GO, REP_ACK, 0));
    }

    #[test]
    fn infos() {
        assert_eq!(
            decode_info(&encode_info_export(1 << 30, 3)).unwrap(),
            Info::Export {
                size: 1 << 30,
                flags: 3
            }
        );
        assert_eq!(
            decode_info(&encode_info_block_size(1, 4096, MAX_PAYLOAD)).unwrap(),
            Info::BlockSize {
                min: 1,
                preferred: 4096,
                max: MAX_PAYLOAD
            }
        );
        assert!(decode_info(&[0, 0, 1]).is_err());
    }

    #[test]
    fn meta_context_requests_and_replies() {
        let b = encode_meta_context_request("disk", &["base:allocation", "qemu:"]);
        let r = decode_meta_context_request(&b).unwrap();
        assert_eq!(r.export, "disk");
        assert_eq!(r.queries, vec!["base:allocation", "qemu:"]);
        let none = decode_meta_context_request(&encode_meta_context_request("", &[])).unwrap();
        assert!(none.queries.is_empty());
        // A count the option cannot hold is refused before allocating.
        let mut huge = encode_meta_context_request("d", &[]);
        let n = huge.len();
        huge[n - 4..].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_meta_context_request(&huge).is_err());
        let mut trailing = b.clone();
        trailing.push(0);
        assert!(decode_meta_context_request(&trailing).is_err());
        let mut cut = b;
        cut.pop();
        assert!(decode_meta_context_request(&cut).is_err());
        let mut long = encode_meta_context_request("d", &[]);
        let n = long.len();
        long[n - 4..].copy_from_slice(&1u32.to_be_bytes());
        long.extend_from_slice(&(MAX_META_QUERY_LEN + 1).to_be_bytes());
        assert!(matches!(
            decode_meta_context_request(&long),
            Err(ProtocolError::TooLong { .. })
        ));
        let reply = encode_meta_context_reply(7, META_BASE_ALLOCATION);
        assert_eq!(
            decode_meta_context_reply(&reply).unwrap(),
            (7, META_BASE_ALLOCATION.to_string())
        );
        assert!(decode_meta_context_reply(&[0, 0]).is_err());
    }

    #[test]
    fn block_status_roundtrip() {
        let d = [
            BlockDescriptor {
                len: 65536,
                flags: 0,
            },
            BlockDescriptor {
                len: 4096,
                flags: STATE_HOLE | STATE_ZERO,
            },
        ];
        let b = encode_block_status(1, &d);
        assert_eq!(decode_block_status(&b).unwrap(), (1, d.to_vec()));
        assert!(decode_block_status(&b[..b.len() - 1]).is_err());
        assert!(decode_block_status(&b[..4]).is_err());
    }

    #[test]
    fn access_counts_roundtrip() {
        let c = AccessCounts {
            group_size: 16 << 20,
            groups: vec![(1, 2), (3, 4)],
        };
        assert_eq!(AccessCounts::decode(&c.encode()).unwrap(), c);
        let mut b = c.encode();
        b.truncate(20);
        assert!(AccessCounts::decode(&b).is_err());
    }
}
