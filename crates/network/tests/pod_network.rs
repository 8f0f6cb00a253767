//! End-to-end pod networking with real namespaces, bridges, veths, taps, nftables and the test
//! guest under QEMU (TCG). Runs as root; fails (never skips) without root, `ip` or `nft`.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use common::{Guest, Lab, PEER_ADDR, PeerServer, http_get_in, links_in, nft_ruleset_in};
use ferrovirt_network::{Binding, PodPlan, PodRequest, Port, PortProtocol, pod};

const BOOT: Duration = Duration::from_secs(90);

async fn lock() -> tokio::sync::MutexGuard<'static, ()> {
    common::GUEST_LOCK.lock().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masquerade_binding_end_to_end() -> anyhow::Result<()> {
    let _guard = lock().await;
    let lab = Lab::new(5).await?;
    let peer = PeerServer::start(&lab.out_ns, PEER_ADDR, 8080)?;
    let req = PodRequest::new(
        format!("masq-{}", lab.token),
        "default",
        "vm-masq",
        Binding::Masquerade {
            ports: vec![Port {
                protocol: PortProtocol::Tcp,
                port: 80,
            }],
        },
    );
    let plan = PodPlan::build(&lab.node, &req)?;
    let attached = pod::setup(&plan).await?;
    let guest = Guest::boot(&attached.netns, &attached.tap, attached.mac)?;

    // DHCP hands out KubeVirt's masquerade addressing.
    let dhcp = guest.wait_line("FERROVIRT-DHCP", BOOT)?;
    assert!(
        dhcp.contains("ip=10.0.2.2/24 router=10.0.2.1"),
        "unexpected lease: {dhcp}"
    );
    guest.wait_line("FERROVIRT-READY", BOOT)?;

    // The node reaches the guest's HTTP through the VMI address (DNAT of the listed port).
    let node_ns = lab.node_ns.clone();
    let body = http_get_in(&node_ns, attached.address, 80, Duration::from_secs(30))?;
    assert!(body.contains("hostname="), "{body}");
    // A port that is not listed is not forwarded.
    assert!(!common::tcp_connects_in(&node_ns, attached.address, 8081)?);

    // The guest reaches the outside through both NATs; the peer sees the node's uplink address.
    let out = guest.exec_ok(&format!("wget -qO- http://{PEER_ADDR}:{}/", peer.port))?;
    assert!(out.contains("peer=198.18.0.1"), "guest got {out:?}");
    let clients = peer.clients();
    assert!(!clients.is_empty());
    assert!(
        clients
            .iter()
            .all(|c| *c == IpAddr::V4(common::NODE_UPLINK_ADDR)),
        "peer saw {clients:?}"
    );
    assert!(!clients.contains(&IpAddr::V4(Ipv4Addr::new(10, 0, 2, 2))));

    // Re-applying everything (an agent restart) keeps the running guest reachable both ways.
    ferrovirt_network::setup_node(&lab.node).await?;
    pod::setup_links(&plan).await?;
    let body = http_get_in(&node_ns, attached.address, 80, Duration::from_secs(10))?;
    assert!(body.contains("hostname="), "{body}");
    let out = guest.exec_ok(&format!("wget -qO- http://{PEER_ADDR}:{}/", peer.port))?;
    assert!(
        out.contains("peer=198.18.0.1"),
        "guest got {out:?} after re-apply"
    );

    // Teardown removes the VMI namespace and the node-side veth.
    drop(guest);
    drop(attached);
    pod::teardown(&plan).await?;
    assert!(!ferrovirt_network::netns::exists(&plan.netns));
    assert!(!links_in(&node_ns).contains(&plan.host_veth));
    pod::teardown(&plan).await?; // twice is fine
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_binding_two_vmis_reach_each_other_and_the_node() -> anyhow::Result<()> {
    let _guard = lock().await;
    let lab = Lab::new(6).await?;
    let peer = PeerServer::start(&lab.out_ns, PEER_ADDR, 8080)?;
    let plan_a = PodPlan::build(
        &lab.node,
        &PodRequest::new(
            format!("a-{}", lab.token),
            "default",
            "vm-a",
            Binding::Bridge,
        ),
    )?;
    let mut req_b = PodRequest::new(
        format!("b-{}", lab.token),
        "default",
        "vm-b",
        Binding::Bridge,
    );
    req_b.used.insert(plan_a.address);
    let plan_b = PodPlan::build(&lab.node, &req_b)?;
    assert_ne!(plan_a.address, plan_b.address);

    let att_a = pod::setup(&plan_a).await?;
    let att_b = pod::setup(&plan_b).await?;
    let a = Guest::boot(&att_a.netns, &att_a.tap, att_a.mac)?;
    // B runs on exactly the argv the agent's launcher would build (tap, sandbox, -runas).
    let b = Guest::boot_like_the_agent(&att_b)?;

    let gw = lab.node.gateway();
    for (g, att) in [(&a, &att_a), (&b, &att_b)] {
        let dhcp = g.wait_line("FERROVIRT-DHCP", BOOT)?;
        let want = format!("ip={}/24 router={gw}", att.address);
        assert!(dhcp.contains(&want), "wanted {want}, got {dhcp}");
    }
    a.wait_line("FERROVIRT-READY", BOOT)?;
    b.wait_line("FERROVIRT-READY", BOOT)?;

    // The node reaches both guests directly on their VMI addresses.
    for att in [&att_a, &att_b] {
        let body = http_get_in(&lab.node_ns, att.address, 80, Duration::from_secs(30))?;
        assert!(body.contains("hostname="), "{body}");
    }
    // The guests reach each other by their VMI addresses.
    let out = a.exec_ok(&format!("wget -qO- http://{}/", att_b.address))?;
    assert!(out.contains("hostname="), "A → B: {out}");
    b.exec_ok(&format!("ping -c 1 -W 3 {}", att_a.address))?;
    // And the outside through the node's NAT.
    let out = a.exec_ok(&format!("wget -qO- http://{PEER_ADDR}:{}/", peer.port))?;
    assert!(out.contains("peer=198.18.0.1"), "guest got {out:?}");

    drop((a, b));
    drop((att_a, att_b));
    pod::teardown(&plan_a).await?;
    pod::teardown(&plan_b).await?;
    for p in [&plan_a, &plan_b] {
        assert!(!ferrovirt_network::netns::exists(&p.netns));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_is_idempotent_and_teardown_removes_everything() -> anyhow::Result<()> {
    let lab = Lab::new(7).await?;
    let req = PodRequest::new(
        format!("idem-{}", lab.token),
        "ns",
        "vm",
        Binding::Masquerade { ports: vec![] },
    );
    let plan = PodPlan::build(&lab.node, &req)?;
    let first = pod::setup(&plan).await?;
    drop(first);
    let again = pod::setup(&plan).await?; // a restarted agent
    assert!(again.dhcp.is_running());
    ferrovirt_network::setup_node(&lab.node).await?;

    let links = links_in(&plan.netns);
    for l in ["eth0", "k6t-eth0", "tap0"] {
        assert!(links.contains(l), "{l} missing in {links}");
    }
    let rules = nft_ruleset_in(&plan.netns);
    assert!(
        rules.contains(&format!("ip daddr {} dnat to 10.0.2.2", plan.address)),
        "{rules}"
    );
    // Re-applied, not duplicated: one IPv4 table (NAT + guest input filter) and one IPv6
    // table (guest input filter).
    assert_eq!(rules.matches("table ip ").count(), 1, "{rules}");
    assert_eq!(rules.matches("table ip6 ").count(), 1, "{rules}");
    let node_rules = nft_ruleset_in(&lab.node_ns);
    assert!(node_rules.contains("masquerade"), "{node_rules}");
    assert!(links_in(&lab.node_ns).contains(&plan.host_veth));

    drop(again);
    pod::teardown(&plan).await?;
    assert!(!ferrovirt_network::netns::exists(&plan.netns));
    assert!(!links_in(&lab.node_ns).contains(&plan.host_veth));
    ferrovirt_network::teardown_node(&lab.node).await?;
    assert!(!links_in(&lab.node_ns).contains("fv-br0"));
    assert!(!nft_ruleset_in(&lab.node_ns).contains(&lab.node.nft_table));
    ferrovirt_network::teardown_node(&lab.node).await?;
    Ok(())
}
