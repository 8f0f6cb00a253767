//! What is left of a request body that the application answered without reading: it is read
//! (up to [`MAX_DRAIN_BYTES`], for at most [`DRAIN_TIMEOUT`]) before the answer goes out.
//!
//! hyper ends a connection whose request body was not read to its end when the answer is
//! written. A client that is still sending that body then fails to write it, and fails the
//! request although the server answered it: `kubectl create --raw` of a path the server
//! refuses (404 before the body is read) failed 4 times in 100 with "HTTP/1.x transport
//! connection broken: write: broken pipe". Go's server reads up to 256 KiB of an unread body
//! for the same reason; so does this. A body the application still holds when it answers
//! (a stream it goes on reading) is left alone, and so is one the client has not started to
//! send because it waits for `100 Continue`.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Frame, SizeHint};

/// Most bytes of an unread body read before an answer.
pub const MAX_DRAIN_BYTES: u64 = 256 << 10;
/// Longest wait for the rest of an unread body.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// A request body that, when dropped before its end, hands itself to its [`Leftover`].
pub struct Tracked<B: Body> {
    inner: Option<B>,
    leftover: Arc<Mutex<Option<B>>>,
}

/// Where a [`Tracked`] body dropped unread ends up.
pub struct Leftover<B>(Arc<Mutex<Option<B>>>);

/// Wraps `body`; the [`Leftover`] drains what the application did not read.
pub fn track<B: Body>(body: B) -> (Tracked<B>, Leftover<B>) {
    let slot = Arc::new(Mutex::new(None));
    (
        Tracked {
            inner: Some(body),
            leftover: slot.clone(),
        },
        Leftover(slot),
    )
}

fn take<B>(m: &Mutex<Option<B>>) -> Option<B> {
    m.lock().unwrap_or_else(|p| p.into_inner()).take()
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.inner.as_mut() {
            Some(b) => Pin::new(b).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |b| b.size_hint())
    }
}

impl<B: Body> Drop for Tracked<B> {
    fn drop(&mut self) {
        if let Some(b) = self.inner.take().filter(|b| !b.is_end_stream()) {
            *self.leftover.lock().unwrap_or_else(|p| p.into_inner()) = Some(b);
        }
    }
}

/// What [`Leftover::drain`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Drained {
    /// The body was read to its end, or was still held by the application.
    Done,
    /// More than the bound was left; the connection will be closed.
    TooLarge,
    /// The client stopped sending; the connection will be closed.
    TimedOut,
    /// Reading failed (the client went away).
    Failed,
}

impl<B: Body + Unpin> Leftover<B> {
    /// Reads the rest of a body that was dropped unread: at most `max_bytes`, for at most
    /// `timeout`.
    pub async fn drain(self, max_bytes: u64, timeout: Duration) -> Drained {
        let Some(mut body) = take(&self.0) else {
            return Drained::Done;
        };
        if body.size_hint().lower() > max_bytes {
            return Drained::TooLarge;
        }
        let read = async {
            let mut seen = 0u64;
            while !body.is_end_stream() {
                match std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
                    None => break,
                    Some(Err(_)) => return Drained::Failed,
                    Some(Ok(frame)) => {
                        if let Some(data) = frame.data_ref() {
                            seen += hyper::body::Buf::remaining(data) as u64;
                            if seen > max_bytes {
                                return Drained::TooLarge;
                            }
                        }
                    }
                }
            }
            Drained::Done
        };
        tokio::time::timeout(timeout, read)
            .await
            .unwrap_or(Drained::TimedOut)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::body::Bytes;

    /// A body of `chunks`, each ready at once.
    struct Chunks(Vec<Bytes>);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            if self.0.is_empty() {
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Ok(Frame::data(self.0.remove(0)))))
        }
        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
    }

    /// A body that never sends anything.
    struct Silent;

    impl Body for Silent {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Pending
        }
    }

    fn chunks(n: usize, size: usize) -> Chunks {
        Chunks((0..n).map(|_| Bytes::from(vec![0u8; size])).collect())
    }

    #[tokio::test]
    async fn an_unread_body_is_read_to_its_end() {
        let (body, leftover) = track(chunks(3, 10));
        drop(body);
        assert!(leftover.0.lock().unwrap().is_some(), "handed over on drop");
        assert_eq!(leftover.drain(100, DRAIN_TIMEOUT).await, Drained::Done);
    }

    #[tokio::test]
    async fn a_body_read_to_its_end_or_still_held_is_left_alone() {
        let (mut body, leftover) = track(chunks(1, 10));
        while std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
            .await
            .is_some()
        {}
        drop(body);
        assert!(leftover.0.lock().unwrap().is_none());
        let (_held, leftover) = track(chunks(1, 10));
        assert_eq!(leftover.drain(100, DRAIN_TIMEOUT).await, Drained::Done);
    }

    #[tokio::test]
    async fn reading_stops_at_the_bound_and_the_timeout() {
        let (body, leftover) = track(chunks(3, 40));
        drop(body);
        assert_eq!(leftover.drain(100, DRAIN_TIMEOUT).await, Drained::TooLarge);
        let (body, leftover) = track(Silent);
        drop(body);
        let t = std::time::Instant::now();
        let d = leftover.drain(100, Duration::from_millis(50)).await;
        assert_eq!(d, Drained::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}
