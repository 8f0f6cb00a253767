//! The user verbs' arguments (virtctl's names and flags) and their hand-over to `ferrovirt-cli`.

use std::path::PathBuf;
use std::time::Duration;

use ferrovirt_cli::target::Target;
use ferrovirt_cli::virt::Verb;

/// Where to connect: shared by every verb.
#[derive(Debug, Clone, clap::Args)]
pub struct Conn {
    /// Kubeconfig file (default: $KUBECONFIG, the local server's, ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// Namespace (default: the kubeconfig context's, else `default`).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
}

/// `pause vm NAME` / `pause vmi NAME` (virtctl's form).
#[derive(Debug, Clone, clap::Args)]
pub struct KindName {
    /// `vm` or `vmi` (both act on the VMI of that name).
    #[arg(value_parser = ["vm", "vmi"])]
    kind: String,
    name: String,
}

#[derive(Debug, clap::Subcommand)]
pub enum VerbCommand {
    /// Connect to a VMI's serial console (Ctrl+] leaves; works in a pipe).
    Console {
        name: String,
        /// In a pipe: stop after the guest printed nothing for this many seconds.
        #[arg(long, default_value_t = 3)]
        quiet_seconds: u64,
    },
    /// Start a VirtualMachine.
    Start { name: String },
    /// Stop a VirtualMachine.
    Stop {
        name: String,
        /// Seconds the guest gets to power off.
        #[arg(long)]
        grace_period: Option<i64>,
    },
    /// Restart a VirtualMachine (its VMI is replaced).
    Restart { name: String },
    /// Pause a VM's or VMI's guest.
    Pause(KindName),
    /// Unpause a VM's or VMI's guest.
    Unpause(KindName),
    /// Reboot the guest through its guest agent.
    SoftReboot { name: String },
    /// Print the guest OS information from the guest agent.
    Guestosinfo { name: String },
    /// Print the users logged in to the guest.
    Userlist { name: String },
    /// Print the guest's filesystems.
    Fslist { name: String },
}

/// Runs a verb; returns the process exit code (kubectl's: 0 ok, 1 error).
pub async fn run(conn: &Conn, cmd: VerbCommand) -> i32 {
    match run_inner(conn, cmd).await {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

async fn run_inner(conn: &Conn, cmd: VerbCommand) -> Result<(), ferrovirt_cli::CliError> {
    let target = Target::load(conn.kubeconfig.as_deref(), conn.namespace.as_deref())?;
    let (verb, name, grace) = match cmd {
        VerbCommand::Console {
            name,
            quiet_seconds,
        } => {
            return ferrovirt_cli::console::run(&target, &name, Duration::from_secs(quiet_seconds))
                .await;
        }
        VerbCommand::Start { name } => (Verb::Start, name, None),
        VerbCommand::Stop { name, grace_period } => (Verb::Stop, name, grace_period),
        VerbCommand::Restart { name } => (Verb::Restart, name, None),
        VerbCommand::Pause(k) => (Verb::Pause, k.name, None),
        VerbCommand::Unpause(k) => (Verb::Unpause, k.name, None),
        VerbCommand::SoftReboot { name } => (Verb::SoftReboot, name, None),
        VerbCommand::Guestosinfo { name } => (Verb::GuestOsInfo, name, None),
        VerbCommand::Userlist { name } => (Verb::UserList, name, None),
        VerbCommand::Fslist { name } => (Verb::FsList, name, None),
    };
    let out = ferrovirt_cli::virt::call(&target, verb, &name, grace).await?;
    println!("{out}");
    Ok(())
}
