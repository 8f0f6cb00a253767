//! `delete TYPE NAME… [--wait]` and `wait --for=condition=X[=STATUS]|jsonpath='{…}'[=VALUE]| delete
//! TYPE/NAME --timeout=D` (jsonpath in ferrovirt-api's kubectl dialect), with a progress line:
//! rewritten in place on a terminal, plain lines (printed only when they change) otherwise. Waiting
//! is a watch of the one object (kube-runtime's `await_condition`, a `metadata.name` field-selected
//! watcher), never a poll: the progress line follows the watch events.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use kube::api::{DeleteParams, DynamicObject};
use serde_json::Value;

use crate::error::CliError;
use crate::resources::{ResourceInfo, split_type_name};
use crate::session::Session;

/// What `wait --for` waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitFor {
    /// `condition=Type[=Status]` (status defaults to True; compared case-insensitively).
    Condition {
        type_: String,
        status: String,
    },
    Delete,
    /// `jsonpath={EXPR}[=VALUE]`: a value the expression selects (rendered as `-o jsonpath`
    /// does) equals VALUE; without VALUE, the expression selects a non-null value.
    JsonPath {
        expr: String,
        value: Option<String>,
    },
}

/// The text of a selected value, as `-o jsonpath` prints it.
fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl WaitFor {
    pub fn parse(s: &str) -> Result<WaitFor, CliError> {
        if s == "delete" {
            return Ok(WaitFor::Delete);
        }
        if let Some(j) = s.strip_prefix("jsonpath=") {
            let (expr, value) = match j.rfind("}=") {
                Some(i) => (&j[..=i], Some(j[i + 2..].to_string())),
                None => (j, None),
            };
            if !(expr.starts_with('{') && expr.ends_with('}')) {
                return Err(CliError::Usage(format!(
                    "unrecognized jsonpath wait: \"{s}\" (use jsonpath='{{.path}}'[=VALUE])"
                )));
            }
            ferrovirt_api::jsonpath::JsonPath::parse(expr)
                .map_err(|e| CliError::Usage(e.to_string()))?;
            return Ok(WaitFor::JsonPath {
                expr: expr.into(),
                value,
            });
        }
        let Some(c) = s.strip_prefix("condition=") else {
            return Err(CliError::Usage(format!(
                "unrecognized condition: \"{s}\" (use condition=NAME[=VALUE], jsonpath='{{.path}}'[=VALUE] or delete)"
            )));
        };
        let (type_, status) = c.split_once('=').unwrap_or((c, "True"));
        if type_.is_empty() {
            return Err(CliError::Usage(
                "--for=condition= needs a condition name".into(),
            ));
        }
        Ok(WaitFor::Condition {
            type_: type_.into(),
            status: status.into(),
        })
    }

    /// Whether `obj` (None: gone) satisfies the wait.
    pub fn met(&self, obj: Option<&Value>) -> bool {
        match (self, obj) {
            (WaitFor::Delete, o) => o.is_none(),
            (WaitFor::Condition { .. } | WaitFor::JsonPath { .. }, None) => false,
            (WaitFor::JsonPath { expr, value }, Some(o)) => {
                let Ok(path) = ferrovirt_api::jsonpath::JsonPath::parse(expr) else {
                    return false;
                };
                let found = path.eval(o);
                match value {
                    Some(want) => found.iter().any(|v| value_text(v) == *want),
                    None => found.iter().any(|v| !v.is_null()),
                }
            }
            (WaitFor::Condition { type_, status }, Some(o)) => o["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| {
                    c["type"]
                        .as_str()
                        .is_some_and(|t| t.eq_ignore_ascii_case(type_))
                        && c["status"]
                            .as_str()
                            .is_some_and(|s| s.eq_ignore_ascii_case(status))
                }),
        }
    }
}

/// Parses kubectl durations: `30s`, `2m`, `1h`, `1m30s`, `500ms`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, CliError> {
    if let Ok(n) = s.parse::<u64>() {
        return Ok(Duration::from_secs(n));
    }
    let bad = || CliError::Usage(format!("invalid duration \"{s}\""));
    let mut total = Duration::ZERO;
    let mut num = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() || c == '.' {
            num.push(c);
            continue;
        }
        let n: f64 = num.parse().map_err(|_| bad())?;
        num.clear();
        let unit = match c {
            'm' if chars.peek() == Some(&'s') => {
                chars.next();
                0.001
            }
            'h' => 3600.0,
            'm' => 60.0,
            's' => 1.0,
            _ => return Err(bad()),
        };
        total += Duration::from_secs_f64(n * unit);
    }
    if !num.is_empty() {
        return Err(bad());
    }
    Ok(total)
}

/// A progress line on stderr.
#[derive(Debug)]
pub struct Progress {
    tty: bool,
    last: String,
}

impl Progress {
    /// A live line when stdout and stderr are terminals, plain lines otherwise.
    pub fn new() -> Progress {
        Progress {
            tty: std::io::stdout().is_terminal() && std::io::stderr().is_terminal(),
            last: String::new(),
        }
    }

    /// The text to write for `msg` (pure; `tty` chooses the style).
    pub fn render(tty: bool, last: &str, msg: &str) -> Option<String> {
        if tty {
            Some(format!("\r\x1b[2K{msg}"))
        } else if msg != last {
            Some(format!("{msg}\n"))
        } else {
            None
        }
    }

    pub fn update(&mut self, msg: &str) {
        if let Some(t) = Progress::render(self.tty, &self.last, msg) {
            let mut e = std::io::stderr();
            let _ = e.write_all(t.as_bytes());
            let _ = e.flush();
        }
        self.last = msg.to_string();
    }

    /// Whether the line is redrawn in place.
    pub fn is_tty(&self) -> bool {
        self.tty
    }

    /// Clears a live line.
    pub fn finish(&mut self) {
        if self.tty && !self.last.is_empty() {
            eprint!("\r\x1b[2K");
        }
    }
}

impl Default for Progress {
    fn default() -> Self {
        Progress::new()
    }
}

fn condition_summary(obj: Option<&Value>, want: &WaitFor) -> String {
    match (want, obj) {
        (WaitFor::Delete, _) => "still exists".into(),
        (_, None) => "not found yet".into(),
        (WaitFor::JsonPath { expr, .. }, Some(o)) => {
            let cur = ferrovirt_api::jsonpath::JsonPath::parse(expr)
                .map(|p| {
                    p.eval(o)
                        .into_iter()
                        .map(value_text)
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default();
            format!("{expr}={cur}")
        }
        (WaitFor::Condition { type_, .. }, Some(o)) => {
            let cur = o["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| {
                    c["type"]
                        .as_str()
                        .is_some_and(|t| t.eq_ignore_ascii_case(type_))
                })
                .and_then(|c| c["status"].as_str())
                .unwrap_or("absent");
            format!("{type_}={cur}")
        }
    }
}

/// What an object reports of its own progress (a DataVolume's `status.phase` and
/// `status.progress: "45.20%"`): a bar on a terminal, the phase and the percentage in steps of
/// 10 otherwise (so piped output gets a line per step, not per poll). Pure.
pub fn object_progress(obj: Option<&Value>, tty: bool) -> Option<String> {
    let status = &obj?["status"];
    let pct: f64 = status["progress"]
        .as_str()?
        .trim()
        .trim_end_matches('%')
        .parse()
        .ok()?;
    let phase = status["phase"].as_str().unwrap_or_default();
    let text = if tty {
        format!(
            "{phase} {} {pct:.1}%",
            crate::progress::bar(pct / 100.0, 20)
        )
    } else {
        format!("{phase} {}%", (pct / 10.0).floor() as u32 * 10)
    };
    Some(text.trim_start().to_string())
}

/// Watches `name` until `want` holds (kube-runtime's `await_condition`), updating `progress`
/// on every event; gives up after `timeout`.
async fn watch_until(
    s: &Session,
    r: &ResourceInfo,
    name: &str,
    want: &WaitFor,
    timeout: Option<Duration>,
    progress: &mut Progress,
) -> Result<(), CliError> {
    let tty = progress.is_tty();
    let kind = r.kind_group();
    let shown = std::sync::Mutex::new(&mut *progress);
    let cond = |obj: Option<&DynamicObject>| -> bool {
        let v = obj.and_then(|o| serde_json::to_value(o).ok());
        if want.met(v.as_ref()) {
            return true;
        }
        let mut line = format!(
            "waiting for {kind}/{name}: {}",
            condition_summary(v.as_ref(), want)
        );
        if let Some(p) = object_progress(v.as_ref(), tty) {
            line.push_str(", ");
            line.push_str(&p);
        }
        if let Ok(mut p) = shown.lock() {
            p.update(&line);
        }
        false
    };
    let watched = kube::runtime::wait::await_condition(s.api(r, None), name, cond);
    let result = match timeout {
        Some(t) => tokio::time::timeout(t, watched).await.map_err(|_| {
            CliError::Usage(format!(
                "timed out waiting for the condition on {}/{name}",
                r.plural
            ))
        }),
        None => Ok(watched.await),
    };
    progress.finish();
    match result? {
        Ok(_) => Ok(()),
        Err(kube::runtime::wait::Error::ProbeFailed(e)) => Err(watch_error(e)),
    }
}

/// The error of a failed watch, as the request's own error where there is one.
fn watch_error(e: kube::runtime::watcher::Error) -> CliError {
    use kube::runtime::watcher::Error as W;
    match e {
        W::InitialListFailed(k) | W::WatchStartFailed(k) | W::WatchFailed(k) => k.into(),
        other => CliError::Transport(other.to_string()),
    }
}

/// `wait --for=… TYPE/NAME` (or `TYPE NAME`); returns `kind.group/name condition met`.
pub async fn wait(
    s: &Session,
    first: &str,
    second: Option<&str>,
    want: &WaitFor,
    timeout: Duration,
) -> Result<String, CliError> {
    let (t, name) = split_type_name(first, second);
    let name = name.ok_or_else(|| CliError::Usage("wait needs TYPE/NAME".into()))?;
    let r = s.resolve(&t)?;
    watch_until(s, &r, &name, want, Some(timeout), &mut Progress::new()).await?;
    Ok(format!("{}/{name} condition met", r.kind_group()))
}

/// `delete TYPE NAME…` (or `TYPE/NAME`): prints `kind.group "name" deleted` for each, then
/// (with `wait`) waits until they are gone.
pub async fn delete(
    s: &Session,
    args: &[String],
    wait: bool,
    timeout: Option<Duration>,
) -> Result<(), CliError> {
    let mut targets: Vec<(ResourceInfo, String)> = Vec::new();
    match args {
        [] => return Err(CliError::Usage("delete needs TYPE NAME".into())),
        [one] if one.contains('/') => {
            let (t, n) = split_type_name(one, None);
            targets.push((s.resolve(&t)?, n.unwrap_or_default()));
        }
        [t, names @ ..] if !names.is_empty() && !t.contains('/') => {
            let r = s.resolve(t)?;
            targets.extend(names.iter().map(|n| (r.clone(), n.clone())));
        }
        many => {
            for a in many {
                let (t, n) = split_type_name(a, None);
                let n = n.ok_or_else(|| {
                    CliError::Usage(format!("there is no need to specify a resource type as a separate argument when passing arguments in resource/name form: {a}"))
                })?;
                targets.push((s.resolve(&t)?, n));
            }
        }
    }
    for (r, n) in &targets {
        s.api(r, None).delete(n, &DeleteParams::default()).await?;
        println!("{} \"{n}\" deleted", r.kind_group());
    }
    if wait {
        let mut progress = Progress::new();
        for (r, n) in &targets {
            watch_until(s, r, n, &WaitFor::Delete, timeout, &mut progress).await?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn wait_for_forms() {
        assert_eq!(WaitFor::parse("delete").unwrap(), WaitFor::Delete);
        let c = WaitFor::parse("condition=Ready").unwrap();
        assert_eq!(
            c,
            WaitFor::Condition {
                type_: "Ready".into(),
                status: "True".into()
            }
        );
        assert!(WaitFor::parse("jsonpath=x").is_err());
        assert!(WaitFor::parse("jsonpath={.status[}=x").is_err());
        let phase = WaitFor::parse("jsonpath={.status.phase}=Running").unwrap();
        assert_eq!(
            phase,
            WaitFor::JsonPath {
                expr: "{.status.phase}".into(),
                value: Some("Running".into())
            }
        );
        let running = json!({"status": {"phase": "Running", "ready": true}});
        assert!(phase.met(Some(&running)));
        assert!(!phase.met(Some(&json!({"status": {"phase": "Pending"}}))));
        assert!(!phase.met(None));
        assert_eq!(
            condition_summary(Some(&json!({"status": {"phase": "Pending"}})), &phase),
            "{.status.phase}=Pending"
        );
        let ready = WaitFor::parse("jsonpath={.status.ready}=true").unwrap();
        assert!(ready.met(Some(&running)));
        let exists = WaitFor::parse("jsonpath={.status.phase}").unwrap();
        assert!(exists.met(Some(&running)));
        assert!(!exists.met(Some(&json!({"status": {}}))));
        let obj = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
        assert!(c.met(Some(&obj)));
        assert!(!c.met(None));
        assert!(
            WaitFor::parse("condition=ready=false")
                .unwrap()
                .met(Some(&json!({
            "status": {"conditions": [{"type": "Ready", "status": "False"}]}})))
        );
        assert!(WaitFor::Delete.met(None));
        assert_eq!(condition_summary(Some(&obj), &c), "Ready=True");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("5m3").is_err());
    }

    #[test]
    fn datavolume_progress_in_waits() {
        let dv = serde_json::json!({"status": {"phase": "ImportInProgress", "progress": "45.20%"}});
        assert_eq!(
            object_progress(Some(&dv), true).unwrap(),
            format!("ImportInProgress {} 45.2%", crate::progress::bar(0.452, 20))
        );
        assert_eq!(
            object_progress(Some(&dv), false).unwrap(),
            "ImportInProgress 40%"
        );
        let na = serde_json::json!({"status": {"phase": "Pending", "progress": "N/A"}});
        assert_eq!(object_progress(Some(&na), false), None);
        assert_eq!(object_progress(None, true), None);
    }

    #[test]
    fn progress_degrades_to_lines() {
        assert_eq!(Progress::render(false, "", "a").as_deref(), Some("a\n"));
        assert_eq!(Progress::render(false, "a", "a"), None);
        assert_eq!(
            Progress::render(true, "a", "a").as_deref(),
            Some("\r\x1b[2Ka")
        );
    }
}
