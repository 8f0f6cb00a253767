//! Decoding of Kubernetes protobuf request bodies (`application/vnd.kubernetes.protobuf`) into
//! JSON, for the built-in kinds that kubectl ≥ 1.32 sends that way from its typed clients
//! (`kubectl create namespace|configmap|secret|serviceaccount|role|rolebinding|…`). The field
//! numbers follow the published `generated.proto` files of k8s.io/api; unknown fields are
//! skipped. Only decoding is needed: responses are always JSON, which kubectl accepts.

use base64::Engine;
use serde_json::{Map, Value, json};

/// A body that is not a decodable Kubernetes protobuf message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("malformed protobuf: {0}")]
    Malformed(&'static str),
    #[error("protobuf bodies are not supported for {0}; send JSON")]
    Unsupported(String),
}

/// How one field is turned into JSON.
#[derive(Debug, Clone, Copy)]
enum Ty {
    Str,
    Int,
    Bool,
    /// metav1.Time {seconds=1, nanos=2} → RFC 3339
    Time,
    Msg(&'static [F]),
    MapStr,
    /// map<string, bytes>: values become base64 strings (JSON form of `[]byte`)
    MapBytes,
    /// map<string, resource.Quantity {string=1}>: values become quantity strings
    MapQuantity,
    /// intstr.IntOrString {type=1, intVal=2, strVal=3} → a JSON number or string
    IntOrStr,
}

/// One field: number, JSON name, type, repeated.
#[derive(Debug, Clone, Copy)]
struct F(u32, &'static str, Ty, bool);

const OWNER_REF: &[F] = &[
    F(1, "kind", Ty::Str, false),
    F(3, "name", Ty::Str, false),
    F(4, "uid", Ty::Str, false),
    F(5, "apiVersion", Ty::Str, false),
    F(6, "controller", Ty::Bool, false),
    F(7, "blockOwnerDeletion", Ty::Bool, false),
];

const OBJECT_META: &[F] = &[
    F(1, "name", Ty::Str, false),
    F(2, "generateName", Ty::Str, false),
    F(3, "namespace", Ty::Str, false),
    F(5, "uid", Ty::Str, false),
    F(6, "resourceVersion", Ty::Str, false),
    F(7, "generation", Ty::Int, false),
    F(8, "creationTimestamp", Ty::Time, false),
    F(9, "deletionTimestamp", Ty::Time, false),
    F(10, "deletionGracePeriodSeconds", Ty::Int, false),
    F(11, "labels", Ty::MapStr, false),
    F(12, "annotations", Ty::MapStr, false),
    F(13, "ownerReferences", Ty::Msg(OWNER_REF), true),
    F(14, "finalizers", Ty::Str, true),
];

const META: F = F(1, "metadata", Ty::Msg(OBJECT_META), false);

const CONFIG_MAP: &[F] = &[
    META,
    F(2, "data", Ty::MapStr, false),
    F(3, "binaryData", Ty::MapBytes, false),
    F(4, "immutable", Ty::Bool, false),
];

const SECRET: &[F] = &[
    META,
    F(2, "data", Ty::MapBytes, false),
    F(3, "type", Ty::Str, false),
    F(4, "stringData", Ty::MapStr, false),
    F(5, "immutable", Ty::Bool, false),
];

const NAMESPACE: &[F] = &[
    META,
    F(
        2,
        "spec",
        Ty::Msg(&[F(1, "finalizers", Ty::Str, true)]),
        false,
    ),
    F(
        3,
        "status",
        Ty::Msg(&[F(1, "phase", Ty::Str, false)]),
        false,
    ),
];

const OBJECT_REF: &[F] = &[
    F(1, "kind", Ty::Str, false),
    F(2, "namespace", Ty::Str, false),
    F(3, "name", Ty::Str, false),
    F(4, "uid", Ty::Str, false),
    F(5, "apiVersion", Ty::Str, false),
    F(6, "resourceVersion", Ty::Str, false),
    F(7, "fieldPath", Ty::Str, false),
];

const SERVICE_ACCOUNT: &[F] = &[
    META,
    F(2, "secrets", Ty::Msg(OBJECT_REF), true),
    F(
        3,
        "imagePullSecrets",
        Ty::Msg(&[F(1, "name", Ty::Str, false)]),
        true,
    ),
    F(4, "automountServiceAccountToken", Ty::Bool, false),
];

const POLICY_RULE: &[F] = &[
    F(1, "verbs", Ty::Str, true),
    F(2, "apiGroups", Ty::Str, true),
    F(3, "resources", Ty::Str, true),
    F(4, "resourceNames", Ty::Str, true),
    F(5, "nonResourceURLs", Ty::Str, true),
];

const RESOURCE_QUOTA: &[F] = &[
    META,
    F(
        2,
        "spec",
        Ty::Msg(&[
            F(1, "hard", Ty::MapQuantity, false),
            F(2, "scopes", Ty::Str, true),
        ]),
        false,
    ),
];

const ROLE: &[F] = &[META, F(2, "rules", Ty::Msg(POLICY_RULE), true)];

/// metav1.LabelSelector.
const LABEL_SELECTOR: &[F] = &[
    F(1, "matchLabels", Ty::MapStr, false),
    F(
        2,
        "matchExpressions",
        Ty::Msg(&[
            F(1, "key", Ty::Str, false),
            F(2, "operator", Ty::Str, false),
            F(3, "values", Ty::Str, true),
        ]),
        true,
    ),
];

/// ClusterRole: a Role plus its aggregationRule (`kubectl create clusterrole --aggregation-rule`).
const CLUSTER_ROLE: &[F] = &[
    META,
    F(2, "rules", Ty::Msg(POLICY_RULE), true),
    F(
        3,
        "aggregationRule",
        Ty::Msg(&[F(1, "clusterRoleSelectors", Ty::Msg(LABEL_SELECTOR), true)]),
        false,
    ),
];

const SUBJECT: &[F] = &[
    F(1, "kind", Ty::Str, false),
    F(2, "apiGroup", Ty::Str, false),
    F(3, "name", Ty::Str, false),
    F(4, "namespace", Ty::Str, false),
];

const ROLE_REF: &[F] = &[
    F(1, "apiGroup", Ty::Str, false),
    F(2, "kind", Ty::Str, false),
    F(3, "name", Ty::Str, false),
];

const BINDING: &[F] = &[
    META,
    F(2, "subjects", Ty::Msg(SUBJECT), true),
    F(3, "roleRef", Ty::Msg(ROLE_REF), false),
];

const SERVICE_PORT: &[F] = &[
    F(1, "name", Ty::Str, false),
    F(2, "protocol", Ty::Str, false),
    F(3, "port", Ty::Int, false),
    F(4, "targetPort", Ty::IntOrStr, false),
    F(5, "nodePort", Ty::Int, false),
    F(6, "appProtocol", Ty::Str, false),
];

/// core/v1 Service (`kubectl create service …`, `kubectl expose`).
const SERVICE: &[F] = &[
    META,
    F(
        2,
        "spec",
        Ty::Msg(&[
            F(1, "ports", Ty::Msg(SERVICE_PORT), true),
            F(2, "selector", Ty::MapStr, false),
            F(3, "clusterIP", Ty::Str, false),
            F(4, "type", Ty::Str, false),
            F(5, "externalIPs", Ty::Str, true),
            F(7, "sessionAffinity", Ty::Str, false),
            F(8, "loadBalancerIP", Ty::Str, false),
            F(9, "loadBalancerSourceRanges", Ty::Str, true),
            F(10, "externalName", Ty::Str, false),
            F(11, "externalTrafficPolicy", Ty::Str, false),
            F(12, "healthCheckNodePort", Ty::Int, false),
            F(13, "publishNotReadyAddresses", Ty::Bool, false),
            F(17, "ipFamilyPolicy", Ty::Str, false),
            F(18, "clusterIPs", Ty::Str, true),
            F(19, "ipFamilies", Ty::Str, true),
            F(21, "loadBalancerClass", Ty::Str, false),
            F(22, "internalTrafficPolicy", Ty::Str, false),
            F(23, "trafficDistribution", Ty::Str, false),
        ]),
        false,
    ),
];

/// metav1.DeleteOptions.
const DELETE_OPTIONS: &[F] = &[
    F(1, "gracePeriodSeconds", Ty::Int, false),
    F(
        2,
        "preconditions",
        Ty::Msg(&[
            F(1, "uid", Ty::Str, false),
            F(2, "resourceVersion", Ty::Str, false),
        ]),
        false,
    ),
    F(3, "orphanDependents", Ty::Bool, false),
    F(4, "propagationPolicy", Ty::Str, false),
    F(5, "dryRun", Ty::Str, true),
];

/// policy/v1 (and v1beta1) Eviction, the body of `pods/{name}/eviction` (`kubectl drain`).
const EVICTION: &[F] = &[META, F(2, "deleteOptions", Ty::Msg(DELETE_OPTIONS), false)];

/// authorization.k8s.io/v1 ResourceAttributes.
const RESOURCE_ATTRIBUTES: &[F] = &[
    F(1, "namespace", Ty::Str, false),
    F(2, "verb", Ty::Str, false),
    F(3, "group", Ty::Str, false),
    F(4, "version", Ty::Str, false),
    F(5, "resource", Ty::Str, false),
    F(6, "subresource", Ty::Str, false),
    F(7, "name", Ty::Str, false),
];

const NON_RESOURCE_ATTRIBUTES: &[F] = &[F(1, "path", Ty::Str, false), F(2, "verb", Ty::Str, false)];

/// SelfSubjectAccessReview (spec fields 1–2) and SubjectAccessReview (also user, groups, uid).
const ACCESS_REVIEW: &[F] = &[
    META,
    F(
        2,
        "spec",
        Ty::Msg(&[
            F(1, "resourceAttributes", Ty::Msg(RESOURCE_ATTRIBUTES), false),
            F(
                2,
                "nonResourceAttributes",
                Ty::Msg(NON_RESOURCE_ATTRIBUTES),
                false,
            ),
            F(3, "user", Ty::Str, false),
            F(4, "groups", Ty::Str, true),
            F(6, "uid", Ty::Str, false),
        ]),
        false,
    ),
];

/// authentication.k8s.io/v1 SelfSubjectReview: only metadata is sent.
const SELF_SUBJECT_REVIEW: &[F] = &[META];

/// authentication.k8s.io/v1 TokenRequest (`kubectl create token`).
const TOKEN_REQUEST: &[F] = &[
    META,
    F(
        2,
        "spec",
        Ty::Msg(&[
            F(1, "audiences", Ty::Str, true),
            F(4, "expirationSeconds", Ty::Int, false),
            F(
                3,
                "boundObjectRef",
                Ty::Msg(&[
                    F(1, "kind", Ty::Str, false),
                    F(2, "apiVersion", Ty::Str, false),
                    F(3, "name", Ty::Str, false),
                    F(4, "uid", Ty::Str, false),
                ]),
                false,
            ),
        ]),
        false,
    ),
];

fn schema_for(api_version: &str, kind: &str) -> Option<&'static [F]> {
    Some(match (api_version, kind) {
        ("v1", "ConfigMap") => CONFIG_MAP,
        ("v1", "Secret") => SECRET,
        ("v1", "Namespace") => NAMESPACE,
        ("v1", "ServiceAccount") => SERVICE_ACCOUNT,
        ("v1", "ResourceQuota") => RESOURCE_QUOTA,
        ("rbac.authorization.k8s.io/v1", "Role") => ROLE,
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => CLUSTER_ROLE,
        ("v1", "Service") => SERVICE,
        ("rbac.authorization.k8s.io/v1", "RoleBinding" | "ClusterRoleBinding") => BINDING,
        ("policy/v1" | "policy/v1beta1", "Eviction") => EVICTION,
        (
            "authorization.k8s.io/v1",
            "SelfSubjectAccessReview" | "SubjectAccessReview" | "LocalSubjectAccessReview",
        ) => ACCESS_REVIEW,
        ("authentication.k8s.io/v1", "SelfSubjectReview") => SELF_SUBJECT_REVIEW,
        ("authentication.k8s.io/v1", "TokenRequest") => TOKEN_REQUEST,
        _ => return None,
    })
}

/// A protobuf wire reader.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// A decoded field value.
enum Wire<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn varint(&mut self) -> Result<u64, ProtoError> {
        let mut out = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *self
                .buf
                .get(self.pos)
                .ok_or(ProtoError::Malformed("truncated varint"))?;
            self.pos += 1;
            out |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(out);
            }
        }
        Err(ProtoError::Malformed("varint too long"))
    }

    fn skip(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or(ProtoError::Malformed("truncated field"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// The next (field number, value), or None at the end.
    fn next(&mut self) -> Result<Option<(u32, Wire<'a>)>, ProtoError> {
        if self.pos >= self.buf.len() {
            return Ok(None);
        }
        let key = self.varint()?;
        let num = u32::try_from(key >> 3).map_err(|_| ProtoError::Malformed("field number"))?;
        let v = match key & 7 {
            0 => Wire::Varint(self.varint()?),
            1 => {
                self.skip(8)?;
                Wire::Fixed
            }
            2 => {
                let n =
                    usize::try_from(self.varint()?).map_err(|_| ProtoError::Malformed("length"))?;
                Wire::Bytes(self.skip(n)?)
            }
            5 => {
                self.skip(4)?;
                Wire::Fixed
            }
            _ => return Err(ProtoError::Malformed("unsupported wire type")),
        };
        Ok(Some((num, v)))
    }
}

fn utf8(b: &[u8]) -> Result<String, ProtoError> {
    String::from_utf8(b.to_vec()).map_err(|_| ProtoError::Malformed("string is not UTF-8"))
}

/// A map entry {1: key, 2: value}.
fn map_entry(b: &[u8], bytes_value: bool) -> Result<(String, Value), ProtoError> {
    let mut r = Reader::new(b);
    let (mut k, mut v) = (String::new(), Value::String(String::new()));
    while let Some((num, w)) = r.next()? {
        match (num, w) {
            (1, Wire::Bytes(s)) => k = utf8(s)?,
            (2, Wire::Bytes(s)) if bytes_value => {
                v = Value::String(base64::engine::general_purpose::STANDARD.encode(s))
            }
            (2, Wire::Bytes(s)) => v = Value::String(utf8(s)?),
            _ => {}
        }
    }
    Ok((k, v))
}

/// A map entry {1: key, 2: resource.Quantity {1: string}}.
fn quantity_entry(b: &[u8]) -> Result<(String, Value), ProtoError> {
    let mut r = Reader::new(b);
    let (mut k, mut v) = (String::new(), Value::String(String::new()));
    while let Some((num, w)) = r.next()? {
        match (num, w) {
            (1, Wire::Bytes(s)) => k = utf8(s)?,
            (2, Wire::Bytes(s)) => {
                v = message(s, &[F(1, "string", Ty::Str, false)])?["string"].clone();
            }
            _ => {}
        }
    }
    Ok((k, v))
}

fn time(b: &[u8]) -> Result<Value, ProtoError> {
    let mut r = Reader::new(b);
    let mut secs = 0i64;
    while let Some((num, w)) = r.next()? {
        if let (1, Wire::Varint(v)) = (num, w) {
            secs = v as i64;
        }
    }
    if secs == 0 {
        return Ok(Value::Null);
    }
    Ok(Value::String(crate::timefmt::format_rfc3339(secs)))
}

/// intstr.IntOrString: type 1 is a string, otherwise the int (0 reads as unset).
fn int_or_string(b: &[u8]) -> Result<Value, ProtoError> {
    let v = message(
        b,
        &[
            F(1, "type", Ty::Int, false),
            F(2, "intVal", Ty::Int, false),
            F(3, "strVal", Ty::Str, false),
        ],
    )?;
    Ok(if v["type"] == 1 {
        v.get("strVal").cloned().unwrap_or(Value::Null)
    } else {
        v.get("intVal")
            .cloned()
            .filter(|n| n != 0)
            .unwrap_or(Value::Null)
    })
}

fn message(b: &[u8], fields: &[F]) -> Result<Value, ProtoError> {
    let mut out = Map::new();
    let mut r = Reader::new(b);
    while let Some((num, w)) = r.next()? {
        let Some(&F(_, name, ty, repeated)) = fields.iter().find(|f| f.0 == num) else {
            continue;
        };
        let v = match (ty, w) {
            (Ty::Str, Wire::Bytes(s)) => Value::String(utf8(s)?),
            (Ty::Int, Wire::Varint(v)) => json!(v as i64),
            (Ty::Bool, Wire::Varint(v)) => Value::Bool(v != 0),
            (Ty::Time, Wire::Bytes(s)) => time(s)?,
            (Ty::Msg(sub), Wire::Bytes(s)) => message(s, sub)?,
            (Ty::IntOrStr, Wire::Bytes(s)) => int_or_string(s)?,
            (Ty::MapStr | Ty::MapBytes | Ty::MapQuantity, Wire::Bytes(s)) => {
                let (k, v) = match ty {
                    Ty::MapQuantity => quantity_entry(s)?,
                    _ => map_entry(s, matches!(ty, Ty::MapBytes))?,
                };
                let m = out.entry(name).or_insert_with(|| json!({}));
                if let Some(m) = m.as_object_mut() {
                    m.insert(k, v);
                }
                continue;
            }
            _ => return Err(ProtoError::Malformed("unexpected wire type")),
        };
        // Go omits empty non-pointer fields from JSON (`omitempty`) but always writes them
        // to protobuf; drop them so the object reads as if it came as JSON.
        let empty = match &v {
            Value::String(s) => s.is_empty() && !repeated,
            Value::Number(n) => n.as_i64() == Some(0) && name == "generation",
            Value::Null => true,
            _ => false,
        };
        if empty {
            continue;
        }
        if repeated {
            let a = out.entry(name).or_insert_with(|| json!([]));
            if let Some(a) = a.as_array_mut() {
                a.push(v);
            }
        } else {
            out.insert(name.to_string(), v);
        }
    }
    Ok(Value::Object(out))
}

/// Decodes a `k8s\0`-prefixed runtime.Unknown envelope into a JSON object with apiVersion
/// and kind.
pub fn decode(body: &[u8]) -> Result<Value, ProtoError> {
    let rest = body
        .strip_prefix(b"k8s\0")
        .ok_or(ProtoError::Malformed("missing the k8s protobuf prefix"))?;
    let mut r = Reader::new(rest);
    let (mut api_version, mut kind, mut raw) = (String::new(), String::new(), &[][..]);
    while let Some((num, w)) = r.next()? {
        match (num, w) {
            (1, Wire::Bytes(tm)) => {
                let mut t = Reader::new(tm);
                while let Some((n, v)) = t.next()? {
                    match (n, v) {
                        (1, Wire::Bytes(s)) => api_version = utf8(s)?,
                        (2, Wire::Bytes(s)) => kind = utf8(s)?,
                        _ => {}
                    }
                }
            }
            (2, Wire::Bytes(s)) => raw = s,
            _ => {}
        }
    }
    let fields = schema_for(&api_version, &kind)
        .ok_or_else(|| ProtoError::Unsupported(format!("{api_version}, Kind={kind}")))?;
    let mut obj = message(raw, fields)?;
    if let Some(m) = obj.as_object_mut() {
        m.insert("apiVersion".into(), Value::String(api_version));
        m.insert("kind".into(), Value::String(kind));
    }
    Ok(obj)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    fn field(num: u32, payload: &[u8], out: &mut Vec<u8>) {
        varint(u64::from(num) << 3 | 2, out);
        varint(payload.len() as u64, out);
        out.extend_from_slice(payload);
    }

    fn entry(k: &str, v: &[u8]) -> Vec<u8> {
        let mut e = Vec::new();
        field(1, k.as_bytes(), &mut e);
        field(2, v, &mut e);
        e
    }

    #[test]
    fn decodes_a_secret() {
        let mut meta = Vec::new();
        field(1, b"creds", &mut meta);
        field(2, b"", &mut meta);
        field(3, b"default", &mut meta);
        field(11, &entry("app", b"x"), &mut meta);
        let mut secret = Vec::new();
        field(1, &meta, &mut secret);
        field(2, &entry("pw", b"\x00hi"), &mut secret);
        field(3, b"Opaque", &mut secret);
        secret.extend_from_slice(&[5 << 3, 1]); // immutable = true
        let mut tm = Vec::new();
        field(1, b"v1", &mut tm);
        field(2, b"Secret", &mut tm);
        let mut body = b"k8s\0".to_vec();
        field(1, &tm, &mut body);
        field(2, &secret, &mut body);
        field(4, b"application/vnd.kubernetes.protobuf", &mut body);
        let v = decode(&body).unwrap();
        assert_eq!(
            v,
            json!({
                "metadata": {"name": "creds", "namespace": "default", "labels": {"app": "x"}},
                "data": {"pw": "AGhp"}, "type": "Opaque", "immutable": true,
                "apiVersion": "v1", "kind": "Secret"
            })
        );
        assert!(matches!(decode(b"nope"), Err(ProtoError::Malformed(_))));
        let mut other = b"k8s\0".to_vec();
        let mut tm = Vec::new();
        field(1, b"apps/v1", &mut tm);
        field(2, b"Deployment", &mut tm);
        field(1, &tm, &mut other);
        assert!(matches!(decode(&other), Err(ProtoError::Unsupported(_))));
        assert!(matches!(
            decode(&body[..body.len() - 3]),
            Err(ProtoError::Malformed(_))
        ));
    }

    #[test]
    fn decodes_an_eviction() {
        let mut meta = Vec::new();
        field(1, b"virt-launcher-vm1-abcde", &mut meta);
        field(3, b"default", &mut meta);
        let mut pre = Vec::new();
        field(1, b"u-1", &mut pre);
        let mut opts = Vec::new();
        opts.extend_from_slice(&[1 << 3, 30]); // gracePeriodSeconds = 30
        field(2, &pre, &mut opts);
        let mut ev = Vec::new();
        field(1, &meta, &mut ev);
        field(2, &opts, &mut ev);
        let mut tm = Vec::new();
        field(1, b"policy/v1", &mut tm);
        field(2, b"Eviction", &mut tm);
        let mut body = b"k8s\0".to_vec();
        field(1, &tm, &mut body);
        field(2, &ev, &mut body);
        assert_eq!(
            decode(&body).unwrap(),
            json!({
                "metadata": {"name": "virt-launcher-vm1-abcde", "namespace": "default"},
                "deleteOptions": {"gracePeriodSeconds": 30, "preconditions": {"uid": "u-1"}},
                "apiVersion": "policy/v1", "kind": "Eviction"
            })
        );
    }

    #[test]
    fn decodes_a_service() {
        let mut meta = Vec::new();
        field(1, b"web", &mut meta);
        let mut named = Vec::new();
        named.extend_from_slice(&[1 << 3, 1]); // type = String
        field(3, b"http", &mut named);
        let mut port = Vec::new();
        field(2, b"TCP", &mut port);
        port.extend_from_slice(&[3 << 3, 80]); // port = 80
        field(4, &named, &mut port);
        port.extend_from_slice(&[5 << 3, 0]); // nodePort = 0
        let mut unnamed = Vec::new();
        unnamed.extend_from_slice(&[2 << 3, 22]); // intVal = 22
        let mut port2 = Vec::new();
        port2.extend_from_slice(&[3 << 3, 22]);
        field(4, &unnamed, &mut port2);
        let mut spec = Vec::new();
        field(1, &port, &mut spec);
        field(1, &port2, &mut spec);
        field(2, &entry("app", b"web"), &mut spec);
        field(4, b"NodePort", &mut spec);
        let mut svc = Vec::new();
        field(1, &meta, &mut svc);
        field(2, &spec, &mut svc);
        let mut tm = Vec::new();
        field(1, b"v1", &mut tm);
        field(2, b"Service", &mut tm);
        let mut body = b"k8s\0".to_vec();
        field(1, &tm, &mut body);
        field(2, &svc, &mut body);
        assert_eq!(
            decode(&body).unwrap(),
            json!({
                "metadata": {"name": "web"},
                "spec": {"ports": [
                    {"protocol": "TCP", "port": 80, "targetPort": "http", "nodePort": 0},
                    {"port": 22, "targetPort": 22}],
                    "selector": {"app": "web"}, "type": "NodePort"},
                "apiVersion": "v1", "kind": "Service"
            })
        );
    }
}
