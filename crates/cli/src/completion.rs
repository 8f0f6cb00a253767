//! `completion bash|zsh|fish|elvish|powershell`: shell completion scripts for a clap command.

use crate::error::CliError;

/// The shells `completion` knows.
pub const SHELLS: [&str; 5] = ["bash", "zsh", "fish", "elvish", "powershell"];

/// The completion script for `cmd` in `shell`.
pub fn script(shell: &str, cmd: &mut clap::Command) -> Result<String, CliError> {
    use clap_complete::Shell;
    let sh = match shell {
        "bash" => Shell::Bash,
        "zsh" => Shell::Zsh,
        "fish" => Shell::Fish,
        "elvish" => Shell::Elvish,
        "powershell" => Shell::PowerShell,
        other => {
            return Err(CliError::Usage(format!(
                "unsupported shell type \"{other}\" (one of {})",
                SHELLS.join(", ")
            )));
        }
    };
    let name = cmd.get_name().to_string();
    let mut out = Vec::new();
    clap_complete::generate(sh, cmd, name, &mut out);
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_for_each_shell() {
        let mut cmd = clap::Command::new("ferrovirt").subcommand(clap::Command::new("get"));
        for sh in SHELLS {
            let s = script(sh, &mut cmd).unwrap();
            assert!(s.contains("ferrovirt"), "{sh}");
        }
        assert!(script("tcsh", &mut cmd).is_err());
    }
}
