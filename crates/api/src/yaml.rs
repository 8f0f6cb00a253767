//! The one YAML stack of ferrovirt (serde-saphyr 2, the version kube-rs uses): decoding of API
//! request bodies and CLI files, and encoding of `-o yaml`. Every caller goes through here so
//! that hostile input meets the same bounds everywhere: the parser's budget (events, nodes,
//! aliases, anchors, documents, scalar bytes) with nesting capped at [`MAX_DEPTH`] and alias
//! replay (billion laughs) capped at [`MAX_REPLAYED_EVENTS`] events in total.
//!
//! Decoding recurses once per nesting level, and a debug build's frames are large (about
//! 20 KiB a level into a `serde_json::Value`: a 100-deep document overflowed a 2 MiB tokio
//! worker stack, which aborts the whole process). So documents are decoded on a scoped thread
//! with a [`DECODE_STACK`] stack, enough for [`MAX_DEPTH`] whatever the caller's stack is.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Deepest nesting accepted: the same as serde_json's recursion limit, so a YAML body is held
/// to what a JSON body is.
pub const MAX_DEPTH: usize = 128;

/// Most events alias expansion may inject across one parse (what serde-saphyr 0.0.16, the
/// former stack, allowed by default).
pub const MAX_REPLAYED_EVENTS: usize = 1_000_000;

/// Stack of the thread that decodes a document (reserved address space; pages are used only as
/// deep as the document goes).
pub const DECODE_STACK: usize = 16 * 1024 * 1024;

/// A document that could not be decoded or encoded.
#[derive(Debug, thiserror::Error)]
pub enum YamlError {
    /// Malformed YAML, a value of the wrong shape, or a budget limit hit.
    #[error("{0}")]
    Decode(Box<serde_saphyr::Error>),
    /// The decoding thread could not be started, or it panicked.
    #[error("the YAML decoder failed: {0}")]
    Thread(String),
    /// The value cannot be written as YAML.
    #[error("{0}")]
    Encode(#[from] serde_saphyr::SerializeError),
}

impl From<serde_saphyr::Error> for YamlError {
    fn from(e: serde_saphyr::Error) -> Self {
        Self::Decode(Box::new(e))
    }
}

/// The decoding options: serde-saphyr's budget with our depth and alias-replay caps, and no
/// source snippets in error messages (they would echo the body back at length).
pub fn options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_depth = MAX_DEPTH;
    let mut opts = serde_saphyr::Options::default();
    opts.budget = Some(budget);
    opts.alias_limits.max_total_replayed_events = MAX_REPLAYED_EVENTS;
    opts.with_snippet = false;
    opts
}

/// Runs `f` on a scoped thread with a [`DECODE_STACK`] stack.
fn on_decode_stack<R: Send>(
    f: impl FnOnce() -> Result<R, serde_saphyr::Error> + Send,
) -> Result<R, YamlError> {
    std::thread::scope(|scope| {
        let handle = std::thread::Builder::new()
            .name("yaml-decode".into())
            .stack_size(DECODE_STACK)
            .spawn_scoped(scope, f)
            .map_err(|e| YamlError::Thread(e.to_string()))?;
        match handle.join() {
            Ok(r) => Ok(r?),
            Err(_) => Err(YamlError::Thread("the decoder panicked".into())),
        }
    })
}

/// Decodes one YAML document.
pub fn from_str<T: DeserializeOwned + Send>(s: &str) -> Result<T, YamlError> {
    on_decode_stack(|| serde_saphyr::from_str_with_options(s, options()))
}

/// Decodes a stream of `---` separated documents.
pub fn from_multiple<T: DeserializeOwned + Send>(s: &str) -> Result<Vec<T>, YamlError> {
    on_decode_stack(|| serde_saphyr::from_multiple_with_options(s, options()))
}

/// Encodes `v` as one YAML document (block style, kubectl-like list indentation).
pub fn to_string<T: Serialize>(v: &T) -> Result<String, YamlError> {
    Ok(serde_saphyr::to_string(v)?)
}

#[cfg(test)]
#[path = "yaml_tests.rs"]
mod tests;
