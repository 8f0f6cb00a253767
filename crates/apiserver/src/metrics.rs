//! Request counters by verb, resource and client (`User-Agent`), served as Prometheus text at
//! `/metrics` (behind the same token as everything else). They let tests (and operators) see
//! which component lists what, e.g. that node agents in steady state only watch.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// One counter's key: verb (`LIST`, `WATCH`, `GET`, `CREATE`, `UPDATE`, `PATCH`, `DELETE`,
/// `DELETECOLLECTION`), `group/resource` (core resources have an empty group) and user agent.
type Key = (&'static str, String, String);

/// Counts resource requests.
#[derive(Debug, Default)]
pub(crate) struct RequestCounter {
    counts: Mutex<BTreeMap<Key, u64>>,
}

/// The longest user agent kept (longer ones are cut; a client cannot grow the map's keys).
const MAX_AGENT: usize = 128;
/// Distinct keys kept; requests beyond are counted under user agent `other`.
const MAX_KEYS: usize = 4096;

impl RequestCounter {
    /// Counts one request.
    pub fn count(&self, verb: &'static str, group: &str, resource: &str, user_agent: &str) {
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
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let mut key = (verb, resource, agent);
        if counts.len() >= MAX_KEYS && !counts.contains_key(&key) {
            key.2 = "other".into();
        }
        *counts.entry(key).or_default() += 1;
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
