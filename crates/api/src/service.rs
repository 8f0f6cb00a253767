//! core/v1 Service admission (defaults and validation, pure) and the vocabulary the API
//! server's allocators, the endpoints controller and the agents' data plane share: the service
//! IP range ([`ServiceCidr`]), the NodePort range, the label that ties an EndpointSlice to its
//! Service. What ferrovirt cannot carry out is refused naming the field (type LoadBalancer and
//! ExternalName, sessionAffinity ClientIP, externalIPs, traffic policy Local, dual stack, SCTP).

use std::net::Ipv4Addr;

use serde_json::{Map, Value, json};

use crate::admission::{FieldError, Operation, is_dns1123_label};

/// The default service IP range (`--service-cidr`), Kubernetes' usual one; disjoint from the
/// default pod network 10.244.0.0/16.
pub const DEFAULT_SERVICE_CIDR: &str = "10.96.0.0/16";
/// The NodePort range, as Kubernetes' default `--service-node-port-range`.
pub const NODE_PORT_MIN: u16 = 30000;
pub const NODE_PORT_MAX: u16 = 32767;
/// The EndpointSlice label naming its Service (Kubernetes' `discovery.LabelServiceName`).
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// The EndpointSlice label naming the controller that manages it.
pub const LABEL_MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";
/// ferrovirt's value of [`LABEL_MANAGED_BY`].
pub const MANAGED_BY: &str = "endpointslice-controller.ferrovirt.io";

/// An IPv4 range for Service ClusterIPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceCidr {
    pub network: Ipv4Addr,
    pub prefix: u8,
}

/// A service CIDR that does not parse or is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid service CIDR {input:?}: {reason}")]
pub struct CidrError {
    pub input: String,
    pub reason: &'static str,
}

impl std::str::FromStr for ServiceCidr {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Self, CidrError> {
        let err = |reason| CidrError {
            input: s.to_string(),
            reason,
        };
        let (ip, len) = s.split_once('/').ok_or_else(|| err("expected A.B.C.D/N"))?;
        let network: Ipv4Addr = ip.parse().map_err(|_| err("not an IPv4 address"))?;
        let prefix: u8 = len.parse().map_err(|_| err("bad prefix length"))?;
        if !(8..=28).contains(&prefix) {
            return Err(err("the prefix length must be between 8 and 28"));
        }
        let c = ServiceCidr { network, prefix };
        if u32::from(network) & !c.mask() != 0 {
            return Err(err("host bits are set"));
        }
        Ok(c)
    }
}

impl std::fmt::Display for ServiceCidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl ServiceCidr {
    fn mask(&self) -> u32 {
        u32::MAX << (32 - u32::from(self.prefix))
    }
    /// Whether `ip` is in the range.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.network)
    }
    /// Whether two ranges share an address.
    pub fn overlaps(&self, network: Ipv4Addr, prefix: u8) -> bool {
        let p = prefix.min(self.prefix).clamp(1, 32);
        let m = u32::MAX << (32 - u32::from(p));
        u32::from(network) & m == u32::from(self.network) & m
    }
    /// How many addresses can be handed out (network and broadcast addresses excluded).
    pub fn usable(&self) -> u32 {
        (1u32 << (32 - u32::from(self.prefix))) - 2
    }
    /// The `i`-th usable address (`i` taken modulo [`Self::usable`]).
    pub fn nth(&self, i: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + 1 + i % self.usable())
    }
    /// Whether `ip` may be handed out: in the range, neither its network nor broadcast address.
    pub fn assignable(&self, ip: Ipv4Addr) -> bool {
        let n = u32::from(ip);
        self.contains(ip)
            && n != u32::from(self.network)
            && n != u32::from(self.network) | !self.mask()
    }
}

/// Kubernetes' message for a ClusterIP outside the range.
pub fn ip_out_of_range(ip: &str, cidr: &ServiceCidr) -> String {
    format!(
        "failed to allocate IP {ip}: the provided IP ({ip}) is not in the valid range. The range of valid IPs is {cidr}"
    )
}

/// Kubernetes' message for a ClusterIP in use.
pub fn ip_taken(ip: &str) -> String {
    format!("failed to allocate IP {ip}: provided IP is already allocated")
}

/// Kubernetes' message for a NodePort in use.
pub const PORT_TAKEN: &str = "provided port is already allocated";

/// Whether `clusterIP` means a headless Service.
pub fn is_headless(obj: &Value) -> bool {
    obj.pointer("/spec/clusterIP").and_then(Value::as_str) == Some("None")
}

/// The (port index, nodePort) pairs of a NodePort Service.
pub fn node_ports(obj: &Value) -> Vec<(usize, u16)> {
    ports(obj)
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let n = p.get("nodePort").and_then(Value::as_u64)?;
            u16::try_from(n).ok().filter(|n| *n > 0).map(|n| (i, n))
        })
        .collect()
}

fn ports(obj: &Value) -> &[Value] {
    obj.pointer("/spec/ports")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

fn str_at<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str).filter(|s| !s.is_empty())
}

/// Defaults Kubernetes applies to a Service (and the values an update carries over from the
/// stored one when left out: ClusterIP, NodePorts), in place.
pub fn default_service(obj: &mut Value, old: Option<&Value>) {
    let old_spec = old.and_then(|o| o.get("spec")).cloned().unwrap_or_default();
    let Some(root) = obj.as_object_mut() else {
        return;
    };
    let spec = root.entry("spec").or_insert_with(|| json!({}));
    let Some(spec) = spec.as_object_mut() else {
        return;
    };
    let set = |spec: &mut Map<String, Value>, k: &str, v: Value| {
        if spec.get(k).is_none_or(|x| x.is_null() || x == "") {
            spec.insert(k.into(), v);
        }
    };
    set(spec, "type", json!("ClusterIP"));
    set(spec, "sessionAffinity", json!("None"));
    set(spec, "internalTrafficPolicy", json!("Cluster"));
    let ty = spec
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if ty == "NodePort" {
        set(spec, "externalTrafficPolicy", json!("Cluster"));
    }
    // ClusterIP: `clusterIP` and `clusterIPs[0]` mirror each other; an update that leaves both
    // out keeps the allocated one.
    let first = spec
        .get("clusterIPs")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .map(str::to_string);
    let ip = spec
        .get("clusterIP")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .or(first)
        .or_else(|| str_at(&old_spec, "clusterIP").map(str::to_string));
    match ip {
        Some(ip) => {
            spec.insert("clusterIP".into(), json!(ip));
            if spec
                .get("clusterIPs")
                .is_none_or(|v| v.is_null() || v == &json!([]))
            {
                spec.insert("clusterIPs".into(), json!([ip]));
            }
        }
        None => {
            spec.remove("clusterIP");
            spec.remove("clusterIPs");
        }
    }
    set(spec, "ipFamilies", json!(["IPv4"]));
    set(spec, "ipFamilyPolicy", json!("SingleStack"));
    let old_ports = old_spec
        .get("ports")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if let Some(Value::Array(ps)) = spec.get_mut("ports") {
        for p in ps.iter_mut().filter_map(Value::as_object_mut) {
            if p.get("protocol").is_none_or(|v| v.is_null() || v == "") {
                p.insert("protocol".into(), json!("TCP"));
            }
            let port = p.get("port").cloned().unwrap_or(Value::Null);
            if p.get("targetPort")
                .is_none_or(|v| v.is_null() || v == 0 || v == "")
            {
                p.insert("targetPort".into(), port.clone());
            }
            if p.get("nodePort").is_some_and(|v| v.is_null() || v == 0) {
                p.remove("nodePort");
            }
            // The NodePort of the same port and protocol is kept when an update leaves it
            // out, and dropped when the Service no longer is a NodePort one.
            let same = old_ports
                .iter()
                .find(|o| o.get("port") == Some(&port) && o.get("protocol") == p.get("protocol"));
            let old_np = same
                .and_then(|o| o.get("nodePort"))
                .filter(|v| !v.is_null());
            if ty == "NodePort" {
                if let (None, Some(np)) = (p.get("nodePort"), old_np) {
                    p.insert("nodePort".into(), np.clone());
                }
            } else if old_np.is_some() && p.get("nodePort") == old_np {
                p.remove("nodePort");
            }
        }
    }
    let status = root.entry("status").or_insert_with(|| json!({}));
    if let Some(s) = status.as_object_mut() {
        s.entry("loadBalancer").or_insert_with(|| json!({}));
    }
}

/// An IANA service name (a named targetPort): 1–15 lower-case letters, digits and inner
/// single hyphens, at least one letter.
pub fn is_port_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.bytes().any(|b| b.is_ascii_lowercase())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

/// Validates a defaulted Service. `old` is the stored one on update.
pub fn validate_service(obj: &Value, op: Operation, old: Option<&Value>) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let Some(spec) = obj.get("spec").filter(|s| s.is_object()) else {
        errs.push(FieldError::required("spec", "Required value"));
        return errs;
    };
    let ty = str_at(spec, "type").unwrap_or("ClusterIP");
    match ty {
        "ClusterIP" | "NodePort" => {}
        other => errs.push(FieldError::not_supported(
            "spec.type",
            format!(
                "Unsupported value: {other:?}: supported values: \"ClusterIP\", \"NodePort\" (ferrovirt has no load balancer and no external DNS names)"
            ),
        )),
    }
    match str_at(spec, "sessionAffinity").unwrap_or("None") {
        "None" => {}
        other => errs.push(FieldError::not_supported(
            "spec.sessionAffinity",
            format!(
                "Unsupported value: {other:?}: supported values: \"None\" (ferrovirt spreads connections over the endpoints without client affinity)"
            ),
        )),
    }
    if spec
        .get("sessionAffinityConfig")
        .is_some_and(|v| !v.is_null())
    {
        errs.push(FieldError::forbidden(
            "spec.sessionAffinityConfig",
            "Forbidden: only used with sessionAffinity ClientIP, which is not supported",
        ));
    }
    for (field, what) in [
        ("externalIPs", "external IPs are not carried out"),
        (
            "loadBalancerIP",
            "may only be used when `type` is 'LoadBalancer'",
        ),
        (
            "loadBalancerSourceRanges",
            "may only be used when `type` is 'LoadBalancer'",
        ),
        (
            "loadBalancerClass",
            "may only be used when `type` is 'LoadBalancer'",
        ),
        (
            "allocateLoadBalancerNodePorts",
            "may only be used when `type` is 'LoadBalancer'",
        ),
        (
            "healthCheckNodePort",
            "may only be used with externalTrafficPolicy Local",
        ),
        (
            "externalName",
            "may only be used when `type` is 'ExternalName'",
        ),
        (
            "trafficDistribution",
            "topology-aware routing is not carried out",
        ),
    ] {
        let set = match spec.get(field) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::String(s)) => !s.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Number(n)) => n.as_i64() != Some(0),
            Some(_) => true,
        };
        if set {
            errs.push(FieldError::forbidden(
                format!("spec.{field}"),
                format!("Forbidden: {what}"),
            ));
        }
    }
    for field in ["externalTrafficPolicy", "internalTrafficPolicy"] {
        match str_at(spec, field) {
            None | Some("Cluster") => {}
            Some(v) => errs.push(FieldError::not_supported(
                format!("spec.{field}"),
                format!("Unsupported value: {v:?}: supported values: \"Cluster\""),
            )),
        }
    }
    if ty != "NodePort" && str_at(spec, "externalTrafficPolicy").is_some() {
        errs.push(FieldError::invalid(
            "spec.externalTrafficPolicy",
            "Invalid value: may only be set for externally-accessible services",
        ));
    }
    validate_families(spec, &mut errs);
    let headless = str_at(spec, "clusterIP") == Some("None");
    validate_cluster_ip(spec, ty, headless, &mut errs);
    if let Some(sel) = spec.get("selector").filter(|v| !v.is_null()) {
        match sel.as_object() {
            Some(m) => {
                for (k, v) in m {
                    if k.is_empty() || !v.is_string() {
                        errs.push(FieldError::invalid(
                            format!("spec.selector[{k}]"),
                            "Invalid value: selector keys and values must be label strings",
                        ));
                    }
                }
            }
            None => errs.push(FieldError::type_invalid("spec.selector", "must be a map")),
        }
    }
    validate_ports(spec, ty, headless, &mut errs);
    if op == Operation::Update
        && let Some(old_spec) = old.and_then(|o| o.get("spec"))
    {
        let (was, now) = (str_at(old_spec, "clusterIP"), str_at(spec, "clusterIP"));
        if was.is_some() && was != now {
            errs.push(FieldError::invalid(
                "spec.clusterIPs[0]",
                format!(
                    "Invalid value: {:?}: may not change once set",
                    now.unwrap_or_default()
                ),
            ));
        }
    }
    errs
}

fn validate_families(spec: &Value, errs: &mut Vec<FieldError>) {
    if let Some(fams) = spec.get("ipFamilies").and_then(Value::as_array) {
        for (i, f) in fams.iter().enumerate() {
            if f != "IPv4" {
                errs.push(FieldError::not_supported(
                    format!("spec.ipFamilies[{i}]"),
                    format!("Unsupported value: {f}: supported values: \"IPv4\""),
                ));
            }
        }
    }
    match str_at(spec, "ipFamilyPolicy") {
        None | Some("SingleStack" | "PreferDualStack") => {}
        Some(p) => errs.push(FieldError::not_supported(
            "spec.ipFamilyPolicy",
            format!(
                "Unsupported value: {p:?}: supported values: \"SingleStack\", \"PreferDualStack\" (the service network is IPv4 only)"
            ),
        )),
    }
}

fn validate_cluster_ip(spec: &Value, ty: &str, headless: bool, errs: &mut Vec<FieldError>) {
    let ip = str_at(spec, "clusterIP");
    if let Some(ip) = ip
        && ip != "None"
        && ip.parse::<Ipv4Addr>().is_err()
    {
        errs.push(FieldError::invalid(
            "spec.clusterIPs[0]",
            format!("Invalid value: {ip:?}: must be a valid IPv4 address or \"None\""),
        ));
    }
    if headless && ty == "NodePort" {
        errs.push(FieldError::invalid(
            "spec.clusterIPs[0]",
            "Invalid value: \"None\": may not be set to 'None' for NodePort services",
        ));
    }
    if let Some(ips) = spec.get("clusterIPs").and_then(Value::as_array) {
        if ips.len() > 1 {
            errs.push(FieldError::invalid(
                "spec.clusterIPs",
                "Invalid value: only one ClusterIP (IPv4, single stack) is supported",
            ));
        }
        if let Some(first) = ips.first().and_then(Value::as_str)
            && Some(first) != ip
        {
            errs.push(FieldError::invalid(
                "spec.clusterIPs[0]",
                format!("Invalid value: {first:?}: must match `clusterIP` {ip:?}"),
            ));
        }
    }
}

fn validate_ports(spec: &Value, ty: &str, headless: bool, errs: &mut Vec<FieldError>) {
    let ports = spec
        .get("ports")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if ports.is_empty() && !headless {
        errs.push(FieldError::required("spec.ports", "Required value"));
    }
    let mut seen_names = Vec::new();
    let mut seen = Vec::new();
    let mut seen_np = Vec::new();
    for (i, p) in ports.iter().enumerate() {
        let at = |f: &str| format!("spec.ports[{i}].{f}");
        let name = p.get("name").and_then(Value::as_str).unwrap_or_default();
        if name.is_empty() && ports.len() > 1 {
            errs.push(FieldError::required(at("name"), "Required value"));
        } else if !name.is_empty() {
            if !is_dns1123_label(name) {
                errs.push(FieldError::invalid(
                    at("name"),
                    format!("Invalid value: {name:?}: a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'"),
                ));
            }
            if seen_names.contains(&name) {
                errs.push(FieldError::duplicate(
                    at("name"),
                    format!("Duplicate value: {name:?}"),
                ));
            }
            seen_names.push(name);
        }
        let port = p.get("port").and_then(Value::as_i64).unwrap_or(0);
        if !(1..=65535).contains(&port) {
            errs.push(FieldError::invalid(
                at("port"),
                format!("Invalid value: {port}: must be between 1 and 65535, inclusive"),
            ));
        }
        let proto = p.get("protocol").and_then(Value::as_str).unwrap_or("TCP");
        if !matches!(proto, "TCP" | "UDP") {
            errs.push(FieldError::not_supported(
                at("protocol"),
                format!("Unsupported value: {proto:?}: supported values: \"TCP\", \"UDP\""),
            ));
        }
        if seen.contains(&(port, proto)) {
            errs.push(FieldError::duplicate(
                format!("spec.ports[{i}]"),
                format!("Duplicate value: port {port}/{proto}"),
            ));
        }
        seen.push((port, proto));
        match p.get("targetPort") {
            Some(Value::Number(n)) if (1..=65535).contains(&n.as_i64().unwrap_or(0)) => {}
            Some(Value::String(s)) if is_port_name(s) => {}
            Some(v) => errs.push(FieldError::invalid(
                at("targetPort"),
                format!("Invalid value: {v}: must be a port number between 1 and 65535 or an IANA service name"),
            )),
            None => {}
        }
        if let Some(np) = p.get("nodePort").filter(|v| !v.is_null()) {
            let n = np.as_i64().unwrap_or(-1);
            if ty != "NodePort" {
                errs.push(FieldError::forbidden(
                    at("nodePort"),
                    format!("Forbidden: may not be used when `type` is '{ty}'"),
                ));
            } else if !(i64::from(NODE_PORT_MIN)..=i64::from(NODE_PORT_MAX)).contains(&n) {
                errs.push(FieldError::invalid(
                    at("nodePort"),
                    format!(
                        "Invalid value: {np}: provided port is not in the valid range. The range of valid ports is {NODE_PORT_MIN}-{NODE_PORT_MAX}"
                    ),
                ));
            } else if seen_np.contains(&(n, proto)) {
                errs.push(FieldError::duplicate(
                    at("nodePort"),
                    format!("Duplicate value: {n}"),
                ));
            } else {
                seen_np.push((n, proto));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admit(mut obj: Value, old: Option<&Value>) -> (Value, Vec<FieldError>) {
        default_service(&mut obj, old);
        let op = if old.is_some() {
            Operation::Update
        } else {
            Operation::Create
        };
        let errs = validate_service(&obj, op, old);
        (obj, errs)
    }

    fn fields(errs: &[FieldError]) -> Vec<&str> {
        errs.iter().map(|e| e.field.as_str()).collect()
    }

    #[test]
    fn cidr_parsing_and_arithmetic() {
        let c: ServiceCidr = DEFAULT_SERVICE_CIDR.parse().unwrap();
        assert_eq!(c.usable(), 65534);
        assert_eq!(c.nth(0), Ipv4Addr::new(10, 96, 0, 1));
        assert_eq!(c.nth(65533), Ipv4Addr::new(10, 96, 255, 254));
        assert_eq!(c.nth(65534), Ipv4Addr::new(10, 96, 0, 1));
        assert!(c.assignable(Ipv4Addr::new(10, 96, 3, 4)));
        assert!(!c.assignable(Ipv4Addr::new(10, 96, 0, 0)));
        assert!(!c.assignable(Ipv4Addr::new(10, 96, 255, 255)));
        assert!(!c.assignable(Ipv4Addr::new(10, 97, 0, 1)));
        assert!(!c.overlaps(Ipv4Addr::new(10, 244, 0, 0), 16));
        assert!(c.overlaps(Ipv4Addr::new(10, 0, 0, 0), 8));
        assert!(c.overlaps(Ipv4Addr::new(10, 96, 7, 0), 24));
        assert!("10.96.0.1/16".parse::<ServiceCidr>().is_err());
        assert!("10.96.0.0/30".parse::<ServiceCidr>().is_err());
        assert!("nope".parse::<ServiceCidr>().is_err());
    }

    #[test]
    fn defaults_like_kubernetes() {
        let (o, errs) = admit(
            json!({"spec": {"selector": {"app": "a"}, "ports": [{"port": 80}]}}),
            None,
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(o["spec"]["type"], "ClusterIP");
        assert_eq!(o["spec"]["sessionAffinity"], "None");
        assert_eq!(o["spec"]["ports"][0]["protocol"], "TCP");
        assert_eq!(o["spec"]["ports"][0]["targetPort"], 80);
        assert_eq!(o["spec"]["ipFamilies"], json!(["IPv4"]));
        assert!(o["spec"].get("clusterIP").is_none());
        assert_eq!(o["status"], json!({"loadBalancer": {}}));
    }

    #[test]
    fn refuses_what_is_not_carried_out_naming_the_field() {
        let (_, errs) = admit(
            json!({"spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}}),
            None,
        );
        assert_eq!(fields(&errs), ["spec.type"]);
        let (_, errs) = admit(
            json!({"spec": {"type": "ExternalName", "externalName": "x.example"}}),
            None,
        );
        assert!(fields(&errs).contains(&"spec.type"));
        assert!(fields(&errs).contains(&"spec.externalName"));
        let (_, errs) = admit(
            json!({"spec": {"sessionAffinity": "ClientIP", "ports": [{"port": 80}]}}),
            None,
        );
        assert_eq!(fields(&errs), ["spec.sessionAffinity"]);
        assert!(errs[0].message.contains("\"ClientIP\""));
        let (_, errs) = admit(
            json!({"spec": {"externalIPs": ["1.2.3.4"], "ports": [{"port": 80, "protocol": "SCTP"}]}}),
            None,
        );
        assert_eq!(
            fields(&errs),
            ["spec.externalIPs", "spec.ports[0].protocol"]
        );
        let (_, errs) = admit(
            json!({"spec": {"type": "NodePort", "externalTrafficPolicy": "Local", "ports": [{"port": 80}]}}),
            None,
        );
        assert_eq!(fields(&errs), ["spec.externalTrafficPolicy"]);
        let (_, errs) = admit(
            json!({"spec": {"ipFamilies": ["IPv6"], "ports": [{"port": 80}]}}),
            None,
        );
        assert_eq!(fields(&errs), ["spec.ipFamilies[0]"]);
    }

    #[test]
    fn ports_are_checked() {
        let (_, errs) = admit(json!({"spec": {"selector": {"a": "b"}}}), None);
        assert_eq!(fields(&errs), ["spec.ports"]);
        let (_, errs) = admit(
            json!({"spec": {"ports": [{"port": 80}, {"port": 0, "name": "b"}]}}),
            None,
        );
        assert_eq!(
            fields(&errs),
            [
                "spec.ports[0].name",
                "spec.ports[1].port",
                "spec.ports[1].targetPort"
            ]
        );
        let (_, errs) = admit(
            json!({"spec": {"ports": [{"port": 80, "name": "a"}, {"port": 80, "name": "a", "targetPort": "Bad_Name"}]}}),
            None,
        );
        assert_eq!(
            fields(&errs),
            [
                "spec.ports[1].name",
                "spec.ports[1]",
                "spec.ports[1].targetPort"
            ]
        );
        let (_, errs) = admit(
            json!({"spec": {"ports": [{"port": 80, "nodePort": 30080}]}}),
            None,
        );
        assert_eq!(fields(&errs), ["spec.ports[0].nodePort"]);
        let (_, errs) = admit(
            json!({"spec": {"type": "NodePort", "ports": [{"port": 80, "nodePort": 80}]}}),
            None,
        );
        assert!(errs[0].message.contains("30000-32767"), "{errs:?}");
        let (o, errs) = admit(
            json!({"spec": {"type": "NodePort", "ports": [{"port": 22, "targetPort": "ssh", "nodePort": 0}]}}),
            None,
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert!(o["spec"]["ports"][0].get("nodePort").is_none());
        assert_eq!(o["spec"]["externalTrafficPolicy"], "Cluster");
    }

    #[test]
    fn headless_and_cluster_ip() {
        let (o, errs) = admit(json!({"spec": {"clusterIP": "None"}}), None);
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(o["spec"]["clusterIPs"], json!(["None"]));
        assert!(is_headless(&o));
        let (_, errs) = admit(
            json!({"spec": {"type": "NodePort", "clusterIP": "None", "ports": [{"port": 1}]}}),
            None,
        );
        assert_eq!(fields(&errs), ["spec.clusterIPs[0]"]);
        let (_, errs) = admit(
            json!({"spec": {"clusterIP": "x", "ports": [{"port": 1}]}}),
            None,
        );
        assert_eq!(fields(&errs), ["spec.clusterIPs[0]"]);
    }

    #[test]
    fn updates_keep_allocations_and_refuse_a_new_cluster_ip() {
        let old = json!({"spec": {"type": "NodePort", "clusterIP": "10.96.0.9",
            "clusterIPs": ["10.96.0.9"],
            "ports": [{"port": 80, "protocol": "TCP", "nodePort": 30123}]}});
        let (o, errs) = admit(
            json!({"spec": {"type": "NodePort", "ports": [{"port": 80}]}}),
            Some(&old),
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(o["spec"]["clusterIP"], "10.96.0.9");
        assert_eq!(o["spec"]["ports"][0]["nodePort"], 30123);
        assert_eq!(node_ports(&o), [(0, 30123)]);
        let (o, errs) = admit(
            json!({"spec": {"type": "ClusterIP", "ports": [{"port": 80, "nodePort": 30123}]}}),
            Some(&old),
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert!(node_ports(&o).is_empty());
        let (_, errs) = admit(
            json!({"spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}}),
            Some(&old),
        );
        assert_eq!(fields(&errs), ["spec.clusterIPs[0]"]);
        assert!(errs[0].message.contains("may not change once set"));
    }

    #[test]
    fn port_names() {
        assert!(is_port_name("http"));
        assert!(is_port_name("ssh-1"));
        assert!(!is_port_name("1234"));
        assert!(!is_port_name("a--b"));
        assert!(!is_port_name("abcdefghijklmnop"));
        assert!(!is_port_name("Http"));
    }
}
