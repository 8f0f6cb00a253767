//! `kube::Resource` wrappers of backup.ferrovirt.io/v1alpha1 kinds.

use crate::runtime::resources::resource_wrapper;
use ferrovirt_api::backup::{self, Backup, BackupPlan, BackupRestore, BackupTarget};

resource_wrapper!(
    /// A BackupTarget usable with `kube::Api`.
    Target(BackupTarget), k8s_openapi::ClusterResourceScope, backup::GROUP, backup::VERSION, "BackupTarget", "backuptargets"
);
resource_wrapper!(
    /// A Backup usable with `kube::Api`.
    BackupRun(Backup), k8s_openapi::NamespaceResourceScope, backup::GROUP, backup::VERSION, "Backup", "backups"
);
resource_wrapper!(
    /// A BackupRestore usable with `kube::Api`.
    Restore(BackupRestore), k8s_openapi::NamespaceResourceScope, backup::GROUP, backup::VERSION, "BackupRestore", "backuprestores"
);
resource_wrapper!(
    /// A BackupPlan usable with `kube::Api`.
    Plan(BackupPlan), k8s_openapi::NamespaceResourceScope, backup::GROUP, backup::VERSION, "BackupPlan", "backupplans"
);
