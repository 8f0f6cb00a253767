//! A tiny HTTP/1.1 file server for import tests: `GET /<name>` answers the file registered as
//! `name` (read when asked), anything else 404; one thread per connection, on 127.0.0.1 only.
//! [`answer`] serves one request on any stream, so a test can wrap it in TLS itself.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;

/// Answers one request on `stream` from `files` (`GET /<name>`), else 404.
pub fn answer<S: Read + Write>(stream: S, files: &[(String, PathBuf)]) {
    let mut reader = BufReader::new(stream);
    let mut request = String::new();
    if reader.read_line(&mut request).is_err() {
        return;
    }
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap_or(0) > 2 {
        line.clear();
    }
    let path = request.split_whitespace().nth(1).unwrap_or("/").to_string();
    let body = files
        .iter()
        .find(|(n, _)| path == format!("/{n}"))
        .and_then(|(_, p)| std::fs::read(p).ok());
    let s = reader.get_mut();
    let _ = match body {
        Some(b) => write!(
            s,
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            b.len()
        )
        .and_then(|_| s.write_all(&b)),
        None => write!(
            s,
            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
    };
    let _ = s.flush();
}

/// Serves `files` (name, path) over plain HTTP on 127.0.0.1; returns the base URL
/// (`http://127.0.0.1:PORT`). The threads end with the test process.
pub fn serve_files(files: Vec<(String, PathBuf)>) -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let files = files.clone();
            std::thread::spawn(move || answer(stream, &files));
        }
    });
    Ok(format!("http://{addr}"))
}
