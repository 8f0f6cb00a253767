//! `ssh [USER@]TYPE/NAME[.NAMESPACE]` (virtctl's form, local-ssh mode): runs the machine's
//! `ssh` client with a ProxyCommand that is this program's own `port-forward --stdio`, so the
//! guest's SSH server is reached through the API server without any route to the guest.

use std::path::{Path, PathBuf};

use crate::error::CliError;
use crate::portforward::ForwardTarget;

/// What the user asked for.
#[derive(Debug, Clone, Default)]
pub struct SshOptions {
    /// `[USER@]vm/NAME[.NAMESPACE]`.
    pub destination: String,
    /// `-l`: the user when the destination has none.
    pub username: Option<String>,
    /// `-i`.
    pub identity_file: Option<PathBuf>,
    /// The guest's SSH port.
    pub port: u16,
    /// `-c`: run this instead of a login shell.
    pub command: Option<String>,
    /// `-t`: extra options for the local ssh client (`-o StrictHostKeyChecking=no`).
    pub local_ssh_opts: Vec<String>,
    /// `--known-hosts`: the known-hosts file for the guests' host keys.
    pub known_hosts: Option<PathBuf>,
}

/// Splits `[USER@]TARGET` into the user and the forward target.
pub fn parse_destination(s: &str) -> Result<(Option<String>, ForwardTarget), CliError> {
    match s.split_once('@') {
        Some(("", _)) => Err(CliError::Usage(format!(
            "invalid destination {s:?}: empty user"
        ))),
        Some((user, rest)) => Ok((Some(user.to_string()), ForwardTarget::parse(rest)?)),
        None => Ok((None, ForwardTarget::parse(s)?)),
    }
}

/// Quotes one word for the shell ssh runs its ProxyCommand with.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:@%+,".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The arguments of the `ssh` client (without `ssh` itself). `exe` is this program,
/// `kubeconfig` the file the parent was told to use, `namespace` the session's namespace.
pub fn ssh_args(
    o: &SshOptions,
    exe: &Path,
    kubeconfig: Option<&Path>,
    namespace: &str,
) -> Result<Vec<String>, CliError> {
    let (user, target) = parse_destination(&o.destination)?;
    let ns = target.namespace_or(namespace).to_string();
    let kind = if target.plural == "virtualmachines" {
        "vm"
    } else {
        "vmi"
    };
    let mut proxy = vec![shell_quote(&exe.display().to_string())];
    if let Some(k) = kubeconfig {
        proxy.push("--kubeconfig".into());
        proxy.push(shell_quote(&k.display().to_string()));
    }
    proxy.push("port-forward".into());
    proxy.push("--stdio".into());
    proxy.push(shell_quote(&format!("{kind}/{}.{ns}", target.name)));
    proxy.push(o.port.to_string());
    let mut args = vec![
        "-o".to_string(),
        format!("ProxyCommand={}", proxy.join(" ")),
    ];
    if let Some(k) = &o.known_hosts {
        args.push("-o".into());
        args.push(format!("UserKnownHostsFile={}", k.display()));
    }
    if let Some(i) = &o.identity_file {
        args.push("-i".into());
        args.push(i.display().to_string());
    }
    if let Some(u) = user.or_else(|| o.username.clone()) {
        args.push("-l".into());
        args.push(u);
    }
    for opt in &o.local_ssh_opts {
        args.extend(opt.split_whitespace().map(String::from));
    }
    // The host name only names the guest in known_hosts: the ProxyCommand does the connecting.
    args.push(format!("{kind}.{}.{ns}", target.name));
    if let Some(c) = &o.command {
        args.push("--".into());
        args.push(c.clone());
    }
    Ok(args)
}

/// Runs the local `ssh` client; its exit code.
pub fn run(args: &[String]) -> Result<i32, CliError> {
    let status = std::process::Command::new("ssh")
        .args(args)
        .status()
        .map_err(|e| CliError::io("running ssh (is openssh-client installed?)", e))?;
    Ok(status.code().unwrap_or(255))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(dest: &str) -> SshOptions {
        SshOptions {
            destination: dest.into(),
            port: 22,
            ..Default::default()
        }
    }

    #[test]
    fn destinations() {
        let (u, t) = parse_destination("root@vm/web.prod").unwrap();
        assert_eq!(u.as_deref(), Some("root"));
        assert_eq!(
            (t.name.as_str(), t.namespace.as_deref()),
            ("web", Some("prod"))
        );
        let (u, _) = parse_destination("vmi/web").unwrap();
        assert_eq!(u, None);
        assert!(parse_destination("@vm/web").is_err());
        assert!(parse_destination("root@web").is_err());
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("/usr/bin/ferrovirt"), "/usr/bin/ferrovirt");
        assert_eq!(shell_quote("/a b/it's"), r"'/a b/it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn ssh_command_line() {
        let mut o = opts("root@vm/web");
        o.identity_file = Some("/k/id".into());
        o.local_ssh_opts = vec!["-o StrictHostKeyChecking=no".into()];
        o.command = Some("hostname".into());
        let a = ssh_args(
            &o,
            Path::new("/bin/ferrovirt"),
            Some(Path::new("/c/kube config")),
            "default",
        )
        .unwrap();
        assert_eq!(
            a,
            vec![
                "-o",
                "ProxyCommand=/bin/ferrovirt --kubeconfig '/c/kube config' port-forward --stdio vm/web.default 22",
                "-i",
                "/k/id",
                "-l",
                "root",
                "-o",
                "StrictHostKeyChecking=no",
                "vm.web.default",
                "--",
                "hostname",
            ]
        );
        let mut o = opts("vmi/db.prod");
        o.username = Some("admin".into());
        o.port = 2222;
        o.known_hosts = Some("/kh".into());
        let a = ssh_args(&o, Path::new("/f"), None, "default").unwrap();
        assert_eq!(
            a,
            vec![
                "-o",
                "ProxyCommand=/f port-forward --stdio vmi/db.prod 2222",
                "-o",
                "UserKnownHostsFile=/kh",
                "-l",
                "admin",
                "vmi.db.prod",
            ]
        );
    }
}
