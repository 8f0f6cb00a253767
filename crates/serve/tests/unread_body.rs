//! A request answered before its body was read, through the real accept loop over TLS: the
//! client can finish sending the body and the connection serves its next request (before the
//! drain, hyper closed it, and `kubectl` failed such requests with "broken pipe").

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{get, post};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::client::TlsStream;

struct Server {
    addr: std::net::SocketAddr,
    client: tokio_rustls::TlsConnector,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start() -> Server {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::try_from(ck.signing_key.serialize_der()).unwrap();
    let server = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert).unwrap();
    let client = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let app = Router::new()
        // Refused before the body is read, as the API server refuses an unknown path.
        .route("/refuse", post(|| async { StatusCode::NOT_FOUND }))
        .route("/ok", get(|| async { "ok" }));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(ferrovirt_serve::serve(
        "test",
        listener,
        tokio_rustls::TlsAcceptor::from(Arc::new(server)),
        app,
        ferrovirt_serve::Limits::default(),
        async {
            let _ = stopped.await;
        },
    ));
    Server {
        addr,
        client: tokio_rustls::TlsConnector::from(Arc::new(client)),
        _stop: stop,
    }
}

async fn connect(s: &Server) -> TlsStream<TcpStream> {
    let tcp = TcpStream::connect(s.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    s.client.connect(name, tcp).await.unwrap()
}

/// Reads until `n` responses' status lines were seen, the connection ends or 10 s pass.
async fn read_responses(tls: &mut TlsStream<TcpStream>, n: usize) -> String {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&got).matches("HTTP/1.1 ").count() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, tls.read(&mut buf)).await {
            Ok(Ok(k)) if k > 0 => got.extend_from_slice(&buf[..k]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn a_body_sent_after_the_answer_began_is_read_and_the_connection_kept() {
    let s = start().await;
    for body_head in ["Content-Length: 10", "Transfer-Encoding: chunked"] {
        let mut tls = connect(&s).await;
        let head = format!("POST /refuse HTTP/1.1\r\nHost: localhost\r\n{body_head}\r\n\r\n");
        tls.write_all(head.as_bytes()).await.unwrap();
        tls.flush().await.unwrap();
        // The server has the head alone and answers; the body comes later.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let body: &[u8] = if body_head.starts_with("Content") {
            b"0123456789"
        } else {
            b"a\r\n0123456789\r\n0\r\n\r\n"
        };
        tls.write_all(body).await.unwrap();
        tls.write_all(b"GET /ok HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        tls.flush().await.unwrap();
        let got = read_responses(&mut tls, 2).await;
        assert!(got.starts_with("HTTP/1.1 404"), "{body_head}: {got}");
        assert!(
            got.contains("HTTP/1.1 200") && got.ends_with("ok"),
            "{body_head}: the connection serves the next request: {got}"
        );
    }
}

/// Sends the head of a refused POST whose body never comes, on a new connection; how long its
/// 404 took.
async fn refused_without_body(s: &Server, content_length: u64) -> Duration {
    let mut tls = connect(s).await;
    let t = Instant::now();
    let head = format!(
        "POST /refuse HTTP/1.1\r\nHost: localhost\r\nContent-Length: {content_length}\r\n\r\n"
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    tls.flush().await.unwrap();
    let got = read_responses(&mut tls, 1).await;
    assert!(got.starts_with("HTTP/1.1 404"), "{got}");
    t.elapsed()
}

#[tokio::test]
async fn a_body_that_never_comes_delays_the_answer_by_the_drain_timeout_at_most() {
    let s = start().await;
    let waited = refused_without_body(&s, 10).await;
    assert!(
        waited >= ferrovirt_serve::drain::DRAIN_TIMEOUT / 2
            && waited < ferrovirt_serve::drain::DRAIN_TIMEOUT + Duration::from_secs(3),
        "answered after {waited:?}"
    );
    // An oversized body is not waited for: answered at once.
    let waited = refused_without_body(&s, 10_000_000).await;
    assert!(waited < Duration::from_secs(1), "{waited:?}");
}
