// A list followed by a watch, kept as a Map of objects by namespace/name: the list gives the
// starting resourceVersion; watch events update the map; a 410 Gone (or an ERROR event) lists
// again; a stream that ends is resumed from the last seen resourceVersion. `onChange(map)` runs
// after the list and after every event. `stop()` ends it.

import { api, watch } from './api.js';

const keyOf = (o) => `${o.metadata.namespace || ''}/${o.metadata.name}`;

export function listWatch(path, onChange, onError = () => {}) {
  const ctl = new AbortController();
  const items = new Map();
  let rv = '';
  (async () => {
    let relist = true;
    while (!ctl.signal.aborted) {
      try {
        if (relist) {
          const list = await api(path, { signal: ctl.signal });
          items.clear();
          for (const o of list.items || []) items.set(keyOf(o), o);
          rv = list.metadata?.resourceVersion || '';
          relist = false;
          onChange(items);
        }
        for await (const ev of watch(path, rv, ctl.signal)) {
          if (ev.type === 'ERROR') {
            relist = true;
            break;
          }
          if (ev.object?.metadata?.resourceVersion) rv = ev.object.metadata.resourceVersion;
          if (ev.type === 'BOOKMARK') continue;
          if (ev.type === 'DELETED') items.delete(keyOf(ev.object));
          else items.set(keyOf(ev.object), ev.object);
          onChange(items);
        }
      } catch (e) {
        if (ctl.signal.aborted) return;
        if (e.status === 410) relist = true;
        else onError(e);
        if (e.status === 401) return;
      }
      await new Promise((r) => setTimeout(r, 1000));
    }
  })();
  return { stop: () => ctl.abort(), items };
}
