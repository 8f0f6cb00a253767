//! Request counters by verb, resource and client (`User-Agent`) and request latencies by verb
//! and resource (`apiserver_request_duration_seconds`, a histogram through `prometheus-client`),
//! served as Prometheus text at `/metrics` (behind the same token as everything else), with the
//! cluster series of `crate::cluster_metrics`. The counters let tests (and operators) see which
//! component lists what, e.g. that node agents in steady state only watch. The counters keep
//! their own bounded map (a client chooses its user agent: at most [`MAX_KEYS`] keys).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Kubernetes' buckets for `apiserver_request_duration_seconds`.
const BUCKETS: [f64; 20] = [
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0,
    10.0, 15.0, 30.0,
];

type DurationLabels = Vec<(&'static str, String)>;
type Durations = Family<DurationLabels, Histogram, fn() -> Histogram>;

fn new_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// Records a request's latency into the histogram when dropped (at the end of its handling;
/// a watch is not timed: it lasts as long as the client wants).
pub(crate) struct RequestTimer {
    durations: Option<(Durations, DurationLabels)>,
    started: Instant,
}

impl Drop for RequestTimer {
    fn drop(&mut self) {
        if let Some((d, labels)) = self.durations.take() {
            d.get_or_create(&labels)
                .observe(self.started.elapsed().as_secs_f64());
        }
    }
}

/// One counter's key: verb (`LIST`, `WATCH`, `GET`, `CREATE`, `UPDATE`, `PATCH`, `DELETE`,
/// `DELETECOLLECTION`), `group/resource` (core resources have an empty group) and user agent.
type Key = (&'static str, String, String);

/// Counts resource requests and times them.
#[derive(Debug)]
pub(crate) struct RequestCounter {
    counts: Mutex<BTreeMap<Key, u64>>,
    durations: Durations,
}

impl Default for RequestCounter {
    fn default() -> Self {
        RequestCounter {
            counts: Mutex::default(),
            durations: Family::new_with_constructor(new_histogram),
        }
    }
}

/// The longest user agent kept (longer ones are cut; a client cannot grow the map's keys).
const MAX_AGENT: usize = 128;
/// Distinct keys kept; requests beyond are counted under user agent `other`.
const MAX_KEYS: usize = 4096;

impl RequestCounter {
    /// Counts one request; the timer returned records its latency when dropped.
    pub fn count(
        &self,
        verb: &'static str,
        group: &str,
        resource: &str,
        user_agent: &str,
    ) -> RequestTimer {
        let agent: String = user_agent
            .chars()
            .filter(|c| c.is_ascii_graphic() || *c == ' ')
            .take(MAX_AGENT)
            .collect();
        let resource = if group.is_empty() {
            resource.to_string()
        } else {
            format!("{resource}.{group}")
        };
        let timed = (verb != "WATCH").then(|| {
            (
                self.durations.clone(),
                vec![("verb", verb.to_string()), ("resource", resource.clone())],
            )
        });
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let mut key = (verb, resource, agent);
        if counts.len() >= MAX_KEYS && !counts.contains_key(&key) {
            key.2 = "other".into();
        }
        *counts.entry(key).or_default() += 1;
        RequestTimer {
            durations: timed,
            started: Instant::now(),
        }
    }

    /// The counters in Prometheus text format (`apiserver_request_total`).
    pub fn render(&self) -> String {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = String::from(
            "# HELP apiserver_request_total Resource requests by verb, resource and user agent.\n\
             # TYPE apiserver_request_total counter\n",
        );
        for ((verb, resource, agent), n) in counts.iter() {
            out.push_str(&format!(
                "apiserver_request_total{{verb=\"{verb}\",resource=\"{}\",user_agent=\"{}\"}} {n}\n",
                escape(resource),
                escape(agent)
            ));
        }
        drop(counts);
        let mut reg = Registry::default();
        reg.register(
            "apiserver_request_duration_seconds",
            "Response latency distribution in seconds for each verb and resource (watches not \
             timed).",
            self.durations.clone(),
        );
        let mut text = String::new();
        if encode(&mut text, &reg).is_ok() {
            out.push_str(text.trim_end().trim_end_matches("# EOF"));
        }
        out
    }
}

/// Escapes a Prometheus label value.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// The verb of a resource request (Kubernetes' names, upper case as in its metrics).
pub(crate) fn verb(method: &str, named: bool, watching: bool) -> &'static str {
    match (method, named) {
        ("GET" | "HEAD", _) if watching => "WATCH",
        ("GET" | "HEAD", false) => "LIST",
        ("GET" | "HEAD", true) => "GET",
        ("POST", _) => "CREATE",
        ("PUT", _) => "UPDATE",
        ("PATCH", _) => "PATCH",
        ("DELETE", true) => "DELETE",
        ("DELETE", false) => "DELETECOLLECTION",
        _ => "OTHER",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_verb_resource_and_agent() {
        let c = RequestCounter::default();
        c.count(
            "LIST",
            "kubevirt.io",
            "virtualmachineinstances",
            "ferrovirt-agent/n1",
        );
        c.count(
            "LIST",
            "kubevirt.io",
            "virtualmachineinstances",
            "ferrovirt-agent/n1",
        );
        c.count("WATCH", "", "nodes", "x\"y");
        let text = c.render();
        // LISTs are timed, watches are not.
        assert!(
            text.contains(
                "apiserver_request_duration_seconds_count{verb=\"LIST\",resource=\"virtualmachineinstances.kubevirt.io\"} 2"
            ),
            "{text}"
        );
        assert!(
            !text.contains("verb=\"WATCH\",resource=\"nodes\"} "),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
        assert!(text.contains(
            "apiserver_request_total{verb=\"LIST\",resource=\"virtualmachineinstances.kubevirt.io\",user_agent=\"ferrovirt-agent/n1\"} 2\n"
        ));
        assert!(text.contains(
            "apiserver_request_total{verb=\"WATCH\",resource=\"nodes\",user_agent=\"x\\\"y\"} 1\n"
        ));
    }

    #[test]
    fn verbs() {
        assert_eq!(verb("GET", false, false), "LIST");
        assert_eq!(verb("GET", false, true), "WATCH");
        assert_eq!(verb("GET", true, false), "GET");
        assert_eq!(verb("DELETE", false, false), "DELETECOLLECTION");
        assert_eq!(verb("PATCH", true, false), "PATCH");
    }

    #[test]
    fn key_count_is_bounded() {
        let c = RequestCounter::default();
        for i in 0..MAX_KEYS + 10 {
            c.count("GET", "", "pods", &format!("agent-{i}"));
        }
        assert!(c.counts.lock().unwrap().len() <= MAX_KEYS + 1);
        assert!(c.render().contains("user_agent=\"other\"} 10"));
    }
}
