//! Binding the API socket: never over a file that is not a stale socket,
//! never over a live one, with its mode set before it appears, and removed
//! at shutdown only if it is still the server's.

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::Duration;

use common::scratch;
use kemari_api::bind::{BindError, SocketOptions};
use kemari_api::server::ServerError;
use kemari_api::{client, ApiRequest, ApiServer, Reply, ServerOptions};

fn serve(path: &std::path::Path, socket: SocketOptions) -> Result<ApiServer, ServerError> {
    ApiServer::start(
        path,
        ServerOptions {
            socket,
            ..ServerOptions::default()
        },
        Arc::new(|_| Ok(Reply::Json(serde_json::json!({ "state": "running" })))),
    )
}

fn bind_error(result: Result<ApiServer, ServerError>) -> BindError {
    match result {
        Err(ServerError::Bind { source, .. }) => source,
        Err(e) => panic!("not a bind error: {e}"),
        Ok(_) => panic!("the server started"),
    }
}

/// Only the given names are left in `dir` (no temporary directory behind).
fn assert_only(dir: &std::path::Path, names: &[&str]) {
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    assert_eq!(found, names);
}

#[test]
fn a_regular_file_is_refused_and_left_intact() {
    let dir = scratch("regular");
    let path = dir.join("api.sock");
    std::fs::write(&path, b"precious").unwrap();
    let e = bind_error(serve(&path, SocketOptions::default()));
    assert!(matches!(e, BindError::NotASocket { .. }), "{e}");
    assert!(e.to_string().contains("not a socket"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    std::fs::create_dir(dir.join("d")).unwrap();
    let e = bind_error(serve(&dir.join("d"), SocketOptions::default()));
    assert!(matches!(e, BindError::NotASocket { .. }), "{e}");
    assert!(dir.join("d").is_dir());
    assert_only(&dir, &["api.sock", "d"]);
}

#[test]
fn a_live_socket_is_refused() {
    let dir = scratch("live");
    let path = dir.join("api.sock");
    let other = UnixListener::bind(&path).unwrap();
    let e = bind_error(serve(&path, SocketOptions::default()));
    assert!(
        e.to_string()
            .contains("another process is serving this socket"),
        "{e}"
    );
    let first = serve(&dir.join("b.sock"), SocketOptions::default()).unwrap();
    let e = bind_error(serve(&dir.join("b.sock"), SocketOptions::default()));
    assert!(matches!(e, BindError::InUse { .. }), "{e}");
    client::call(first.path(), &ApiRequest::Info).unwrap();
    drop(other);
}

#[test]
fn a_stale_socket_is_replaced() {
    let dir = scratch("stale");
    let path = dir.join("api.sock");
    drop(UnixListener::bind(&path).unwrap());
    assert!(std::fs::symlink_metadata(&path)
        .unwrap()
        .file_type()
        .is_socket());
    let server = serve(&path, SocketOptions::default()).unwrap();
    client::call(&path, &ApiRequest::Info).unwrap();
    assert_only(&dir, &["api.sock"]);
    server.shutdown(Duration::from_secs(1));
    assert_only(&dir, &[]);
}

#[test]
fn the_mode_is_applied() {
    let dir = scratch("mode");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let default = serve(&dir.join("a.sock"), SocketOptions::default()).unwrap();
    assert_eq!(mode(&dir.join("a.sock")), 0o600);
    let gid = std::fs::metadata(&dir)
        .map(|m| std::os::unix::fs::MetadataExt::gid(&m))
        .unwrap();
    let shared = serve(
        &dir.join("b.sock"),
        SocketOptions {
            mode: 0o660,
            group: Some(gid.to_string()),
        },
    )
    .unwrap();
    assert_eq!(mode(&dir.join("b.sock")), 0o660);
    let e = bind_error(serve(
        &dir.join("c.sock"),
        SocketOptions {
            mode: 0o600,
            group: Some("no-such-group-kemari".into()),
        },
    ));
    assert!(matches!(e, BindError::NoGroup(_)), "{e}");
    assert!(!dir.join("c.sock").exists());
    drop((default, shared));
    assert_only(&dir, &[]);
}

#[test]
fn the_socket_is_removed_at_shutdown_only_if_still_ours() {
    let dir = scratch("ours");
    let path = dir.join("api.sock");
    let server = serve(&path, SocketOptions::default()).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, b"someone else's").unwrap();
    server.shutdown(Duration::from_secs(1));
    assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
}
