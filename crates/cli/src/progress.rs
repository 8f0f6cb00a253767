//! Progress display for long transfers: a bar with percentage, sizes, rate and time left,
//! redrawn in place (at most 5 times a second) when stderr is a terminal, or a plain line at
//! every 10% otherwise, so logs of scripts stay readable. The rendering is pure.

use std::io::Write;
use std::time::{Duration, Instant};

/// Width of the bar between its brackets.
pub const BAR_WIDTH: usize = 30;

/// `[=========>          ]` for `fraction` (clamped to 0..=1).
pub fn bar(fraction: f64, width: usize) -> String {
    let f = if fraction.is_finite() {
        fraction.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let filled = ((f * width as f64).floor() as usize).min(width);
    let mut s = String::with_capacity(width + 2);
    s.push('[');
    if filled == width {
        s.push_str(&"=".repeat(width));
    } else {
        s.push_str(&"=".repeat(filled));
        s.push('>');
        s.push_str(&" ".repeat(width - filled - 1));
    }
    s.push(']');
    s
}

/// `18.25 MiB`-style sizes.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// `m:ss` (or `h:mm:ss`).
pub fn clock(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

/// One progress line for `done` of `total` bytes after `elapsed`.
pub fn line(done: u64, total: u64, elapsed: Duration) -> String {
    let frac = if total == 0 {
        1.0
    } else {
        done as f64 / total as f64
    };
    let secs = elapsed.as_secs_f64();
    let mut s = format!(
        "{} {:6.2}% {} / {}",
        bar(frac, BAR_WIDTH),
        frac * 100.0,
        human(done),
        human(total)
    );
    if secs >= 0.1 && done > 0 {
        let rate = done as f64 / secs;
        s.push_str(&format!("  {}/s", human(rate as u64)));
        if done < total {
            let left = Duration::from_secs_f64((total - done) as f64 / rate);
            s.push_str(&format!("  ETA {}", clock(left)));
        } else {
            s.push_str(&format!("  in {}", clock(elapsed)));
        }
    }
    s
}

/// A byte-count progress display on stderr.
#[derive(Debug)]
pub struct ByteProgress {
    tty: bool,
    total: u64,
    start: Instant,
    last_draw: Option<Instant>,
    next_line: u64,
}

impl ByteProgress {
    /// A bar on a terminal, plain lines otherwise.
    pub fn new(total: u64) -> ByteProgress {
        use std::io::IsTerminal;
        ByteProgress::with_style(total, std::io::stderr().is_terminal())
    }

    pub fn with_style(total: u64, tty: bool) -> ByteProgress {
        ByteProgress {
            tty,
            total,
            start: Instant::now(),
            last_draw: None,
            next_line: 0,
        }
    }

    /// What to write for `done` bytes now, if anything (pure apart from the clock).
    pub fn render(&mut self, done: u64) -> Option<String> {
        let now = Instant::now();
        let finished = done >= self.total;
        if self.tty {
            let due = self
                .last_draw
                .is_none_or(|t| now.duration_since(t) >= Duration::from_millis(200));
            if !(due || finished) {
                return None;
            }
            self.last_draw = Some(now);
            Some(format!(
                "\r\x1b[2K{}",
                line(done, self.total, now - self.start)
            ))
        } else if done >= self.next_line || finished {
            self.next_line = done + (self.total / 10).max(1);
            Some(format!("{}\n", line(done, self.total, now - self.start)))
        } else {
            None
        }
    }

    pub fn update(&mut self, done: u64) {
        if let Some(t) = self.render(done) {
            let mut e = std::io::stderr();
            let _ = e.write_all(t.as_bytes());
            let _ = e.flush();
        }
    }

    /// Ends the live line (a newline on a terminal).
    pub fn finish(&mut self) {
        if self.tty && self.last_draw.is_some() {
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars() {
        assert_eq!(bar(0.0, 10), "[>         ]");
        assert_eq!(bar(0.5, 10), "[=====>    ]");
        assert_eq!(bar(1.0, 10), "[==========]");
        assert_eq!(bar(7.0, 4), "[====]");
        assert_eq!(bar(f64::NAN, 4), "[>   ]");
    }

    #[test]
    fn sizes_and_clocks() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(19 << 20), "19.00 MiB");
        assert_eq!(clock(Duration::from_secs(65)), "1:05");
        assert_eq!(clock(Duration::from_secs(3725)), "1:02:05");
    }

    #[test]
    fn lines() {
        let l = line(1 << 20, 2 << 20, Duration::from_secs(2));
        assert_eq!(
            l,
            format!(
                "{}  50.00% 1.00 MiB / 2.00 MiB  512.00 KiB/s  ETA 0:02",
                bar(0.5, BAR_WIDTH)
            )
        );
        assert!(line(4, 4, Duration::from_secs(1)).ends_with("in 0:01"));
        assert!(line(0, 0, Duration::ZERO).contains("100.00%"));
    }

    #[test]
    fn plain_lines_every_tenth() {
        let mut p = ByteProgress::with_style(100, false);
        let printed: Vec<u64> = (0..=100).filter(|d| p.render(*d).is_some()).collect();
        assert_eq!(printed, vec![0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]);
        let mut t = ByteProgress::with_style(100, true);
        assert!(t.render(1).unwrap().starts_with("\r\x1b[2K["));
        // Redraws are rate-limited, but the last one always shows.
        assert!(t.render(2).is_none());
        assert!(t.render(100).is_some());
    }
}
