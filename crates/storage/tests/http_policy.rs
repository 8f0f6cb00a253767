//! The downloader's address policy against real loopback servers this test starts: a
//! loopback URL (IP literal or the name `localhost`) is refused before any connection, an
//! allowed origin (127.0.0.2) that redirects to a refused one (127.0.0.1) is refused on the
//! hop, and an allowed range lets the same download through.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ferrovirt_storage::StorageError;
use ferrovirt_storage::http::{DownloadRequest, download};
use ferrovirt_storage::netpolicy::{AddressClass, AddressPolicy, parse_list};

/// A server on `ip` answering every request with `head` and `body`; counts connections.
fn serve(ip: &str, head: String, body: &'static [u8]) -> (u16, Arc<AtomicUsize>) {
    let l = TcpListener::bind((ip, 0)).unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(AtomicUsize::new(0));
    let s2 = seen.clone();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            s2.fetch_add(1, Ordering::SeqCst);
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            while r.read_line(&mut line).unwrap_or(0) > 2 {
                line.clear();
            }
            let mut s = s;
            let _ = write!(
                s,
                "HTTP/1.1 {head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(body);
        }
    });
    (port, seen)
}

async fn get(url: String, policy: AddressPolicy) -> Result<Vec<u8>, StorageError> {
    let req = DownloadRequest {
        url,
        address_policy: policy,
        ..Default::default()
    };
    let mut out = Vec::new();
    download(
        &req,
        |c| {
            out.extend_from_slice(c);
            Ok(())
        },
        |_, _| {},
    )
    .await?;
    Ok(out)
}

fn refused_class(e: StorageError) -> AddressClass {
    match e {
        StorageError::AddressRefused { refusal, .. } => refusal.class,
        e => panic!("not an address refusal: {e}"),
    }
}

#[tokio::test]
async fn loopback_is_refused_unless_allowed() {
    let (port, seen) = serve("127.0.0.1", "200 OK".into(), b"disk");
    for host in ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]"] {
        let e = get(format!("http://{host}:{port}/d"), AddressPolicy::default())
            .await
            .unwrap_err();
        let m = e.to_string();
        assert!(m.contains("loopback address"), "{m}");
        assert_eq!(refused_class(e), AddressClass::Loopback, "{host}");
    }
    assert_eq!(seen.load(Ordering::SeqCst), 0, "a refused import connected");
    let allowed = AddressPolicy::allowing(parse_list("127.0.0.0/8,::1/128").unwrap());
    let body = get(format!("http://127.0.0.1:{port}/d"), allowed.clone())
        .await
        .unwrap();
    assert_eq!(body, b"disk");
    let body = get(format!("http://localhost:{port}/d"), allowed)
        .await
        .unwrap();
    assert_eq!(body, b"disk");
}

#[tokio::test]
async fn a_redirect_to_a_refused_address_is_refused_on_the_hop() {
    let (inner_port, inner_seen) = serve("127.0.0.1", "200 OK".into(), b"secret");
    let (outer_port, outer_seen) = serve(
        "127.0.0.2",
        format!("302 Found\r\nLocation: http://127.0.0.1:{inner_port}/latest/meta-data"),
        b"",
    );
    let policy = AddressPolicy::allowing(parse_list("127.0.0.2/32").unwrap());
    let e = get(format!("http://127.0.0.2:{outer_port}/d"), policy)
        .await
        .unwrap_err();
    let m = e.to_string();
    assert!(m.contains(&format!("127.0.0.1:{inner_port}")), "{m}");
    assert_eq!(refused_class(e), AddressClass::Loopback);
    assert_eq!(outer_seen.load(Ordering::SeqCst), 1);
    assert_eq!(inner_seen.load(Ordering::SeqCst), 0, "the hop connected");
}
