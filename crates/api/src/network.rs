//! k8s.cni.cncf.io/v1 NetworkAttachmentDefinition: a secondary network (Multus).

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
