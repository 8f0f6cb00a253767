// The VirtualMachines list: Name, Namespace, Status (printableStatus), Conditions, Node, IP,
// filtered by namespace and label selector (server side) and status (here), kept live by
// watches of the VMs and their VMIs (node and addresses live on the VMI).

import { h, mount } from './dom.js';
import { kv } from './api.js';
import { listWatch } from './listwatch.js';

const filters = { namespace: '', status: '', labels: '' };

export const trueConditions = (o) =>
  (o?.status?.conditions || []).filter((c) => c.status === 'True').map((c) => c.type).join(', ');

export const ipsOf = (vmi) =>
  [...new Set((vmi?.status?.interfaces || []).flatMap((i) => i.ipAddresses || (i.ipAddress ? [i.ipAddress] : [])))];

export function vmList(main) {
  let vms = new Map();
  let vmis = new Map();
  let watches = [];
  const error = h('p.error', { role: 'alert' });
  const body = h('tbody');
  const count = h('p.count', { 'aria-live': 'polite' });
  const nsInput = h('input#f-namespace', { value: filters.namespace, placeholder: 'all', list: 'namespaces' });
  const nsList = h('datalist#namespaces');
  const statusSelect = h('select#f-status', {}, h('option', { value: '' }, 'any'));
  const labelInput = h('input#f-labels', { value: filters.labels, placeholder: 'app=web,tier!=db' });

  const render = () => {
    const statuses = new Set([...vms.values()].map((v) => v.status?.printableStatus).filter(Boolean));
    const have = new Set([...statusSelect.options].map((o) => o.value));
    for (const s of [...statuses, filters.status].filter(Boolean)) {
      if (!have.has(s)) statusSelect.append(h('option', { value: s }, s));
    }
    statusSelect.value = filters.status;
    const rows = [...vms.values()]
      .filter((v) => !filters.status || v.status?.printableStatus === filters.status)
      .sort((a, b) => `${a.metadata.namespace}/${a.metadata.name}`.localeCompare(`${b.metadata.namespace}/${b.metadata.name}`))
      .map((vm) => {
        const { namespace, name } = vm.metadata;
        const vmi = vmis.get(`${namespace}/${name}`);
        const status = vm.status?.printableStatus || 'Unknown';
        return h(
          'tr',
          { 'data-vm': `${namespace}/${name}` },
          h('td', { 'data-label': 'Name' }, h('a', { href: `#/vms/${encodeURIComponent(namespace)}/${encodeURIComponent(name)}` }, name)),
          h('td', { 'data-label': 'Namespace' }, namespace),
          h('td.status', { 'data-label': 'Status' }, h(`span.badge.s-${status.toLowerCase()}`, {}, status)),
          h('td', { 'data-label': 'Conditions' }, trueConditions(vm)),
          h('td', { 'data-label': 'Node' }, vmi?.status?.nodeName || ''),
          h('td', { 'data-label': 'IP' }, ipsOf(vmi).join(', ')),
        );
      });
    mount(body, rows.length ? rows : h('tr', {}, h('td', { colspan: 6 }, 'No VirtualMachines match.')));
    count.textContent = `${rows.length} of ${vms.size} VirtualMachines`;
  };

  const start = () => {
    watches.forEach((w) => w.stop());
    error.textContent = '';
    const sel = filters.labels ? `?labelSelector=${encodeURIComponent(filters.labels)}` : '';
    const onError = (e) => (error.textContent = e.message);
    watches = [
      listWatch(`${kv(filters.namespace)}/virtualmachines${sel}`, (m) => { vms = m; error.textContent = ''; render(); }, onError),
      listWatch(`${kv(filters.namespace)}/virtualmachineinstances`, (m) => { vmis = m; render(); }, onError),
      listWatch('/api/v1/namespaces', (m) => mount(nsList, [...m.values()].map((n) => h('option', { value: n.metadata.name }))), () => {}),
    ];
  };

  const form = h(
    'form.filters',
    {
      onsubmit: (e) => {
        e.preventDefault();
        filters.namespace = nsInput.value.trim();
        filters.labels = labelInput.value.trim();
        start();
      },
    },
    h('label', {}, 'Namespace ', nsInput),
    nsList,
    h('label', {}, 'Status ', statusSelect),
    h('label', {}, 'Labels ', labelInput),
    h('button', { type: 'submit' }, 'Apply'),
  );
  statusSelect.addEventListener('change', () => {
    filters.status = statusSelect.value;
    render();
  });

  mount(
    main,
    h('h1', {}, 'VirtualMachines'),
    h('p', {}, h('a.button#create-vm', { href: '#/create' }, 'Create VirtualMachine')),
    form,
    error,
    count,
    h(
      'div.scroll',
      {},
      h(
        'table.list#vm-list',
        {},
        h('thead', {}, h('tr', {}, ['Name', 'Namespace', 'Status', 'Conditions', 'Node', 'IP'].map((c) => h('th', { scope: 'col' }, c)))),
        body,
      ),
    ),
  );
  start();
  return () => watches.forEach((w) => w.stop());
}
