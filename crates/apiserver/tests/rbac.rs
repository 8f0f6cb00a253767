//! Access control end to end with the real kubectl against a real server in a temp dir: a
//! ServiceAccount token from `kubectl create token`, RoleBindings to KubeVirt's default
//! roles made with `kubectl create rolebinding`, 403s with Kubernetes' messages, `kubectl
//! auth can-i` agreeing with what the server does, a client-certificate identity, `kubectl
//! auth whoami`, tokens that stop working when their ServiceAccount is deleted, and
//! TokenReviews.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use common::TestServer;

const VM: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: vm1
spec:
  runStrategy: Halted
  template:
    spec:
      domain:
        devices: {}
        resources:
          requests:
            memory: 128Mi
"#;

/// kubectl with another kubeconfig (own cache dir).
async fn kubectl_as(
    t: &TestServer,
    kc: &Path,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<Output> {
    let cache = t.dir.path().join(format!(
        "cache-{}",
        kc.file_name().and_then(|n| n.to_str()).unwrap_or("x")
    ));
    let mut cmd = tokio::process::Command::new(common::KUBECTL);
    cmd.arg("--kubeconfig")
        .arg(kc)
        .arg("--cache-dir")
        .arg(cache)
        .args(args)
        .stdin(if stdin.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().context("spawning kubectl")?;
    if let Some(input) = stdin {
        use tokio::io::AsyncWriteExt;
        let mut w = child.stdin.take().context("stdin")?;
        w.write_all(input.as_bytes()).await?;
    }
    Ok(tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await??)
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A kubeconfig like the admin one with `token` instead of the admin token.
fn token_kubeconfig(t: &TestServer, name: &str, token: &str) -> Result<PathBuf> {
    let admin = std::fs::read_to_string(t.kubeconfig())?;
    let line = admin
        .lines()
        .find(|l| l.trim_start().starts_with("token: "))
        .context("admin kubeconfig has a token")?;
    let p = t.dir.path().join(name);
    std::fs::write(&p, admin.replace(line, &format!("    token: {token}")))?;
    Ok(p)
}

/// `kubectl auth can-i …` → yes/no (exit 0/1).
async fn can_i(t: &TestServer, kc: &Path, args: &[&str]) -> Result<bool> {
    let mut all = vec!["auth", "can-i"];
    all.extend_from_slice(args);
    let out = kubectl_as(t, kc, &all, None).await?;
    let (stdout, stderr) = text(&out);
    match stdout.trim() {
        "yes" => Ok(true),
        "no" => Ok(false),
        other => bail!("can-i {args:?}: {other:?} {stderr}"),
    }
}

/// Waits until `f` holds (RBAC changes reach the authorizer through a watch).
async fn eventually<F, Fut>(what: &str, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    for _ in 0..100 {
        if f().await? {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("timed out waiting for {what}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_accounts_roles_and_client_certificates() -> Result<()> {
    common::require_kubectl();
    let t = common::start().await?;
    let admin = t.kubeconfig();
    t.kubectl_ok(&["create", "namespace", "a"]).await?;
    t.kubectl_ok(&["create", "namespace", "b"]).await?;
    t.kubectl_ok(&[
        "-n",
        "b",
        "create",
        "secret",
        "generic",
        "s",
        "--from-literal=k=v",
    ])
    .await?;
    // The ServiceAccount controller's default account appears in every namespace.
    eventually("the default ServiceAccount", || async {
        Ok(t.kubectl(&["-n", "a", "get", "sa", "default"])
            .await?
            .status
            .success())
    })
    .await?;
    for sa in ["robot", "viewer"] {
        t.kubectl_ok(&["-n", "a", "create", "serviceaccount", sa])
            .await?;
    }
    t.kubectl_ok(&[
        "-n",
        "a",
        "create",
        "rolebinding",
        "robot-edit",
        "--clusterrole=kubevirt.io:edit",
        "--serviceaccount=a:robot",
    ])
    .await?;
    t.kubectl_ok(&[
        "-n",
        "a",
        "create",
        "rolebinding",
        "viewer-view",
        "--clusterrole=kubevirt.io:view",
        "--serviceaccount=a:viewer",
    ])
    .await?;
    let out = t
        .kubectl_ok(&["-n", "a", "get", "rolebinding", "robot-edit", "-o", "wide"])
        .await?;
    assert!(
        out.contains("ClusterRole/kubevirt.io:edit") && out.contains("a/robot"),
        "{out}"
    );

    let token = t
        .kubectl_ok(&["-n", "a", "create", "token", "robot", "--duration=1h"])
        .await?;
    let robot = token_kubeconfig(&t, "robot.yaml", token.trim())?;
    let viewer_token = t
        .kubectl_ok(&["-n", "a", "create", "token", "viewer"])
        .await?;
    let viewer = token_kubeconfig(&t, "viewer.yaml", viewer_token.trim())?;

    // whoami
    let out = kubectl_as(&t, &robot, &["auth", "whoami", "-o", "json"], None).await?;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let who: serde_json::Value = serde_json::from_str(&stdout)?;
    assert_eq!(
        who["status"]["userInfo"]["username"],
        "system:serviceaccount:a:robot"
    );
    let groups = who["status"]["userInfo"]["groups"].to_string();
    assert!(
        groups.contains("system:serviceaccounts:a") && groups.contains("system:authenticated"),
        "{groups}"
    );

    // The robot creates its VM in a …
    eventually("the robot's binding", || async {
        can_i(
            &t,
            &robot,
            &["create", "virtualmachines.kubevirt.io", "-n", "a"],
        )
        .await
    })
    .await?;
    let out = kubectl_as(&t, &robot, &["-n", "a", "apply", "-f", "-"], Some(VM)).await?;
    assert!(out.status.success(), "{:?}", text(&out));
    let out = kubectl_as(&t, &robot, &["-n", "a", "get", "vms"], None).await?;
    assert!(text(&out).0.contains("vm1"), "{:?}", text(&out));
    // … but cannot list VMs or read Secrets in b, and can-i agrees.
    let out = kubectl_as(&t, &robot, &["-n", "b", "get", "vms"], None).await?;
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains(
            "virtualmachines.kubevirt.io is forbidden: User \"system:serviceaccount:a:robot\" cannot list resource \"virtualmachines\" in API group \"kubevirt.io\" in the namespace \"b\""
        ),
        "{stderr}"
    );
    let out = kubectl_as(&t, &robot, &["-n", "b", "get", "secret", "s"], None).await?;
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains(
            "secrets \"s\" is forbidden: User \"system:serviceaccount:a:robot\" cannot get resource \"secrets\" in API group \"\" in the namespace \"b\""
        ),
        "{stderr}"
    );
    assert!(
        !can_i(
            &t,
            &robot,
            &["list", "virtualmachines.kubevirt.io", "-n", "b"]
        )
        .await?
    );
    assert!(!can_i(&t, &robot, &["get", "secrets", "-n", "b"]).await?);
    assert!(!can_i(&t, &robot, &["get", "secrets", "-n", "a"]).await?);
    // Watches are authorized too.
    let out = kubectl_as(
        &t,
        &robot,
        &["-n", "b", "get", "vms", "-w", "--request-timeout=5s"],
        None,
    )
    .await?;
    assert!(
        text(&out).1.contains("cannot watch resource")
            || text(&out).1.contains("cannot list resource"),
        "{:?}",
        text(&out)
    );

    // VM subresources: edit may start, view may not.
    // kubectl can-i cannot name them (discovery lists no resources for
    // subresources.kubevirt.io), so ask the SelfSubjectAccessReview it would send.
    let start = "/apis/subresources.kubevirt.io/v1/namespaces/a/virtualmachines/vm1/start";
    let may_start = |token: String| {
        let t = &t;
        async move {
            let review = serde_json::json!({
                "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": {"namespace": "a", "verb": "update",
                    "group": "subresources.kubevirt.io", "resource": "virtualmachines",
                    "subresource": "start", "name": "vm1"}}});
            let r = t
                .request_as(
                    Some(&token),
                    "POST",
                    "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                    Some("application/json"),
                    serde_json::to_vec(&review)?,
                )
                .await?;
            anyhow::ensure!(r.status == 201, "{}", r.text());
            Ok::<bool, anyhow::Error>(r.json()["status"]["allowed"] == true)
        }
    };
    assert!(may_start(token.trim().to_string()).await?);
    assert!(!may_start(viewer_token.trim().to_string()).await?);
    assert!(
        can_i(
            &t,
            &viewer,
            &["get", "virtualmachines.kubevirt.io", "-n", "a"]
        )
        .await?
    );
    let r = t
        .request_as(
            Some(viewer_token.trim()),
            "PUT",
            start,
            Some("application/json"),
            b"{}".to_vec(),
        )
        .await?;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(
        r.json()["message"],
        "virtualmachines.subresources.kubevirt.io \"vm1\" is forbidden: User \"system:serviceaccount:a:viewer\" cannot update resource \"virtualmachines/start\" in API group \"subresources.kubevirt.io\" in the namespace \"a\""
    );
    let r = t
        .request_as(
            Some(token.trim()),
            "PUT",
            start,
            Some("application/json"),
            b"{}".to_vec(),
        )
        .await?;
    assert_ne!(r.status, 403, "{}", r.text());

    // A client-certificate identity with no bindings.
    let kc = ferrovirt_apiserver::client_kubeconfig(t.dir.path(), "carol", &["dev".into()], 1)?;
    let carol = t.dir.path().join("carol.yaml");
    std::fs::write(&carol, kc)?;
    let out = kubectl_as(&t, &carol, &["auth", "whoami"], None).await?;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("carol") && stdout.contains("dev"),
        "{stdout}"
    );
    let out = kubectl_as(&t, &carol, &["-n", "a", "get", "vms"], None).await?;
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains("Error from server (Forbidden): virtualmachines.kubevirt.io is forbidden: User \"carol\" cannot list resource \"virtualmachines\" in API group \"kubevirt.io\" in the namespace \"a\""),
        "{stderr}"
    );
    assert!(
        !can_i(
            &t,
            &carol,
            &["list", "virtualmachines.kubevirt.io", "-n", "a"]
        )
        .await?
    );
    // Bound through its group, it may.
    t.kubectl_ok(&[
        "-n",
        "a",
        "create",
        "rolebinding",
        "dev-view",
        "--clusterrole=view",
        "--group=dev",
    ])
    .await?;
    eventually("carol's group binding", || async {
        Ok(kubectl_as(&t, &carol, &["-n", "a", "get", "vms"], None)
            .await?
            .status
            .success())
    })
    .await?;
    // Impersonation needs its own permission: carol may not act as the robot …
    let out = kubectl_as(
        &t,
        &carol,
        &[
            "-n",
            "a",
            "get",
            "vms",
            "--as=system:serviceaccount:a:robot",
        ],
        None,
    )
    .await?;
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains("serviceaccounts \"robot\" is forbidden: User \"carol\" cannot impersonate resource \"serviceaccounts\" in API group \"\" in the namespace \"a\""),
        "{stderr}"
    );
    // … the admin may, and sees what the robot may do.
    assert!(
        !can_i(
            &t,
            &admin,
            &[
                "get",
                "secrets",
                "-n",
                "b",
                "--as=system:serviceaccount:a:robot"
            ]
        )
        .await?
    );
    assert!(
        can_i(
            &t,
            &admin,
            &[
                "create",
                "virtualmachines.kubevirt.io",
                "-n",
                "a",
                "--as=system:serviceaccount:a:robot"
            ]
        )
        .await?
    );

    // Roles made with kubectl create: a Role, and a ClusterRole aggregated from a labelled one.
    t.kubectl_ok(&[
        "-n",
        "b",
        "create",
        "role",
        "vm-reader",
        "--verb=get,list",
        "--resource=virtualmachines.kubevirt.io",
    ])
    .await?;
    t.kubectl_ok(&[
        "-n",
        "b",
        "create",
        "rolebinding",
        "carol-reader",
        "--role=vm-reader",
        "--user=carol",
    ])
    .await?;
    eventually("carol's Role in b", || async {
        Ok(kubectl_as(&t, &carol, &["-n", "b", "get", "vms"], None)
            .await?
            .status
            .success())
    })
    .await?;
    t.kubectl_ok(&[
        "create",
        "clusterrole",
        "secret-agg",
        "--aggregation-rule=team=carol",
    ])
    .await?;
    t.kubectl_ok(&[
        "create",
        "clusterrole",
        "secret-reader",
        "--verb=get",
        "--resource=secrets",
    ])
    .await?;
    t.kubectl_ok(&["label", "clusterrole", "secret-reader", "team=carol"])
        .await?;
    t.kubectl_ok(&[
        "create",
        "clusterrolebinding",
        "carol-secrets",
        "--clusterrole=secret-agg",
        "--user=carol",
    ])
    .await?;
    eventually("carol's aggregated ClusterRole", || async {
        can_i(&t, &carol, &["get", "secrets", "-n", "b"]).await
    })
    .await?;
    assert!(!can_i(&t, &carol, &["list", "secrets", "-n", "b"]).await?);

    // The admin is unaffected; deleting the ServiceAccount ends its tokens.
    assert!(can_i(&t, &admin, &["delete", "nodes"]).await?);
    // (Once the server's ServiceAccount cache has seen the delete: the watch's latency, as
    // Kubernetes' informer-fed token authenticator.)
    t.kubectl_ok(&["-n", "a", "delete", "serviceaccount", "robot"])
        .await?;
    eventually("the deleted ServiceAccount's token refused", || async {
        let r = t
            .request_as(
                Some(token.trim()),
                "GET",
                "/apis/kubevirt.io/v1/namespaces/a/virtualmachines",
                None,
                vec![],
            )
            .await?;
        Ok(r.status == 401)
    })
    .await?;
    // A recreated ServiceAccount of the same name is another account.
    t.kubectl_ok(&["-n", "a", "create", "serviceaccount", "robot"])
        .await?;
    let r = t
        .request_as(
            Some(token.trim()),
            "GET",
            "/apis/kubevirt.io/v1/namespaces/a/virtualmachines",
            None,
            vec![],
        )
        .await?;
    assert_eq!(r.status, 401, "{}", r.text());
    t.shutdown().await;
    Ok(())
}

/// TokenReview (authentication.k8s.io/v1), as the agents use it to let Prometheus scrape
/// with a ServiceAccount token: `kubectl create -f` of a review names the token's user and
/// groups; a forged token and a token for another audience are not authenticated (the latter
/// is, when the review asks for that audience); the admin token is the API's only; and a
/// ServiceAccount without `system:auth-delegator` may not review tokens at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_reviews_authenticate_for_delegating_servers() -> Result<()> {
    common::require_kubectl();
    let t = common::start().await?;
    t.kubectl_ok(&["create", "namespace", "a"]).await?;
    t.kubectl_ok(&["-n", "a", "create", "serviceaccount", "prom"])
        .await?;
    let review = |token: &str, audiences: &[&str]| {
        serde_json::json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": token, "audiences": audiences}})
        .to_string()
    };
    let ask = |body: String| {
        let t = &t;
        async move {
            let out = t
                .kubectl_stdin(&["create", "-f", "-", "-o", "json"], Some(&body))
                .await?;
            let (stdout, stderr) = text(&out);
            anyhow::ensure!(out.status.success(), "{stderr}");
            Ok::<_, anyhow::Error>(serde_json::from_str::<serde_json::Value>(&stdout)?)
        }
    };
    let token = t
        .kubectl_ok(&["-n", "a", "create", "token", "prom"])
        .await?;
    let r = ask(review(token.trim(), &[])).await?;
    assert_eq!(r["kind"], "TokenReview", "{r}");
    assert_eq!(r["status"]["authenticated"], true, "{r}");
    assert_eq!(
        r["status"]["user"]["username"],
        "system:serviceaccount:a:prom"
    );
    let groups = r["status"]["user"]["groups"].to_string();
    assert!(
        groups.contains("system:serviceaccounts:a") && groups.contains("system:authenticated"),
        "{groups}"
    );
    assert_eq!(
        r["status"]["audiences"],
        serde_json::json!(["https://kubernetes.default.svc.cluster.local"])
    );
    // A forged token: not authenticated, with an error.
    let forged = format!("{}x", token.trim());
    let r = ask(review(&forged, &[])).await?;
    assert_eq!(r["status"]["authenticated"], false, "{r}");
    assert!(r["status"]["user"].is_null(), "{r}");
    // A token for another service is that service's only.
    let other = t
        .kubectl_ok(&["-n", "a", "create", "token", "prom", "--audience", "other"])
        .await?;
    let r = ask(review(other.trim(), &[])).await?;
    assert_eq!(r["status"]["authenticated"], false, "{r}");
    let r = ask(review(other.trim(), &["other", "more"])).await?;
    assert_eq!(r["status"]["authenticated"], true, "{r}");
    assert_eq!(r["status"]["audiences"], serde_json::json!(["other"]));
    // The admin token is valid for the API server only.
    let admin = t.srv().token.clone();
    let r = ask(review(admin.trim(), &[])).await?;
    assert_eq!(r["status"]["user"]["username"], "system:admin", "{r}");
    let r = ask(review(admin.trim(), &["other"])).await?;
    assert_eq!(r["status"]["authenticated"], false, "{r}");
    // No token: refused naming it.
    let out = t
        .kubectl_stdin(&["create", "-f", "-"], Some(&review("", &[])))
        .await?;
    assert!(!out.status.success());
    assert!(
        text(&out).1.contains("token is required"),
        "{:?}",
        text(&out)
    );
    // prom itself may not review tokens (no system:auth-delegator) …
    let prom = token_kubeconfig(&t, "prom.yaml", token.trim())?;
    let body = review(token.trim(), &[]);
    let out = kubectl_as(
        &t,
        &prom,
        &["create", "--validate=false", "-f", "-"],
        Some(&body),
    )
    .await?;
    assert!(!out.status.success());
    assert!(
        text(&out).1.contains(
            "cannot create resource \"tokenreviews\" in API group \"authentication.k8s.io\""
        ),
        "{:?}",
        text(&out)
    );
    // … until it is bound to it.
    t.kubectl_ok(&[
        "create",
        "clusterrolebinding",
        "prom-delegator",
        "--clusterrole=system:auth-delegator",
        "--serviceaccount=a:prom",
    ])
    .await?;
    eventually("prom may review tokens", || async {
        Ok(kubectl_as(
            &t,
            &prom,
            &["create", "--validate=false", "-f", "-"],
            Some(&body),
        )
        .await?
        .status
        .success())
    })
    .await?;
    t.shutdown().await;
    Ok(())
}

/// The privilege-escalation attack (docs/security.md): a user who may edit VMs and create
/// Roles and RoleBindings in namespace a tries to bind himself `admin` and `cluster-admin`
/// and to make a Role with `*`: refused with Kubernetes' message; a Role with rules he
/// holds is fine; once granted `bind` on `admin` (by name), he may bind that one only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_writes_cannot_escalate() -> Result<()> {
    common::require_kubectl();
    let t = common::start().await?;
    t.kubectl_ok(&["create", "namespace", "a"]).await?;
    t.kubectl_ok(&[
        "create",
        "clusterrole",
        "vm-editor",
        "--verb=get,list,watch,create,update,patch,delete",
        "--resource=virtualmachines.kubevirt.io",
    ])
    .await?;
    t.kubectl_ok(&[
        "create",
        "clusterrole",
        "rbac-writer",
        "--verb=get,list,create,update,patch",
        "--resource=roles.rbac.authorization.k8s.io,rolebindings.rbac.authorization.k8s.io",
    ])
    .await?;
    for role in ["vm-editor", "rbac-writer"] {
        t.kubectl_ok(&[
            "-n",
            "a",
            "create",
            "rolebinding",
            &format!("mallory-{role}"),
            &format!("--clusterrole={role}"),
            "--user=mallory",
        ])
        .await?;
    }
    let kc = ferrovirt_apiserver::client_kubeconfig(t.dir.path(), "mallory", &["dev".into()], 1)?;
    let mallory = t.dir.path().join("mallory.yaml");
    std::fs::write(&mallory, kc)?;
    eventually("mallory's bindings", || async {
        can_i(
            &t,
            &mallory,
            &[
                "create",
                "rolebindings.rbac.authorization.k8s.io",
                "-n",
                "a",
            ],
        )
        .await
    })
    .await?;

    let refused = |args: Vec<String>| {
        let (t, mallory) = (&t, &mallory);
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = kubectl_as(t, mallory, &args, None).await?;
            let (_, stderr) = text(&out);
            anyhow::ensure!(!out.status.success(), "{args:?} was allowed");
            Ok::<String, anyhow::Error>(stderr)
        }
    };
    let bind = |name: &str, role: &str| -> Vec<String> {
        [
            "-n",
            "a",
            "create",
            "rolebinding",
            name,
            role,
            "--user=mallory",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let stderr = refused(bind("m-admin", "--clusterrole=admin")).await?;
    assert!(
        stderr.contains(
            "rolebindings.rbac.authorization.k8s.io \"m-admin\" is forbidden: user \"mallory\" (groups=[\"dev\" \"system:authenticated\"]) is attempting to grant RBAC permissions not currently held:"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("{APIGroups:[\"\"], Resources:[\"secrets\"], Verbs:[\"create\""),
        "{stderr}"
    );
    let stderr = refused(bind("m-root", "--clusterrole=cluster-admin")).await?;
    assert!(
        stderr.contains("{APIGroups:[\"*\"], Resources:[\"*\"], Verbs:[\"*\"]}")
            && stderr.contains("{NonResourceURLs:[\"*\"], Verbs:[\"*\"]}"),
        "{stderr}"
    );
    let star: Vec<String> = [
        "-n",
        "a",
        "create",
        "role",
        "star",
        "--verb=*",
        "--resource=*.*",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let stderr = refused(star.clone()).await?;
    assert!(
        stderr.contains("roles.rbac.authorization.k8s.io \"star\" is forbidden: user \"mallory\"")
            && stderr.contains("{APIGroups:[\"*\"], Resources:[\"*\"], Verbs:[\"*\"]}"),
        "{stderr}"
    );
    // Nothing was written.
    assert!(
        !t.kubectl(&["-n", "a", "get", "rolebinding", "m-admin"])
            .await?
            .status
            .success()
    );
    assert!(
        !t.kubectl(&["-n", "a", "get", "role", "star"])
            .await?
            .status
            .success()
    );
    // A Role with rules he holds, and a binding to it: allowed.
    let out = kubectl_as(
        &t,
        &mallory,
        &[
            "-n",
            "a",
            "create",
            "role",
            "vm-reader",
            "--verb=get,list",
            "--resource=virtualmachines.kubevirt.io",
        ],
        None,
    )
    .await?;
    assert!(out.status.success(), "{:?}", text(&out));
    let out = kubectl_as(
        &t,
        &mallory,
        &[
            "-n",
            "a",
            "create",
            "rolebinding",
            "friend-reader",
            "--role=vm-reader",
            "--user=friend",
        ],
        None,
    )
    .await?;
    assert!(out.status.success(), "{:?}", text(&out));
    // Widening that Role by an update is refused too.
    let out = kubectl_as(
        &t,
        &mallory,
        &[
            "-n",
            "a",
            "patch",
            "role",
            "vm-reader",
            "--type=json",
            "-p",
            r#"[{"op":"add","path":"/rules/-","value":{"apiGroups":[""],"resources":["secrets"],"verbs":["get"]}}]"#,
        ],
        None,
    )
    .await?;
    let (_, stderr) = text(&out);
    assert!(
        !out.status.success()
            && stderr.contains("{APIGroups:[\"\"], Resources:[\"secrets\"], Verbs:[\"get\"]}"),
        "{stderr}"
    );

    // `bind` on exactly the admin ClusterRole, in a.
    t.kubectl_ok(&[
        "create",
        "clusterrole",
        "bind-admin",
        "--verb=bind",
        "--resource=clusterroles.rbac.authorization.k8s.io",
        "--resource-name=admin",
    ])
    .await?;
    t.kubectl_ok(&[
        "-n",
        "a",
        "create",
        "rolebinding",
        "mallory-bind-admin",
        "--clusterrole=bind-admin",
        "--user=mallory",
    ])
    .await?;
    eventually("mallory's bind grant", || async {
        Ok(kubectl_as(
            &t,
            &mallory,
            &[
                "-n",
                "a",
                "create",
                "rolebinding",
                "m-admin",
                "--clusterrole=admin",
                "--user=mallory",
            ],
            None,
        )
        .await?
        .status
        .success())
    })
    .await?;
    refused(bind("m-root", "--clusterrole=cluster-admin")).await?;
    refused(star).await?;
    t.shutdown().await;
    Ok(())
}
