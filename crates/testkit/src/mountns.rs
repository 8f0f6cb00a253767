//! Agents that see a different filesystem: [`hide_path_wrapper`] is a command prefix that runs
//! a program in its own mount namespace (`unshare --mount`, private propagation) with an empty
//! tmpfs mounted over a path, so a node agent started through it (see
//! [`crate::Cluster::start_agent_wrapped`]) sees an empty directory where the other nodes see a
//! shared filesystem: exactly a node on which the administrator forgot the mount. Needs root.

use std::path::Path;

/// `unshare … sh -c 'mount -t tmpfs … PATH && exec "$@"'`: the prefix, the program and its
/// arguments follow.
pub fn hide_path_wrapper(path: &Path) -> Vec<String> {
    [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        r#"mount -t tmpfs -o size=1m fv-hidden "$0" && exec "$@""#,
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([path.display().to_string()])
    .collect()
}
