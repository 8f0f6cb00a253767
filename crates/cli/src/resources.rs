//! Resource types from the server's discovery documents (`/api/v1`, `/apis`, each group's
//! preferred version): resolving what a user types (`vm`, `vms`, `virtualmachine`,
//! `virtualmachines.kubevirt.io`, `VirtualMachine`) to one resource, and `api-resources`.

use kube::discovery::{ApiResource, Scope};

use crate::error::CliError;

/// One resource type the server serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceInfo {
    pub group: String,
    pub version: String,
    pub kind: String,
    pub plural: String,
    pub singular: String,
    pub short_names: Vec<String>,
    pub namespaced: bool,
    pub verbs: Vec<String>,
}

impl ResourceInfo {
    /// `group/version`, or `version` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// kube-rs's description, for `Api<DynamicObject>`.
    pub fn api_resource(&self) -> ApiResource {
        ApiResource {
            group: self.group.clone(),
            version: self.version.clone(),
            api_version: self.api_version(),
            kind: self.kind.clone(),
            plural: self.plural.clone(),
        }
    }

    pub fn scope(&self) -> Scope {
        if self.namespaced {
            Scope::Namespaced
        } else {
            Scope::Cluster
        }
    }

    /// `virtualmachines.kubevirt.io` (kubectl's name in messages), `pods` for core.
    pub fn group_resource(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `virtualmachine.kubevirt.io` (kubectl's `-o name` prefix and verb output).
    pub fn kind_group(&self) -> String {
        let kind = self.kind.to_lowercase();
        if self.group.is_empty() {
            kind
        } else {
            format!("{kind}.{}", self.group)
        }
    }

    fn matches(&self, name: &str) -> bool {
        let lower = name.to_lowercase();
        self.plural == lower
            || self.singular == lower
            || self.kind.to_lowercase() == lower
            || self.short_names.contains(&lower)
    }
}

/// Every resource type the server serves (preferred versions).
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    pub resources: Vec<ResourceInfo>,
}

fn from_list(
    list: &k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResourceList,
) -> Vec<ResourceInfo> {
    let (group, version) = match list.group_version.split_once('/') {
        Some((g, v)) => (g.to_string(), v.to_string()),
        None => (String::new(), list.group_version.clone()),
    };
    list.resources
        .iter()
        .filter(|r| !r.name.contains('/'))
        .map(|r| ResourceInfo {
            group: group.clone(),
            version: version.clone(),
            kind: r.kind.clone(),
            plural: r.name.clone(),
            singular: if r.singular_name.is_empty() {
                r.kind.to_lowercase()
            } else {
                r.singular_name.clone()
            },
            short_names: r.short_names.clone().unwrap_or_default(),
            namespaced: r.namespaced,
            verbs: r.verbs.clone(),
        })
        .collect()
}

impl Catalog {
    /// Reads discovery from the server.
    pub async fn fetch(client: &kube::Client) -> Result<Catalog, CliError> {
        let mut resources = from_list(&client.list_core_api_resources("v1").await?);
        let groups = client.list_api_groups().await?;
        let lists = futures::future::join_all(groups.groups.iter().filter_map(|g| {
            let gv = g
                .preferred_version
                .as_ref()
                .map(|v| v.group_version.clone())
                .or_else(|| g.versions.first().map(|v| v.group_version.clone()))?;
            Some(async move { client.list_api_group_resources(&gv).await })
        }))
        .await;
        for list in lists {
            resources.extend(from_list(&list?));
        }
        Ok(Catalog { resources })
    }

    /// Resolves a type name as kubectl does: `NAME`, `NAME.GROUP`, `NAME.VERSION.GROUP`, with
    /// NAME a plural, singular, kind or short name (case-insensitive).
    pub fn resolve(&self, typed: &str) -> Result<&ResourceInfo, CliError> {
        let mut candidates: Vec<&ResourceInfo> =
            self.resources.iter().filter(|r| r.matches(typed)).collect();
        if candidates.is_empty()
            && let Some((name, rest)) = typed.split_once('.')
        {
            candidates = self
                .resources
                .iter()
                .filter(|r| r.matches(name))
                .filter(|r| r.group == rest || format!("{}.{}", r.version, r.group) == rest)
                .collect();
        }
        // Prefer the core group and kubevirt.io when a short name is shared, as discovery order
        // would (core first).
        candidates.into_iter().next().ok_or_else(|| {
            CliError::Usage(format!(
                "the server doesn't have a resource type \"{typed}\""
            ))
        })
    }

    /// The resource of an object's `apiVersion` and `kind`.
    pub fn by_kind(&self, api_version: &str, kind: &str) -> Result<&ResourceInfo, CliError> {
        let (group, version) = match api_version.split_once('/') {
            Some((g, v)) => (g, v),
            None => ("", api_version),
        };
        self.resources
            .iter()
            .find(|r| r.group == group && r.kind == kind && r.version == version)
            .or_else(|| {
                self.resources
                    .iter()
                    .find(|r| r.group == group && r.kind == kind)
            })
            .ok_or_else(|| {
                CliError::Usage(format!(
                    "resource mapping not found for kind \"{kind}\" in version \"{api_version}\""
                ))
            })
    }
}

/// Splits `TYPE/NAME` or (`TYPE`, `NAME`) arguments into (type, optional name).
pub fn split_type_name(first: &str, second: Option<&str>) -> (String, Option<String>) {
    match first.split_once('/') {
        Some((t, n)) if second.is_none() => (t.to_string(), Some(n.to_string())),
        _ => (first.to_string(), second.map(String::from)),
    }
}

/// `api-resources` output: NAME, SHORTNAMES, APIVERSION, NAMESPACED, KIND sorted as kubectl
/// does (by group, then name).
pub fn api_resources_table(resources: &[ResourceInfo]) -> String {
    let mut sorted: Vec<&ResourceInfo> = resources.iter().collect();
    sorted.sort_by(|a, b| (&a.group, &a.plural).cmp(&(&b.group, &b.plural)));
    let mut rows = vec![vec![
        "NAME".to_string(),
        "SHORTNAMES".into(),
        "APIVERSION".into(),
        "NAMESPACED".into(),
        "KIND".into(),
    ]];
    for r in sorted {
        rows.push(vec![
            r.plural.clone(),
            r.short_names.join(","),
            r.api_version(),
            r.namespaced.to_string(),
            r.kind.clone(),
        ]);
    }
    crate::printer::columns(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm() -> ResourceInfo {
        ResourceInfo {
            group: "kubevirt.io".into(),
            version: "v1".into(),
            kind: "VirtualMachine".into(),
            plural: "virtualmachines".into(),
            singular: "virtualmachine".into(),
            short_names: vec!["vm".into(), "vms".into()],
            namespaced: true,
            verbs: vec!["get".into()],
        }
    }

    fn catalog() -> Catalog {
        let pod = ResourceInfo {
            group: String::new(),
            version: "v1".into(),
            kind: "Pod".into(),
            plural: "pods".into(),
            singular: "pod".into(),
            short_names: vec!["po".into()],
            namespaced: true,
            verbs: vec![],
        };
        Catalog {
            resources: vec![pod, vm()],
        }
    }

    #[test]
    fn resolves_every_form() {
        let c = catalog();
        for t in [
            "vm",
            "vms",
            "virtualmachine",
            "virtualmachines",
            "VirtualMachine",
            "virtualmachines.kubevirt.io",
            "vm.kubevirt.io",
            "virtualmachines.v1.kubevirt.io",
        ] {
            assert_eq!(c.resolve(t).unwrap().plural, "virtualmachines", "{t}");
        }
        assert_eq!(c.resolve("po").unwrap().plural, "pods");
        assert_eq!(
            c.resolve("nope").unwrap_err().to_string(),
            "error: the server doesn't have a resource type \"nope\""
        );
        assert!(c.resolve("vm.example.com").is_err());
        assert_eq!(
            c.by_kind("kubevirt.io/v1", "VirtualMachine")
                .unwrap()
                .plural,
            "virtualmachines"
        );
        assert_eq!(c.by_kind("v1", "Pod").unwrap().plural, "pods");
    }

    #[test]
    fn names_and_splitting() {
        let r = vm();
        assert_eq!(r.group_resource(), "virtualmachines.kubevirt.io");
        assert_eq!(r.kind_group(), "virtualmachine.kubevirt.io");
        assert_eq!(r.api_resource().api_version, "kubevirt.io/v1");
        assert_eq!(
            split_type_name("vm/x", None),
            ("vm".to_string(), Some("x".to_string()))
        );
        assert_eq!(split_type_name("vm", Some("x")).1.as_deref(), Some("x"));
        assert_eq!(split_type_name("vm", None).1, None);
    }

    #[test]
    fn api_resources_lists_short_names() {
        let out = api_resources_table(&catalog().resources);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("NAME"));
        assert!(lines[1].starts_with("pods"));
        assert!(lines[2].contains("vm,vms"));
        assert!(lines[2].contains("kubevirt.io/v1"));
    }
}
