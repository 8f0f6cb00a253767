//! The migration stream's setup on the source (docs/migration.md "The stream", steps 1–3):
//! the migration's start written and announced, the target's channel and this side's
//! ephemeral certificate (made at the same time), the certificates exchanged, the disks
//! mirrored for a block migration while the data connection is opened; and the node identities and
//! launcher certificates both sides need for it.

use std::net::IpAddr;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::control::Request;
use ferrovirt_launcher::migtls::Endpoint;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use serde_json::json;

use super::migration::{SETUP_STEP, timeout};
use super::{Agent, kube_err, now_string};
use crate::error::AgentError;
use crate::launchers;
use crate::migstream as ms;

impl Agent {
    /// This side's ephemeral migration certificate, made by its launcher (which keeps the
    /// key).
    pub(super) async fn launcher_cert(
        &self,
        uid: &str,
        endpoint: Endpoint,
    ) -> Result<String, String> {
        let v = launchers::request(
            &self.cfg,
            uid,
            &Request::MigrationCert { endpoint },
            SETUP_STEP,
        )
        .await
        .map_err(|e| format!("the launcher's migration certificate: {e}"))?;
        serde_json::from_value::<ferrovirt_launcher::control::MigrationCert>(v)
            .map(|c| c.cert)
            .map_err(|e| format!("the launcher's migration certificate: {e}"))
    }

    /// A node's InternalIP and published certificate fingerprint (if any).
    pub(super) async fn node_identity(
        &self,
        name: &str,
    ) -> Result<(IpAddr, Option<crate::tls::Fingerprint>), AgentError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = nodes.get(name).await.map_err(kube_err)?;
        let pin = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::node::FINGERPRINT_ANNOTATION))
            .and_then(|f| crate::tls::parse_fingerprint(f).ok());
        let ip = node
            .status
            .and_then(|s| s.addresses)
            .into_iter()
            .flatten()
            .find(|a| a.type_ == "InternalIP")
            .and_then(|a| a.address.parse().ok())
            .ok_or_else(|| AgentError::Reference(format!("node {name} has no InternalIP")))?;
        Ok((ip, pin))
    }

    /// Source: the stream's setup with the target agent ([`crate::migstream`]) on the
    /// authenticated channel `ch` (from `local`): our launcher's ephemeral certificate `cert`
    /// for the target's, the data
    /// connection opened from the announced port once the target accepts it. Returns the
    /// data connection and the target's certificate (`None` with `disableTLS`). With `block`
    /// volumes, the disks are mirrored ([`Agent::mirror_out`]) after the certificates'
    /// exchange, while the data connection is set up. With `recover` (a post-copy recovery's new
    /// connection) no certificate is exchanged: the QEMUs keep the original stream's.
    pub(super) async fn open_stream(
        &self,
        vmi: &VirtualMachineInstance,
        target: std::net::SocketAddr,
        (mut ch, local, cert): (ms::Channel, std::net::SocketAddr, Option<String>),
        block: &[ferrovirt_api::migration::BlockVolume],
        recover: bool,
    ) -> Result<(std::os::fd::OwnedFd, Option<String>), SetupError> {
        let encrypted = cert.is_some();
        let socket = ms::data_socket(self.net.node_netns(), local.ip())
            .await
            .map_err(|e| format!("the migration's data socket: {e}"))?;
        let data_port = socket.local_addr().map_err(|e| e.to_string())?.port();
        let hello = ms::Hello {
            cert,
            data_port,
            recover,
            query: false,
        };
        timeout(ms::send(&mut ch, &hello)).await?;
        let answer: ms::Reply = timeout(ms::recv(&mut ch)).await?;
        if let Some(e) = answer.error {
            return Err(SetupError {
                message: format!("the target: {e}"),
                unrecoverable: answer.unrecoverable,
                target_status: answer.status,
            });
        }
        if encrypted && answer.cert.is_none() {
            return Err("the target sent no certificate for an encrypted migration"
                .to_string()
                .into());
        }
        // The data connection and the target's QEMU waiting on it are set up while the
        // disks are mirrored: the target accepts it within its mirror wait, and our QEMU sends
        // nothing on it before `migrate`, which comes after the mirrors are in sync.
        let stream = async {
            let data = timeout(socket.connect(target))
                .await
                .map_err(|e| format!("the migration's data connection to {target}: {e}"))?;
            let _ = data.set_nodelay(true);
            let ready: ms::Reply = timeout(ms::recv(&mut ch)).await?;
            if let Some(e) = ready.error {
                return Err(SetupError {
                    message: format!("the target: {e}"),
                    unrecoverable: ready.unrecoverable,
                    target_status: ready.status,
                });
            }
            Ok(data)
        };
        let mirrors = async {
            if !block.is_empty() {
                self.mirror_out(vmi, block, target.ip(), answer.cert.clone())
                    .await?;
            }
            Ok::<_, SetupError>(())
        };
        let (data, ()) = tokio::try_join!(stream, mirrors)?;
        let conn = ms::into_fd(data).map_err(|e| e.to_string())?;
        Ok((conn, answer.cert))
    }

    /// Source: the client side of the agents' channel to `target_node` (its pinned
    /// certificate), `None` with `disableTLS`.
    pub(super) async fn channel_tls(
        &self,
        target_node: &str,
        config: &ferrovirt_api::kubevirt::misc::MigrationConfiguration,
    ) -> Result<Option<std::sync::Arc<rustls::ClientConfig>>, String> {
        if crate::migration::tls_disabled(config) {
            return Ok(None);
        }
        let (_, pin) = self
            .node_identity(target_node)
            .await
            .map_err(|e| e.to_string())?;
        let pin = pin.ok_or_else(|| {
            format!(
                "node {target_node} publishes no certificate: the migration stream cannot be \
                 encrypted (set disableTLS in the migration configuration to allow it)"
            )
        })?;
        crate::tls::migration_client_config(&self.cert, pin)
            .map(Some)
            .map_err(|e| e.to_string())
    }

    /// Source: the migration's start written (`startTimestamp`, `migrationMethod`) and its
    /// Events recorded.
    pub(super) async fn announce_out(
        &self,
        vmi: &VirtualMachineInstance,
        target: std::net::SocketAddr,
        target_node: &str,
        disks: usize,
    ) -> Result<(), String> {
        let start = json!({"migrationState": {"startTimestamp": now_string()},
            "migrationMethod": super::blockmig::method_patch(disks > 0)});
        self.patch_status(vmi, start)
            .await
            .map_err(|e| e.to_string())?;
        self.event(
            vmi,
            "Normal",
            "Migrating",
            &format!(
                "Sending the VM from {} to {target_node} ({target})",
                self.opts.node_name
            ),
        )
        .await;
        if disks > 0 {
            self.event(
                vmi,
                "Normal",
                "Migrating",
                &format!("Copying {} node-local disk(s) to {target_node}", disks),
            )
            .await;
        }
        Ok(())
    }
}

/// A stream setup that failed: why, whether the target said that no recovery of a
/// post-copy migration can succeed (its QEMU is gone), and what the target's QEMU reported
/// when the target said it.
#[derive(Debug, Default)]
pub(super) struct SetupError {
    pub(super) message: String,
    pub(super) unrecoverable: bool,
    pub(super) target_status: Option<String>,
}

impl From<String> for SetupError {
    fn from(message: String) -> Self {
        SetupError {
            message,
            ..SetupError::default()
        }
    }
}

impl From<SetupError> for String {
    fn from(e: SetupError) -> Self {
        e.message
    }
}
