// The Events tab: core/v1 Events about the VM and its VMI (involvedObject.name), watched.

import { age, h, mount } from './dom.js';
import { listWatch } from './listwatch.js';

export function eventsTab(panel, ns, name) {
  const body = h('tbody');
  const error = h('p.error', { role: 'alert' });
  const sel = encodeURIComponent(`involvedObject.name=${name}`);
  mount(
    panel,
    h('h2', {}, 'Events'),
    error,
    h('div.scroll', {}, h('table.list#events', {}, h('thead', {}, h('tr', {}, ['Last seen', 'Type', 'Reason', 'Object', 'Message'].map((c) => h('th', { scope: 'col' }, c)))), body)),
  );
  const w = listWatch(
    `/api/v1/namespaces/${encodeURIComponent(ns)}/events?fieldSelector=${sel}`,
    (m) => {
      const when = (e) => e.lastTimestamp || e.eventTime || e.metadata.creationTimestamp || '';
      const rows = [...m.values()]
        .sort((a, b) => when(b).localeCompare(when(a)))
        .map((e) =>
          h('tr', {}, h('td', { title: when(e) }, age(when(e))), h('td', {}, e.type || ''), h('td', {}, e.reason || ''), h('td', {}, `${e.involvedObject?.kind || ''}/${e.involvedObject?.name || ''}`), h('td', {}, e.message || '')),
        );
      mount(body, rows.length ? rows : h('tr', {}, h('td', { colspan: 5 }, 'No events.')));
    },
    (e) => (error.textContent = e.message),
  );
  return () => w.stop();
}
