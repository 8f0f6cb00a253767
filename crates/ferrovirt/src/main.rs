//! The `ferrovirt` binary: argument parsing and wiring only. Each subcommand hands over to the
//! crate that owns it.

mod demo;

use clap::{Parser, Subcommand};

/// ferrovirt: virtual machines as declarative, KubeVirt-compatible API objects.
#[derive(Debug, Parser)]
#[command(name = "ferrovirt", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Boot the test guest as a demo VM (interim: straight through QEMU, without the server).
    Demo {
        #[command(subcommand)]
        cmd: demo::DemoCommand,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Demo { cmd } => demo::run(cmd),
    }
}
