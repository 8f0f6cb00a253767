//! The node's network mode (pure): the pod network or QEMU user networking, and the decision
//! `auto` makes from what the node offers. The agent logs the decision and reports the mode
//! on its Node as the label [`NODE_LABEL`].

use std::fmt;

use crate::error::{Error, Result};

/// Label on the Node with the mode its agent runs (`pod` or `user`).
pub const NODE_LABEL: &str = "ferrovirt.io/network-mode";

/// What the operator asked for (`--network-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RequestedMode {
    /// The pod network when the node can build it, else QEMU user networking (with a warning).
    #[default]
    Auto,
    /// The pod network; the agent refuses to start when the node cannot build it.
    Pod,
    /// QEMU user networking, restricted (the guest reaches no host address).
    User,
}

impl std::str::FromStr for RequestedMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(RequestedMode::Auto),
            "pod" => Ok(RequestedMode::Pod),
            "user" => Ok(RequestedMode::User),
            other => Err(format!(
                "network mode {other:?} is not one of auto, pod, user"
            )),
        }
    }
}

/// The mode an agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkMode {
    Pod,
    User,
}

impl NetworkMode {
    pub fn as_str(self) -> &'static str {
        match self {
            NetworkMode::Pod => "pod",
            NetworkMode::User => "user",
        }
    }
}

impl fmt::Display for NetworkMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The mode chosen and why (for the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModeDecision {
    pub mode: NetworkMode,
    pub reason: String,
    /// Set when `auto` fell back to user networking: worth a warning.
    pub fell_back: bool,
}

/// Decides the mode from the request and the result of [`crate::apply::preflight`] (`Err`
/// carries what is missing). An explicit `pod` that the node cannot build is an error.
pub fn decide(requested: RequestedMode, preflight: &Result<()>) -> Result<ModeDecision> {
    let pod = |reason: &str| ModeDecision {
        mode: NetworkMode::Pod,
        reason: reason.to_string(),
        fell_back: false,
    };
    match (requested, preflight) {
        (RequestedMode::User, _) => Ok(ModeDecision {
            mode: NetworkMode::User,
            reason: "--network-mode user: QEMU user networking, restricted (the guest reaches no host address)".into(),
            fell_back: false,
        }),
        (RequestedMode::Pod, Ok(())) => Ok(pod("--network-mode pod")),
        (RequestedMode::Pod, Err(e)) => Err(Error::Preflight(format!(
            "--network-mode pod: {}",
            preflight_detail(e)
        ))),
        (RequestedMode::Auto, Ok(())) => Ok(pod(
            "--network-mode auto: root, ip, nft, nsenter and /dev/net/tun present",
        )),
        (RequestedMode::Auto, Err(e)) => Ok(ModeDecision {
            mode: NetworkMode::User,
            reason: format!(
                "--network-mode auto: the pod network cannot be built here ({}); falling back to QEMU user networking, restricted (the guest reaches no host address; bridge bindings and multus networks are refused)",
                preflight_detail(e)
            ),
            fell_back: true,
        }),
    }
}

fn preflight_detail(e: &Error) -> String {
    match e {
        Error::Preflight(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_pod_when_the_node_can_build_it() {
        let d = decide(RequestedMode::Auto, &Ok(())).unwrap();
        assert_eq!(d.mode, NetworkMode::Pod);
        assert!(!d.fell_back);
    }

    #[test]
    fn auto_falls_back_to_user_naming_what_is_missing() {
        let missing = Err(Error::Preflight(
            "missing `nft` (Debian package nftables)".into(),
        ));
        let d = decide(RequestedMode::Auto, &missing).unwrap();
        assert_eq!(d.mode, NetworkMode::User);
        assert!(d.fell_back);
        assert!(d.reason.contains("missing `nft`"), "{}", d.reason);
    }

    #[test]
    fn explicit_pod_without_the_tools_is_an_error() {
        let missing = Err(Error::Preflight(
            "missing root privileges (run as root)".into(),
        ));
        let e = decide(RequestedMode::Pod, &missing)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--network-mode pod: missing root privileges"),
            "{e}"
        );
        assert_eq!(
            decide(RequestedMode::Pod, &Ok(())).unwrap().mode,
            NetworkMode::Pod
        );
    }

    #[test]
    fn explicit_user_ignores_the_tools() {
        let d = decide(RequestedMode::User, &Ok(())).unwrap();
        assert_eq!((d.mode, d.fell_back), (NetworkMode::User, false));
    }

    #[test]
    fn parses_the_flag() {
        assert_eq!("auto".parse::<RequestedMode>(), Ok(RequestedMode::Auto));
        assert_eq!("pod".parse::<RequestedMode>(), Ok(RequestedMode::Pod));
        assert_eq!("user".parse::<RequestedMode>(), Ok(RequestedMode::User));
        assert!(
            "slirp"
                .parse::<RequestedMode>()
                .unwrap_err()
                .contains("auto, pod, user")
        );
    }
}
