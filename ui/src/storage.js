// The Storage page: DataVolumes (phase and import progress bars), PersistentVolumeClaims, and
// StorageClasses with their StorageProfiles' access and volume modes, all watched.

import { h, mount } from './dom.js';
import { listWatch } from './listwatch.js';
import { listTable, progressBar } from './table.js';

const byName = (a, b) => `${a.metadata.namespace || ''}/${a.metadata.name}`.localeCompare(`${b.metadata.namespace || ''}/${b.metadata.name}`);
const key = (o) => `${o.metadata.namespace || ''}/${o.metadata.name}`;

export function storagePage(main) {
  const data = { dvs: new Map(), pvcs: new Map(), classes: new Map(), profiles: new Map() };
  const error = h('p.error', { role: 'alert' });
  const dvHolder = h('div');
  const pvcHolder = h('div');
  const scHolder = h('div');
  const render = () => {
    mount(
      dvHolder,
      listTable(
        'datavolumes',
        ['Name', 'Namespace', 'Phase', 'Progress', 'Size', 'Source'],
        [...data.dvs.values()].sort(byName).map((d) => {
          const src = Object.keys(d.spec?.source || {})[0] || (d.spec?.sourceRef ? `${d.spec.sourceRef.kind}` : '');
          return [
            key(d),
            [
              d.metadata.name,
              d.metadata.namespace,
              h('span.dv-phase', {}, d.status?.phase || 'Pending'),
              progressBar(d.status?.progress, d.status?.phase, `import progress of ${d.metadata.name}`),
              d.spec?.storage?.resources?.requests?.storage || d.spec?.pvc?.resources?.requests?.storage || '',
              src,
            ],
          ];
        }),
      ),
    );
    mount(
      pvcHolder,
      listTable(
        'pvcs',
        ['Name', 'Namespace', 'Status', 'Volume', 'Capacity', 'Access modes', 'StorageClass'],
        [...data.pvcs.values()].sort(byName).map((p) => [
          key(p),
          [p.metadata.name, p.metadata.namespace, p.status?.phase || 'Pending', p.spec?.volumeName || '', p.status?.capacity?.storage || '', (p.spec?.accessModes || []).join(', '), p.spec?.storageClassName || ''],
        ]),
      ),
    );
    mount(
      scHolder,
      listTable(
        'storageclasses',
        ['Name', 'Provisioner', 'Reclaim policy', 'Binding mode', 'Profile (access / volume modes)'],
        [...data.classes.values()].sort(byName).map((c) => {
          const isDefault = c.metadata.annotations?.['storageclass.kubernetes.io/is-default-class'] === 'true';
          const sets = data.profiles.get(`/${c.metadata.name}`)?.status?.claimPropertySets || [];
          const profile = sets.map((s) => `${(s.accessModes || []).join('+')} / ${s.volumeMode || ''}`).join('; ');
          return [
            key(c),
            [`${c.metadata.name}${isDefault ? ' (default)' : ''}`, c.provisioner || '', c.reclaimPolicy || 'Delete', c.volumeBindingMode || 'Immediate', profile || '—'],
          ];
        }),
      ),
    );
  };
  mount(main, h('h1', {}, 'Storage'), error, h('h2', {}, 'DataVolumes'), dvHolder, h('h2', {}, 'PersistentVolumeClaims'), pvcHolder, h('h2', {}, 'StorageClasses'), scHolder);
  const onError = (e) => (error.textContent = e.message);
  const watch = (path, k) => listWatch(path, (m) => { data[k] = m; render(); }, onError);
  const watches = [
    watch('/apis/cdi.kubevirt.io/v1beta1/datavolumes', 'dvs'),
    watch('/api/v1/persistentvolumeclaims', 'pvcs'),
    watch('/apis/storage.k8s.io/v1/storageclasses', 'classes'),
    listWatch('/apis/cdi.kubevirt.io/v1beta1/storageprofiles', (m) => { data.profiles = m; render(); }, () => {}),
  ];
  return () => watches.forEach((w) => w.stop());
}
