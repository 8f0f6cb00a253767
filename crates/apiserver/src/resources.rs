//! The served resource table as the server uses it: lookup by URL (group, version, plural) and
//! by key prefix, the group/version lists for discovery, and the store key layout
//! `/registry/{group or core}/{plural}/{namespace}/{name}`.

use std::collections::HashMap;

use ferrovirt_api::registry::ResourceDef;

/// Lookup tables over the resource definitions.
#[derive(Debug)]
pub struct Resources {
    defs: Vec<ResourceDef>,
    by_url: HashMap<(String, String, String), usize>,
    /// Groups served by extra routes (listed in `/apis`, no resources of their own here).
    extra_groups: Vec<GroupInfo>,
}

/// One API group with its versions, preferred (first) first.
#[derive(Debug, Clone)]
pub struct GroupInfo {
    pub name: String,
    pub versions: Vec<String>,
}

/// Whether `def` is events.k8s.io's Event, which shares storage with core/v1 events.
pub fn is_events_v1(def: &ResourceDef) -> bool {
    def.group == "events.k8s.io" && def.kind == "Event"
}

/// The (group segment, plural) a kind is stored under.
fn storage_of(def: &ResourceDef) -> (&'static str, &'static str) {
    if is_events_v1(def) {
        return ("core", "events");
    }
    let g = if def.group.is_empty() {
        "core"
    } else {
        def.group
    };
    (g, def.plural)
}

/// Store key of one object.
pub fn object_key(def: &ResourceDef, namespace: Option<&str>, name: &str) -> String {
    let (g, p) = storage_of(def);
    match namespace.filter(|_| def.namespaced) {
        Some(ns) => format!("/registry/{g}/{p}/{ns}/{name}"),
        None => format!("/registry/{g}/{p}/{name}"),
    }
}

/// Store prefix for a list (all namespaces when `namespace` is None).
pub fn list_prefix(def: &ResourceDef, namespace: Option<&str>) -> String {
    let (g, p) = storage_of(def);
    match namespace.filter(|_| def.namespaced) {
        Some(ns) => format!("/registry/{g}/{p}/{ns}/"),
        None => format!("/registry/{g}/{p}/"),
    }
}

impl Resources {
    pub fn new(defs: Vec<ResourceDef>) -> Self {
        let by_url = defs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                (
                    (
                        d.group.to_string(),
                        d.version.to_string(),
                        d.plural.to_string(),
                    ),
                    i,
                )
            })
            .collect();
        Self {
            defs,
            by_url,
            extra_groups: Vec::new(),
        }
    }

    pub fn all(&self) -> &[ResourceDef] {
        &self.defs
    }

    pub fn lookup(&self, group: &str, version: &str, plural: &str) -> Option<&ResourceDef> {
        self.by_url
            .get(&(group.to_string(), version.to_string(), plural.to_string()))
            .map(|&i| &self.defs[i])
    }

    /// Groups in first-seen order, versions in first-seen order (the preferred one first).
    /// Adds groups served by extra routes (`group/version` strings) to discovery.
    pub fn with_extra_groups(mut self, group_versions: &[String]) -> Self {
        for gv in group_versions {
            let Some((g, v)) = gv.split_once('/') else {
                continue;
            };
            match self.extra_groups.iter_mut().find(|x| x.name == g) {
                Some(x) => x.versions.push(v.to_string()),
                None => self.extra_groups.push(GroupInfo {
                    name: g.to_string(),
                    versions: vec![v.to_string()],
                }),
            }
        }
        self
    }

    pub fn groups(&self) -> Vec<GroupInfo> {
        let mut out: Vec<GroupInfo> = Vec::new();
        for d in &self.defs {
            match out.iter_mut().find(|g| g.name == d.group) {
                Some(g) => {
                    if !g.versions.iter().any(|v| v == d.version) {
                        g.versions.push(d.version.to_string());
                    }
                }
                None => out.push(GroupInfo {
                    name: d.group.to_string(),
                    versions: vec![d.version.to_string()],
                }),
            }
        }
        out.extend(self.extra_groups.iter().cloned());
        out
    }

    /// Resources of one group/version.
    pub fn in_group_version<'a>(
        &'a self,
        group: &'a str,
        version: &'a str,
    ) -> impl Iterator<Item = &'a ResourceDef> + 'a {
        self.defs
            .iter()
            .filter(move |d| d.group == group && d.version == version)
    }

    /// Distinct storage prefixes (one per stored kind), for GC and namespace cleanup. The
    /// CustomResourceDefinitions are left out: the server writes them, nothing owns or deletes
    /// them, and their schemas would make every GC scan read a megabyte more.
    pub fn storage_defs(&self) -> Vec<&ResourceDef> {
        let mut seen = std::collections::HashSet::new();
        self.defs
            .iter()
            .filter(|d| !is_events_v1(d) && d.group != "apiextensions.k8s.io")
            .filter(|d| seen.insert(storage_of(d)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        let r = Resources::new(ferrovirt_api::registry::resources());
        let cm = r.lookup("", "v1", "configmaps").expect("configmaps served");
        assert_eq!(
            object_key(cm, Some("ns"), "a"),
            "/registry/core/configmaps/ns/a"
        );
        assert_eq!(list_prefix(cm, None), "/registry/core/configmaps/");
        let ns = r.lookup("", "v1", "namespaces").expect("namespaces served");
        assert_eq!(
            object_key(ns, Some("x"), "a"),
            "/registry/core/namespaces/a"
        );
        if let Some(ev) = r.lookup("events.k8s.io", "v1", "events") {
            assert_eq!(list_prefix(ev, Some("d")), "/registry/core/events/d/");
        }
    }
}
