//! The `portforward` subresource of VMIs and VMs (`.../portforward/{port}[/{protocol}]`): a
//! websocket (`plain.kubevirt.io`, binary frames) that carries one TCP connection to the
//! guest's port. The connection is opened by the agent of the VMI's node
//! ([`crate::portforward`]); a VM forwards to its VMI of the same name.

use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{FromRequestParts, Path, Request, State};
use axum::response::{IntoResponse, Response};

use super::{ApiErr, ProxyState, WS_PROTOCOL, agent_stream, locate, pump_ws};

/// `GET .../{resource}/{name}/portforward/{port}`.
pub(super) async fn handle(
    State(st): State<ProxyState>,
    Path((ns, resource, name, port)): Path<(String, String, String, String)>,
    req: Request,
) -> Response {
    forward(st, &ns, &resource, &name, &port, None, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `GET .../{resource}/{name}/portforward/{port}/{protocol}`.
pub(super) async fn handle_with_protocol(
    State(st): State<ProxyState>,
    Path((ns, resource, name, port, protocol)): Path<(String, String, String, String, String)>,
    req: Request,
) -> Response {
    forward(st, &ns, &resource, &name, &port, Some(&protocol), req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn forward(
    st: ProxyState,
    ns: &str,
    resource: &str,
    name: &str,
    port: &str,
    protocol: Option<&str>,
    req: Request,
) -> Result<Response, ApiErr> {
    if !matches!(resource, "virtualmachineinstances" | "virtualmachines") {
        return Err(ApiErr::new(
            404,
            format!("the server could not find the requested resource ({resource}/portforward)"),
        ));
    }
    let port = crate::portforward::parse_port(port, protocol).map_err(|m| ApiErr::new(400, m))?;
    let (mut parts, _body) = req.into_parts();
    let ws = WebSocketUpgrade::from_request_parts(&mut parts, &())
        .await
        .map_err(|e| ApiErr::new(400, format!("portforward needs a websocket: {e}")))?;
    let ready = st.ready()?;
    let (_, uid, url) = locate(ready, ns, name).await?;
    // Connect first, so that a refused port is answered as an HTTP error.
    let path = format!("/vmis/{uid}/portforward/{port}");
    let agent = agent_stream(&url, &path, &ready.token).await?;
    tracing::info!(%ns, %name, port, "port forward");
    Ok(ws
        .protocols([WS_PROTOCOL])
        .on_upgrade(move |socket| pump_ws(socket, agent)))
}
