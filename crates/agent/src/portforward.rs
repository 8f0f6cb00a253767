//! Port forwarding into a guest, for KubeVirt's `portforward` subresource: the agent opens a
//! TCP connection to one of the guest's ports and the endpoint pumps it through an upgraded
//! HTTP connection.
//!
//! How the guest is reached depends on its network:
//! - pod network (the VMI directory holds its [`PodPlan`]): a socket made inside a network
//!   namespace connects to the guest's address there ([`pod_target`]);
//! - QEMU user-mode networking: the launcher adds a host forward from a free loopback port to
//!   the guest port, the agent connects to it, and the launcher removes the forward at once
//!   (the connection stays). The forward exists only for that moment, on 127.0.0.1.
//!
//! Only TCP is forwarded.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use ferrovirt_launcher::control::{LauncherClient, OpenedPort, Request as LauncherRequest};
use ferrovirt_network::{Binding, PodPlan};
use http::StatusCode;
use tokio::net::TcpStream;

use crate::launchers::{CONTROL_TIMEOUT, LauncherConfig};

/// How long connecting to the guest port may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a pod-networked VMI's guest is reached from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodTarget {
    /// The network namespace to connect from (`None`: the agent's own).
    pub netns: Option<String>,
    /// The guest's address as seen from that namespace.
    pub addr: Ipv4Addr,
}

/// Where the guest of a pod-network plan is reached: masquerade from inside the VMI's
/// namespace at the guest's private address (every port, listed in `ports` or not); bridge
/// binding from the node's namespace at the VMI address, which the guest holds itself.
pub fn pod_target(plan: &PodPlan) -> PodTarget {
    match plan.binding {
        Binding::Masquerade { .. } => PodTarget {
            netns: Some(plan.netns.clone()),
            addr: plan.lease.address,
        },
        Binding::Bridge => PodTarget {
            netns: plan.node.netns.clone(),
            addr: plan.address,
        },
    }
}

/// Where the guest of a plan on a Primary user-defined network is reached: from the network's
/// namespace on this node, where the node's gateway of the network holds an address (a
/// Layer3 network always; a Layer2 one when the node gives it a gateway), at the guest's
/// address. The connection comes from the gateway's address, which only this node answers
/// (Layer2's gateway is anycast, but the guest runs here). Without a gateway address there is
/// nothing to connect from: the reason.
pub fn udn_target(plan: &PodPlan) -> Result<PodTarget, String> {
    let Some(udn) = &plan.udn else {
        return Ok(pod_target(plan));
    };
    if udn.layer3 || udn.gateway.is_some() {
        Ok(PodTarget {
            netns: Some(udn.netns.clone()),
            addr: plan.address,
        })
    } else {
        Err(format!(
            "port-forward to a VMI on the user-defined network {:?}: the network has no gateway \
             on this node (its agent runs without --uplink), so there is no address on the node \
             to connect from",
            udn.name
        ))
    }
}

/// A failed dial: the HTTP status to answer and the message.
pub type DialError = (StatusCode, String);

/// The `{port}` and optional `{protocol}` of a portforward URL.
pub fn parse_port(port: &str, protocol: Option<&str>) -> Result<u16, String> {
    match protocol.map(str::to_ascii_lowercase).as_deref() {
        None | Some("tcp") => {}
        Some(other) => return Err(format!("protocol {other:?} is not supported (only tcp)")),
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(format!("invalid port {port:?}: must be 1-65535")),
    }
}

/// Connects to TCP `port` of the guest of VMI `uid`.
pub async fn dial(cfg: &LauncherConfig, uid: &str, port: u16) -> Result<TcpStream, DialError> {
    match crate::launchers::read_network_plan(&cfg.vmi_dir(uid)) {
        Some(plan) => match udn_target(&plan) {
            Ok(t) => dial_in_netns(t, port).await,
            Err(e) => Err((StatusCode::BAD_REQUEST, e)),
        },
        None => dial_user_net(cfg, uid, port).await,
    }
}

async fn dial_in_netns(t: PodTarget, port: u16) -> Result<TcpStream, DialError> {
    let addr = SocketAddr::from((t.addr, port));
    let netns = t.netns.clone();
    let join = tokio::task::spawn_blocking(move || {
        ferrovirt_network::netns::run_in(netns.as_deref(), move || {
            std::net::TcpStream::connect_timeout(&addr, DIAL_TIMEOUT)
        })
    })
    .await
    .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let stream = join
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| refused(port, &e))?;
    stream
        .set_nonblocking(true)
        .and_then(|_| TcpStream::from_std(stream))
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

async fn dial_user_net(cfg: &LauncherConfig, uid: &str, port: u16) -> Result<TcpStream, DialError> {
    let mut client = LauncherClient::connect(&cfg.vmi_dir(uid), CONTROL_TIMEOUT)
        .await
        .map_err(|_| {
            (
                StatusCode::CONFLICT,
                format!("VMI {uid} is not running on this node"),
            )
        })?;
    let opened = client
        .request(&LauncherRequest::OpenPort { port })
        .await
        .map_err(|e| (StatusCode::CONFLICT, format!("port forward: {e}")))?;
    let OpenedPort { host_port } = serde_json::from_value(opened)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let conn =
        tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(("127.0.0.1", host_port))).await;
    // The forward is needed only to make this one connection.
    if let Err(e) = client
        .request(&LauncherRequest::ClosePort { host_port })
        .await
    {
        tracing::warn!(%uid, host_port, "removing the host forward: {e}");
    }
    match conn {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(refused(port, &e)),
        Err(_) => Err((
            StatusCode::GATEWAY_TIMEOUT,
            format!("connecting to guest port {port} timed out"),
        )),
    }
}

fn refused(port: u16, e: &std::io::Error) -> DialError {
    (
        StatusCode::BAD_GATEWAY,
        format!("cannot connect to guest port {port}: {e}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_and_protocols() {
        assert_eq!(parse_port("80", None), Ok(80));
        assert_eq!(parse_port("22", Some("TCP")), Ok(22));
        assert!(parse_port("0", None).unwrap_err().contains("1-65535"));
        assert!(parse_port("70000", None).is_err());
        assert!(parse_port("x", None).is_err());
        assert!(
            parse_port("53", Some("udp"))
                .unwrap_err()
                .contains("only tcp")
        );
    }

    #[test]
    fn pod_targets_follow_the_binding() {
        let ipam = ferrovirt_network::Ipam::default();
        let mut node = ferrovirt_network::NodeNetwork::new(ipam, ipam.node_subnet(3).unwrap());
        node.netns = Some("node-a".into());
        let masq = Binding::Masquerade { ports: vec![] };
        let req = ferrovirt_network::PodRequest::new("u1", "default", "vm", masq);
        let plan = PodPlan::build(&node, &req).unwrap();
        let t = pod_target(&plan);
        assert_eq!(t.netns.as_deref(), Some(plan.netns.as_str()));
        assert_eq!(t.addr, Ipv4Addr::new(10, 0, 2, 2));
        let req = ferrovirt_network::PodRequest::new("u2", "default", "vm2", Binding::Bridge);
        let plan = PodPlan::build(&node, &req).unwrap();
        let t = pod_target(&plan);
        assert_eq!(t.netns.as_deref(), Some("node-a"));
        assert_eq!(t.addr, plan.address);
        assert_eq!(
            udn_target(&plan),
            Ok(t),
            "not on a UDN: the pod network's target"
        );
    }

    #[test]
    fn udn_guests_are_reached_from_the_networks_namespace_when_it_has_a_gateway() {
        let cfg = ferrovirt_network::udn::parse_nad_config(
            r#"{"name": "ua_net", "topology": "layer2", "role": "primary", "subnets": "10.100.0.0/24"}"#,
        )
        .unwrap();
        let mut net =
            ferrovirt_network::udn::UdnNetwork::from_nad(&cfg, 12345, Some("node-a"), None)
                .unwrap();
        let ipam = ferrovirt_network::Ipam::default();
        let node = ferrovirt_network::NodeNetwork::new(ipam, ipam.node_subnet(3).unwrap());
        let req = ferrovirt_network::PodRequest::new("u1", "ua", "vm", Binding::Bridge);
        let mut plan = PodPlan::build(&node, &req).unwrap();
        plan.address = Ipv4Addr::new(10, 100, 0, 7);
        plan.udn = Some(net.clone());
        let e = udn_target(&plan).unwrap_err();
        assert!(e.contains("\"ua_net\"") && e.contains("--uplink"), "{e}");
        net.layer3 = true;
        plan.udn = Some(net.clone());
        let t = udn_target(&plan).unwrap();
        assert_eq!(t.netns.as_deref(), Some(net.netns.as_str()));
        assert_eq!(t.addr, Ipv4Addr::new(10, 100, 0, 7));
        net.layer3 = false;
        net.gateway = Some(ferrovirt_network::udn::UdnGateway {
            address: Ipv4Addr::new(10, 100, 0, 1),
            uplink: Some("eth0".into()),
        });
        plan.udn = Some(net.clone());
        assert_eq!(udn_target(&plan).unwrap(), t);
    }
}
