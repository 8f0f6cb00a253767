// The YAML tab, and the YAML editor of other objects (Settings): the object as YAML, editable;
// Save PUTs the text (application/yaml) with the resourceVersion it was read at, so a change made meanwhile is answered 409 and shown, never
// overwritten. Reload reads the current object (dropping the edits).

import YAML from 'yaml';
import { h, mount } from './dom.js';
import { api, kv } from './api.js';

export function yamlTab(panel, ns, name) {
  return yamlEditor(panel, `${kv(ns)}/virtualmachines/${encodeURIComponent(name)}`, 'VirtualMachine');
}

/** The YAML view and editor of the object at API path `path`. */
export function yamlEditor(panel, path, kind, heading = 'YAML') {
  const text = h('textarea#yaml-text', { spellcheck: 'false', rows: 28, 'aria-label': `${kind} YAML` });
  const msg = h('p.result#yaml-result', { role: 'status', 'aria-live': 'polite' });
  const load = async () => {
    msg.className = 'result';
    msg.textContent = 'Loading…';
    try {
      const vm = await api(path);
      delete vm.metadata?.managedFields;
      text.value = YAML.stringify(vm);
      msg.textContent = `Read at resourceVersion ${vm.metadata.resourceVersion}`;
    } catch (e) {
      msg.className = 'result error';
      msg.textContent = e.message;
    }
  };
  const save = async () => {
    msg.className = 'result';
    msg.textContent = 'Saving…';
    try {
      const vm = await api(path, { method: 'PUT', body: text.value, contentType: 'application/yaml' });
      text.value = YAML.stringify(vm);
      msg.textContent = `Saved: resourceVersion ${vm.metadata.resourceVersion}`;
    } catch (e) {
      msg.className = 'result error';
      msg.textContent =
        e.status === 409
          ? `Conflict: ${e.message}. Your edits are kept here; Reload to see the current object.`
          : `Save failed: ${e.message}`;
    }
  };
  mount(
    panel,
    h('h2', {}, heading),
    text,
    h('div.actions', {}, h('button#yaml-save', { type: 'button', onclick: save }, 'Save'), h('button#yaml-reload', { type: 'button', onclick: load }, 'Reload')),
    msg,
  );
  load();
  return () => {};
}
