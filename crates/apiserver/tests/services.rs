//! core/v1 Services against a real server with the machine's kubectl: allocation of ClusterIPs
//! and NodePorts (race-free, released on delete), Kubernetes' refusals naming the field, and
//! `kubectl get svc,endpointslices` columns.

mod common;

use anyhow::Result;
use serde_json::{Value, json};

const SVC: &str = "/api/v1/namespaces/default/services";

async fn post(t: &common::TestServer, path: &str, body: &Value) -> Result<common::Resp> {
    let token = t.srv().token.clone();
    t.request_as(
        Some(&token),
        "POST",
        path,
        Some("application/json"),
        serde_json::to_vec(body)?,
    )
    .await
}

async fn delete(t: &common::TestServer, path: &str) -> Result<common::Resp> {
    let token = t.srv().token.clone();
    t.request_as(Some(&token), "DELETE", path, None, Vec::new())
        .await
}

fn svc(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_creates_services_and_shows_their_columns() -> Result<()> {
    let t = common::start().await?;
    t.kubectl_ok(&["create", "service", "clusterip", "web", "--tcp=80:8080"])
        .await?;
    let web: Value =
        serde_json::from_str(&t.kubectl_ok(&["get", "svc", "web", "-o", "json"]).await?)?;
    let ip = web["spec"]["clusterIP"].as_str().unwrap_or_default();
    assert!(ip.starts_with("10.96."), "{web}");
    assert_eq!(web["spec"]["clusterIPs"], json!([ip]));
    assert_eq!(web["spec"]["ports"][0]["targetPort"], 8080);
    t.kubectl_ok(&[
        "create",
        "service",
        "nodeport",
        "np",
        "--tcp=80:80",
        "--node-port=30080",
    ])
    .await?;
    let out = t
        .kubectl(&[
            "create",
            "service",
            "nodeport",
            "np2",
            "--tcp=81:81",
            "--node-port=30080",
        ])
        .await?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("spec.ports[0].nodePort")
            && err.contains("provided port is already allocated"),
        "{err}"
    );
    t.kubectl_ok(&["create", "service", "clusterip", "hl", "--clusterip=None"])
        .await?;
    let table = t.kubectl_ok(&["get", "svc"]).await?;
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME",
            "TYPE",
            "CLUSTER-IP",
            "EXTERNAL-IP",
            "PORT(S)",
            "AGE"
        ],
        "{table}"
    );
    let np_line = table
        .lines()
        .find(|l| l.starts_with("np "))
        .unwrap_or_default();
    assert!(
        np_line.contains("NodePort") && np_line.contains("80:30080/TCP"),
        "{table}"
    );
    let hl_line = table
        .lines()
        .find(|l| l.starts_with("hl "))
        .unwrap_or_default();
    assert!(hl_line.contains(" None "), "{table}");
    let wide = t.kubectl_ok(&["get", "svc", "-o", "wide"]).await?;
    assert!(
        wide.lines()
            .next()
            .unwrap_or_default()
            .ends_with("SELECTOR"),
        "{wide}"
    );
    // EndpointSlices and Endpoints are served with Kubernetes' columns.
    let slices = t.kubectl_ok(&["get", "endpointslices"]).await?;
    assert!(
        slices.is_empty() || slices.contains("No resources"),
        "{slices}"
    );
    let es = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "manual"}, "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.244.0.9"]}], "ports": [{"port": 80}]});
    let r = post(
        &t,
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
        &es,
    )
    .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let table = t.kubectl_ok(&["get", "endpointslices"]).await?;
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        ["NAME", "ADDRESSTYPE", "PORTS", "ENDPOINTS", "AGE"],
        "{table}"
    );
    assert!(table.contains("10.244.0.9"), "{table}");
    // Deleting a Service releases its NodePort.
    t.kubectl_ok(&["delete", "svc", "np"]).await?;
    t.kubectl_ok(&[
        "create",
        "service",
        "nodeport",
        "np3",
        "--tcp=80:80",
        "--node-port=30080",
    ])
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_name_the_field() -> Result<()> {
    let t = common::start().await?;
    let cases = [
        (
            json!({"type": "LoadBalancer", "ports": [{"port": 80}]}),
            "spec.type",
        ),
        (
            json!({"type": "ExternalName", "externalName": "a.example"}),
            "spec.type",
        ),
        (
            json!({"sessionAffinity": "ClientIP", "ports": [{"port": 80}]}),
            "spec.sessionAffinity",
        ),
        (
            json!({"ports": [{"port": 80}], "externalIPs": ["192.0.2.1"]}),
            "spec.externalIPs",
        ),
        (json!({"ports": [{"port": 70000}]}), "spec.ports[0].port"),
        (
            json!({"ports": [{"port": 80, "nodePort": 30001}]}),
            "spec.ports[0].nodePort",
        ),
        (
            json!({"type": "NodePort", "ports": [{"port": 80, "nodePort": 22}]}),
            "spec.ports[0].nodePort",
        ),
        (
            json!({"clusterIP": "192.168.0.1", "ports": [{"port": 80}]}),
            "spec.clusterIPs",
        ),
        (json!({"selector": {"a": "b"}}), "spec.ports"),
    ];
    for (i, (spec, field)) in cases.into_iter().enumerate() {
        let r = post(&t, SVC, &svc(&format!("bad{i}"), spec.clone())).await?;
        assert_eq!(r.status, 422, "{spec}: {}", r.text());
        let body = r.json();
        let fields: Vec<&str> = body["details"]["causes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["field"].as_str())
            .collect();
        assert!(fields.contains(&field), "{spec}: {body}");
    }
    // A ClusterIP in use is refused with Kubernetes' message; once released it can be had.
    let r = post(
        &t,
        SVC,
        &svc(
            "a",
            json!({"clusterIP": "10.96.0.50", "ports": [{"port": 80}]}),
        ),
    )
    .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = post(
        &t,
        SVC,
        &svc(
            "b",
            json!({"clusterIP": "10.96.0.50", "ports": [{"port": 80}]}),
        ),
    )
    .await?;
    assert_eq!(r.status, 422);
    assert!(
        r.text().contains("provided IP is already allocated"),
        "{}",
        r.text()
    );
    // The ClusterIP cannot change.
    let token = t.srv().token.clone();
    let r = t
        .request_as(
            Some(&token),
            "PATCH",
            &format!("{SVC}/a"),
            Some("application/merge-patch+json"),
            br#"{"spec":{"clusterIP":"10.96.0.51","clusterIPs":["10.96.0.51"]}}"#.to_vec(),
        )
        .await?;
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("may not change once set"), "{}", r.text());
    assert_eq!(delete(&t, &format!("{SVC}/a")).await?.status, 200);
    let r = post(
        &t,
        SVC,
        &svc(
            "b",
            json!({"clusterIP": "10.96.0.50", "ports": [{"port": 80}]}),
        ),
    )
    .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_share_an_address_or_port() -> Result<()> {
    // 14 usable addresses: 14 concurrent creates take all of them, the 15th finds none.
    let t = common::start_with(|o| o.service_cidr = "10.96.0.0/28".parse().expect("cidr")).await?;
    let creates = (0..14).map(|i| {
        let t = &t;
        async move {
            post(
                t,
                SVC,
                &svc(
                    &format!("s{i}"),
                    json!({"type": "NodePort", "ports": [{"port": 80}]}),
                ),
            )
            .await
        }
    });
    let results = futures::future::join_all(creates).await;
    let mut ips = Vec::new();
    let mut ports = Vec::new();
    for r in results {
        let r = r?;
        assert_eq!(r.status, 201, "{}", r.text());
        let o = r.json();
        ips.push(
            o["spec"]["clusterIP"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
        let p = o["spec"]["ports"][0]["nodePort"].as_u64().unwrap_or(0);
        assert!((30000..=32767).contains(&p), "{o}");
        ports.push(p);
    }
    ips.sort();
    ips.dedup();
    ports.sort();
    ports.dedup();
    assert_eq!((ips.len(), ports.len()), (14, 14), "{ips:?} {ports:?}");
    let r = post(&t, SVC, &svc("full", json!({"ports": [{"port": 80}]}))).await?;
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(
        r.text().contains("range 10.96.0.0/28 is full"),
        "{}",
        r.text()
    );
    assert_eq!(delete(&t, &format!("{SVC}/s3")).await?.status, 200);
    let r = post(&t, SVC, &svc("full", json!({"ports": [{"port": 80}]}))).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    Ok(())
}
