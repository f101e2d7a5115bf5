//! Option haggling (fixed newstyle): what a client may ask before the
//! transmission phase, and what it settles.
//!
//! ```text
//!   greet ──► haggle ──STARTTLS (ACK)──► [TLS handshake, by the caller] ──► haggle (secured)
//!               │                                                              │
//!               ├── GO / EXPORT_NAME ──► transmission ◄──────── GO / EXPORT_NAME
//!               └── ABORT / hang-up ──► end
//! ```
//!
//! TLS policy (`--tls`): `off` answers STARTTLS with `ERR_UNSUP`; `on`
//! accepts it; `require` answers every option but STARTTLS and ABORT with
//! `ERR_TLS_REQD` until TLS is up, and hangs up on `EXPORT_NAME` (which has
//! no error reply). After STARTTLS the haggling starts over: structured
//! replies and metadata contexts negotiated in the clear are forgotten, as
//! the protocol requires.
//!
//! Metadata contexts: `base:allocation` only (after STRUCTURED_REPLY). LIST
//! answers it for no query, `base:` or its own name; SET selects it for its
//! exact name; a later GO for another export drops the selection.

use std::io::{self, Read, Write};

use tracing::debug;

use super::{read_exact_or_eof, Export, Exports, ServerError, TlsMode};
use crate::backend::Backend;
use nbd_client::protocol::*;

/// The id the server gives the `base:allocation` context.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// What a session settled before transmission.
pub struct Session {
    pub export: Export,
    pub structured: bool,
    /// The `base:allocation` context's id, when the client selected it.
    pub base_allocation: Option<u32>,
}

/// How haggling ended.
pub enum Haggled {
    /// The client aborted or went away.
    Done,
    Transmit(Session),
    /// STARTTLS was acknowledged: the caller runs the TLS handshake and
    /// haggles again over it with [`Negotiation::secured`].
    StartTls,
}

/// The state of one connection's negotiation.
pub struct Negotiation<'a> {
    exports: &'a Exports,
    tls: TlsMode,
    secured: bool,
    no_zeroes: bool,
    structured: bool,
    /// `base:allocation` selected for this export (resolved name).
    meta: Option<String>,
}

impl<'a> Negotiation<'a> {
    /// Sends the server's greeting and reads the client's flags; `None` when
    /// the client went away at once.
    pub fn greet<R: Read, W: Write>(
        r: &mut R,
        w: &mut W,
        exports: &'a Exports,
        tls: TlsMode,
    ) -> Result<Option<Self>, ServerError> {
        w.write_all(&encode_handshake(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))?;
        w.flush()?;
        let mut cf = [0u8; 4];
        if !read_exact_or_eof(r, &mut cf)? {
            return Ok(None);
        }
        let cflags = u32::from_be_bytes(cf);
        if cflags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
            return Err(ServerError::ClientFlags(cflags));
        }
        Ok(Some(Negotiation {
            exports,
            tls,
            secured: false,
            no_zeroes: cflags & CLIENT_NO_ZEROES != 0,
            structured: false,
            meta: None,
        }))
    }

    /// TLS is up: haggling starts over, forgetting what was settled in the clear.
    pub fn secured(&mut self) {
        self.secured = true;
        self.structured = false;
        self.meta = None;
    }

    /// The option haggling loop.
    pub fn haggle<R: Read, W: Write>(
        &mut self,
        r: &mut R,
        w: &mut W,
    ) -> Result<Haggled, ServerError> {
        loop {
            w.flush()?;
            let mut hb = [0u8; OPTION_HEADER_LEN];
            if !read_exact_or_eof(r, &mut hb)? {
                return Ok(Haggled::Done);
            }
            let h = match decode_option_header(&hb) {
                Ok(h) => h,
                Err(e @ ProtocolError::TooLong { .. }) => {
                    let opt = u32::from_be_bytes([hb[8], hb[9], hb[10], hb[11]]);
                    opt_reply(w, opt, REP_ERR_TOO_BIG, b"option too long")?;
                    w.flush()?;
                    return Err(e.into());
                }
                Err(e) => return Err(e.into()),
            };
            let mut data = vec![0u8; h.len as usize];
            r.read_exact(&mut data)?;
            if let Some(end) = self.option(w, h.option, &data)? {
                w.flush()?;
                return Ok(end);
            }
        }
    }

    /// Answers one option; `Some` when haggling ends with it.
    fn option<W: Write>(
        &mut self,
        w: &mut W,
        opt: u32,
        data: &[u8],
    ) -> Result<Option<Haggled>, ServerError> {
        let tls_missing = self.tls == TlsMode::Require && !self.secured;
        match opt {
            OPT_ABORT => {
                let _ = opt_reply(w, opt, REP_ACK, &[]);
                let _ = w.flush();
                return Ok(Some(Haggled::Done));
            }
            OPT_STARTTLS => return self.starttls(w, data),
            // No error reply exists for EXPORT_NAME: hang up.
            OPT_EXPORT_NAME if tls_missing => return Err(ServerError::TlsRequired),
            _ if tls_missing => {
                debug!(option = opt, "refused before TLS");
                opt_reply(
                    w,
                    opt,
                    REP_ERR_TLS_REQD,
                    b"this server requires TLS: use NBD_OPT_STARTTLS",
                )?;
            }
            OPT_EXPORT_NAME => {
                let name = decode_export_name(data)?;
                let Some(ex) = self.exports.get(&name) else {
                    return Err(ServerError::UnknownExport(name));
                };
                let b = &ex.backend;
                w.write_all(&b.size().to_be_bytes())?;
                w.write_all(&transmission_flags(b.as_ref()).to_be_bytes())?;
                if !self.no_zeroes {
                    w.write_all(&[0u8; 124])?;
                }
                return Ok(Some(Haggled::Transmit(self.session(ex))));
            }
            OPT_LIST => {
                if !data.is_empty() {
                    opt_reply(w, opt, REP_ERR_INVALID, b"NBD_OPT_LIST takes no data")?;
                    return Ok(None);
                }
                for name in self.exports.names() {
                    let mut d = (name.len() as u32).to_be_bytes().to_vec();
                    d.extend_from_slice(name.as_bytes());
                    opt_reply(w, opt, REP_SERVER, &d)?;
                }
                opt_reply(w, opt, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => return self.info_or_go(w, opt, data),
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    opt_reply(w, opt, REP_ERR_INVALID, b"takes no data")?;
                } else if self.structured {
                    opt_reply(w, opt, REP_ERR_INVALID, b"already negotiated")?;
                } else {
                    self.structured = true;
                    opt_reply(w, opt, REP_ACK, &[])?;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.meta_context(w, opt, data)?,
            OPT_KEMARI_ACCESS_COUNTS => {
                let name = match decode_name_prefixed(data, "access counts request") {
                    Ok((n, _)) => n,
                    Err(e) => {
                        opt_reply(w, opt, REP_ERR_INVALID, e.to_string().as_bytes())?;
                        return Ok(None);
                    }
                };
                match self
                    .exports
                    .get(&name)
                    .and_then(|e| e.backend.access_counts())
                {
                    Some(c) => {
                        opt_reply(w, opt, REP_KEMARI_ACCESS_COUNTS, &c.encode())?;
                        opt_reply(w, opt, REP_ACK, &[])?;
                    }
                    None => opt_reply(w, opt, REP_ERR_UNKNOWN, b"no counters for export")?,
                }
            }
            _ => opt_reply(w, opt, REP_ERR_UNSUP, b"unsupported option")?,
        }
        Ok(None)
    }

    fn starttls<W: Write>(
        &mut self,
        w: &mut W,
        data: &[u8],
    ) -> Result<Option<Haggled>, ServerError> {
        let opt = OPT_STARTTLS;
        if !data.is_empty() {
            opt_reply(w, opt, REP_ERR_INVALID, b"NBD_OPT_STARTTLS takes no data")?;
        } else if self.secured {
            opt_reply(w, opt, REP_ERR_INVALID, b"TLS is already in use")?;
        } else if self.tls == TlsMode::Off {
            opt_reply(w, opt, REP_ERR_UNSUP, b"TLS is not enabled on this server")?;
        } else {
            opt_reply(w, opt, REP_ACK, &[])?;
            return Ok(Some(Haggled::StartTls));
        }
        Ok(None)
    }

    fn info_or_go<W: Write>(
        &mut self,
        w: &mut W,
        opt: u32,
        data: &[u8],
    ) -> Result<Option<Haggled>, ServerError> {
        let req = match decode_info_request(data) {
            Ok(req) => req,
            Err(e) => {
                opt_reply(w, opt, REP_ERR_INVALID, e.to_string().as_bytes())?;
                return Ok(None);
            }
        };
        let Some(ex) = self.exports.get(&req.name) else {
            opt_reply(w, opt, REP_ERR_UNKNOWN, b"no such export")?;
            return Ok(None);
        };
        let b = &ex.backend;
        opt_reply(
            w,
            opt,
            REP_INFO,
            &encode_info_export(b.size(), transmission_flags(b.as_ref())),
        )?;
        opt_reply(
            w,
            opt,
            REP_INFO,
            &encode_info_block_size(1, 4096, MAX_PAYLOAD),
        )?;
        if req.requests.contains(&INFO_NAME) {
            let mut d = INFO_NAME.to_be_bytes().to_vec();
            d.extend_from_slice(ex.name.as_bytes());
            opt_reply(w, opt, REP_INFO, &d)?;
        }
        opt_reply(w, opt, REP_ACK, &[])?;
        if opt == OPT_GO {
            return Ok(Some(Haggled::Transmit(self.session(ex))));
        }
        Ok(None)
    }

    /// LIST_META_CONTEXT and SET_META_CONTEXT.
    fn meta_context<W: Write>(&mut self, w: &mut W, opt: u32, data: &[u8]) -> io::Result<()> {
        if !self.structured {
            return opt_reply(w, opt, REP_ERR_INVALID, b"structured replies first");
        }
        let req = match decode_meta_context_request(data) {
            Ok(req) => req,
            Err(e) => return opt_reply(w, opt, REP_ERR_INVALID, e.to_string().as_bytes()),
        };
        let Some(ex) = self.exports.get(&req.export) else {
            return opt_reply(w, opt, REP_ERR_UNKNOWN, b"no such export");
        };
        let set = opt == OPT_SET_META_CONTEXT;
        let wanted = if set {
            // SET names contexts exactly, and replaces any earlier choice.
            self.meta = None;
            req.queries.iter().any(|q| q == META_BASE_ALLOCATION)
        } else {
            req.queries.is_empty()
                || req
                    .queries
                    .iter()
                    .any(|q| q == "base:" || q == META_BASE_ALLOCATION)
        };
        if wanted {
            let id = if set { BASE_ALLOCATION_ID } else { 0 };
            opt_reply(
                w,
                opt,
                REP_META_CONTEXT,
                &encode_meta_context_reply(id, META_BASE_ALLOCATION),
            )?;
            if set {
                self.meta = Some(ex.name.clone());
            }
        }
        opt_reply(w, opt, REP_ACK, &[])
    }

    fn session(&self, ex: &Export) -> Session {
        Session {
            export: ex.clone(),
            structured: self.structured,
            base_allocation: (self.structured && self.meta.as_deref() == Some(ex.name.as_str()))
                .then_some(BASE_ALLOCATION_ID),
        }
    }
}

pub(super) fn transmission_flags(b: &dyn Backend) -> u16 {
    let mut f = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_TRIM
        | TFLAG_SEND_WRITE_ZEROES
        | TFLAG_CAN_MULTI_CONN;
    if b.read_only() {
        f = (f | TFLAG_READ_ONLY) & !(TFLAG_SEND_FUA | TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES);
    }
    f
}

fn opt_reply<W: Write>(w: &mut W, option: u32, ty: u32, data: &[u8]) -> io::Result<()> {
    w.write_all(&encode_option_reply(option, ty, data))
}
