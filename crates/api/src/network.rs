//! k8s.cni.cncf.io: v1 NetworkAttachmentDefinition (a secondary network, Multus) and v1alpha1
//! IPAMClaim (a persistent address allocation).

resource! {
    /// A secondary network definition; `spec.config` is a CNI JSON document as a string.
    NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec
}

kstruct! {
    /// The CNI configuration.
    pub struct NetworkAttachmentDefinitionSpec {
        /// The CNI configuration (JSON) of this network.
        pub config: Option<String>,
    }
}

resource! {
    /// A persistent address allocation (k8s.cni.cncf.io/v1alpha1 IPAMClaim, the
    /// k8snetworkplumbingwg API OVN-Kubernetes and KubeVirt use): the addresses one interface of
    /// one VM holds on one network, kept while the VM exists so a restarted or migrated VMI gets
    /// them again. Written by the user-defined network controller, named `<vm>.<network>`.
    IPAMClaim, IPAMClaimSpec, IPAMClaimStatus
}

kstruct! {
    /// Which network and interface the allocation is for.
    pub struct IPAMClaimSpec {
        /// The network name (the `name` of the NAD's CNI config, e.g. `ns_udn`).
        pub network: Option<String>,
        /// The interface the allocation is for (the VMI's network name).
        pub interface: Option<String>,
    }
}

kstruct! {
    /// What was allocated.
    pub struct IPAMClaimStatus {
        /// The addresses (CIDR notation) allocated for the interface.
        pub ips: Option<Vec<String>>,
    }
}

/// The group and version of [`IPAMClaim`].
pub const IPAMCLAIM_API_VERSION: &str = "k8s.cni.cncf.io/v1alpha1";

/// Admission of an IPAMClaim: `spec.network` and `spec.interface` are required (as in the
/// published CRD); every status address must be an address with a prefix length.
pub fn validate_ipamclaim(c: &IPAMClaim) -> Vec<crate::admission::FieldError> {
    use crate::admission::FieldError;
    let mut errs = Vec::new();
    let spec = c.spec.clone().unwrap_or_default();
    if spec.network.as_deref().is_none_or(str::is_empty) {
        errs.push(FieldError::required("spec.network", "Required value"));
    }
    if spec.interface.as_deref().is_none_or(str::is_empty) {
        errs.push(FieldError::required("spec.interface", "Required value"));
    }
    for (i, ip) in c
        .status
        .as_ref()
        .and_then(|s| s.ips.as_ref())
        .into_iter()
        .flatten()
        .enumerate()
    {
        let ok = ip
            .split_once('/')
            .is_some_and(|(a, p)| a.parse::<std::net::IpAddr>().is_ok() && p.parse::<u8>().is_ok());
        if !ok {
            errs.push(FieldError::invalid(
                format!("status.ips[{i}]"),
                format!("{ip:?} is not an address with a prefix length (e.g. 10.0.0.5/24)"),
            ));
        }
    }
    errs
}
