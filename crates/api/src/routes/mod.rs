//! The API's requests and its one route table.
//!
//! [`ROUTES`] (`table.rs`) lists every action with its method, path, body
//! fields and a summary. The server routes requests through it ([`route`]),
//! `kemarictl` and the client turn an [`ApiRequest`] into a call through it
//! ([`ApiRequest::to_http`]), and a test (`tests/api_yaml.rs`) checks
//! docs/api.yaml against it. [`route`] is pure and bounded, so it can be
//! fuzzed (`fuzz/` target `api_request`).
//!
//! A route names the [`ApiRequest`] variant it builds; the body is that
//! variant's fields, as JSON (serde's externally tagged form: the route's
//! `action` wraps the body).

mod request;
mod table;

use serde_json::Value;

pub use request::{ApiRequest, FtStartRequest};
pub use table::{Field, FieldType, Method, Route, ROUTES};

/// Largest request body accepted.
pub const MAX_BODY: usize = 64 << 10;

/// A routed request: the action, and whether the caller follows it
/// (`?follow`: progress lines until it ends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    /// The action.
    pub request: ApiRequest,
    /// `?follow` was given.
    pub follow: bool,
}

/// A request as HTTP: what a client sends for an [`ApiRequest`].
#[derive(Debug, Clone, PartialEq)]
pub struct HttpCall {
    /// The method.
    pub method: Method,
    /// Path and query.
    pub path: String,
    /// The JSON body, if the action has parameters.
    pub body: Option<Value>,
}

/// Why an [`ApiRequest`] cannot be written as HTTP.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A parameter cannot be written as JSON (a path that is not UTF-8).
    #[error("cannot encode the request: {0}")]
    Serialize(String),
    /// No route builds the action (a bug: the table misses it).
    #[error("no API route for the action {0}")]
    NoRoute(String),
}

impl ApiRequest {
    /// The route that builds this action, and its body.
    fn route_and_body(&self) -> Result<(&'static Route, Option<Value>), EncodeError> {
        let (action, body) = match serde_json::to_value(self) {
            Ok(Value::String(action)) => (action, None),
            Ok(Value::Object(map)) if map.len() == 1 => {
                let Some((action, body)) = map.into_iter().next() else {
                    return Err(EncodeError::NoRoute(format!("{self:?}")));
                };
                (action, Some(body))
            }
            Ok(_) => return Err(EncodeError::NoRoute(format!("{self:?}"))),
            Err(e) => return Err(EncodeError::Serialize(e.to_string())),
        };
        let route = ROUTES
            .iter()
            .find(|r| r.action == action)
            .ok_or(EncodeError::NoRoute(action))?;
        Ok((route, body))
    }

    /// The route that builds this action.
    pub fn route(&self) -> Result<&'static Route, EncodeError> {
        Ok(self.route_and_body()?.0)
    }

    /// The HTTP call that asks for this action.
    pub fn to_http(&self) -> Result<HttpCall, EncodeError> {
        let (route, body) = self.route_and_body()?;
        Ok(HttpCall {
            method: route.method,
            path: route.path.to_owned(),
            body,
        })
    }
}

impl Routed {
    /// The HTTP call that asks for this action (with `?follow` if followed).
    pub fn to_http(&self) -> Result<HttpCall, EncodeError> {
        let mut call = self.request.to_http()?;
        if self.follow {
            call.path.push_str("?follow");
        }
        Ok(call)
    }
}

/// Why a request was refused before reaching the VM.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No such path.
    #[error("no such API path: {0}")]
    NotFound(String),
    /// Path exists, method does not.
    #[error("method {method} not allowed on {path} (allowed: {allowed})")]
    MethodNotAllowed {
        /// The method used.
        method: String,
        /// The path.
        path: String,
        /// What is allowed.
        allowed: &'static str,
    },
    /// Body too large or not valid for the action.
    #[error("bad request body: {0}")]
    BadBody(String),
    /// A query parameter that the route does not take.
    #[error("bad query: {0}")]
    BadQuery(String),
}

/// Maps a request to an action.
pub fn route(method: &str, target: &str, body: &[u8]) -> Result<Routed, RouteError> {
    if body.len() > MAX_BODY {
        return Err(RouteError::BadBody(format!(
            "{} bytes, limit {MAX_BODY}",
            body.len()
        )));
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let path = path
        .strip_suffix('/')
        .filter(|p| !p.is_empty())
        .unwrap_or(path);
    let mut on_path = ROUTES.iter().filter(|r| r.path == path).peekable();
    let Some(&first) = on_path.peek() else {
        return Err(RouteError::NotFound(truncate(path)));
    };
    let route = on_path
        .find(|r| method.eq_ignore_ascii_case(r.method.as_str()))
        .ok_or_else(|| RouteError::MethodNotAllowed {
            method: truncate(method),
            path: path.to_owned(),
            allowed: first.method.as_str(),
        })?;
    let follow = parse_query(query, route)?;
    let request = if route.body.is_empty() {
        // Actions without parameters accept an empty body or a JSON object.
        if !body.iter().all(u8::is_ascii_whitespace) {
            serde_json::from_slice::<serde_json::Map<String, Value>>(body)
                .map_err(|e| RouteError::BadBody(e.to_string()))?;
        }
        serde_json::from_value(Value::String(route.action.to_owned()))
    } else {
        let fields = serde_json::from_slice::<serde_json::Map<String, Value>>(body)
            .map_err(|e| RouteError::BadBody(format!("expected a JSON object: {e}")))?;
        let mut tagged = serde_json::Map::new();
        tagged.insert(route.action.to_owned(), Value::Object(fields));
        serde_json::from_value(Value::Object(tagged))
    }
    .map_err(|e| RouteError::BadBody(e.to_string()))?;
    Ok(Routed { request, follow })
}

/// The query: only `follow` (`follow`, `follow=1`, `follow=true`; `0` and
/// `false` turn it off), and only on routes that take it.
fn parse_query(query: &str, route: &Route) -> Result<bool, RouteError> {
    let mut follow = false;
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = param.split_once('=').unwrap_or((param, ""));
        if name != "follow" {
            return Err(RouteError::BadQuery(format!(
                "unknown query parameter `{}` (only `follow` is accepted)",
                truncate(name)
            )));
        }
        if !route.follow {
            return Err(RouteError::BadQuery(format!(
                "`follow` is not accepted on {} {}",
                route.method.as_str(),
                route.path
            )));
        }
        follow = match value {
            "" | "1" | "true" => true,
            "0" | "false" => false,
            other => {
                return Err(RouteError::BadQuery(format!(
                    "`follow={}`: use follow, follow=1 or follow=true",
                    truncate(other)
                )))
            }
        };
    }
    Ok(follow)
}

fn truncate(s: &str) -> String {
    s.chars().take(128).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn action(method: &str, target: &str, body: &[u8]) -> Result<ApiRequest, RouteError> {
        route(method, target, body).map(|r| r.request)
    }

    fn status(method: &str, target: &str, body: &[u8]) -> u16 {
        route(method, target, body).unwrap_err().status()
    }

    #[test]
    fn routes() {
        for (method, target, body, expected) in [
            ("GET", "/vm", &b""[..], ApiRequest::Info),
            ("get", "/vm/metrics/", b"", ApiRequest::Metrics),
            ("PUT", "/vm/pause", b"{}", ApiRequest::Pause),
            ("PUT", "/vm/shutdown", b" \n", ApiRequest::Shutdown),
            ("GET", "/vm/operation", b"", ApiRequest::OperationStatus),
            ("GET", "/vm/events", b"", ApiRequest::Events),
            ("GET", "/metrics", b"", ApiRequest::PrometheusMetrics),
            (
                "PUT",
                "/vm/operation/cancel",
                b"",
                ApiRequest::OperationCancel,
            ),
        ] {
            assert_eq!(
                action(method, target, body),
                Ok(expected),
                "{method} {target}"
            );
        }
    }

    #[test]
    fn follow_is_accepted_on_long_operations_only() {
        for target in [
            "/vm/operation?follow",
            "/vm/operation?follow=1",
            "/vm/operation?follow=true",
        ] {
            assert!(route("GET", target, b"").unwrap().follow, "{target}");
        }
        assert!(!route("GET", "/vm/operation?follow=0", b"").unwrap().follow);
        assert!(!route("GET", "/vm/operation", b"").unwrap().follow);
        let snap = route("PUT", "/vm/snapshot?follow", br#"{"dir":"/s"}"#).unwrap();
        assert!(snap.follow);
        assert_eq!(
            snap.request,
            ApiRequest::Snapshot {
                dir: "/s".into(),
                exit: false,
                force: false
            }
        );
        assert_eq!(
            action("PUT", "/vm/snapshot", br#"{"dir":"/s","force":true}"#).unwrap(),
            ApiRequest::Snapshot {
                dir: "/s".into(),
                exit: false,
                force: true
            }
        );
        assert_eq!(status("GET", "/vm?follow", b""), 400);
        assert_eq!(status("GET", "/vm/operation?follow=maybe", b""), 400);
        let e = route("PUT", "/vm/shutdown?x=1", b"").unwrap_err();
        assert_eq!(e.status(), 400);
        assert!(e.to_string().contains("`x`"), "{e}");
        let e = route("GET", "/vm/operation?follow&verbose", b"").unwrap_err();
        assert!(e.to_string().contains("`verbose`"), "{e}");
    }

    #[test]
    fn errors() {
        assert_eq!(status("GET", "/nope", b""), 404);
        assert_eq!(status("POST", "/vm/pause", b""), 405);
        assert_eq!(status("PUT", "/vm/pause", b"{not json"), 400);
        assert_eq!(status("PUT", "/vm/pause", b"[1]"), 400);
        assert_eq!(status("PUT", "/vm/snapshot", b"{}"), 400);
        assert_eq!(status("PUT", "/vm/snapshot", b""), 400);
        assert_eq!(status("PUT", "/vm/snapshot", b"null"), 400);
        assert_eq!(
            status("PUT", "/vm/snapshot", br#"{"dir":"/s","bogus":1}"#),
            400
        );
        assert_eq!(status("GET", "/vm/warm-restart", b""), 405);
        assert_eq!(status("PUT", "/vm/ft/start", br#"{"peer":"h:1"}"#), 400);
        assert!(matches!(
            action(
                "PUT",
                "/vm/ft/start",
                br#"{"peer":"h:1","key_file":"/k","periodic_ms":25,"keep_writable_pages":0,"epochs_in_flight":4}"#
            ),
            Ok(ApiRequest::FtStart(FtStartRequest {
                periodic_ms: Some(25),
                keep_writable_pages: Some(0),
                epochs_in_flight: Some(4),
                ..
            }))
        ));
        assert_eq!(action("GET", "/vm/ft", b"").unwrap(), ApiRequest::FtStatus);
        assert_eq!(
            action("PUT", "/vm/warm-restart", br#"{"dir":"/w","prepare":true}"#).unwrap(),
            ApiRequest::WarmRestart {
                dir: "/w".into(),
                prepare: true
            }
        );
        // Optional parameters may be given as null (older kemarictl did).
        assert_eq!(
            action(
                "PUT",
                "/vm/migrate",
                br#"{"to":"h:1","key_file":"/k","max_downtime_ms":null}"#
            )
            .unwrap(),
            ApiRequest::Migrate {
                to: "h:1".into(),
                key_file: "/k".into(),
                max_downtime_ms: None,
                max_rounds: None,
                max_bandwidth_mib_s: None,
                connections: None,
                plaintext: false,
            }
        );
        assert!(action("PUT", "/vm/warm-restart", br#"{"dir":"/w"}"#)
            .unwrap()
            .moves_vm());
        assert!(
            !action("PUT", "/vm/warm-restart", br#"{"dir":"/w","prepare":true}"#)
                .unwrap()
                .moves_vm()
        );
        let big = vec![b' '; MAX_BODY + 1];
        assert_eq!(status("PUT", "/vm/pause", &big), 400);
        let long = "/".repeat(10_000);
        assert!(route("GET", &long, b"").unwrap_err().to_string().len() < 300);
    }

    /// One request per action (a new action needs one here: the table's
    /// length is checked against this list).
    fn one_of_each() -> Vec<ApiRequest> {
        let all = vec![
            ApiRequest::Info,
            ApiRequest::Config,
            ApiRequest::Devices,
            ApiRequest::Metrics,
            ApiRequest::Pause,
            ApiRequest::Resume,
            ApiRequest::Shutdown,
            ApiRequest::Snapshot {
                dir: "/s".into(),
                exit: true,
                force: true,
            },
            ApiRequest::WarmRestart {
                dir: "/w".into(),
                prepare: false,
            },
            ApiRequest::MigrateLocal {
                socket: "/m.sock".into(),
            },
            ApiRequest::Migrate {
                to: "h:1".into(),
                key_file: "/k".into(),
                max_downtime_ms: Some(300),
                max_rounds: None,
                max_bandwidth_mib_s: Some(100),
                connections: Some(4),
                plaintext: true,
            },
            ApiRequest::MigrationStatus,
            ApiRequest::MigrationCancel,
            ApiRequest::FtStart(FtStartRequest {
                peer: "h:2".into(),
                key_file: "/k".into(),
                periodic_ms: None,
                heartbeat_ms: Some(50),
                timeout_ms: None,
                keep_writable_pages: Some(0),
                epochs_in_flight: Some(2),
                plaintext: false,
            }),
            ApiRequest::FtStatus,
            ApiRequest::FtStop,
            ApiRequest::OperationStatus,
            ApiRequest::OperationCancel,
            ApiRequest::Events,
            ApiRequest::PrometheusMetrics,
        ];
        all
    }

    #[test]
    fn every_action_has_one_route_and_goes_there_and_back() {
        let all = one_of_each();
        assert_eq!(all.len(), ROUTES.len());
        for request in all {
            for follow in [false, true] {
                let routed = Routed {
                    request: request.clone(),
                    follow: follow && request.route().unwrap().follow,
                };
                let call = routed.to_http().unwrap();
                let body = call
                    .body
                    .as_ref()
                    .map(|b| b.to_string())
                    .unwrap_or_default();
                assert_eq!(
                    route(call.method.as_str(), &call.path, body.as_bytes()),
                    Ok(routed.clone()),
                    "{call:?}"
                );
            }
        }
        for (i, r) in ROUTES.iter().enumerate() {
            assert!(
                !ROUTES[..i]
                    .iter()
                    .any(|o| o.path == r.path || o.action == r.action),
                "{} {} is in the table twice",
                r.method.as_str(),
                r.path
            );
        }
    }

    fn sample(ty: FieldType) -> Value {
        match ty {
            FieldType::String | FieldType::Path => Value::from("/x"),
            FieldType::Boolean => Value::from(true),
            FieldType::Integer => Value::from(7),
        }
    }

    #[test]
    fn the_body_fields_are_what_the_actions_take() {
        for r in ROUTES.iter().filter(|r| !r.body.is_empty()) {
            let body = |fields: &mut dyn Iterator<Item = &Field>| {
                Value::Object(fields.map(|f| (f.name.to_owned(), sample(f.ty))).collect())
                    .to_string()
            };
            let every = body(&mut r.body.iter());
            route(r.method.as_str(), r.path, every.as_bytes())
                .unwrap_or_else(|e| panic!("{} with every field: {e}", r.path));
            let needed = body(&mut r.body.iter().filter(|f| f.required));
            route(r.method.as_str(), r.path, needed.as_bytes())
                .unwrap_or_else(|e| panic!("{} with the required fields: {e}", r.path));
            for missing in r.body.iter().filter(|f| f.required) {
                let without = body(&mut r.body.iter().filter(|f| f.name != missing.name));
                assert!(
                    route(r.method.as_str(), r.path, without.as_bytes()).is_err(),
                    "{} without {}",
                    r.path,
                    missing.name
                );
            }
        }
    }
}
