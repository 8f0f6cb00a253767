//! Runs the web console's JavaScript unit tests (`ui/test/*.test.js`, Node's built-in test
//! runner) as part of `cargo test`: the pure steps of the page (the Create VM manifest, the
//! websocket token subprotocol). Needs `node`, which building the bundle needs anyway; without
//! it the test is skipped with a message, except under `CI=true`, where it fails.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn ui_javascript_unit_tests_pass() {
    let ui = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../ui");
    if Command::new("node").arg("--version").output().is_err() {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "node is missing under CI=true (scripts/install-deps.sh installs nodejs)"
        );
        eprintln!("SKIPPED ui unit tests: node is not installed");
        return;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(ui.join("test"))
        .expect("ui/test")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(".test.js"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no ui/test/*.test.js");
    let out = Command::new("node")
        .arg("--test")
        .args(&files)
        .current_dir(&ui)
        .output()
        .expect("running node --test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "node --test failed:\n{text}");
    assert!(text.contains("# fail 0"), "{text}");
}
