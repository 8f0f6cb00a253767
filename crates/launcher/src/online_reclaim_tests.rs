use super::*;

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn the_running_chain_orders_backings_the_start_node_and_overlays() {
    let got = running_chain(
        "disk-data",
        [
            "fmt-disk-data-s3",
            "file-disk-data",
            "fmt-disk-data",
            "fmt-disk-data-b2",
            "fmt-disk-data-s1",
            "fmt-disk-data-b1",
            "fmt-disk-root",
            "fmt-disk-data-w4",
        ],
    );
    assert_eq!(
        got,
        [
            "fmt-disk-data-b2",
            "fmt-disk-data-b1",
            "fmt-disk-data",
            "fmt-disk-data-s1",
            "fmt-disk-data-s3"
        ]
    );
    // After an active commit pivoted to a backing, only what is left counts.
    assert_eq!(
        running_chain("d", ["fmt-d-b1", "fmt-d-s9"]),
        ["fmt-d-b1", "fmt-d-s9"]
    );
}

#[test]
fn a_released_bottom_with_nothing_held_is_an_active_commit() {
    let nodes = names(&["fmt-d", "fmt-d-s1"]);
    let layers = names(&["disk.img", "layer-000001.qcow2"]);
    let jobs = plan_jobs(
        &nodes,
        &layers,
        &[MergeStep::CommitActive {
            base: "disk.img".into(),
        }],
    )
    .unwrap();
    assert_eq!(jobs.len(), 1);
    let j = &jobs[0];
    assert_eq!(j.kind, JobKind::CommitActive);
    assert_eq!(j.target, "fmt-d");
    assert_eq!(j.target_backing, None);
    assert_eq!(j.dropped, ["fmt-d-s1"]);
    let (cmd, args) = job_command(j, "r");
    assert_eq!(cmd, "block-commit");
    assert_eq!(args["device"], "fmt-d-s1");
    assert_eq!(args["top-node"], "fmt-d-s1");
    assert_eq!(args["base-node"], "fmt-d");
    assert_eq!(args["auto-dismiss"], false);
}

#[test]
fn runs_of_released_layers_stream_into_the_layer_above_with_the_held_base() {
    // disk.img (held) ← l1 (released) ← l2 (released) ← l3 (held) ← l4 (released) ← l5 top
    let nodes = names(&[
        "fmt-d-b5", "fmt-d-b4", "fmt-d-b3", "fmt-d-b2", "fmt-d-b1", "fmt-d",
    ]);
    let layers = names(&["disk.img", "l1", "l2", "l3", "l4", "l5"]);
    let steps = [
        MergeStep::Stream {
            image: "l3".into(),
            base: "disk.img".into(),
        },
        MergeStep::Stream {
            image: "l5".into(),
            base: "l3".into(),
        },
    ];
    let jobs = plan_jobs(&nodes, &layers, &steps).unwrap();
    assert_eq!(jobs[0].kind, JobKind::Stream);
    assert_eq!(jobs[0].target, "fmt-d-b2");
    assert_eq!(jobs[0].target_backing.as_deref(), Some("fmt-d-b5"));
    assert_eq!(jobs[0].dropped, ["fmt-d-b4", "fmt-d-b3"]);
    let (cmd, args) = job_command(&jobs[0], "j");
    assert_eq!(cmd, "block-stream");
    assert_eq!(args["device"], "fmt-d-b2");
    assert_eq!(args["base-node"], "fmt-d-b5");
    assert_eq!(
        args["backing-file"], "disk.img",
        "the relative name, as offline"
    );
    assert_eq!(jobs[1].target, "fmt-d");
    assert_eq!(jobs[1].other, "fmt-d-b2");
    assert_eq!(jobs[1].dropped, ["fmt-d-b1"]);
}

#[test]
fn a_chain_that_does_not_match_the_record_is_refused() {
    let e = plan_jobs(
        &names(&["fmt-d"]),
        &names(&["disk.img", "layer-000001.qcow2"]),
        &[],
    )
    .unwrap_err();
    assert!(e.to_string().contains("records 2"), "{e}");
    let nodes = names(&["fmt-d-b1", "fmt-d"]);
    let layers = names(&["disk.img", "l1"]);
    for (step, want) in [
        (
            MergeStep::Stream {
                image: "disk.img".into(),
                base: "l1".into(),
            },
            "not below",
        ),
        (
            MergeStep::Stream {
                image: "l1".into(),
                base: "nope".into(),
            },
            "nope is not in",
        ),
        (
            MergeStep::CommitActive { base: "l1".into() },
            "active layer",
        ),
    ] {
        let e = plan_jobs(&nodes, &layers, &[step]).unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
    }
}

#[test]
fn job_states_come_from_query_jobs() {
    let q = serde_json::json!([
        {"id": "a", "status": "running"},
        {"id": "b", "status": "ready"},
        {"id": "c", "status": "concluded"},
        {"id": "d", "status": "concluded", "error": "Permission denied"},
    ]);
    assert_eq!(job_state(&q, "a"), JobState::Running);
    assert_eq!(job_state(&q, "b"), JobState::Ready);
    assert_eq!(job_state(&q, "c"), JobState::Concluded(None));
    assert_eq!(
        job_state(&q, "d"),
        JobState::Concluded(Some("Permission denied".into()))
    );
    assert_eq!(job_state(&q, "e"), JobState::Gone);
}

#[test]
fn fdset_nodes_are_found_by_their_file_name() {
    let list = vec![
        serde_json::json!({"node-name": "file-d-s1", "file": "/dev/fdset/3"}),
        serde_json::json!({"node-name": "file-d", "file": "/v/disk.img"}),
    ];
    assert_eq!(file_fdsets(&list), [("file-d-s1".to_string(), 3)]);
}
