//! ferrovirt's web console, embedded: the bundle `ui/build.sh` writes into `ui/dist` is compiled
//! into the binary by build.rs ([`ASSETS`]) and served at `/ui/` by [`router`], mounted among the
//! API server's public routes (static files carry no secrets and need no token; every API call
//! the page makes carries the user's bearer token). Responses carry a Content-Security-Policy
//! that allows scripts, styles and connections from this origin only ([`CSP`]).

use axum::Router;
use axum::extract::Path;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{HeaderValue, StatusCode, header};

/// One embedded file of the bundle.
#[derive(Debug)]
pub struct Asset {
    /// Path below `/ui/`, e.g. `app.js`.
    pub path: &'static str,
    pub content_type: &'static str,
    pub body: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/assets.rs"));

/// Where the console is served.
pub const PREFIX: &str = "/ui/";

/// The Content-Security-Policy of every `/ui/` response: scripts only from this origin (no
/// inline script, no eval), connections (fetch, watch, websockets) only to this origin, no
/// framing. Inline styles stay allowed: xterm.js and noVNC set element styles.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
img-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; object-src 'none'; \
base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The asset at `path` below `/ui/` (the empty path is `index.html`).
pub fn asset(path: &str) -> Option<&'static Asset> {
    let path = if path.is_empty() { "index.html" } else { path };
    ASSETS.iter().find(|a| a.path == path)
}

/// The answer for `path` below `/ui/`: the asset with its type and the security headers, or
/// 404.
pub fn respond(path: &str) -> Response {
    let mut resp = match asset(path) {
        Some(a) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(a.content_type),
            )],
            a.body,
        )
            .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            )],
            "not found\n",
        )
            .into_response(),
    };
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// `/ui` (redirected to `/ui/`), `/ui/` and `/ui/{path}`: GET and HEAD, no authentication.
pub fn router() -> Router {
    Router::new()
        .route(
            "/ui",
            get(|| async {
                (
                    StatusCode::PERMANENT_REDIRECT,
                    [(header::LOCATION, HeaderValue::from_static(PREFIX))],
                )
            }),
        )
        .route("/ui/", get(|| async { respond("") }))
        .route(
            "/ui/{*path}",
            get(|Path(path): Path<String>| async move { respond(&path) }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    async fn call(method: &str, uri: &str) -> (StatusCode, http::HeaderMap, Vec<u8>) {
        let req = http::Request::builder()
            .method(method)
            .uri(uri)
            .body(axum::body::Body::empty())
            .unwrap();
        let resp = router().oneshot(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes().to_vec();
        (parts.status, parts.headers, body)
    }

    #[test]
    fn the_bundle_is_embedded() {
        let index = asset("").expect("index.html");
        let html = std::str::from_utf8(index.body).unwrap();
        assert!(
            html.contains("app.js") && html.contains("app.css"),
            "{html}"
        );
        assert!(asset("app.js").unwrap().body.len() > 10_000);
        assert_eq!(
            asset("app.css").unwrap().content_type,
            "text/css; charset=utf-8"
        );
        assert!(asset("nope.js").is_none());
    }

    #[test]
    fn no_inline_script_in_the_page() {
        // script-src 'self' forbids inline scripts: the page must not need any.
        let html = std::str::from_utf8(asset("").unwrap().body).unwrap();
        for tag in html.split("<script").skip(1) {
            assert!(tag.contains("src="), "inline script in index.html: {tag}");
        }
        assert!(
            !html.contains("http://") && !html.contains("https://"),
            "no external assets"
        );
    }

    #[tokio::test]
    async fn serves_assets_with_type_and_csp() {
        let (status, h, body) = call("GET", "/ui/").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(h[header::CONTENT_TYPE], "text/html; charset=utf-8");
        assert_eq!(h[header::CONTENT_SECURITY_POLICY], CSP);
        assert!(CSP.contains("script-src 'self';"));
        assert_eq!(h[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert!(!body.is_empty());
        let (status, h, _) = call("GET", "/ui/app.js").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(h[header::CONTENT_TYPE], "text/javascript; charset=utf-8");
        let (status, _, body) = call("HEAD", "/ui/app.js").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.is_empty());
    }

    #[tokio::test]
    async fn redirects_and_unknown_paths() {
        let (status, h, _) = call("GET", "/ui").await;
        assert_eq!(status, StatusCode::PERMANENT_REDIRECT);
        assert_eq!(h[header::LOCATION], "/ui/");
        for bad in [
            "/ui/missing.js",
            "/ui/../token",
            "/ui/%2e%2e/token",
            "/ui/..%2ftoken",
        ] {
            let (status, h, _) = call("GET", bad).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{bad}");
            assert_eq!(h[header::CONTENT_SECURITY_POLICY], CSP);
        }
        let (status, _, _) = call("POST", "/ui/app.js").await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    }
}
