// The Snapshots tab: the VM's VirtualMachineSnapshots (phase, ready, indications), Take (a new
// snapshot of this VM), Restore (a VirtualMachineRestore of that snapshot into this VM) and
// Delete (after a confirmation) per snapshot, and the VM's restores with their completion,
// all watched. Results and API errors are shown in the tab's status line.

import { age, h, mount } from './dom.js';
import { api } from './api.js';
import { listWatch } from './listwatch.js';
import { listTable } from './table.js';

export const SNAP = (ns) => `/apis/snapshot.kubevirt.io/v1beta1/namespaces/${encodeURIComponent(ns)}`;

/** A new snapshot of VM `name`. */
export function snapshotOf(name) {
  return {
    apiVersion: 'snapshot.kubevirt.io/v1beta1',
    kind: 'VirtualMachineSnapshot',
    metadata: { generateName: `${name}-snapshot-` },
    spec: { source: { apiGroup: 'kubevirt.io', kind: 'VirtualMachine', name } },
  };
}

/** A restore of snapshot `snapshot` into VM `name`. */
export function restoreOf(name, snapshot) {
  return {
    apiVersion: 'snapshot.kubevirt.io/v1beta1',
    kind: 'VirtualMachineRestore',
    metadata: { generateName: `${name}-restore-` },
    spec: { target: { apiGroup: 'kubevirt.io', kind: 'VirtualMachine', name }, virtualMachineSnapshotName: snapshot },
  };
}

export function snapshotsTab(panel, ns, name) {
  let snaps = new Map();
  let restores = new Map();
  const status = h('p.result#snap-result', { role: 'status', 'aria-live': 'polite' });
  const snapHolder = h('div');
  const restoreHolder = h('div');
  const run = async (label, f) => {
    status.className = 'result';
    status.textContent = `${label}…`;
    try {
      const out = await f();
      status.textContent = `${label}: accepted${out?.metadata?.name ? ` (${out.metadata.name})` : ''}`;
    } catch (e) {
      status.className = 'result error';
      status.textContent = `${label} failed: ${e.message}`;
    }
  };
  const render = () => {
    const mine = [...snaps.values()]
      .filter((s) => s.spec?.source?.name === name)
      .sort((a, b) => (b.metadata.creationTimestamp || '').localeCompare(a.metadata.creationTimestamp || ''));
    mount(
      snapHolder,
      listTable(
        'snapshots',
        ['Name', 'Phase', 'Ready', 'Age', 'Indications', 'Actions'],
        mine.map((s) => {
          const sn = s.metadata.name;
          return [
            sn,
            [
              sn,
              h('span.snap-phase', {}, s.status?.phase || 'Pending'),
              String(s.status?.readyToUse ?? false),
              age(s.metadata.creationTimestamp),
              (s.status?.indications || []).join(', '),
              h(
                'span.actions',
                {},
                h('button.snap-restore', { type: 'button', onclick: () => run(`Restore ${sn}`, () => api(`${SNAP(ns)}/virtualmachinerestores`, { method: 'POST', body: restoreOf(name, sn) })) }, 'Restore'),
                h(
                  'button.danger.snap-delete',
                  {
                    type: 'button',
                    onclick: () => {
                      if (window.confirm(`Delete snapshot ${sn}?`)) run(`Delete ${sn}`, () => api(`${SNAP(ns)}/virtualmachinesnapshots/${encodeURIComponent(sn)}`, { method: 'DELETE' }));
                    },
                  },
                  'Delete',
                ),
              ),
            ],
          ];
        }),
      ),
    );
    const mineRestores = [...restores.values()].filter((r) => r.spec?.target?.name === name);
    mount(
      restoreHolder,
      listTable(
        'restores',
        ['Name', 'Snapshot', 'Complete', 'Age', 'Conditions'],
        mineRestores.map((r) => [
          r.metadata.name,
          [
            r.metadata.name,
            r.spec?.virtualMachineSnapshotName || '',
            h('span.restore-complete', {}, String(r.status?.complete ?? false)),
            age(r.metadata.creationTimestamp),
            (r.status?.conditions || []).filter((c) => c.status === 'True').map((c) => `${c.type}${c.reason ? ` (${c.reason})` : ''}`).join(', '),
          ],
        ]),
      ),
    );
  };
  mount(
    panel,
    h('h2', {}, 'Snapshots'),
    h('div.actions', {}, h('button#snap-take', { type: 'button', onclick: () => run('Snapshot', () => api(`${SNAP(ns)}/virtualmachinesnapshots`, { method: 'POST', body: snapshotOf(name) })) }, 'Take snapshot')),
    status,
    snapHolder,
    h('h3', {}, 'Restores'),
    restoreHolder,
  );
  const watches = [
    listWatch(`${SNAP(ns)}/virtualmachinesnapshots`, (m) => { snaps = m; render(); }, (e) => (status.textContent = e.message)),
    listWatch(`${SNAP(ns)}/virtualmachinerestores`, (m) => { restores = m; render(); }, () => {}),
  ];
  return () => watches.forEach((w) => w.stop());
}
