use super::*;
use crate::snapshot::{LayerFormat, held_layers, plan_reclaim, plan_snapshot};

fn chain(n: usize, released: &[&str]) -> Chain {
    let mut c = Chain::default();
    for _ in 0..n {
        c = plan_snapshot(&c).chain;
    }
    c.released = released.iter().map(|s| s.to_string()).collect();
    c
}

/// `c` with the journal of its reclaim plan, as `begin_online` records it.
fn journaled(c: &Chain) -> Chain {
    let plan = plan_reclaim(c, &held_layers(c));
    let commit = plan
        .steps
        .iter()
        .any(|s| matches!(s, crate::snapshot::reclaim::Step::CommitAll { .. }));
    let mut j = c.clone();
    j.journal = Some(Journal {
        id: "m1".into(),
        commit,
        layers: plan.chain.layers.clone(),
        detached: plan.chain.detached.clone(),
        delete: plan.delete.clone(),
    });
    validate_chain(&j).unwrap();
    j
}

fn files(c: &Chain) -> Vec<String> {
    c.layers.iter().map(|l| l.file.clone()).collect()
}

fn run(names: &[&str]) -> Facts {
    Facts::Running(names.iter().map(|s| s.to_string()).collect())
}

use super::super::validate_chain;

#[test]
fn no_journal_nothing_to_resolve() {
    assert_eq!(
        resolve(&chain(1, &[]), &Facts::Gone { pivoted: true }).unwrap(),
        None
    );
}

#[test]
fn a_commit_is_resolved_to_the_chain_qemu_runs() {
    let c = journaled(&chain(1, &["disk.img"]));
    assert!(c.journal.as_ref().unwrap().commit);
    // Crash after the pivot, QEMU runs the raw bottom: the bottom alone is recorded and the
    // qcow2 layer is deleted.
    let r = resolve(&c, &run(&["disk.img"])).unwrap().unwrap();
    assert!(r.merged);
    assert!(r.chain.is_plain());
    assert_eq!(r.chain.journal, None);
    assert!(r.chain.released.is_empty());
    assert_eq!(r.delete, ["layer-000001.qcow2"]);
    // Crash before the pivot (QEMU still runs the top): the old chain, nothing deleted.
    let r = resolve(&c, &run(&["disk.img", "layer-000001.qcow2"]))
        .unwrap()
        .unwrap();
    assert!(!r.merged);
    assert_eq!(files(&r.chain), ["disk.img", "layer-000001.qcow2"]);
    assert_eq!(r.chain.journal, None);
    assert!(r.chain.released.contains("disk.img"), "the release is kept");
    assert!(r.delete.is_empty());
}

#[test]
fn a_commit_with_qemu_gone_follows_the_pivot_marker() {
    let c = journaled(&chain(2, &["disk.img", "layer-000001.qcow2"]));
    // The marker: the guest may have written the bottom after the pivot.
    let r = resolve(&c, &Facts::Gone { pivoted: true })
        .unwrap()
        .unwrap();
    assert!(r.merged && r.chain.is_plain());
    assert_eq!(r.delete, ["layer-000001.qcow2", "layer-000002.qcow2"]);
    // No marker: no guest write after a pivot, the old chain reads the last bytes.
    let r = resolve(&c, &Facts::Gone { pivoted: false })
        .unwrap()
        .unwrap();
    assert!(!r.merged);
    assert_eq!(files(&r.chain), files(&c));
    assert!(r.delete.is_empty());
}

#[test]
fn a_stream_is_resolved_to_the_chain_qemu_runs_or_kept_when_qemu_is_gone() {
    // disk.img held, l1 l2 released, l3 held, top l4: l1 and l2 streamed into l3.
    let c = journaled(&chain(4, &["layer-000001.qcow2", "layer-000002.qcow2"]));
    let j = c.journal.clone().unwrap();
    assert!(!j.commit);
    // Crash after the stream: QEMU runs the shorter chain.
    let after = ["disk.img", "layer-000003.qcow2", "layer-000004.qcow2"];
    let r = resolve(&c, &run(&after)).unwrap().unwrap();
    assert!(r.merged);
    assert_eq!(files(&r.chain), after);
    assert_eq!(r.delete, ["layer-000001.qcow2", "layer-000002.qcow2"]);
    assert!(r.chain.released.is_empty());
    // Crash before: the old chain.
    let r = resolve(
        &c,
        &run(&files(&c).iter().map(String::as_str).collect::<Vec<_>>()),
    )
    .unwrap()
    .unwrap();
    assert!(!r.merged && r.delete.is_empty());
    assert_eq!(files(&r.chain), files(&c));
    // QEMU gone, marker or not: the old chain reads the same bytes as the streamed one.
    for pivoted in [false, true] {
        let r = resolve(&c, &Facts::Gone { pivoted }).unwrap().unwrap();
        assert!(!r.merged && r.delete.is_empty());
        assert_eq!(files(&r.chain), files(&c));
    }
}

#[test]
fn a_partly_done_stream_records_the_layers_qemu_still_runs() {
    // disk.img held, l1 released, l2 held, l3 released, l4 held, top l5: two streams.
    let c = journaled(&chain(5, &["layer-000001.qcow2", "layer-000003.qcow2"]));
    let j = c.journal.clone().unwrap();
    assert_eq!(j.delete, ["layer-000001.qcow2", "layer-000003.qcow2"]);
    // The first stream ended (l1 gone), the second did not.
    let running = [
        "disk.img",
        "layer-000002.qcow2",
        "layer-000003.qcow2",
        "layer-000004.qcow2",
        "layer-000005.qcow2",
    ];
    let r = resolve(&c, &run(&running)).unwrap().unwrap();
    assert!(!r.merged);
    assert_eq!(files(&r.chain), running);
    assert_eq!(r.delete, ["layer-000001.qcow2"]);
    assert_eq!(
        r.chain.released.iter().collect::<Vec<_>>(),
        ["layer-000003.qcow2"],
        "the release not carried out stays"
    );
}

#[test]
fn a_running_chain_that_fits_nothing_is_refused() {
    let c = journaled(&chain(1, &["disk.img"]));
    for bad in [
        run(&["layer-000001.qcow2"]),
        run(&["disk.img", "layer-000009.qcow2"]),
        run(&[]),
    ] {
        let e = resolve(&c, &bad).unwrap_err().to_string();
        assert!(e.contains("neither the recorded one"), "{e}");
    }
    // A commit is never partly done: a shorter chain than the record is refused too.
    let c = journaled(&chain(2, &["disk.img", "layer-000001.qcow2"]));
    assert!(resolve(&c, &run(&["disk.img", "layer-000002.qcow2"])).is_err());
}

#[test]
fn late_releases_are_kept_where_the_layer_is_still_frozen() {
    let mut c = journaled(&chain(3, &["layer-000001.qcow2"]));
    // Released while the merge ran.
    c.released.insert("layer-000002.qcow2".into());
    let after = ["disk.img", "layer-000002.qcow2", "layer-000003.qcow2"];
    let r = resolve(&c, &run(&after)).unwrap().unwrap();
    assert_eq!(
        r.chain.released.iter().collect::<Vec<_>>(),
        ["layer-000002.qcow2"]
    );
}

#[test]
fn hostile_journals_are_refused() {
    let good = journaled(&chain(1, &["disk.img"]));
    let mut bad = good.clone();
    bad.journal.as_mut().unwrap().id = "../x".into();
    assert!(
        validate_chain(&bad).is_err(),
        "a marker outside the directory"
    );
    let mut bad = good.clone();
    bad.journal.as_mut().unwrap().delete = vec!["../../etc/passwd".into()];
    assert!(validate_chain(&bad).is_err(), "a path to delete");
    let mut bad = good.clone();
    bad.journal.as_mut().unwrap().delete = vec!["disk.img".into()];
    assert!(validate_chain(&bad).is_err(), "deleting the layer it keeps");
    let mut bad = good.clone();
    bad.journal.as_mut().unwrap().delete = vec!["chain.json".into()];
    assert!(
        validate_chain(&bad).is_err(),
        "deleting a file it does not drop"
    );
    let mut bad = good.clone();
    bad.journal.as_mut().unwrap().layers = vec![Layer {
        file: "other.img".into(),
        format: LayerFormat::Raw,
    }];
    assert!(validate_chain(&bad).is_err(), "another bottom");
}

#[test]
fn journals_are_recorded_and_resolved_on_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let root = crate::provisioner::VolumeRoot::new(tmp.path());
    let dir = root.create("pv1", 1 << 20).unwrap();
    crate::snapshot::take(&dir).unwrap();
    crate::snapshot::release(&dir, &["disk.img".to_string()]).unwrap();
    let c = read_chain(&dir).unwrap();
    let j = journaled(&c).journal.unwrap();
    begin_online(&dir, &c, j.clone()).unwrap();
    assert!(
        begin_online(&dir, &c, j.clone()).is_err(),
        "one journal at a time"
    );
    // An offline user resolves it from the files: no marker, the old chain stays.
    let r = read_resolved(&dir).unwrap();
    assert_eq!(files(&r), ["disk.img", "layer-000001.qcow2"]);
    assert!(dir.join("layer-000001.qcow2").exists());
    // Again, with the launcher's marker: the bottom alone, the layer and marker deleted.
    begin_online(&dir, &r, j.clone()).unwrap();
    std::fs::write(dir.join(marker_name(&j.id)), b"").unwrap();
    assert!(
        crate::snapshot::prepare_online(&dir).is_err(),
        "no online snapshot over a pending journal"
    );
    let r = read_resolved(&dir).unwrap();
    assert!(r.is_plain());
    assert!(!dir.join("layer-000001.qcow2").exists());
    assert!(!dir.join(marker_name(&j.id)).exists());
    assert_eq!(read_chain(&dir).unwrap(), r);
}

#[test]
fn a_journal_is_not_resolved_from_the_files_while_a_qemu_writes_the_volume() {
    let tmp = tempfile::tempdir().unwrap();
    let root = crate::provisioner::VolumeRoot::new(tmp.path());
    let dir = root.create("pv1", 1 << 20).unwrap();
    crate::snapshot::take(&dir).unwrap();
    crate::snapshot::release(&dir, &["disk.img".to_string()]).unwrap();
    let c = read_chain(&dir).unwrap();
    begin_online(&dir, &c, journaled(&c).journal.unwrap()).unwrap();
    // A QEMU process holding the raw bottom open (qemu-nbd: QEMU's block layer and locks).
    let mut writer = std::process::Command::new("qemu-nbd")
        .args(["-f", "raw", "--persistent", "-k"])
        .arg(tmp.path().join("nbd.sock"))
        .arg(dir.join("disk.img"))
        .spawn()
        .expect("qemu-nbd (qemu-utils) runs");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !tmp.path().join("nbd.sock").exists() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let e = read_resolved(&dir).unwrap_err();
    assert!(matches!(e, StorageError::InUse(_)), "{e}");
    assert!(read_chain(&dir).unwrap().journal.is_some(), "still pending");
    writer.kill().unwrap();
    writer.wait().unwrap();
    assert!(read_resolved(&dir).unwrap().journal.is_none());
}

#[test]
fn qemu_locks_are_read_from_proc_locks() {
    let locks = "1: POSIX  ADVISORY  WRITE 77 08:01:5555 0 EOF\n\
                 2: OFDLCK ADVISORY  READ -1 fe:00:10010692 201 201\n\
                 3: OFDLCK ADVISORY  READ -1 fe:00:10010692 100 101\n";
    let dev = 0xfe00; // major 0xfe, minor 0
    assert!(qemu_holds(locks, dev, 10010692));
    assert!(!qemu_holds(locks, dev, 10010693), "another file");
    assert!(!qemu_holds(locks, 0x0801, 10010692), "another device");
    // A lock outside QEMU's bytes is not QEMU's; a whole-file lock covers them.
    assert!(!qemu_holds(
        "1: OFDLCK ADVISORY  READ -1 fe:00:9 0 99\n",
        dev,
        9
    ));
    assert!(qemu_holds(
        "1: POSIX  ADVISORY  WRITE 7 08:01:9 0 EOF\n",
        0x0801,
        9
    ));
}
