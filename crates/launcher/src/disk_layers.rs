//! Which layer files a disk's QEMU actually runs (`DiskLayers`): the facts an agent resolves
//! an online merge's journal from after a crash (docs/snapshots.md "Order and crashes").
//!
//! The disk's running chain is its format nodes in order ([`crate::online_reclaim::running_chain`]);
//! each format node's protocol node names its file: a path, or `/dev/fdset/<id>` for a layer
//! the launcher opened on a descriptor (an online snapshot's overlay, a layer reopened
//! writable), whose file is found from QEMU's descriptors (`query-fdsets`, then
//! `/proc/<qemu pid>/fd/<fd>`). Every file must lie in the volume directory the agent names;
//! the answer is their file names, bottom first ([`layer_files`], pure).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::lifecycle::Vm;
use crate::online_reclaim::running_chain;
use crate::online_snapshot::Tops;

/// `DiskLayers`: the files disk `disk` runs on, in volume directory `dir`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskLayersRequest {
    pub disk: String,
    pub dir: PathBuf,
}

/// The answer to a [`DiskLayersRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskLayers {
    /// File names in the request's `dir`, bottom first.
    pub layers: Vec<String>,
}

/// The file names of the running chain `nodes` (format nodes, bottom first) (pure): `list`
/// is `query-named-block-nodes` (flat), `file_of` the protocol node of a format node,
/// `fdsets` the files behind each descriptor set. A layer outside `dir` or whose file cannot
/// be told is refused.
pub fn layer_files(
    nodes: &[String],
    list: &[Value],
    file_of: impl Fn(&str) -> String,
    fdsets: &BTreeMap<u64, Vec<PathBuf>>,
    dir: &Path,
) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for fmt in nodes {
        let proto = file_of(fmt);
        let filename = list
            .iter()
            .find(|n| n["node-name"] == proto.as_str())
            .and_then(|n| n["file"].as_str())
            .ok_or_else(|| {
                Error::Protocol(format!("no protocol node {proto} under {fmt} with a file"))
            })?;
        let paths: Vec<PathBuf> = match filename
            .strip_prefix("/dev/fdset/")
            .and_then(|id| id.parse::<u64>().ok())
        {
            Some(id) => fdsets.get(&id).cloned().unwrap_or_default(),
            None => vec![PathBuf::from(filename)],
        };
        let mut names: Vec<String> = paths
            .iter()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        names.dedup();
        match names.as_slice() {
            [one] => out.push(one.clone()),
            _ => {
                return Err(Error::InvalidSpec(format!(
                    "layer {fmt} ({filename}) is not one file of {}",
                    dir.display()
                )));
            }
        }
    }
    Ok(out)
}

/// Answers `req` from the running QEMU.
pub async fn disk_layers(vm: &Vm, tops: &Tops, req: &DiskLayersRequest) -> Result<DiskLayers> {
    let named = vm
        .qmp()
        .execute("query-named-block-nodes", Some(json!({"flat": true})))
        .await?;
    let list = named.as_array().cloned().unwrap_or_default();
    let nodes = running_chain(
        &req.disk,
        list.iter().filter_map(|n| n["node-name"].as_str()),
    );
    if nodes.is_empty() {
        return Err(Error::InvalidSpec(format!("no disk {}", req.disk)));
    }
    let sets = vm.qmp().execute("query-fdsets", None).await?;
    let mut fdsets: BTreeMap<u64, Vec<PathBuf>> = BTreeMap::new();
    if let Some(pid) = vm.pid() {
        for set in sets.as_array().into_iter().flatten() {
            let Some(id) = set["fdset-id"].as_u64() else {
                continue;
            };
            for fd in set["fds"].as_array().into_iter().flatten() {
                if let Some(fd) = fd["fd"].as_u64()
                    && let Ok(p) = std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
                {
                    fdsets.entry(id).or_default().push(p);
                }
            }
        }
    }
    let layers = layer_files(&nodes, &list, |f| tops.file_of(f), &fdsets, &req.dir)?;
    Ok(DiskLayers { layers })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_come_from_paths_and_descriptor_sets_inside_the_volume_directory() {
        let dir = Path::new("/v/pv1");
        let list = vec![
            json!({"node-name": "file-disk-a-b1", "file": "/v/pv1/disk.img"}),
            json!({"node-name": "fmt-disk-a-b1", "file": "json:{...}"}),
            json!({"node-name": "file-disk-a", "file": "/v/pv1/layer-000001.qcow2"}),
            json!({"node-name": "file-disk-a-s2", "file": "/dev/fdset/3"}),
        ];
        let nodes: Vec<String> = ["fmt-disk-a-b1", "fmt-disk-a", "fmt-disk-a-s2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let file_of = |f: &str| format!("file-{}", f.strip_prefix("fmt-").unwrap());
        let fdsets = BTreeMap::from([(
            3,
            vec![
                PathBuf::from("/v/pv1/layer-000002.qcow2"),
                PathBuf::from("/v/pv1/layer-000002.qcow2"),
            ],
        )]);
        assert_eq!(
            layer_files(&nodes, &list, file_of, &fdsets, dir).unwrap(),
            ["disk.img", "layer-000001.qcow2", "layer-000002.qcow2"]
        );
        // A layer outside the directory, an unknown descriptor set, a missing node: refused.
        assert!(layer_files(&nodes, &list, file_of, &fdsets, Path::new("/v/pv2")).is_err());
        assert!(layer_files(&nodes, &list, file_of, &BTreeMap::new(), dir).is_err());
        let short = &list[..2];
        assert!(layer_files(&nodes, short, file_of, &fdsets, dir).is_err());
        // A node reopened writable names its new protocol node.
        let mut list2 = list.clone();
        list2.push(json!({"node-name": "file-disk-a-b1-w5", "file": "/dev/fdset/3"}));
        let reopened = |f: &str| {
            if f == "fmt-disk-a-b1" {
                "file-disk-a-b1-w5".to_string()
            } else {
                file_of(f)
            }
        };
        let one = vec!["fmt-disk-a-b1".to_string()];
        assert_eq!(
            layer_files(&one, &list2, reopened, &fdsets, dir).unwrap(),
            ["layer-000002.qcow2"]
        );
    }
}
