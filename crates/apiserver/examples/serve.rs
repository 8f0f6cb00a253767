//! Runs the API server alone: `cargo run -p ferrovirt-apiserver --example serve -- DATA_DIR [ADDR]`
//! (ADDR defaults to 127.0.0.1:6443; use port 0 for any free port), then
//! `kubectl --kubeconfig DATA_DIR/kubeconfig.yaml get ns`. Stops on Ctrl-C.

use ferrovirt_apiserver::{Server, ServerOptions};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let data_dir = args
        .next()
        .unwrap_or_else(|| "/tmp/ferrovirt-apiserver".into());
    let mut opts = ServerOptions {
        data_dir: data_dir.into(),
        ..Default::default()
    };
    if let Some(addr) = args.next() {
        opts.listen = addr.parse()?;
    }
    let server = Server::start(opts).await?;
    println!(
        "listening on {}; kubeconfig {}",
        server.url(),
        server.kubeconfig_path.display()
    );
    tokio::signal::ctrl_c().await?;
    server.shutdown().await;
    Ok(())
}
