//! `kube::Resource` wrappers of backup.ferrovirt.io/v1alpha1 kinds.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use ferrovirt_api::backup::{self, Backup, BackupRestore, BackupTarget};

macro_rules! backup_kind {
    ($(#[$m:meta])* $wrapper:ident($inner:ty), $scope:ty, $kind:literal, $plural:literal) => {
        $(#[$m])*
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $wrapper(pub $inner);

        impl kube::Resource for $wrapper {
            type DynamicType = ();
            type Scope = $scope;
            fn kind(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }
            fn group(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(backup::GROUP)
            }
            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(backup::VERSION)
            }
            fn plural(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.0.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.0.metadata
            }
        }
    };
}

backup_kind!(
    /// A BackupTarget usable with `kube::Api`.
    Target(BackupTarget), k8s_openapi::ClusterResourceScope, "BackupTarget", "backuptargets"
);
backup_kind!(
    /// A Backup usable with `kube::Api`.
    BackupRun(Backup), k8s_openapi::NamespaceResourceScope, "Backup", "backups"
);
backup_kind!(
    /// A BackupRestore usable with `kube::Api`.
    Restore(BackupRestore), k8s_openapi::NamespaceResourceScope, "BackupRestore", "backuprestores"
);
