//! The user verbs' arguments (kubectl's and virtctl's names and flags) and their hand-over to
//! `ferrovirt-cli`.

use std::path::PathBuf;
use std::time::Duration;

use ferrovirt_cli::CliError;
use ferrovirt_cli::get::{GetRequest, Output};
use ferrovirt_cli::session::Session;
use ferrovirt_cli::target::Target;
use ferrovirt_cli::virt::Verb;
use ferrovirt_cli::wait::{WaitFor, parse_duration};

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

/// `get`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct GetArgs {
    /// Resource type (`vm`, `vmis`, `virtualmachines.kubevirt.io`, …) or TYPE/NAME.
    #[arg(value_name = "TYPE")]
    type_: String,
    name: Option<String>,
    /// Output format: wide, yaml, json, name, jsonpath=TEMPLATE.
    #[arg(short, long)]
    output: Option<String>,
    /// Label selector (`app=a,tier!=b`).
    #[arg(short = 'l', long)]
    selector: Option<String>,
    /// List across all namespaces.
    #[arg(short = 'A', long)]
    all_namespaces: bool,
    /// After listing, print a row for every change.
    #[arg(short, long)]
    watch: bool,
}

/// What `create` makes without `-f`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CreateWhat {
    /// Print a VirtualMachine manifest built from flags (virtctl's `create vm`).
    Vm(CreateVmArgs),
}

/// `create vm`'s flags.
#[derive(Debug, Clone, clap::Args)]
pub struct CreateVmArgs {
    /// VM name (default: vm-XXXXX).
    #[arg(long)]
    name: Option<String>,
    /// Instancetype: NAME (cluster-wide) or KIND/NAME.
    #[arg(long)]
    instancetype: Option<String>,
    /// Preference: NAME (cluster-wide) or KIND/NAME.
    #[arg(long)]
    preference: Option<String>,
    /// A containerdisk volume: src:IMAGE[,name:NAME] (repeatable).
    #[arg(long = "volume-containerdisk")]
    volume_containerdisk: Vec<String>,
    /// A DataVolume from a DataSource: src:[NAMESPACE/]NAME[,name:NAME][,size:SIZE] (repeatable).
    #[arg(long = "volume-datasource")]
    volume_datasource: Vec<String>,
    /// Base64-encoded cloud-init user data (NoCloud).
    #[arg(long)]
    cloud_init_user_data: Option<String>,
    /// Run strategy (default Always).
    #[arg(long)]
    run_strategy: Option<String>,
}

/// `vnc screenshot`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum VncCmd {
    /// Save the VMI's display as a PNG.
    Screenshot {
        name: String,
        /// Output file.
        #[arg(short = 'f', long = "file", default_value = "screenshot.png")]
        file: PathBuf,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum VerbCommand {
    /// Create or update resources from YAML/JSON files, a directory or `-` (stdin).
    Apply {
        #[arg(short = 'f', long = "filename")]
        filename: PathBuf,
    },
    /// Create resources from files (`-f`), or print a VM manifest (`create vm`).
    #[command(args_conflicts_with_subcommands = true)]
    Create {
        #[arg(short = 'f', long = "filename")]
        filename: Option<PathBuf>,
        #[command(subcommand)]
        what: Option<CreateWhat>,
    },
    /// Display resources (server-side columns, or -o yaml|json|name|jsonpath=…).
    Get(GetArgs),
    /// Show an object's fields and its events.
    Describe {
        #[arg(value_name = "TYPE")]
        type_: String,
        name: Option<String>,
    },
    /// Delete resources: TYPE NAME… or TYPE/NAME….
    Delete {
        #[arg(required = true)]
        args: Vec<String>,
        /// Wait until the objects are gone.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set,
              num_args = 0..=1, default_missing_value = "true")]
        wait: bool,
        /// How long to wait (`60s`, `5m`); default: forever.
        #[arg(long)]
        timeout: Option<String>,
    },
    /// Edit an object in $EDITOR and replace it with the result.
    Edit {
        #[arg(value_name = "TYPE")]
        type_: String,
        name: Option<String>,
    },
    /// Wait for a condition (`--for=condition=Ready`), a field (`--for=jsonpath={.status.phase}=Running`)
    /// or deletion (`--for=delete`), by watching the object.
    Wait {
        #[arg(required = true, num_args = 1..=2)]
        args: Vec<String>,
        #[arg(long = "for")]
        for_: String,
        #[arg(long, default_value = "30s")]
        timeout: String,
    },
    /// List the server's resource types with their short names.
    ApiResources,
    /// Connect to a VMI's VNC display through a local port, or take a screenshot.
    #[command(args_conflicts_with_subcommands = true)]
    Vnc {
        #[command(subcommand)]
        cmd: Option<VncCmd>,
        name: Option<String>,
        /// Only listen locally and print the port (`{"port":N}`); start no viewer.
        #[arg(long)]
        proxy_only: bool,
        /// Local port (0: any free port).
        #[arg(long, default_value_t = 0)]
        port: u16,
    },
    /// Print a VM with its instancetype and preference inlined.
    Expand {
        /// The VM's name.
        #[arg(long)]
        vm: Option<String>,
        /// A VM manifest instead of a VM on the server.
        #[arg(short = 'f', long = "file")]
        file: Option<PathBuf>,
        /// yaml or json.
        #[arg(short, long, default_value = "yaml")]
        output: String,
    },
    /// Print a shell completion script.
    Completion {
        #[arg(value_parser = ferrovirt_cli::completion::SHELLS)]
        shell: String,
    },
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
    /// Live-migrate a VM's VMI to another node (creates a VirtualMachineInstanceMigration).
    Migrate { name: String },
    /// Cancel a VM's unfinished live migration (the VM runs on where it was).
    MigrateCancel { name: String },
    /// Create a Service in front of a VM or VMI (virtctl's expose): selector from the VM's
    /// template labels (a VMI's labels), else `vm.kubevirt.io/name`.
    Expose {
        #[command(flatten)]
        what: KindName,
        /// The Service port.
        #[arg(long)]
        port: u16,
        /// The guest port, a number or a name of the VMI interface's `ports` (default: --port).
        #[arg(long)]
        target_port: Option<String>,
        /// ClusterIP (default) or NodePort.
        #[arg(long = "type")]
        type_: Option<String>,
        /// The Service name (default: the VM's).
        #[arg(long = "name")]
        service_name: Option<String>,
    },
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
    /// Upload a disk image into a DataVolume (created with an `upload` source when absent).
    ImageUpload(ImageUploadArgs),
    /// Export a PVC, VM or VM snapshot and download its volumes or manifests.
    Vmexport {
        #[command(subcommand)]
        cmd: VmexportCommand,
    },
    /// Back up VMs to a BackupTarget, list, describe, verify and restore backups.
    Backup {
        #[command(subcommand)]
        cmd: ferrovirt_cli::backup::BackupCommand,
    },
    /// Forward local ports to a VM's guest ports through the API server.
    PortForward(PortForwardArgs),
    /// SSH into a VM's guest through the API server (runs the local ssh client).
    Ssh(SshArgs),
}

/// `port-forward TYPE/NAME[.NAMESPACE] [LOCAL:]REMOTE…` (virtctl's form).
#[derive(Debug, Clone, clap::Args)]
pub struct PortForwardArgs {
    /// `vm/NAME[.NAMESPACE]` or `vmi/NAME[.NAMESPACE]`.
    target: String,
    /// `PORT`, `LOCAL:REMOTE` or `:REMOTE` (any free local port).
    ports: Vec<String>,
    /// Local address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    address: std::net::IpAddr,
    /// Carry one connection over stdin/stdout instead of listening (for ssh's ProxyCommand).
    #[arg(long)]
    stdio: bool,
}

/// `ssh [USER@]TYPE/NAME[.NAMESPACE]` (virtctl's flags, local ssh client).
#[derive(Debug, Clone, clap::Args)]
pub struct SshArgs {
    /// `[USER@]vm/NAME[.NAMESPACE]` or `vmi/…`.
    destination: String,
    /// User to log in as (when the destination has none).
    #[arg(short = 'l', long)]
    username: Option<String>,
    /// Private key file.
    #[arg(short = 'i', long)]
    identity_file: Option<PathBuf>,
    /// The guest's SSH port.
    #[arg(short = 'p', long, default_value_t = 22)]
    port: u16,
    /// Run this command instead of a login shell.
    #[arg(short = 'c', long)]
    command: Option<String>,
    /// Extra options for the local ssh client (repeatable), e.g. -t "-o StrictHostKeyChecking=no".
    #[arg(short = 't', long = "local-ssh-opts", allow_hyphen_values = true)]
    local_ssh_opts: Vec<String>,
    /// Known-hosts file for the guests' host keys.
    #[arg(long)]
    known_hosts: Option<PathBuf>,
}

/// The source flags of `vmexport` (virtctl's).
#[derive(Debug, Clone, clap::Args)]
pub struct ExportSourceArgs {
    /// Export this PersistentVolumeClaim.
    #[arg(long, conflicts_with_all = ["vm", "snapshot"])]
    pvc: Option<String>,
    /// Export this VirtualMachine's volumes (it must be stopped).
    #[arg(long, conflicts_with_all = ["pvc", "snapshot"])]
    vm: Option<String>,
    /// Export this VirtualMachineSnapshot's volumes.
    #[arg(long, conflicts_with_all = ["pvc", "vm"])]
    snapshot: Option<String>,
    /// The export's ttlDuration (`30m`, `2h`; default 2h).
    #[arg(long)]
    ttl: Option<String>,
}

impl ExportSourceArgs {
    fn source(&self) -> Option<ferrovirt_cli::vmexport::Source> {
        use ferrovirt_cli::vmexport::Source;
        self.pvc
            .clone()
            .map(Source::Pvc)
            .or_else(|| self.vm.clone().map(Source::Vm))
            .or_else(|| self.snapshot.clone().map(Source::Snapshot))
    }
}

/// `vmexport create|download|delete NAME` (virtctl's flags).
#[derive(Debug, Clone, clap::Subcommand)]
pub enum VmexportCommand {
    /// Create a VirtualMachineExport.
    Create {
        name: String,
        #[command(flatten)]
        source: ExportSourceArgs,
    },
    /// Download a volume (or the manifests) of an export; with a source flag, create it first.
    Download {
        name: String,
        #[command(flatten)]
        source: ExportSourceArgs,
        /// The volume to download (needed when the export has several).
        #[arg(long)]
        volume: Option<String>,
        /// The file to write.
        #[arg(long)]
        output: Option<PathBuf>,
        /// `gzip` or `raw`.
        #[arg(long, default_value = "gzip", value_parser = ["gzip", "raw"])]
        format: String,
        /// Download the manifests (VM, DataVolumes, CA ConfigMap) instead of a volume.
        #[arg(long)]
        manifest: bool,
        /// With --manifest: add the token header Secret.
        #[arg(long)]
        include_secret: bool,
        /// With --manifest: `yaml` or `json`.
        #[arg(long, default_value = "yaml", value_parser = ["yaml", "json"])]
        manifest_output_format: String,
        /// Keep the VirtualMachineExport after the download (it is deleted otherwise).
        #[arg(long)]
        keep_vme: bool,
        /// Do not verify the server's certificate.
        #[arg(long)]
        insecure: bool,
        /// How long to wait for the export to be ready.
        #[arg(long, default_value = "2m")]
        wait: String,
    },
    /// Delete a VirtualMachineExport.
    Delete { name: String },
}

/// `image-upload dv NAME --size SIZE --image-path FILE` (virtctl's flags).
#[derive(Debug, Clone, clap::Args)]
pub struct ImageUploadArgs {
    /// Only `dv` (DataVolume).
    #[arg(value_parser = ["dv"])]
    kind: String,
    name: String,
    /// Size of the DataVolume to create (`1Gi`).
    #[arg(long)]
    size: Option<String>,
    /// The image file (raw, qcow2, vmdk, …; optionally gz/xz/zst compressed).
    #[arg(long)]
    image_path: PathBuf,
    /// StorageClass of the DataVolume to create.
    #[arg(long)]
    storage_class: Option<String>,
    /// Access mode of the DataVolume to create (`ReadWriteOnce`, `ReadWriteMany`).
    #[arg(long)]
    access_mode: Option<String>,
    /// Do not verify the server's certificate for the upload.
    #[arg(long)]
    insecure: bool,
    /// How long to wait for the upload to be ready and processed (`60s`, `5m`).
    #[arg(long, default_value = "5m")]
    wait: String,
}

/// Runs a verb; returns the process exit code (kubectl's: 0 ok, 1 error; `ssh`: the ssh
/// client's).
pub async fn run(conn: &Conn, cmd: VerbCommand) -> i32 {
    if let VerbCommand::Ssh(a) = cmd {
        return match ssh(conn, a) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("{e}");
                1
            }
        };
    }
    match run_inner(conn, cmd).await {
        Ok(()) => 0,
        Err(ferrovirt_cli::CliError::Reported) => 1,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

fn print_text(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout();
    let _ = out.write_all(text.as_bytes());
    if !text.is_empty() && !text.ends_with('\n') {
        let _ = out.write_all(b"\n");
    }
    let _ = out.flush();
}

fn format_doc(v: &serde_json::Value, output: &str) -> Result<String, CliError> {
    match output {
        "json" => Ok(serde_json::to_string_pretty(v).unwrap_or_default()),
        "yaml" => ferrovirt_cli::printer::to_yaml(v),
        other => Err(CliError::Usage(format!(
            "unsupported output format \"{other}\" (yaml or json)"
        ))),
    }
}

fn ssh(conn: &Conn, a: SshArgs) -> Result<i32, CliError> {
    let target = Target::load(conn.kubeconfig.as_deref(), conn.namespace.as_deref())?;
    let o = ferrovirt_cli::ssh::SshOptions {
        destination: a.destination,
        username: a.username,
        identity_file: a.identity_file,
        port: a.port,
        command: a.command,
        local_ssh_opts: a.local_ssh_opts,
        known_hosts: a.known_hosts,
    };
    let exe = std::env::current_exe().map_err(|e| CliError::io("finding this program", e))?;
    let args =
        ferrovirt_cli::ssh::ssh_args(&o, &exe, conn.kubeconfig.as_deref(), &target.namespace)?;
    ferrovirt_cli::ssh::run(&args)
}

/// Verbs that need no server.
fn offline(cmd: &VerbCommand) -> Option<Result<(), CliError>> {
    match cmd {
        VerbCommand::Completion { shell } => {
            use clap::CommandFactory;
            Some(
                ferrovirt_cli::completion::script(shell, &mut crate::Cli::command())
                    .map(|s| print_text(&s)),
            )
        }
        VerbCommand::Create {
            filename: None,
            what: Some(CreateWhat::Vm(a)),
        } => {
            let o = ferrovirt_cli::create_vm::VmOptions {
                name: a.name.clone(),
                instancetype: a.instancetype.clone(),
                preference: a.preference.clone(),
                containerdisks: a.volume_containerdisk.clone(),
                datasources: a.volume_datasource.clone(),
                cloud_init_user_data: a.cloud_init_user_data.clone(),
                run_strategy: a.run_strategy.clone(),
            };
            Some(
                ferrovirt_cli::create_vm::vm_manifest(&o)
                    .and_then(|v| ferrovirt_cli::printer::to_yaml(&v))
                    .map(|s| print_text(&s)),
            )
        }
        _ => None,
    }
}

async fn run_inner(conn: &Conn, cmd: VerbCommand) -> Result<(), CliError> {
    if let Some(r) = offline(&cmd) {
        return r;
    }
    let target = Target::load(conn.kubeconfig.as_deref(), conn.namespace.as_deref())?;
    let (verb, name, grace) = match cmd {
        VerbCommand::Console {
            name,
            quiet_seconds,
        } => {
            return ferrovirt_cli::console::run(&target, &name, Duration::from_secs(quiet_seconds))
                .await;
        }
        VerbCommand::Vnc {
            cmd: Some(VncCmd::Screenshot { name, file }),
            ..
        } => {
            let f = ferrovirt_cli::vnc::screenshot(&target, &name, &file).await?;
            eprintln!(
                "saved a {}x{} screenshot to {}",
                f.width,
                f.height,
                file.display()
            );
            return Ok(());
        }
        VerbCommand::Vnc {
            cmd: None,
            name,
            proxy_only,
            port,
        } => {
            let name = name.ok_or_else(|| CliError::Usage("vnc needs a VMI name".into()))?;
            if !proxy_only {
                eprintln!("no VNC viewer is started: connect one to the port printed below");
            }
            return ferrovirt_cli::vnc::proxy(&target, &name, port).await;
        }
        VerbCommand::Vmexport { cmd } => {
            use ferrovirt_cli::vmexport;
            return match cmd {
                VmexportCommand::Create { name, source } => {
                    let src = source.source().ok_or_else(|| {
                        CliError::Usage("one of --pvc, --vm or --snapshot is required".into())
                    })?;
                    let o = vmexport::CreateOptions {
                        name,
                        source: src,
                        ttl: source.ttl.clone(),
                    };
                    vmexport::create(&target, &o).await
                }
                VmexportCommand::Download {
                    name,
                    source,
                    volume,
                    output,
                    format,
                    manifest,
                    include_secret,
                    manifest_output_format,
                    keep_vme,
                    insecure,
                    wait,
                } => {
                    let o = vmexport::DownloadOptions {
                        name,
                        source: source.source(),
                        ttl: source.ttl.clone(),
                        volume,
                        format,
                        output,
                        manifest,
                        include_secret,
                        manifest_format: manifest_output_format,
                        keep_vme,
                        insecure,
                        wait: parse_duration(&wait)?,
                    };
                    vmexport::download(&target, &o).await
                }
                VmexportCommand::Delete { name } => vmexport::delete(&target, &name).await,
            };
        }
        VerbCommand::Backup { cmd } => return ferrovirt_cli::backup::run(&target, cmd).await,
        VerbCommand::ImageUpload(a) => {
            let o = ferrovirt_cli::upload::UploadOptions {
                name: a.name,
                size: a.size,
                image_path: a.image_path,
                storage_class: a.storage_class,
                access_mode: a.access_mode,
                insecure: a.insecure,
                wait: parse_duration(&a.wait)?,
            };
            return ferrovirt_cli::upload::run(&target, &o).await;
        }
        VerbCommand::PortForward(a) => {
            let fwd = ferrovirt_cli::portforward::ForwardTarget::parse(&a.target)?;
            let ports = a
                .ports
                .iter()
                .map(|p| ferrovirt_cli::portforward::parse_port(p))
                .collect::<Result<Vec<_>, _>>()?;
            if a.stdio {
                let [p] = ports.as_slice() else {
                    return Err(CliError::Usage("--stdio takes exactly one port".into()));
                };
                return ferrovirt_cli::portforward::stdio(&target, &fwd, p.remote).await;
            }
            return ferrovirt_cli::portforward::run(&target, &fwd, &ports, a.address).await;
        }
        VerbCommand::Migrate { name } => {
            println!("{}", ferrovirt_cli::migrate::migrate(&target, &name).await?);
            return Ok(());
        }
        VerbCommand::MigrateCancel { name } => {
            println!("{}", ferrovirt_cli::migrate::cancel(&target, &name).await?);
            return Ok(());
        }
        VerbCommand::Expose {
            what,
            port,
            target_port,
            type_,
            service_name,
        } => {
            let opts = ferrovirt_cli::expose::ExposeOpts {
                name: service_name,
                port,
                target_port,
                type_,
            };
            let out = ferrovirt_cli::expose::expose(&target, what.kind == "vm", &what.name, &opts)
                .await?;
            println!("{out}");
            return Ok(());
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
        other => return kubectl(&target, other).await,
    };
    let out = ferrovirt_cli::virt::call(&target, verb, &name, grace).await?;
    println!("{out}");
    Ok(())
}

/// The verbs that need discovery.
async fn kubectl(target: &Target, cmd: VerbCommand) -> Result<(), CliError> {
    let s = Session::connect(target).await?;
    match cmd {
        VerbCommand::Apply { filename } => {
            ferrovirt_cli::apply::run_files(&s, &filename, false).await
        }
        VerbCommand::Create {
            filename: Some(f), ..
        } => ferrovirt_cli::apply::run_files(&s, &f, true).await,
        VerbCommand::Create { .. } => Err(CliError::Usage(
            "create needs -f FILE or a subcommand (vm)".into(),
        )),
        VerbCommand::Get(a) => {
            let mut req = GetRequest::new(
                &a.type_,
                a.name.as_deref(),
                Output::parse(a.output.as_deref())?,
            );
            req.selector = a.selector;
            req.all_namespaces = a.all_namespaces;
            req.watch = a.watch;
            ferrovirt_cli::get::run(&s, &req, &mut std::io::stdout()).await
        }
        VerbCommand::Describe { type_, name } => {
            print_text(&ferrovirt_cli::describe::run(&s, &type_, name.as_deref()).await?);
            Ok(())
        }
        VerbCommand::Delete {
            args,
            wait,
            timeout,
        } => {
            let timeout = timeout.as_deref().map(parse_duration).transpose()?;
            ferrovirt_cli::wait::delete(&s, &args, wait, timeout).await
        }
        VerbCommand::Edit { type_, name } => {
            print_text(&ferrovirt_cli::apply::edit(&s, &type_, name.as_deref()).await?);
            Ok(())
        }
        VerbCommand::Wait {
            args,
            for_,
            timeout,
        } => {
            let want = WaitFor::parse(&for_)?;
            let timeout = parse_duration(&timeout)?;
            let line = ferrovirt_cli::wait::wait(
                &s,
                &args[0],
                args.get(1).map(String::as_str),
                &want,
                timeout,
            )
            .await?;
            print_text(&line);
            Ok(())
        }
        VerbCommand::ApiResources => {
            print_text(&ferrovirt_cli::resources::api_resources_table(
                &s.catalog.resources,
            ));
            Ok(())
        }
        VerbCommand::Expand { vm, file, output } => {
            let v = ferrovirt_cli::expand::run(&s, vm.as_deref(), file.as_deref()).await?;
            print_text(&format_doc(&v, &output)?);
            Ok(())
        }
        other => Err(CliError::Usage(format!("unhandled verb {other:?}"))),
    }
}
