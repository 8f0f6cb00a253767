//! A command run in the guest through QEMU's guest agent (`guest-exec`, then
//! `guest-exec-status` polled until it exited): a backup's `preFreezeCommand` and
//! `postThawCommand` (docs/backup.md "Consistency"). The output comes back as the guest agent
//! gives it (base64, `outData`/`errData`, QEMU's own cap on its size), the exit code as
//! `exitcode`. The command runs while the launcher's request loop waits, so its timeout is
//! bounded by [`MAX_TIMEOUT`]; a command still running at its timeout is left running in the
//! guest (the guest agent cannot stop it) and reported as a timeout.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::lifecycle::Vm;

/// The longest a command may run.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(120);

/// How often the command's status is asked.
const POLL_EVERY: Duration = Duration::from_millis(200);

/// What a command did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecDone {
    /// The exit code (or the terminating signal's number as a negative value).
    pub exit_code: i64,
    /// Standard output and error, base64, as the guest agent returned them.
    pub out_data: String,
    pub err_data: String,
}

/// `guest-exec`'s arguments for `command` (pure): the first element is the path.
pub fn exec_arguments(command: &[String]) -> Result<Value> {
    let (path, args) = command
        .split_first()
        .ok_or_else(|| Error::InvalidSpec("an empty command".into()))?;
    Ok(json!({"path": path, "arg": args, "capture-output": true}))
}

/// The result from a `guest-exec-status` answer once the process exited (pure).
pub fn finished(status: &Value) -> Option<ExecDone> {
    if status["exited"] != true {
        return None;
    }
    let exit_code = status["exitcode"]
        .as_i64()
        .or_else(|| status["signal"].as_i64().map(|s| -s))
        .unwrap_or(-1);
    let text = |k: &str| status[k].as_str().unwrap_or_default().to_string();
    Some(ExecDone {
        exit_code,
        out_data: text("out-data"),
        err_data: text("err-data"),
    })
}

/// Runs `command` in the guest, waiting at most `timeout` (capped at [`MAX_TIMEOUT`]).
pub async fn run(vm: &Vm, command: &[String], timeout: Duration) -> Result<ExecDone> {
    let timeout = timeout.min(MAX_TIMEOUT);
    let args = exec_arguments(command)?;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut qga = vm.guest_agent().await?;
    let started = qga.execute("guest-exec", Some(args)).await?;
    let pid = started["pid"]
        .as_i64()
        .ok_or_else(|| Error::Protocol(format!("guest-exec answered without a pid: {started}")))?;
    loop {
        let st = qga
            .execute("guest-exec-status", Some(json!({"pid": pid})))
            .await?;
        if let Some(done) = finished(&st) {
            return Ok(done);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::timeout(
                format!("{:?} in the guest", command.join(" ")),
                timeout,
            ));
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_and_results() {
        let cmd: Vec<String> = ["/bin/sh", "-c", "sync"].map(String::from).to_vec();
        assert_eq!(
            exec_arguments(&cmd).unwrap(),
            json!({"path": "/bin/sh", "arg": ["-c", "sync"], "capture-output": true})
        );
        assert!(exec_arguments(&[]).is_err());
        assert_eq!(finished(&json!({"exited": false})), None);
        let d = finished(&json!({"exited": true, "exitcode": 3, "out-data": "aGk="})).unwrap();
        assert_eq!(d.exit_code, 3);
        assert_eq!(d.out_data, "aGk=");
        assert_eq!(
            finished(&json!({"exited": true, "signal": 9}))
                .unwrap()
                .exit_code,
            -9
        );
    }
}
