//! `vnc NAME --proxy-only` (a local TCP port bridged to the VMI's VNC websocket) and `vnc
//! screenshot NAME -f out.png`: a minimal RFB client (versions 3.3–3.8, security type None, one
//! full framebuffer update in raw encoding at 32 bits per pixel) and a PNG writer.

use std::path::Path;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::CliError;
use crate::target::Target;

/// The VNC websocket path of a VMI.
pub fn path(namespace: &str, name: &str) -> String {
    format!(
        "/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/{name}/vnc"
    )
}

fn rfb_err(e: impl std::fmt::Display) -> CliError {
    CliError::Transport(format!("VNC: {e}"))
}

/// A framebuffer as 8-bit RGB rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub width: u16,
    pub height: u16,
    pub rgb: Vec<u8>,
}

async fn u8_<R: AsyncRead + Unpin>(r: &mut R) -> Result<u8, CliError> {
    r.read_u8().await.map_err(rfb_err)
}
async fn u16_<R: AsyncRead + Unpin>(r: &mut R) -> Result<u16, CliError> {
    r.read_u16().await.map_err(rfb_err)
}
async fn u32_<R: AsyncRead + Unpin>(r: &mut R) -> Result<u32, CliError> {
    r.read_u32().await.map_err(rfb_err)
}
async fn bytes_<R: AsyncRead + Unpin>(r: &mut R, n: usize) -> Result<Vec<u8>, CliError> {
    let mut b = vec![0u8; n];
    r.read_exact(&mut b).await.map_err(rfb_err)?;
    Ok(b)
}

async fn reason<R: AsyncRead + Unpin>(r: &mut R) -> String {
    match u32_(r).await {
        Ok(n) => bytes_(r, n.min(4096) as usize)
            .await
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Our pixel format: 32 bpp, depth 24, little-endian, true colour, RGB at shifts 16/8/0.
pub fn set_pixel_format() -> Vec<u8> {
    let mut m = vec![0u8, 0, 0, 0, 32, 24, 0, 1];
    m.extend_from_slice(&255u16.to_be_bytes());
    m.extend_from_slice(&255u16.to_be_bytes());
    m.extend_from_slice(&255u16.to_be_bytes());
    m.extend_from_slice(&[16, 8, 0, 0, 0, 0]);
    m
}

/// The RFB handshake and one full framebuffer update.
pub async fn capture<IO: AsyncRead + AsyncWrite + Unpin>(io: &mut IO) -> Result<Frame, CliError> {
    let version = bytes_(io, 12).await?;
    let text = String::from_utf8_lossy(&version).into_owned();
    if !text.starts_with("RFB ") {
        return Err(rfb_err(format!("not an RFB server: {text:?}")));
    }
    let minor: u32 = text[8..11].parse().unwrap_or(3);
    let minor = if minor >= 8 {
        8
    } else if minor >= 7 {
        7
    } else {
        3
    };
    io.write_all(format!("RFB 003.00{minor}\n").as_bytes())
        .await
        .map_err(rfb_err)?;
    if minor == 3 {
        match u32_(io).await? {
            1 => {}
            0 => return Err(rfb_err(format!("connection refused: {}", reason(io).await))),
            t => return Err(rfb_err(format!("security type {t} is not supported"))),
        }
    } else {
        let n = u8_(io).await?;
        if n == 0 {
            return Err(rfb_err(format!("connection refused: {}", reason(io).await)));
        }
        let types = bytes_(io, n as usize).await?;
        if !types.contains(&1) {
            return Err(rfb_err(format!(
                "the server offers security types {types:?}, not None (1)"
            )));
        }
        io.write_all(&[1]).await.map_err(rfb_err)?;
        if minor == 8 && u32_(io).await? != 0 {
            return Err(rfb_err(format!("security failed: {}", reason(io).await)));
        }
    }
    io.write_all(&[1]).await.map_err(rfb_err)?; // ClientInit, shared
    let mut width = u16_(io).await?;
    let mut height = u16_(io).await?;
    let _server_format = bytes_(io, 16).await?;
    let name_len = u32_(io).await?;
    let _name = bytes_(io, name_len.min(1 << 16) as usize).await?;
    let mut msgs = set_pixel_format();
    msgs.extend_from_slice(&[2, 0, 0, 2]);
    msgs.extend_from_slice(&0i32.to_be_bytes()); // raw
    msgs.extend_from_slice(&(-223i32).to_be_bytes()); // DesktopSize
    msgs.extend_from_slice(&update_request(width, height));
    io.write_all(&msgs).await.map_err(rfb_err)?;
    let mut fb = vec![0u8; usize::from(width) * usize::from(height) * 3];
    loop {
        match u8_(io).await? {
            0 => {
                let _pad = u8_(io).await?;
                let n = u16_(io).await?;
                let mut resized = false;
                for _ in 0..n {
                    let (x, y, w, h) = (
                        u16_(io).await?,
                        u16_(io).await?,
                        u16_(io).await?,
                        u16_(io).await?,
                    );
                    let enc = u32_(io).await? as i32;
                    match enc {
                        0 => {
                            let px = bytes_(io, usize::from(w) * usize::from(h) * 4).await?;
                            blit(&mut fb, width, height, (x, y, w, h), &px);
                        }
                        -223 => {
                            width = w;
                            height = h;
                            fb = vec![0u8; usize::from(width) * usize::from(height) * 3];
                            resized = true;
                        }
                        e => return Err(rfb_err(format!("unexpected encoding {e}"))),
                    }
                }
                if resized {
                    io.write_all(&update_request(width, height))
                        .await
                        .map_err(rfb_err)?;
                    continue;
                }
                return Ok(Frame {
                    width,
                    height,
                    rgb: fb,
                });
            }
            1 => {
                let _pad = u8_(io).await?;
                let _first = u16_(io).await?;
                let n = u16_(io).await?;
                bytes_(io, usize::from(n) * 6).await?;
            }
            2 => {}
            3 => {
                bytes_(io, 3).await?;
                let n = u32_(io).await?;
                bytes_(io, n as usize).await?;
            }
            t => return Err(rfb_err(format!("unexpected server message {t}"))),
        }
    }
}

fn update_request(w: u16, h: u16) -> Vec<u8> {
    let mut m = vec![3u8, 0, 0, 0, 0, 0];
    m.extend_from_slice(&w.to_be_bytes());
    m.extend_from_slice(&h.to_be_bytes());
    m
}

/// Copies a raw rectangle (32-bit little-endian pixels, red at bit 16) into an RGB framebuffer.
fn blit(fb: &mut [u8], width: u16, height: u16, (x, y, w, h): (u16, u16, u16, u16), px: &[u8]) {
    for row in 0..h {
        for col in 0..w {
            let (fx, fy) = (usize::from(x + col), usize::from(y + row));
            if fx >= usize::from(width) || fy >= usize::from(height) {
                continue;
            }
            let s = (usize::from(row) * usize::from(w) + usize::from(col)) * 4;
            let d = (fy * usize::from(width) + fx) * 3;
            fb[d] = px[s + 2];
            fb[d + 1] = px[s + 1];
            fb[d + 2] = px[s];
        }
    }
}

/// The frame as a PNG file.
pub fn encode_png(frame: &Frame) -> Result<Vec<u8>, CliError> {
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, u32::from(frame.width), u32::from(frame.height));
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc
            .write_header()
            .map_err(|e| CliError::Usage(format!("PNG: {e}")))?;
        w.write_image_data(&frame.rgb)
            .map_err(|e| CliError::Usage(format!("PNG: {e}")))?;
    }
    Ok(out)
}

/// `vnc screenshot NAME -f FILE`.
pub async fn screenshot(target: &Target, name: &str, file: &Path) -> Result<Frame, CliError> {
    let ws = target.websocket(&path(&target.namespace, name)).await?;
    let (mut ours, theirs) = tokio::io::duplex(1 << 20);
    let pump = tokio::spawn(crate::wsio::bridge(ws, theirs));
    let frame = tokio::time::timeout(std::time::Duration::from_secs(60), capture(&mut ours))
        .await
        .map_err(|_| rfb_err("no framebuffer update within 60 s"))??;
    drop(ours);
    pump.abort();
    if frame.width == 0 || frame.height == 0 {
        return Err(rfb_err("the display is 0×0"));
    }
    std::fs::write(file, encode_png(&frame)?)
        .map_err(|e| CliError::io(format!("writing {}", file.display()), e))?;
    Ok(frame)
}

/// `vnc NAME --proxy-only`: listens on 127.0.0.1:`port` (0: any free port), prints
/// `{"port":N}`, and bridges each connection to a new VNC websocket.
pub async fn proxy(target: &Target, name: &str, port: u16) -> Result<(), CliError> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .map_err(|e| CliError::io(format!("listening on 127.0.0.1:{port}"), e))?;
    let port = listener
        .local_addr()
        .map_err(|e| CliError::io("local address", e))?
        .port();
    println!("{}", serde_json::json!({ "port": port }));
    loop {
        let (conn, _) = listener
            .accept()
            .await
            .map_err(|e| CliError::io("accepting a connection", e))?;
        let ws = target.websocket(&path(&target.namespace, name)).await?;
        tokio::spawn(async move {
            if let Err(e) = crate::wsio::bridge(ws, conn).await {
                eprintln!("{e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake QEMU: RFB 3.8, security None, a 3×2 display answering one raw update.
    async fn fake_server(mut s: tokio::io::DuplexStream) {
        s.write_all(b"RFB 003.008\n").await.unwrap();
        let mut v = [0u8; 12];
        s.read_exact(&mut v).await.unwrap();
        assert_eq!(&v, b"RFB 003.008\n");
        s.write_all(&[1, 1]).await.unwrap();
        assert_eq!(s.read_u8().await.unwrap(), 1);
        s.write_all(&0u32.to_be_bytes()).await.unwrap();
        assert_eq!(s.read_u8().await.unwrap(), 1); // shared
        let mut init = vec![0, 3, 0, 2];
        init.extend_from_slice(&[0u8; 16]);
        init.extend_from_slice(&4u32.to_be_bytes());
        init.extend_from_slice(b"QEMU");
        s.write_all(&init).await.unwrap();
        let mut spf = [0u8; 20];
        s.read_exact(&mut spf).await.unwrap();
        assert_eq!(spf.to_vec(), set_pixel_format());
        let mut enc = [0u8; 12];
        s.read_exact(&mut enc).await.unwrap();
        let mut req = [0u8; 10];
        s.read_exact(&mut req).await.unwrap();
        assert_eq!(req, [3, 0, 0, 0, 0, 0, 0, 3, 0, 2]);
        // A Bell, then a FramebufferUpdate with one 3×2 raw rectangle at (0, 0).
        let mut upd = vec![2u8, 0, 0, 0, 1, 0, 0, 0, 0, 0, 3, 0, 2, 0, 0, 0, 0];
        for i in 0..6u8 {
            upd.extend_from_slice(&[i, 10 + i, 20 + i, 0]); // B, G, R, pad
        }
        s.write_all(&upd).await.unwrap();
    }

    #[tokio::test]
    async fn screenshot_of_a_fake_server() {
        let (mut a, b) = tokio::io::duplex(4096);
        let server = tokio::spawn(fake_server(b));
        let frame = capture(&mut a).await.unwrap();
        server.await.unwrap();
        assert_eq!((frame.width, frame.height), (3, 2));
        assert_eq!(&frame.rgb[..6], &[20, 10, 0, 21, 11, 1]);
        let png_bytes = encode_png(&frame).unwrap();
        assert_eq!(&png_bytes[..8], b"\x89PNG\r\n\x1a\n");
        let dec = png::Decoder::new(std::io::Cursor::new(png_bytes));
        let reader = dec.read_info().unwrap();
        assert_eq!((reader.info().width, reader.info().height), (3, 2));
    }
}
