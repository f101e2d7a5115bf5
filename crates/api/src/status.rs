//! Every HTTP status the API answers with is chosen here, from typed
//! errors: the parser's ([`HttpError`]), the router's ([`RouteError`]), the
//! controller's ([`ActionError`]) and the server's own refusals
//! ([`Refusal`]).

use crate::http::HttpError;
use crate::reply::ActionError;
use crate::routes::RouteError;

/// Why the server itself refused a connection or a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The request was not complete within the deadline.
    #[error("the request was not complete within {0} ms")]
    Timeout(u128),
    /// Every connection slot is taken; this, the oldest incomplete one, was
    /// closed to let a new client in.
    #[error("too many connections: this one, the oldest without a complete request, was closed for a new one")]
    TooManyConnections,
    /// Every handler is busy.
    #[error("the API is busy: {0} requests are being handled; retry")]
    TooManyRequests(usize),
    /// Every stream slot is taken.
    #[error("too many streams: {0} are being followed; retry")]
    TooManyStreams(usize),
    /// The server is shutting down.
    #[error("the API server is shutting down")]
    ShuttingDown,
}

impl HttpError {
    /// HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            HttpError::Malformed(_) | HttpError::Incomplete => 400,
            HttpError::HeaderTooLarge => 431,
            HttpError::BodyTooLarge(_) => 413,
            HttpError::UnsupportedEncoding => 501,
        }
    }
}

impl RouteError {
    /// HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            RouteError::NotFound(_) => 404,
            RouteError::MethodNotAllowed { .. } => 405,
            RouteError::BadBody(_) | RouteError::BadQuery(_) => 400,
        }
    }
}

impl ActionError {
    /// HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            ActionError::BadRequest(_) => 400,
            ActionError::NotFound(_) => 404,
            ActionError::Conflict(_) | ActionError::Busy(_) => 409,
            ActionError::PeerFailed(_) => 502,
            ActionError::Unavailable(_) => 503,
            ActionError::Internal(_) => 500,
        }
    }
}

impl Refusal {
    /// HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::Timeout(_) => 408,
            Refusal::TooManyConnections
            | Refusal::TooManyRequests(_)
            | Refusal::TooManyStreams(_)
            | Refusal::ShuttingDown => 503,
        }
    }
}

/// Status of a successful reply: a result, or a long operation started.
pub(crate) fn success(accepted: bool) -> u16 {
    if accepted {
        202
    } else {
        200
    }
}

/// The reason phrase of a status line.
pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        202 => "Accepted",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_errors_map_to_their_statuses() {
        let cases = [
            (ActionError::BadRequest("x".into()), 400),
            (ActionError::NotFound("x".into()), 404),
            (ActionError::Conflict("x".into()), 409),
            (ActionError::Busy("x".into()), 409),
            (ActionError::PeerFailed("x".into()), 502),
            (ActionError::Unavailable("x".into()), 503),
            (ActionError::Internal("x".into()), 500),
        ];
        for (error, status) in cases {
            assert_eq!(error.status(), status, "{error:?}");
            assert_ne!(reason(status), "Status");
        }
        assert_eq!(Refusal::Timeout(5000).status(), 408);
        assert_eq!(Refusal::TooManyConnections.status(), 503);
    }
}
