// The Nodes page: each Node's readiness, capacity and allocatable CPU and memory, the VMIs
// placed on it, its other conditions that are True (pressure, network) and its system info,
// kept live by watches of Nodes and VMIs.

import { h, mount } from './dom.js';
import { kv } from './api.js';
import { listWatch } from './listwatch.js';
import { listTable } from './table.js';

export function nodesPage(main) {
  let nodes = new Map();
  let vmis = new Map();
  const error = h('p.error', { role: 'alert' });
  const holder = h('div');
  const render = () => {
    const perNode = new Map();
    for (const v of vmis.values()) {
      const n = v.status?.nodeName;
      if (n) perNode.set(n, [...(perNode.get(n) || []), `${v.metadata.namespace}/${v.metadata.name}`]);
    }
    const rows = [...nodes.values()]
      .sort((a, b) => a.metadata.name.localeCompare(b.metadata.name))
      .map((n) => {
        const conds = n.status?.conditions || [];
        const ready = conds.find((c) => c.type === 'Ready')?.status === 'True' ? 'Ready' : 'NotReady';
        const status = n.spec?.unschedulable ? `${ready},SchedulingDisabled` : ready;
        const other = conds.filter((c) => c.type !== 'Ready' && c.status === 'True').map((c) => c.type).join(', ');
        const cap = n.status?.capacity || {};
        const alloc = n.status?.allocatable || {};
        const vms = perNode.get(n.metadata.name) || [];
        const info = n.status?.nodeInfo || {};
        return [
          n.metadata.name,
          [
            n.metadata.name,
            h(`span.badge.s-${ready === 'Ready' ? 'running' : 'unknown'}`, {}, status),
            `${alloc.cpu ?? '?'} / ${cap.cpu ?? '?'}`,
            `${alloc.memory ?? '?'} / ${cap.memory ?? '?'}`,
            h('span', { title: vms.join(', ') }, String(vms.length)),
            other || '—',
            [info.osImage, info.kernelVersion, info.architecture].filter(Boolean).join(', '),
          ],
        ];
      });
    mount(holder, listTable('nodes', ['Name', 'Status', 'CPU (allocatable / capacity)', 'Memory (allocatable / capacity)', 'VMIs', 'Other conditions', 'System'], rows));
  };
  mount(main, h('h1', {}, 'Nodes'), error, holder);
  const onError = (e) => (error.textContent = e.message);
  const watches = [
    listWatch('/api/v1/nodes', (m) => { nodes = m; render(); }, onError),
    listWatch(`${kv('')}/virtualmachineinstances`, (m) => { vmis = m; render(); }, onError),
  ];
  return () => watches.forEach((w) => w.stop());
}
