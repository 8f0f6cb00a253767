//! Reclaim planning (pure) and its qemu-img steps on real images.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use super::*;
use crate::snapshot::{export_raw, plan_revert, plan_snapshot, prefix_to, revert, take};

fn held(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn files(c: &Chain) -> Vec<&str> {
    c.layers.iter().map(|l| l.file.as_str()).collect()
}

/// disk.img, layer-1, layer-2, layer-3 frozen under the top layer-4.
fn four_snapshots() -> Chain {
    let mut c = Chain::default();
    for _ in 0..4 {
        c = plan_snapshot(&c).chain;
    }
    c
}

#[test]
fn nothing_held_commits_everything_into_the_bottom() {
    let c = four_snapshots();
    let p = plan_reclaim(&c, &held(&[]));
    assert_eq!(p.steps.len(), 1);
    assert!(matches!(&p.steps[0], Step::CommitAll { layers } if layers.len() == 5));
    assert!(p.chain.is_plain());
    assert_eq!(p.chain.next, c.next, "layer names are never reused");
    assert_eq!(p.delete.len(), 4);
    // A plain volume has nothing to reclaim.
    assert!(plan_reclaim(&Chain::default(), &held(&[])).is_empty());
}

#[test]
fn unheld_runs_are_streamed_into_the_layer_above() {
    let c = four_snapshots();
    // disk.img and layer-2 held: layer-1 goes into layer-2, layer-3 into the top.
    let p = plan_reclaim(&c, &held(&["disk.img", "layer-000002.qcow2"]));
    assert_eq!(
        files(&p.chain),
        ["disk.img", "layer-000002.qcow2", "layer-000004.qcow2"]
    );
    assert_eq!(p.delete, ["layer-000001.qcow2", "layer-000003.qcow2"]);
    match &p.steps[..] {
        [
            Step::Rebase { image, old, onto },
            Step::Rebase {
                image: i2,
                old: o2,
                onto: n2,
            },
        ] => {
            assert_eq!(image.file, "layer-000002.qcow2");
            assert_eq!(old.len(), 3);
            assert_eq!(onto.len(), 1);
            assert_eq!(i2.file, "layer-000004.qcow2");
            assert_eq!(o2.len(), 4, "after the first step: disk, 2, 3, 4");
            assert_eq!(n2.len(), 2);
        }
        other => panic!("{other:?}"),
    }
    // Only disk.img held: one rebase of the top onto it.
    let p = plan_reclaim(&c, &held(&["disk.img"]));
    assert_eq!(files(&p.chain), ["disk.img", "layer-000004.qcow2"]);
    assert_eq!(p.steps.len(), 1);
    // Everything held: nothing to do.
    let all = held(&[
        "disk.img",
        "layer-000001.qcow2",
        "layer-000002.qcow2",
        "layer-000003.qcow2",
    ]);
    assert!(plan_reclaim(&c, &all).is_empty());
}

#[test]
fn detached_layers_stay_readable_and_go_when_unheld() {
    let c = four_snapshots();
    // Revert to layer-1: layers 2 and 3 are detached, the old top dropped.
    let r = plan_revert(&c, "layer-000001.qcow2").unwrap().chain;
    assert_eq!(
        files(&r),
        ["disk.img", "layer-000001.qcow2", "layer-000005.qcow2"]
    );
    assert_eq!(r.detached.len(), 2);
    let p3 = prefix_to(&r, "layer-000003.qcow2").unwrap();
    assert_eq!(
        p3.iter().map(|l| l.file.as_str()).collect::<Vec<_>>(),
        [
            "disk.img",
            "layer-000001.qcow2",
            "layer-000002.qcow2",
            "layer-000003.qcow2"
        ],
        "a later snapshot stays readable after reverting to an earlier one"
    );
    // layer-3 held: layer-2 backs it, so both stay and pin layer-1.
    let p = plan_reclaim(&r, &held(&["layer-000003.qcow2"]));
    assert!(p.is_empty(), "{p:?}");
    // layer-3 no longer held: both detached go, then the live chain commits down.
    let p = plan_reclaim(&r, &held(&[]));
    assert_eq!(p.delete[..2], ["layer-000003.qcow2", "layer-000002.qcow2"]);
    assert!(p.chain.is_plain());
    // Reverting to a detached layer makes its path live again.
    let r2 = plan_revert(&r, "layer-000003.qcow2").unwrap().chain;
    assert_eq!(
        files(&r2),
        [
            "disk.img",
            "layer-000001.qcow2",
            "layer-000002.qcow2",
            "layer-000003.qcow2",
            "layer-000006.qcow2"
        ]
    );
    assert!(r2.detached.is_empty());
}

#[test]
fn hostile_detached_records_are_refused() {
    let mut c = Chain::default();
    c.detached.push(super::super::Detached {
        file: "layer-000001.qcow2".into(),
        backing: "../../etc/passwd".into(),
    });
    assert!(super::super::validate_chain(&c).is_err());
}

fn qemu_io(dir: &Path, layers: &[Layer], cmd: &str) -> String {
    let spec = format!("json:{}", blockdev_json(dir, layers));
    let out = Command::new("qemu-io")
        .args(["-c", cmd, &spec])
        .output()
        .expect("qemu-io (qemu-utils) runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn write(dir: &Path, offset: u64, pattern: u8) {
    let chain = read_chain(dir).unwrap();
    qemu_io(
        dir,
        &chain.layers,
        &format!("write -P {pattern} {offset} 65536"),
    );
}

fn byte_at(img: &Path, offset: u64) -> u8 {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(img).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0]
}

/// What snapshot `handle` (the live chain when `None`) reads at the four offsets written below.
fn view(dir: &Path, handle: Option<&str>) -> [u8; 4] {
    let out = dir.join(format!("view-{}.raw", handle.unwrap_or("live")));
    let _ = std::fs::remove_file(&out);
    export_raw(dir, handle, &out).unwrap();
    let v = [0, 1, 2, 3].map(|i| byte_at(&out, i << 20));
    std::fs::remove_file(&out).unwrap();
    v
}

#[test]
fn reclaim_on_disk_keeps_every_held_snapshot_and_the_live_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = crate::provisioner::VolumeRoot::new(tmp.path());
    let dir = root.create("pv1", 8 << 20).unwrap();
    write(&dir, 0, 1);
    let s1 = take(&dir).unwrap(); // disk.img: [1,0,0,0]
    write(&dir, 1 << 20, 2);
    let s2 = take(&dir).unwrap(); // layer-1: [1,2,0,0]
    write(&dir, 2 << 20, 3);
    let s3 = take(&dir).unwrap(); // layer-2: [1,2,3,0]
    write(&dir, 3 << 20, 4);
    write(&dir, 0, 9); // live: [9,2,3,4]
    assert_eq!(view(&dir, Some(&s2)), [1, 2, 0, 0]);

    // s2 deleted: its layer is streamed into s3's; s1, s3 and the live bytes unchanged.
    assert!(release(&dir, std::slice::from_ref(&s2)).unwrap());
    assert!(
        !release(&dir, &["layer-000004.qcow2".into(), "nope".into()]).unwrap(),
        "the live top and unknown names are never released"
    );
    let r = reclaim(&dir).unwrap();
    assert_eq!(r.dropped, std::slice::from_ref(&s2));
    assert!(!dir.join(&s2).exists());
    assert_eq!(view(&dir, Some(&s1)), [1, 0, 0, 0]);
    assert_eq!(view(&dir, Some(&s3)), [1, 2, 3, 0]);
    assert_eq!(view(&dir, None), [9, 2, 3, 4]);
    assert_eq!(read_chain(&dir).unwrap().layers.len(), 3);
    // Nothing more to do while both are held.
    assert!(reclaim(&dir).unwrap().dropped.is_empty());
    assert!(read_chain(&dir).unwrap().released.is_empty());

    // Revert to s1 (s3 detached, still readable), write, then let everything go.
    revert(&dir, &s1).unwrap();
    write(&dir, 3 << 20, 7);
    assert_eq!(view(&dir, Some(&s3)), [1, 2, 3, 0]);
    assert_eq!(view(&dir, None), [1, 0, 0, 7]);
    release(&dir, &[s1.clone(), s3.clone()]).unwrap();
    let r = reclaim(&dir).unwrap();
    assert!(r.plain, "{r:?}");
    assert!(read_chain(&dir).unwrap().is_plain());
    let img = dir.join("disk.img");
    assert_eq!(
        [0, 1, 2, 3].map(|i| byte_at(&img, i << 20)),
        [1, 0, 0, 7],
        "the live bytes are committed into the raw image"
    );
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".qcow2"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    crate::snapshot::check_growable(&dir).unwrap();
}

#[test]
fn an_online_merge_records_the_plan_keeps_late_releases_and_open_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    // disk.img, layer-1, layer-2 frozen under the top layer-3; layer-1 released.
    let mut c = Chain::default();
    for _ in 0..3 {
        c = plan_snapshot(&c).chain;
    }
    c.released.insert("layer-000001.qcow2".into());
    write_chain(&dir, &c).unwrap();
    for l in &c.layers {
        std::fs::write(dir.join(&l.file), b"x").unwrap();
    }
    let plan = plan_reclaim(&c, &held_layers(&c));
    assert_eq!(plan.delete, ["layer-000001.qcow2"]);
    // Released while QEMU ran the job: stays released.
    release(&dir, &["layer-000002.qcow2".into()]).unwrap();
    let r = finish_online(&dir, &c, &plan, &[]).unwrap();
    assert_eq!(r.dropped, ["layer-000001.qcow2"]);
    assert!(!dir.join("layer-000001.qcow2").exists());
    let now = read_chain(&dir).unwrap();
    assert_eq!(
        files(&now),
        ["disk.img", "layer-000002.qcow2", "layer-000003.qcow2"]
    );
    assert_eq!(now.released, held(&["layer-000002.qcow2"]));

    // Everything released: a file QEMU still holds is kept, the record moves on.
    release(&dir, &["disk.img".into()]).unwrap();
    let now = read_chain(&dir).unwrap();
    let plan = plan_reclaim(&now, &held_layers(&now));
    let r = finish_online(&dir, &now, &plan, &["layer-000003.qcow2".into()]).unwrap();
    assert!(r.plain);
    assert_eq!(r.dropped, ["layer-000002.qcow2"]);
    assert_eq!(r.kept_open, ["layer-000003.qcow2"]);
    assert!(dir.join("layer-000003.qcow2").exists());
    assert!(read_chain(&dir).unwrap().is_plain());

    // A chain that changed since the plan (a snapshot meanwhile) is refused, untouched.
    let before = read_chain(&dir).unwrap();
    let snap = plan_snapshot(&before).chain;
    write_chain(&dir, &snap).unwrap();
    let e = finish_online(&dir, &before, &plan_reclaim(&before, &held(&[])), &[]).unwrap_err();
    assert!(e.to_string().contains("changed"), "{e}");
    assert_eq!(read_chain(&dir).unwrap(), snap);
}
