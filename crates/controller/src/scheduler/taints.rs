//! Taints and tolerations: which taints a VMI tolerates, the NoSchedule/NoExecute filter and
//! the PreferNoSchedule count used for scoring.

use k8s_openapi::api::core::v1::{Node, Taint, Toleration};

/// Taint effects.
pub const NO_SCHEDULE: &str = "NoSchedule";
pub const PREFER_NO_SCHEDULE: &str = "PreferNoSchedule";
pub const NO_EXECUTE: &str = "NoExecute";

/// The node's taints (empty when none).
pub fn node_taints(node: &Node) -> &[Taint] {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
}

/// Whether one toleration tolerates one taint (Kubernetes' rules: an empty effect matches
/// every effect; an empty key with `Exists` matches every key; `Equal` is the default).
pub fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = toleration.effect.as_deref()
        && !effect.is_empty()
        && effect != taint.effect
    {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or("");
    let op = toleration.operator.as_deref().unwrap_or("Equal");
    if key.is_empty() {
        return op == "Exists";
    }
    if key != taint.key {
        return false;
    }
    match op {
        "Exists" => true,
        "Equal" | "" => {
            toleration.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
        _ => false,
    }
}

/// The first toleration in `tolerations` that tolerates `taint`.
pub fn find_toleration<'a>(tolerations: &'a [Toleration], taint: &Taint) -> Option<&'a Toleration> {
    tolerations.iter().find(|t| tolerates(t, taint))
}

/// The first NoSchedule/NoExecute taint none of the tolerations tolerates.
pub fn first_untolerated<'a>(taints: &'a [Taint], tolerations: &[Toleration]) -> Option<&'a Taint> {
    taints.iter().find(|taint| {
        (taint.effect == NO_SCHEDULE || taint.effect == NO_EXECUTE)
            && find_toleration(tolerations, taint).is_none()
    })
}

/// Kubernetes' filter reason for an untolerated taint: `node(s) had untolerated taint {k: v}`.
pub fn untolerated_reason(taint: &Taint) -> String {
    format!(
        "node(s) had untolerated taint {{{}: {}}}",
        taint.key,
        taint.value.as_deref().unwrap_or("")
    )
}

/// How many PreferNoSchedule taints are not tolerated (lower is better).
pub fn count_intolerable_prefer_no_schedule(taints: &[Taint], tolerations: &[Toleration]) -> usize {
    taints
        .iter()
        .filter(|t| t.effect == PREFER_NO_SCHEDULE && find_toleration(tolerations, t).is_none())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn taint(key: &str, value: &str, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: (!value.is_empty()).then(|| value.into()),
            effect: effect.into(),
            time_added: None,
        }
    }

    fn tol(key: &str, op: &str, value: &str, effect: &str) -> Toleration {
        Toleration {
            key: (!key.is_empty()).then(|| key.into()),
            operator: (!op.is_empty()).then(|| op.into()),
            value: (!value.is_empty()).then(|| value.into()),
            effect: (!effect.is_empty()).then(|| effect.into()),
            toleration_seconds: None,
        }
    }

    #[test]
    fn toleration_matching() {
        let t = taint("dedicated", "gpu", NO_SCHEDULE);
        assert!(tolerates(
            &tol("dedicated", "Equal", "gpu", NO_SCHEDULE),
            &t
        ));
        assert!(tolerates(&tol("dedicated", "", "gpu", ""), &t));
        assert!(!tolerates(
            &tol("dedicated", "Equal", "cpu", NO_SCHEDULE),
            &t
        ));
        assert!(tolerates(&tol("dedicated", "Exists", "", ""), &t));
        assert!(!tolerates(&tol("dedicated", "Exists", "", NO_EXECUTE), &t));
        assert!(tolerates(&tol("", "Exists", "", ""), &t));
        assert!(!tolerates(&tol("", "Equal", "", ""), &t));
        assert!(!tolerates(&tol("other", "Exists", "", ""), &t));
    }

    #[test]
    fn filter_ignores_prefer_no_schedule() {
        let taints = vec![
            taint("soft", "", PREFER_NO_SCHEDULE),
            taint("hard", "x", NO_EXECUTE),
        ];
        let got = first_untolerated(&taints, &[]).unwrap();
        assert_eq!(got.key, "hard");
        assert_eq!(
            untolerated_reason(got),
            "node(s) had untolerated taint {hard: x}"
        );
        assert!(first_untolerated(&taints, &[tol("hard", "Exists", "", "")]).is_none());
        assert_eq!(count_intolerable_prefer_no_schedule(&taints, &[]), 1);
        assert_eq!(
            count_intolerable_prefer_no_schedule(&taints, &[tol("soft", "Exists", "", "")]),
            0
        );
    }
}
