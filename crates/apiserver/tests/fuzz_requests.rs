//! Random requests against a real server (issue #13, "no panic reachable from a request"): a
//! seeded generator sends random methods, paths (core, group and subresource shapes with hostile
//! segments), queries (selectors, limit/continue, watch, resourceVersion, dryRun, grace periods),
//! content types and bodies (random JSON, wrongly typed metadata, deep nesting, JSON/merge/
//! strategic patches with random operations, YAML and raw bytes) to every handler. The server runs
//! in this process, so a panic hook sees a panic on any of its threads; after every batch the
//! server must still answer `/version`, and at the end no panic may have happened and every
//! request must have had an HTTP answer (a dropped connection is how a panicking handler shows).
//!
//! `FERROVIRT_FUZZ_SEED` picks another seed and `FERROVIRT_FUZZ_REQUESTS` another count.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use proptest::prelude::Rng;
use proptest::test_runner::{RngAlgorithm, TestRng};
use serde_json::{Value, json};

struct Gen(TestRng);

impl Gen {
    fn below(&mut self, n: usize) -> usize {
        (self.0.next_u64() % n as u64) as usize
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    /// A path segment: mostly plausible, sometimes hostile.
    fn segment(&mut self) -> String {
        match self.below(14) {
            0 => String::new(),
            1 => "..".into(),
            2 => "%2e%2e".into(),
            3 => "%00".into(),
            4 => "a".repeat(300),
            5 => "é".repeat(130),
            6 => "x%ZZ".into(),
            7 => "%F0%9F%98%80".into(),
            8 => "UPPER_case".into(),
            9 => format!("n{}", self.below(1000)),
            10 => "-leading".into(),
            11 => "a.b.c".into(),
            12 => "~1slash".into(),
            _ => self
                .pick(&["demo", "default", "vm1", "kube-system", "x"])
                .into(),
        }
    }

    fn resource(&mut self) -> (&'static str, &'static str) {
        let all: &[(&str, &str)] = &[
            ("/api/v1", "configmaps"),
            ("/api/v1", "secrets"),
            ("/api/v1", "pods"),
            ("/api/v1", "events"),
            ("/api/v1", "persistentvolumeclaims"),
            ("/api/v1", "nodes"),
            ("/api/v1", "namespaces"),
            ("/apis/kubevirt.io/v1", "virtualmachines"),
            ("/apis/kubevirt.io/v1", "virtualmachineinstances"),
            ("/apis/kubevirt.io/v1", "virtualmachineinstancemigrations"),
            ("/apis/cdi.kubevirt.io/v1beta1", "datavolumes"),
            (
                "/apis/instancetype.kubevirt.io/v1beta1",
                "virtualmachineinstancetypes",
            ),
            ("/apis/coordination.k8s.io/v1", "leases"),
            ("/apis/storage.k8s.io/v1", "storageclasses"),
            ("/apis/hco.kubevirt.io/v1beta1", "hyperconvergeds"),
            ("/apis/nope.example/v9", "widgets"),
        ];
        all[self.below(all.len())]
    }

    fn path(&mut self) -> String {
        let (gv, res) = self.resource();
        let mut p = match self.below(8) {
            0 => self
                .pick(&[
                    "/",
                    "/api",
                    "/apis",
                    "/version",
                    "/healthz",
                    "/openapi/v2",
                    "/openapi/v3",
                    "/apis/kubevirt.io",
                    "//api//v1",
                ])
                .to_string(),
            1 => format!("{gv}/{res}"),
            2 => format!("{gv}/namespaces/{}/{res}", self.segment()),
            3 | 4 => format!(
                "{gv}/namespaces/{}/{res}/{}",
                self.segment(),
                self.segment()
            ),
            5 => format!(
                "{gv}/namespaces/{}/{res}/{}/{}",
                self.segment(),
                self.segment(),
                self.pick(&["status", "scale", "log", "console", "eviction", "", "x"])
            ),
            6 => format!(
                "/apis/subresources.kubevirt.io/v1/namespaces/{}/{}/{}/{}",
                self.segment(),
                self.pick(&["virtualmachines", "virtualmachineinstances", "bogus"]),
                self.segment(),
                self.pick(&[
                    "start",
                    "stop",
                    "restart",
                    "pause",
                    "unpause",
                    "guestosinfo"
                ])
            ),
            _ => format!("{gv}/{}", self.segment()),
        };
        if self.chance(60) {
            p.push('?');
            let n = 1 + self.below(3);
            let mut parts = Vec::new();
            for _ in 0..n {
                parts.push(self.query_pair());
            }
            p.push_str(&parts.join("&"));
        }
        p
    }

    fn query_pair(&mut self) -> String {
        let v = |g: &mut Gen, xs: &[&str]| g.pick(xs).to_string();
        match self.below(12) {
            0 => format!(
                "labelSelector={}",
                v(
                    self,
                    &[
                        "a%3Db",
                        "a+in+(x,y)",
                        "!a",
                        "a%3D%3D",
                        "(((",
                        "a!=",
                        "%FF",
                        "a=b,c"
                    ]
                )
            ),
            1 => format!(
                "fieldSelector={}",
                v(
                    self,
                    &[
                        "metadata.name%3Dx",
                        "status.phase!=Running",
                        "spec.nodeName=",
                        "x%3D%3D%3D",
                        "involvedObject.uid%3D%00"
                    ]
                )
            ),
            2 => format!(
                "limit={}",
                v(self, &["-1", "0", "1", "99999999999999999999", "abc", ""])
            ),
            3 => format!(
                "continue={}",
                v(self, &["abc", "eyJ4IjoxfQ", "%FF%FE", "", "=="])
            ),
            4 => "watch=true&timeoutSeconds=1".into(),
            5 => format!(
                "resourceVersion={}",
                v(self, &["0", "-5", "abc", "99999999999999999999", ""])
            ),
            6 => format!(
                "resourceVersionMatch={}",
                v(self, &["NotOlderThan", "Exact", "bogus"])
            ),
            7 => format!("dryRun={}", v(self, &["All", "bogus", ""])),
            8 => format!(
                "gracePeriodSeconds={}",
                v(self, &["-5", "0", "abc", "99999999999"])
            ),
            9 => format!(
                "propagationPolicy={}",
                v(self, &["Foreground", "Orphan", "bogus"])
            ),
            10 => format!(
                "fieldValidation={}",
                v(self, &["Strict", "Warn", "Ignore", "bogus"])
            ),
            _ => format!(
                "{}={}",
                v(
                    self,
                    &["sendInitialEvents", "allowWatchBookmarks", "pretty", "x"]
                ),
                v(self, &["true", "false", "1", ""])
            ),
        }
    }

    fn scalar(&mut self) -> Value {
        match self.below(8) {
            0 => Value::Null,
            1 => json!(self.chance(50)),
            2 => json!(self.0.next_u64() as i64),
            3 => json!(-1.5e300),
            4 => json!("é".repeat(self.below(300))),
            5 => json!(""),
            6 => json!([]),
            _ => json!({}),
        }
    }

    /// Random JSON of bounded size; `depth` bounds nesting.
    fn value(&mut self, depth: usize) -> Value {
        if depth == 0 || self.chance(30) {
            return self.scalar();
        }
        if self.chance(50) {
            let n = self.below(4);
            Value::Array((0..n).map(|_| self.value(depth - 1)).collect())
        } else {
            let mut m = serde_json::Map::new();
            for _ in 0..self.below(4) {
                let k = self.pick(&[
                    "metadata",
                    "spec",
                    "status",
                    "name",
                    "labels",
                    "kind",
                    "apiVersion",
                    "data",
                    "x",
                    "",
                    "template",
                    "domain",
                    "devices",
                ]);
                m.insert(k.to_string(), self.value(depth - 1));
            }
            Value::Object(m)
        }
    }

    fn object(&mut self) -> Value {
        let kind = self.pick(&[
            "ConfigMap",
            "Secret",
            "VirtualMachine",
            "VirtualMachineInstance",
            "DataVolume",
            "Namespace",
            "Widget",
        ]);
        let api = self.pick(&["v1", "kubevirt.io/v1", "cdi.kubevirt.io/v1beta1", "x/y/z"]);
        let name = match self.below(6) {
            0 => json!(5),
            1 => json!(self.segment()),
            2 => json!(null),
            _ => json!(format!("fz-{}", self.below(50))),
        };
        let mut meta = json!({"name": name});
        if self.chance(30) {
            meta["generateName"] = json!(format!("{}-", "ü".repeat(self.below(200))));
        }
        if self.chance(30) {
            meta["labels"] = match self.below(3) {
                0 => json!({"a/b/c": "x", "ok": "é"}),
                1 => json!([1, 2]),
                _ => json!({"k": "v".repeat(self.below(100))}),
            };
        }
        if self.chance(20) {
            meta["resourceVersion"] = json!(self.pick(&["1", "abc", "-1"]));
        }
        if self.chance(20) {
            meta["finalizers"] = json!(["x/y", 5]);
        }
        let mut o = json!({"apiVersion": api, "kind": kind, "metadata": meta});
        if self.chance(70) {
            o["spec"] = self.value(4);
        }
        if self.chance(40) {
            o["data"] = self.value(2);
        }
        o
    }

    fn json_patch(&mut self) -> Value {
        let n = self.below(6);
        let ops: Vec<Value> = (0..n)
            .map(|_| {
                let op = self.pick(&["add", "remove", "replace", "move", "copy", "test", "bogus"]);
                let path = self.pick(&[
                    "",
                    "/",
                    "/metadata/labels/a",
                    "/metadata/labels/~1x~0",
                    "/spec/-",
                    "/spec/0/1/2",
                    "/metadata",
                    "/metadata/name",
                    "/data/~2",
                    "no-slash",
                ]);
                let mut o = json!({"op": op, "path": path});
                if self.chance(70) {
                    o["value"] = self.value(3);
                }
                if self.chance(30) {
                    o["from"] = json!(self.pick(&["/metadata", "/spec", "/x/y", ""]));
                }
                o
            })
            .collect();
        Value::Array(ops)
    }

    fn body(&mut self, method: &str) -> (Option<&'static str>, Vec<u8>) {
        let ct = match method {
            "PATCH" => Some(self.pick(&[
                "application/json-patch+json",
                "application/merge-patch+json",
                "application/strategic-merge-patch+json",
                "application/apply-patch+yaml",
                "application/json",
                "text/plain",
            ])),
            "GET" | "DELETE" | "HEAD" if self.chance(70) => None,
            _ => Some(self.pick(&[
                "application/json",
                "application/yaml",
                "application/vnd.kubernetes.protobuf",
                "text/plain",
                "application/json; charset=utf-8",
            ])),
        };
        let bytes = match self.below(10) {
            0 => Vec::new(),
            1 => (0..self.below(600))
                .map(|_| self.below(256) as u8)
                .collect(),
            2 => {
                let d = 1 + self.below(300);
                format!("{}{}", "[".repeat(d), "]".repeat(d)).into_bytes()
            }
            3 => b"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: [x\n".to_vec(),
            4 | 5 if ct == Some("application/json-patch+json") || self.chance(30) => {
                serde_json::to_vec(&self.json_patch()).expect("json")
            }
            6 => serde_json::to_vec(&self.value(5)).expect("json"),
            _ => serde_json::to_vec(&self.object()).expect("json"),
        };
        (ct, bytes)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_never_panic_the_server() -> Result<()> {
    let panics = Arc::new(AtomicUsize::new(0));
    let seen = panics.clone();
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        seen.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));

    let ts = common::start().await?;
    // Some objects for the name-addressed paths to find.
    for n in 0..5 {
        ts.request(
            "POST",
            "/api/v1/namespaces/default/configmaps",
            Some(json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": format!("fz-{n}"), "labels": {"a": "b"}},
                        "data": {"k": "v"}})),
        )
        .await?;
    }

    let seed: u64 = std::env::var("FERROVIRT_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(13);
    let count: usize = std::env::var("FERROVIRT_FUZZ_REQUESTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1500);
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut g = Gen(TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes));

    let token = ts.srv().token.clone();
    let started = Instant::now();
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    let mut no_answer = Vec::new();
    let mut sent = 0;
    while sent < count && started.elapsed() < Duration::from_secs(90) {
        let method = g.pick(&[
            "GET", "GET", "POST", "PUT", "PATCH", "PATCH", "DELETE", "HEAD", "OPTIONS",
        ]);
        let path = g.path();
        let (ct, body) = g.body(method);
        let tok = if g.chance(3) {
            None
        } else {
            Some(token.as_str())
        };
        match tokio::time::timeout(
            Duration::from_secs(20),
            ts.request_as(tok, method, &path, ct, body),
        )
        .await
        {
            Ok(Ok(r)) => *statuses.entry(r.status).or_default() += 1,
            Ok(Err(e)) => no_answer.push(format!("{method} {path}: {e:#}")),
            Err(_) => no_answer.push(format!("{method} {path}: no answer in 20 s")),
        }
        sent += 1;
        if sent % 100 == 0 {
            let v = ts.request("GET", "/version", None).await?;
            if v.status != 200 {
                bail!("/version answered {} after {sent} requests", v.status);
            }
        }
    }
    eprintln!(
        "fuzz: {sent} requests (seed {seed}) in {:.1} s, statuses {statuses:?}",
        started.elapsed().as_secs_f64()
    );
    let v = ts.request("GET", "/version", None).await?;
    assert_eq!(v.status, 200, "the server stopped answering");
    assert_eq!(
        panics.load(Ordering::SeqCst),
        0,
        "a request panicked the server"
    );
    assert!(
        no_answer.is_empty(),
        "{} requests got no HTTP answer, e.g. {:?}",
        no_answer.len(),
        &no_answer[..no_answer.len().min(5)]
    );
    assert!(sent >= 500, "only {sent} requests were sent in 90 s");
    ts.shutdown().await;
    Ok(())
}
