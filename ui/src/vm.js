// A VirtualMachine's details: the header with its status and the actions (Start, Stop,
// Restart, Pause, Unpause through subresources.kubevirt.io; Migrate: a
// VirtualMachineInstanceMigration; Delete after a confirmation), and the tabs Overview, YAML,
// Events, Console (serial), VNC, Snapshots and Metrics (charts from the node's metrics). The VM, its VMI and the
// namespace's DataVolumes (import progress) are watched.

import { h, mount } from './dom.js';
import { api, kv, sub } from './api.js';
import { listWatch } from './listwatch.js';
import { ipsOf, trueConditions } from './vms.js';
import { overview } from './overview.js';
import { yamlTab } from './yamltab.js';
import { eventsTab } from './events.js';
import { serialTab, vncTab } from './console.js';
import { snapshotsTab } from './snapshots.js';
import { metricsTab } from './metrics.js';

const TABS = [
  ['overview', 'Overview'],
  ['yaml', 'YAML'],
  ['events', 'Events'],
  ['console', 'Console'],
  ['vnc', 'VNC'],
  ['snapshots', 'Snapshots'],
  ['metrics', 'Metrics'],
];

export function vmDetails(main, ns, name, tab) {
  const base = `#/vms/${encodeURIComponent(ns)}/${encodeURIComponent(name)}`;
  const state = { vm: null, vmi: null, vmiListed: false, dvs: new Map() };
  const statusEl = h('span.badge#vm-status', {}, '…');
  const result = h('p.result#action-result', { role: 'status', 'aria-live': 'polite' });
  const panel = h('section.panel#tab-panel', { role: 'tabpanel' });
  const listeners = [];

  const act = async (label, path, opts = {}) => {
    result.className = 'result';
    result.textContent = `${label}…`;
    try {
      const out = await api(path, { method: 'PUT', body: {}, ...opts });
      result.textContent = `${label}: accepted${out?.metadata?.name ? ` (${out.metadata.name})` : ''}`;
    } catch (e) {
      result.className = 'result error';
      result.textContent = `${label} failed: ${e.message}`;
    }
  };
  const vmPath = `${sub(ns)}/virtualmachines/${encodeURIComponent(name)}`;
  const vmiPath = `${sub(ns)}/virtualmachineinstances/${encodeURIComponent(name)}`;

  const dialog = h(
    'dialog#confirm-delete',
    { 'aria-labelledby': 'confirm-title' },
    h('h2#confirm-title', {}, `Delete VirtualMachine ${name}?`),
    h('p', {}, 'Its VirtualMachineInstance stops; disks owned by it are deleted with it.'),
    h(
      'form',
      { method: 'dialog' },
      h('button#confirm-cancel', { value: 'cancel', autofocus: true }, 'Cancel'),
      h('button.danger#confirm-ok', { value: 'delete' }, 'Delete'),
    ),
  );
  dialog.addEventListener('close', async () => {
    if (dialog.returnValue !== 'delete') return;
    result.className = 'result';
    result.textContent = 'Delete…';
    try {
      await api(`${kv(ns)}/virtualmachines/${encodeURIComponent(name)}`, { method: 'DELETE' });
      result.textContent = 'Delete: accepted';
    } catch (e) {
      result.className = 'result error';
      result.textContent = `Delete failed: ${e.message}`;
    }
  });

  const button = (id, label, onclick) => h(`button#${id}`, { type: 'button', onclick }, label);
  const actions = h(
    'div.actions',
    { role: 'toolbar', 'aria-label': 'Actions' },
    button('act-start', 'Start', () => act('Start', `${vmPath}/start`)),
    button('act-stop', 'Stop', () => act('Stop', `${vmPath}/stop`)),
    button('act-restart', 'Restart', () => act('Restart', `${vmPath}/restart`)),
    button('act-pause', 'Pause', () => act('Pause', `${vmiPath}/pause`)),
    button('act-unpause', 'Unpause', () => act('Unpause', `${vmiPath}/unpause`)),
    button('act-migrate', 'Migrate', () =>
      act('Migrate', `${kv(ns)}/virtualmachineinstancemigrations`, {
        method: 'POST',
        body: { apiVersion: 'kubevirt.io/v1', kind: 'VirtualMachineInstanceMigration', metadata: { generateName: `${name}-migration-` }, spec: { vmiName: name } },
      }),
    ),
    h('button.danger#act-delete', { type: 'button', onclick: () => dialog.showModal() }, 'Delete'),
  );
  const tabs = h(
    'nav.tabs',
    { 'aria-label': 'VM tabs' },
    TABS.map(([id, label]) =>
      h(`a#tab-${id}`, { href: `${base}/${id}`, 'aria-current': id === tab ? 'page' : null, role: 'tab', 'aria-selected': String(id === tab) }, label),
    ),
  );

  mount(
    main,
    h('p.crumbs', {}, h('a', { href: '#/vms' }, 'VirtualMachines'), ' / ', ns),
    h('h1', {}, name, ' ', statusEl),
    actions,
    result,
    tabs,
    panel,
    dialog,
  );

  const refresh = () => {
    const status = state.vm?.status?.printableStatus || (state.vm ? 'Unknown' : 'Not found');
    statusEl.textContent = status;
    statusEl.className = `badge s-${status.toLowerCase().replace(/\s+/g, '-')}`;
    statusEl.title = trueConditions(state.vm);
    listeners.forEach((f) => f(state));
  };
  const field = `?fieldSelector=${encodeURIComponent(`metadata.name=${name}`)}`;
  const watches = [
    listWatch(`${kv(ns)}/virtualmachines${field}`, (m) => { state.vm = m.get(`${ns}/${name}`) || null; refresh(); }, (e) => (result.textContent = e.message)),
    listWatch(`${kv(ns)}/virtualmachineinstances${field}`, (m) => { state.vmi = m.get(`${ns}/${name}`) || null; state.vmiListed = true; refresh(); }, () => {}),
    // Import progress of the VM's own DataVolumes (its dataVolumeTemplates).
    listWatch(`/apis/cdi.kubevirt.io/v1beta1/namespaces/${encodeURIComponent(ns)}/datavolumes`, (m) => { state.dvs = m; refresh(); }, () => {}),
  ];
  const onState = (f) => {
    listeners.push(f);
    f(state);
  };

  let stopTab = () => {};
  switch (tab) {
    case 'yaml':
      stopTab = yamlTab(panel, ns, name);
      break;
    case 'events':
      stopTab = eventsTab(panel, ns, name);
      break;
    case 'console':
      stopTab = serialTab(panel, ns, name);
      break;
    case 'vnc':
      stopTab = vncTab(panel, ns, name);
      break;
    case 'snapshots':
      stopTab = snapshotsTab(panel, ns, name);
      break;
    case 'metrics':
      stopTab = metricsTab(panel, ns, name, onState);
      break;
    default:
      stopTab = overview(panel, onState, ipsOf);
  }
  return () => {
    watches.forEach((w) => w.stop());
    stopTab();
  };
}
