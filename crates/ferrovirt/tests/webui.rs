//! End-to-end test of the web console (`/ui/`) in a real headless Chromium driven through
//! chromedriver (WebDriver, `fantoccini`), against the real server binary with its embedded
//! agent and a VM on the test guest under TCG: a wrong token is refused at sign-in; the right one
//! signs in; the list shows the VM Running (live, from the watch); Overview and Events show
//! it; Unpause of a running VM shows the API's error, Pause/Unpause their result and status;
//! the serial console tab
//! (xterm.js over the `console` websocket, token in the subprotocol) runs `echo web-$((6*7))`
//! and shows `web-42`; the Metrics tab (node1's metrics through the Node proxy) charts CPU
//! usage with 2+ points above zero, memory and storage, and says so once the VM is stopped; the VNC tab's canvas (noVNC over the `vnc` websocket) is not blank; a
//! YAML save with a stale resourceVersion shows the conflict (and saves after Reload); the list
//! is readable at phone width; Stop turns the status Stopped; Delete asks, then deletes; the
//! Create VM form refuses a bad name and makes a VM of the common instancetype `u1.nano` and
//! preference `alpine`, importing its disk from a URL, that boots;
//! Storage shows its DataVolume and claim, Nodes shows node1 Ready with that one VMI; Migrate
//! creates a migration; the Snapshots tab takes a snapshot of the running VM, restores it into
//! the stopped VM and deletes it; Settings creates the HyperConverged object and saves its YAML;
//! the whole run had no Content-Security-Policy violation, and an injected inline script is
//! refused by the browser. Then a shorter run in headless Firefox (geckodriver) on a second VM:
//! sign in, Running, `web-42`, VNC, Metrics, a `view` account's Metrics refused with the API's
//! 403, Restart (a new VMI, Running again), Stop.
//! Screenshots are written under `target/webui-artifacts/`.
//!
//! Needs Debian's `chromium` and `chromium-driver` (and for the Firefox part `firefox-esr` and
//! geckodriver from crates.io): skipped with a message when they are missing, except under
//! `CI=true`, where their absence fails the test.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fantoccini::actions::{InputSource, KeyAction, KeyActions};
use fantoccini::{Client, ClientBuilder, Locator};
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::json;

const BOOT: Duration = Duration::from_secs(180);
const STEP: Duration = Duration::from_secs(60);
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const FIREFOX: &str = "/usr/bin/firefox-esr";

fn artifacts() -> anyhow::Result<PathBuf> {
    let dir = ferrovirt_testkit::repo_root().join("target/webui-artifacts");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Where geckodriver is: `$GECKODRIVER`, `PATH`, or cargo's bin directory (scripts/install-deps.sh
/// installs it with `cargo install --locked geckodriver`).
fn geckodriver() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GECKODRIVER") {
        return Some(PathBuf::from(p));
    }
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(cargo_home.map(|c| c.join("bin")))
        .map(|d| d.join("geckodriver"))
        .find(|p| p.is_file())
}

/// Whether Firefox and geckodriver are here; missing ones fail under CI and skip elsewhere.
fn firefox_present() -> anyhow::Result<Option<PathBuf>> {
    let driver = geckodriver();
    let mut missing = Vec::new();
    if !Path::new(FIREFOX).exists() {
        missing.push(FIREFOX);
    }
    if driver.is_none() {
        missing.push("geckodriver");
    }
    if missing.is_empty() {
        return Ok(driver);
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        bail!(
            "{} missing under CI=true: scripts/install-deps.sh installs firefox-esr and geckodriver",
            missing.join(", ")
        );
    }
    eprintln!(
        "SKIPPED the Firefox part of the webui e2e: {} not installed (apt-get install firefox-esr; cargo install --locked geckodriver; required under CI=true)",
        missing.join(", ")
    );
    Ok(None)
}

/// Whether the browser is here; a missing one fails under CI and skips elsewhere.
fn browser_present() -> anyhow::Result<bool> {
    let missing: Vec<&str> = [CHROMIUM, CHROMEDRIVER]
        .into_iter()
        .filter(|p| !Path::new(p).exists())
        .collect();
    if missing.is_empty() {
        return Ok(true);
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        bail!(
            "{} missing under CI=true: scripts/install-deps.sh installs chromium and chromium-driver",
            missing.join(", ")
        );
    }
    eprintln!(
        "SKIPPED webui e2e: {} not installed (apt-get install chromium chromium-driver; required under CI=true)",
        missing.join(", ")
    );
    Ok(false)
}

/// chromedriver on a free loopback port, killed on drop.
struct Driver {
    child: Child,
    port: u16,
    _profile: tempfile::TempDir,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_driver() -> anyhow::Result<Driver> {
    let port = ferrovirt_testkit::free_port()?;
    let log = artifacts()?.join("chromedriver.log");
    let child = Command::new(CHROMEDRIVER)
        .arg(format!("--port={port}"))
        .arg(format!("--log-path={}", log.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting chromedriver")?;
    listening(child, port, "chromedriver")
}

/// geckodriver on a free loopback port (its log, with Firefox's console, in the artifacts).
fn start_geckodriver(bin: &Path) -> anyhow::Result<Driver> {
    let port = ferrovirt_testkit::free_port()?;
    let log = std::fs::File::create(artifacts()?.join("geckodriver.log"))?;
    let child = Command::new(bin)
        .arg(format!("--port={port}"))
        .arg("--host=127.0.0.1")
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    listening(child, port, "geckodriver")
}

fn listening(mut child: Child, port: u16, what: &str) -> anyhow::Result<Driver> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} did not listen on {port}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(Driver {
        child,
        port,
        _profile: tempfile::tempdir()?,
    })
}

async fn browser(driver: &Driver) -> anyhow::Result<Client> {
    let profile = driver._profile.path().display().to_string();
    let caps = json!({
        "browserName": "chrome",
        // The server's certificate is signed by the cluster's own CA.
        "acceptInsecureCerts": true,
        "goog:chromeOptions": {
            "binary": CHROMIUM,
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--ignore-certificate-errors",
                "--window-size=1280,900", format!("--user-data-dir={profile}"),
            ],
        },
    });
    let caps = caps.as_object().cloned().unwrap_or_default();
    let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.port))
        .await
        .context("starting a chromium session through chromedriver")?;
    Ok(client)
}

/// A headless Firefox session through geckodriver (its own fresh profile).
async fn firefox(driver: &Driver) -> anyhow::Result<Client> {
    let caps = json!({
        "browserName": "firefox",
        "acceptInsecureCerts": true,
        "moz:firefoxOptions": {
            "binary": FIREFOX,
            "args": ["-headless", "-width=1280", "-height=900"],
            "prefs": {
                "app.update.enabled": false,
                "browser.shell.checkDefaultBrowser": false,
                "datareporting.policy.dataSubmissionEnabled": false,
                "toolkit.telemetry.enabled": false,
                "network.captive-portal-service.enabled": false,
                "network.connectivity-service.enabled": false,
                "browser.safebrowsing.malware.enabled": false,
                "browser.safebrowsing.phishing.enabled": false,
                "extensions.update.enabled": false,
                "remote.prefs.recommended": true,
            },
        },
    });
    let caps = caps.as_object().cloned().unwrap_or_default();
    let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.port))
        .await
        .context("starting a Firefox session through geckodriver")?;
    Ok(client)
}

/// Polls `f` until it returns Some, or fails naming `what` after `timeout`.
async fn until<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        match f().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what} {last}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn text_of(c: &Client, css: &str) -> anyhow::Result<String> {
    Ok(c.find(Locator::Css(css)).await?.text().await?)
}

/// Waits until the element at `css` shows text containing `want`; returns the text.
async fn wait_text(c: &Client, css: &str, want: &str, timeout: Duration) -> anyhow::Result<String> {
    until(&format!("{css:?} to show {want:?}"), timeout, || async {
        let t = text_of(c, css).await?;
        Ok(t.contains(want).then_some(t))
    })
    .await
}

async fn shot(c: &Client, name: &str) -> anyhow::Result<()> {
    let png = c.screenshot().await?;
    std::fs::write(artifacts()?.join(name), png)?;
    Ok(())
}

/// Types `text` into whatever has the keyboard focus (xterm.js's hidden textarea).
async fn type_keys(c: &Client, text: &str) -> anyhow::Result<()> {
    let mut keys = KeyActions::new("keyboard".into());
    for ch in text.chars() {
        keys = keys
            .then(KeyAction::Down { value: ch })
            .then(KeyAction::Up { value: ch });
    }
    c.perform_actions(keys).await?;
    Ok(())
}

/// How many distinct colours a PNG has (a blank canvas has one).
fn distinct_colours(png_bytes: &[u8]) -> anyhow::Result<usize> {
    let decoder = png::Decoder::new(std::io::Cursor::new(png_bytes));
    let mut reader = decoder.read_info()?;
    let mut buf = vec![0; reader.output_buffer_size().context("png size")?];
    let info = reader.next_frame(&mut buf)?;
    let bpp = info.color_type.samples() * usize::from(info.bit_depth as u8).div_ceil(8);
    let mut seen = std::collections::HashSet::new();
    for px in buf[..info.buffer_size()].chunks(bpp) {
        seen.insert(px.to_vec());
        if seen.len() > 64 {
            break;
        }
    }
    Ok(seen.len())
}

fn vm_manifest(c: &Cluster, name: &str) -> anyhow::Result<String> {
    c.guest_disk_claim(&format!("{name}-root"))?;
    Ok(format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: {name}
  namespace: default
  labels: {{app: webui}}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 5
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: {name}-root}}
"#
    ))
}

#[test]
fn web_console_signs_in_lists_consoles_and_stops_a_vm() -> anyhow::Result<()> {
    if !browser_present()? {
        return Ok(());
    }
    let started = Instant::now();
    TestGuest::get()?;
    let gecko = firefox_present()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    c.apply(&vm_manifest(&c, "web")?)?;
    if gecko.is_some() {
        // Firefox's VM boots while Chromium drives the other.
        c.apply(&vm_manifest(&c, "fox")?)?;
    }
    let token = std::fs::read_to_string(c.data_dir.join("token"))
        .context("reading the admin token")?
        .trim()
        .to_string();
    let driver = start_driver()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = rt.block_on(async {
        let b = browser(&driver).await?;
        let r = drive(&c, &b, &token).await;
        if r.is_err() {
            let _ = shot(&b, "failure.png").await;
        }
        let _ = b.close().await;
        r
    });
    drop(driver);
    eprintln!("webui e2e (Chromium) took {:?}", started.elapsed());
    let result = result.and_then(|()| {
        let Some(bin) = &gecko else { return Ok(()) };
        let t0 = Instant::now();
        let driver = start_geckodriver(bin)?;
        let r = rt.block_on(async {
            let b = firefox(&driver).await?;
            let r = drive_short(&c, &b, &token, "fox", "firefox").await;
            if r.is_err() {
                let _ = shot(&b, "firefox-failure.png").await;
            }
            let _ = b.close().await;
            r
        });
        eprintln!("webui e2e (Firefox) took {:?}", t0.elapsed());
        r.context("in Firefox")
    });
    if result.is_err() {
        eprintln!("server log:\n{}", c.server_log());
    }
    result?;
    eprintln!("webui e2e took {:?}", started.elapsed());
    Ok(())
}

/// The short run for a second browser, on its own VM `vm`: sign in; the list shows the VM
/// Running; the serial console answers `web-42`; the VNC canvas is not blank; the Metrics CPU
/// chart has data, and a `view` ServiceAccount's Metrics tab shows the API's 403; Restart gives a new VMI (another launcher) that comes back Running; Stop
/// turns the list's status Stopped. Screenshots are named `<tag>-…`.
async fn drive_short(
    c: &Cluster,
    b: &Client,
    token: &str,
    vm: &str,
    tag: &str,
) -> anyhow::Result<()> {
    let base = format!("https://127.0.0.1:{}/ui/", c.port);
    let page = format!("{base}#/vms/default/{vm}");
    b.goto(&base).await?;
    let field = b.wait().for_element(Locator::Css("#token")).await?;
    field.send_keys(token).await?;
    b.find(Locator::Css("#signin")).await?.click().await?;
    let row = format!(r#"tr[data-vm="default/{vm}"]"#);
    wait_text(b, &format!("{row} .status"), "Running", BOOT).await?;
    shot(b, &format!("{tag}-01-list-running.png")).await?;

    let uid = c.wait_booted(vm, BOOT)?;
    let log = c.agent_dir().join("vmis").join(&uid).join("serial.log");
    until("FERROVIRT-READY on the serial console", BOOT, || async {
        let text = std::fs::read(&log).unwrap_or_default();
        Ok(String::from_utf8_lossy(&text)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })
    .await?;

    b.goto(&format!("{page}/console")).await?;
    wait_text(b, "#console-status", "Connected", STEP).await?;
    b.find(Locator::Css("#serial .xterm"))
        .await?
        .click()
        .await?;
    until("web-42 in the terminal", STEP, || async {
        type_keys(b, "\u{E007}echo web-$((6*7))\u{E007}").await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let t = text_of(b, "#serial .xterm-rows").await?;
        Ok(t.contains("web-42").then_some(()))
    })
    .await?;
    shot(b, &format!("{tag}-02-serial-console.png")).await?;

    b.goto(&format!("{page}/vnc")).await?;
    wait_text(b, "#vnc-status", "Connected", STEP).await?;
    until("a VNC canvas that is not blank", STEP, || async {
        let canvas = b.find(Locator::Css("#vnc-screen canvas")).await?;
        let png = canvas.screenshot().await?;
        std::fs::write(artifacts()?.join(format!("{tag}-03-vnc-canvas.png")), &png)?;
        Ok((distinct_colours(&png)? > 1).then_some(()))
    })
    .await?;

    b.goto(&format!("{page}/metrics")).await?;
    until(
        "a CPU chart with 2+ points and usage above 0",
        STEP,
        || async {
            let fig = b.find(Locator::Css("#chart-cpu")).await?;
            let points: usize = fig.attr("data-points").await?.unwrap_or_default().parse()?;
            let last: f64 = fig.attr("data-last").await?.unwrap_or_default().parse()?;
            Ok((points >= 2 && last > 0.0).then_some(()))
        },
    )
    .await?;
    shot(b, &format!("{tag}-04-metrics.png")).await?;

    // A user without `nodes/proxy` (a ServiceAccount with `view`) sees the API's refusal.
    c.kubectl_ok(&["create", "serviceaccount", "viewer", "-n", "default"])?;
    c.kubectl_ok(&[
        "create",
        "clusterrolebinding",
        "viewer-view",
        "--clusterrole=view",
        "--serviceaccount=default:viewer",
    ])?;
    let viewer = c.kubectl_ok(&["create", "token", "viewer", "-n", "default"])?;
    b.find(Locator::Css("#signout")).await?.click().await?;
    let field = b.wait().for_element(Locator::Css("#token")).await?;
    field.send_keys(viewer.trim()).await?;
    b.find(Locator::Css("#signin")).await?.click().await?;
    wait_text(b, &format!("{row} .status"), "Running", STEP).await?;
    b.goto(&format!("{page}/metrics")).await?;
    wait_text(b, "#metrics-status", "Metrics unavailable: ", STEP).await?;
    wait_text(
        b,
        "#metrics-status",
        "cannot get resource \"nodes/proxy\"",
        STEP,
    )
    .await?;
    shot(b, &format!("{tag}-04-metrics-refused.png")).await?;
    b.find(Locator::Css("#signout")).await?.click().await?;
    let field = b.wait().for_element(Locator::Css("#token")).await?;
    field.send_keys(token).await?;
    b.find(Locator::Css("#signin")).await?.click().await?;
    wait_text(b, &format!("{row} .status"), "Running", STEP).await?;

    // Restart: a new VMI (new uid, new launcher) that is Running again.
    b.goto(&format!("{page}/overview")).await?;
    b.wait()
        .for_element(Locator::Css("#act-restart"))
        .await?
        .click()
        .await?;
    wait_text(b, "#action-result", "Restart: accepted", STEP).await?;
    let t0 = Instant::now();
    let new_uid = until("a new VMI after Restart", BOOT, || async {
        let vmi = c.get_json(&["vmi", vm])?;
        let u = vmi["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let running = vmi["status"]["phase"] == "Running";
        Ok((running && !u.is_empty() && u != uid).then_some(u))
    })
    .await?;
    wait_text(b, "#vm-status", "Running", BOOT).await?;
    eprintln!(
        "{tag}: Restart gave VMI {new_uid} (was {uid}), Running after {:?}",
        t0.elapsed()
    );
    shot(b, &format!("{tag}-05-restarted.png")).await?;

    b.find(Locator::Css("#act-stop")).await?.click().await?;
    wait_text(b, "#action-result", "Stop: accepted", STEP).await?;
    b.goto(&format!("{base}#/vms")).await?;
    wait_text(b, &format!("{row} .status"), "Stopped", BOOT).await?;
    shot(b, &format!("{tag}-06-list-stopped.png")).await?;
    let violations = b
        .execute(
            "return document.documentElement.dataset.cspViolations || '';",
            vec![],
        )
        .await?;
    assert_eq!(violations, serde_json::json!(""), "CSP violations");
    Ok(())
}

async fn drive(c: &Cluster, b: &Client, token: &str) -> anyhow::Result<()> {
    let base = format!("https://127.0.0.1:{}/ui/", c.port);

    // A wrong token is refused at sign-in.
    b.goto(&base).await?;
    let field = b.wait().for_element(Locator::Css("#token")).await?;
    field.send_keys("not-the-token").await?;
    b.find(Locator::Css("#signin")).await?.click().await?;
    wait_text(b, "#login-error", "Sign-in failed", STEP).await?;

    // The right token signs in and shows the list.
    let field = b.wait().for_element(Locator::Css("#token")).await?;
    field.clear().await?;
    field.send_keys(token).await?;
    b.find(Locator::Css("#signin")).await?.click().await?;
    let t0 = Instant::now();
    let row = r#"tr[data-vm="default/web"]"#;
    wait_text(b, &format!("{row} .status"), "Running", BOOT).await?;
    eprintln!("list shows Running after {:?}", t0.elapsed());
    let node = text_of(b, &format!("{row} td:nth-child(5)")).await?;
    assert_eq!(node, "node1", "the Node column comes from the VMI");
    shot(b, "01-list-running.png").await?;

    // Wait for the guest's shell before typing into it.
    let uid = c.wait_booted("web", BOOT)?;
    let log = c.agent_dir().join("vmis").join(&uid).join("serial.log");
    until("FERROVIRT-READY on the serial console", BOOT, || async {
        let text = std::fs::read(&log).unwrap_or_default();
        Ok(String::from_utf8_lossy(&text)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })
    .await?;

    // Overview shows the node and the memory.
    b.goto(&format!("{base}#/vms/default/web/overview")).await?;
    wait_text(b, r#"dd[data-field="Node"]"#, "node1", STEP).await?;
    wait_text(b, r#"dd[data-field="Memory"]"#, "128Mi", STEP).await?;

    // Events: the VM controller's SuccessfulCreate of the VMI.
    b.goto(&format!("{base}#/vms/default/web/events")).await?;
    wait_text(b, "#events", "SuccessfulCreate", STEP).await?;

    // Actions show the API's error (unpausing a running VMI) or their result, and the status
    // follows: Pause → Paused, Unpause → Running.
    b.goto(&format!("{base}#/vms/default/web/overview")).await?;
    b.wait()
        .for_element(Locator::Css("#act-unpause"))
        .await?
        .click()
        .await?;
    wait_text(b, "#action-result", "Unpause failed: ", STEP).await?;
    wait_text(b, "#action-result", "not paused", STEP).await?;
    b.find(Locator::Css("#act-pause")).await?.click().await?;
    wait_text(b, "#action-result", "Pause: accepted", STEP).await?;
    wait_text(b, "#vm-status", "Paused", STEP).await?;
    shot(b, "02-overview-paused.png").await?;
    b.find(Locator::Css("#act-unpause")).await?.click().await?;
    wait_text(b, "#action-result", "Unpause: accepted", STEP).await?;
    wait_text(b, "#vm-status", "Running", STEP).await?;

    // Serial console.
    b.goto(&format!("{base}#/vms/default/web/console")).await?;
    wait_text(b, "#console-status", "Connected", STEP).await?;
    b.find(Locator::Css("#serial .xterm"))
        .await?
        .click()
        .await?;
    let t0 = Instant::now();
    until("web-42 in the terminal", STEP, || async {
        type_keys(b, "\u{E007}echo web-$((6*7))\u{E007}").await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let t = text_of(b, "#serial .xterm-rows").await?;
        Ok(t.contains("web-42").then_some(()))
    })
    .await?;
    eprintln!("serial console answered after {:?}", t0.elapsed());
    shot(b, "02-serial-console.png").await?;

    // Metrics: the tab polls node1's metrics through the Node proxy and charts them; the CPU
    // chart gets two or more rate points with a value above zero (TCG keeps a vCPU busy).
    b.goto(&format!("{base}#/vms/default/web/metrics")).await?;
    let t0 = Instant::now();
    let (points, cpu) = until(
        "a CPU chart with 2+ points and usage above 0",
        STEP,
        || async {
            let fig = b.find(Locator::Css("#chart-cpu")).await?;
            let points: usize = fig.attr("data-points").await?.unwrap_or_default().parse()?;
            let last: f64 = fig.attr("data-last").await?.unwrap_or_default().parse()?;
            Ok((points >= 2 && last > 0.0).then_some((points, last)))
        },
    )
    .await?;
    eprintln!(
        "metrics chart: {points} CPU points, last {cpu:.3} cores, after {:?}",
        t0.elapsed()
    );
    wait_text(b, "#chart-memory", "domain: 128.0 MiB", STEP).await?;
    wait_text(b, "#chart-memory", "resident: ", STEP).await?;
    wait_text(b, "#chart-storage", "root read: ", STEP).await?;
    wait_text(b, "#metrics-status", "Node node1: ", STEP).await?;
    shot(b, "03-metrics.png").await?;

    // VNC: the canvas shows the guest's screen (the firmware and boot loader text).
    b.goto(&format!("{base}#/vms/default/web/vnc")).await?;
    wait_text(b, "#vnc-status", "Connected", STEP).await?;
    let colours = until("a VNC canvas that is not blank", STEP, || async {
        let canvas = b.find(Locator::Css("#vnc-screen canvas")).await?;
        let png = canvas.screenshot().await?;
        std::fs::write(artifacts()?.join("03-vnc-canvas.png"), &png)?;
        let n = distinct_colours(&png)?;
        Ok((n > 1).then_some(n))
    })
    .await?;
    eprintln!("VNC canvas has {colours}+ colours");
    shot(b, "03-vnc-tab.png").await?;

    // YAML: a save from a stale resourceVersion shows the conflict.
    b.goto(&format!("{base}#/vms/default/web/yaml")).await?;
    wait_text(b, "#yaml-result", "resourceVersion", STEP).await?;
    c.kubectl_ok(&["label", "vm", "web", "-n", "default", "edited=elsewhere"])?;
    b.find(Locator::Css("#yaml-save")).await?.click().await?;
    wait_text(b, "#yaml-result", "Conflict", STEP).await?;
    shot(b, "04-yaml-conflict.png").await?;
    // Reloaded, the same save goes through.
    b.find(Locator::Css("#yaml-reload")).await?.click().await?;
    wait_text(b, "#yaml-result", "Read at", STEP).await?;
    b.find(Locator::Css("#yaml-save")).await?.click().await?;
    wait_text(b, "#yaml-result", "Saved", STEP).await?;

    // At phone width the list is still readable (labelled cards instead of columns).
    b.set_window_size(390, 844).await?;
    b.goto(&format!("{base}#/vms")).await?;
    wait_text(b, &format!("{row} .status"), "Running", STEP).await?;
    shot(b, "04-list-phone-width.png").await?;
    b.set_window_size(1280, 900).await?;

    // Stop: the action is accepted and the list turns Stopped.
    b.goto(&format!("{base}#/vms/default/web/overview")).await?;
    b.wait()
        .for_element(Locator::Css("#act-stop"))
        .await?
        .click()
        .await?;
    wait_text(b, "#action-result", "Stop: accepted", STEP).await?;
    b.goto(&format!("{base}#/vms")).await?;
    let t0 = Instant::now();
    wait_text(b, &format!("{row} .status"), "Stopped", BOOT).await?;
    eprintln!("list shows Stopped {:?} after Stop", t0.elapsed());
    shot(b, "05-list-stopped.png").await?;
    // The Metrics tab of a stopped VM says so instead of charting.
    b.goto(&format!("{base}#/vms/default/web/metrics")).await?;
    wait_text(b, "#metrics-status", "The VM is not running", STEP).await?;

    // Delete asks first; Cancel keeps the VM, Delete removes it from the list.
    b.goto(&format!("{base}#/vms/default/web/overview")).await?;
    b.wait()
        .for_element(Locator::Css("#act-delete"))
        .await?
        .click()
        .await?;
    b.wait()
        .for_element(Locator::Css("#confirm-cancel"))
        .await?
        .click()
        .await?;
    assert!(c.get_json(&["vm", "web"]).is_ok(), "Cancel must not delete");
    b.find(Locator::Css("#act-delete")).await?.click().await?;
    b.wait()
        .for_element(Locator::Css("#confirm-ok"))
        .await?
        .click()
        .await?;
    wait_text(b, "#action-result", "Delete: accepted", STEP).await?;
    b.goto(&format!("{base}#/vms")).await?;
    if c.get_json(&["vm", "fox"]).is_ok() {
        // The list has loaded (the Firefox run's VM), without web.
        wait_text(b, r#"tr[data-vm="default/fox"]"#, "fox", STEP).await?;
    } else {
        wait_text(b, "#vm-list", "No VirtualMachines match", STEP).await?;
    }
    until("web to leave the list", STEP, || async {
        Ok(b.find(Locator::Css(row)).await.is_err().then_some(()))
    })
    .await?;

    // Create VM: a bad name is refused naming the field; then the form makes a VM whose root
    // disk is imported from a URL (a DataVolume it owns), shows the import, and it boots.
    let guest = TestGuest::get()?;
    let files = ferrovirt_testkit::serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2)])?;
    b.goto(&format!("{base}#/create")).await?;
    let name = b.wait().for_element(Locator::Css("#c-name")).await?;
    name.send_keys("Bad_Name").await?;
    let image = b.find(Locator::Css("#c-image")).await?;
    image.send_keys(&format!("{files}/disk.qcow2")).await?;
    let size = b.find(Locator::Css("#c-size")).await?;
    size.clear().await?;
    size.send_keys("64Mi").await?;
    // A common instancetype and preference (deployed by the controllers) size the VM.
    for (select, value) in [("#c-instancetype", "u1.nano"), ("#c-preference", "alpine")] {
        b.wait()
            .at_most(STEP)
            .for_element(Locator::Css(&format!("{select} option[value='{value}']")))
            .await?;
        b.find(Locator::Css(select))
            .await?
            .select_by_value(value)
            .await?;
    }
    b.find(Locator::Css("#c-sshkey"))
        .await?
        .send_keys("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcdefg web@test")
        .await?;
    b.find(Locator::Css("#c-create")).await?.click().await?;
    wait_text(b, "#create-result", "Name:", STEP).await?;
    name.clear().await?;
    name.send_keys("made").await?;
    shot(b, "06-create-form.png").await?;
    b.find(Locator::Css("#c-create")).await?.click().await?;
    let t0 = Instant::now();
    wait_text(b, "#dv-made-root .dv-phase", "Succeeded", BOOT).await?;
    wait_text(b, "#vm-status", "Running", BOOT).await?;
    shot(b, "07-created-vm.png").await?;
    c.wait_booted("made", BOOT)?;
    eprintln!("created VM booted {:?} after Create", t0.elapsed());
    let vm = c.get_json(&["vm", "made"])?;
    assert_eq!(vm["spec"]["instancetype"]["name"], "u1.nano", "{vm}");
    assert_eq!(vm["spec"]["preference"]["name"], "alpine", "{vm}");
    let vmi = c.get_json(&["vmi", "made"])?;
    assert_eq!(vmi["spec"]["domain"]["memory"]["guest"], "512Mi", "{vmi}");
    assert_eq!(
        vm["spec"]["dataVolumeTemplates"][0]["spec"]["source"]["http"]["url"],
        format!("{files}/disk.qcow2"),
        "{vm}"
    );

    // Storage: the created VM's DataVolume and claim, and the built-in classes.
    b.find(Locator::Css("#nav-storage")).await?.click().await?;
    let dv_row = r#"#datavolumes tr[data-key="default/made-root"]"#;
    wait_text(b, dv_row, "Succeeded", STEP).await?;
    wait_text(b, dv_row, "100.0%", STEP).await?;
    wait_text(
        b,
        r#"#pvcs tr[data-key="default/made-root"]"#,
        "Bound",
        STEP,
    )
    .await?;
    wait_text(b, "#storageclasses", "local", STEP).await?;
    shot(b, "08-storage.png").await?;

    // Nodes: node1 is Ready and holds the created VM's VMI (and the Firefox run's).
    b.find(Locator::Css("#nav-nodes")).await?.click().await?;
    let node_row = r#"#nodes tr[data-key="node1"]"#;
    wait_text(b, node_row, "Ready", STEP).await?;
    let want = if c.get_json(&["vm", "fox"]).is_ok() {
        "2"
    } else {
        "1"
    };
    until(&format!("node1 to count {want} VMIs"), STEP, || async {
        let vmis = text_of(b, &format!("{node_row} td:nth-child(5)")).await?;
        Ok((vmis == want).then_some(()))
    })
    .await?;
    shot(b, "09-nodes.png").await?;

    // Migrate creates a VirtualMachineInstanceMigration (one node: it has nowhere to go, but the
    // request is accepted and named).
    let made = format!("{base}#/vms/default/made");
    b.goto(&format!("{made}/overview")).await?;
    b.wait()
        .for_element(Locator::Css("#act-migrate"))
        .await?
        .click()
        .await?;
    wait_text(
        b,
        "#action-result",
        "Migrate: accepted (made-migration-",
        STEP,
    )
    .await?;

    // Snapshots: take one of the running VM, stop it, restore it, delete the snapshot.
    b.goto(&format!("{made}/snapshots")).await?;
    b.wait()
        .for_element(Locator::Css("#snap-take"))
        .await?
        .click()
        .await?;
    wait_text(
        b,
        "#snap-result",
        "Snapshot: accepted (made-snapshot-",
        STEP,
    )
    .await?;
    wait_text(b, "#snapshots .snap-phase", "Succeeded", BOOT).await?;
    b.find(Locator::Css("#act-stop")).await?.click().await?;
    wait_text(b, "#vm-status", "Stopped", BOOT).await?;
    b.find(Locator::Css("#snapshots .snap-restore"))
        .await?
        .click()
        .await?;
    wait_text(b, "#snap-result", "accepted (made-restore-", STEP).await?;
    wait_text(b, "#restores .restore-complete", "true", BOOT).await?;
    shot(b, "10-snapshots.png").await?;
    b.find(Locator::Css("#snapshots .snap-delete"))
        .await?
        .click()
        .await?;
    b.accept_alert().await?;
    wait_text(b, "#snapshots", "None.", STEP).await?;

    // Settings: the HyperConverged the server made at start, its conditions and its YAML,
    // which saves.
    b.find(Locator::Css("#nav-settings")).await?.click().await?;
    wait_text(b, "#hco-conditions", "Available=True", STEP).await?;
    wait_text(b, "#yaml-result", "Read at resourceVersion", STEP).await?;
    let yaml = b
        .find(Locator::Css("#yaml-text"))
        .await?
        .prop("value")
        .await?
        .unwrap_or_default();
    assert!(yaml.contains("kind: HyperConverged"), "{yaml}");
    b.find(Locator::Css("#yaml-save")).await?.click().await?;
    wait_text(b, "#yaml-result", "Saved", STEP).await?;
    c.get_json(&[
        "hyperconverged",
        "kubevirt-hyperconverged",
        "-n",
        "kubevirt-hyperconverged",
    ])?;
    shot(b, "11-settings.png").await?;

    // The whole run stayed within the Content-Security-Policy (one document throughout: every
    // navigation above changed only the hash).
    let violations = b
        .execute(
            "return document.documentElement.dataset.cspViolations || '';",
            vec![],
        )
        .await?;
    assert_eq!(violations, serde_json::json!(""), "CSP violations");
    // The attack: an injected inline script is refused by the browser under that policy.
    b.execute(
        "const s = document.createElement('script'); \
         s.textContent = 'window.injected = true'; document.body.append(s);",
        vec![],
    )
    .await?;
    let (ran, noted) = until("the CSP violation to be noted", STEP, || async {
        let v = b
            .execute(
                "return [window.injected === true, document.documentElement.dataset.cspViolations || ''];",
                vec![],
            )
            .await?;
        let noted = v[1].as_str().unwrap_or_default().to_string();
        Ok((!noted.is_empty()).then(|| (v[0] == serde_json::json!(true), noted)))
    })
    .await?;
    assert!(!ran, "an inline script ran");
    assert!(noted.contains("script-src"), "{noted}");
    Ok(())
}
