//! The bearer token in a websocket subprotocol (`base64url.bearer.authorization.k8s.io.<token>`,
//! how browsers authenticate websockets to a Kubernetes apiserver) through a real server: the
//! right token is accepted and taken out of the protocols the handler sees; a wrong one, a
//! malformed one, two of them, or one without another protocol is answered 401.

mod common;

use anyhow::Result;
use axum::routing::get;
use base64::Engine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ECHO: &str = "/apis/wstest.example/v1/echo";

fn proto(token: &str) -> String {
    format!(
        "base64url.bearer.authorization.k8s.io.{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(token)
    )
}

/// A websocket upgrade GET of `path` offering `protocols`; returns status and body.
async fn upgrade_get(t: &common::TestServer, path: &str, protocols: &str) -> Result<(u16, String)> {
    let mut s = t.tls().await?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Protocol: {protocols}\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    // Read until the headers and a short body arrived (the server closes after a 401).
    let read = async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
            let text = String::from_utf8_lossy(&raw);
            if let Some((_, body)) = text.split_once("\r\n\r\n")
                && (body.ends_with('}') || body.ends_with("\n"))
            {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), read).await;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_subprotocol_token() -> Result<()> {
    // A route behind the authentication that answers the protocols it was handed.
    let echo = axum::Router::new().route(
        ECHO,
        get(|headers: http::HeaderMap| async move {
            let protos: Vec<String> = headers
                .get_all(http::header::SEC_WEBSOCKET_PROTOCOL)
                .iter()
                .map(|v| v.to_str().unwrap_or_default().to_string())
                .collect();
            format!("protocols={}\n", protos.join("|"))
        }),
    );
    let t = common::start_with(|o| o.extra_routes = Some(echo)).await?;
    let token = t.srv().token.clone();

    let (status, body) =
        upgrade_get(&t, ECHO, &format!("plain.kubevirt.io, {}", proto(&token))).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body.trim(),
        "protocols=plain.kubevirt.io",
        "the token protocol is removed"
    );

    // The API's own resources accept it too.
    let (status, body) = upgrade_get(
        &t,
        "/api/v1/namespaces/default",
        &format!("{}, base64.channel.k8s.io", proto(&token)),
    )
    .await?;
    assert_eq!(status, 200, "{body}");

    let wrong = format!("plain.kubevirt.io, {}", proto("not-the-token"));
    let bad_encoding = "plain.kubevirt.io, base64url.bearer.authorization.k8s.io.%%%".to_string();
    let two = format!("plain.kubevirt.io, {}, {}", proto(&token), proto(&token));
    let alone = proto(&token);
    for protocols in [wrong, bad_encoding, two, alone] {
        let (status, body) = upgrade_get(&t, ECHO, &protocols).await?;
        assert_eq!(status, 401, "{protocols}: {body}");
        assert!(body.contains("Unauthorized"), "{body}");
    }
    // Without the upgrade headers the subprotocol means nothing: no token, 401.
    let r = t.request_as(None, "GET", ECHO, None, vec![]).await?;
    assert_eq!(r.status, 401);
    t.shutdown().await;
    Ok(())
}
