//! The platform's configuration object at start: the `kubevirt-hyperconverged` namespace and
//! the one HyperConverged in it with HCO's defaults (admission fills them), unless they exist
//! (an existing one is kept as it is). The controllers' HyperConverged reconcile takes it from
//! there (`ferrovirt_controller::hco`).

use serde_json::json;

use ferrovirt_api::hco::desired::{HCO_API_VERSION, HCO_NAME, PLATFORM_NAMESPACE};

use crate::error::ApiError;
use crate::handlers::{WriteOpts, create};
use crate::server::Shared;

/// Creates the platform namespace and the HyperConverged when absent.
pub(crate) async fn ensure_hyperconverged(sh: &Shared) -> Result<(), ApiError> {
    let wanted = [
        (
            sh.resources.lookup("", "v1", "namespaces").cloned(),
            None,
            json!({"apiVersion": "v1", "kind": "Namespace",
                   "metadata": {"name": PLATFORM_NAMESPACE}}),
        ),
        (
            sh.resources
                .lookup("hco.kubevirt.io", "v1beta1", "hyperconvergeds")
                .cloned(),
            Some(PLATFORM_NAMESPACE),
            json!({"apiVersion": HCO_API_VERSION, "kind": "HyperConverged",
                   "metadata": {"name": HCO_NAME, "namespace": PLATFORM_NAMESPACE},
                   "spec": {}}),
        ),
    ];
    for (def, ns, obj) in wanted {
        let Some(def) = def else { continue };
        match create(sh, &def, ns, obj, WriteOpts::default()).await {
            Ok(_) => {}
            Err(e) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
