// The Settings page: the cluster's HyperConverged object (hco.kubevirt.io/v1beta1), the one
// configuration object, with its status conditions and a YAML editor (saves with its
// resourceVersion: a conflict is shown, not overwritten). When none exists, Create makes
// `kubevirt-hyperconverged` in the namespace of that name (created too when missing).

import { h, mount } from './dom.js';
import { api } from './api.js';
import { yamlEditor } from './yamltab.js';

const HCO = '/apis/hco.kubevirt.io/v1beta1';
export const HCO_NAME = 'kubevirt-hyperconverged';

export function settingsPage(main) {
  const status = h('p.result#settings-result', { role: 'status', 'aria-live': 'polite' });
  const body = h('div');
  let stop = () => {};
  const show = (hco) => {
    const path = `${HCO}/namespaces/${encodeURIComponent(hco.metadata.namespace)}/hyperconvergeds/${encodeURIComponent(hco.metadata.name)}`;
    const conds = (hco.status?.conditions || []).map((c) => h('li', {}, `${c.type}=${c.status}${c.reason ? ` (${c.reason})` : ''}${c.message ? `: ${c.message}` : ''}`));
    const panel = h('section.panel.settings-yaml');
    mount(body, h('p', {}, `HyperConverged ${hco.metadata.namespace}/${hco.metadata.name}`), h('h2', {}, 'Conditions'), conds.length ? h('ul#hco-conditions', {}, conds) : h('p#hco-conditions', {}, 'None reported.'), panel);
    stop = yamlEditor(panel, path, 'HyperConverged', 'HyperConverged YAML');
  };
  const create = async () => {
    status.className = 'result';
    status.textContent = 'Creating…';
    try {
      await api('/api/v1/namespaces', { method: 'POST', body: { apiVersion: 'v1', kind: 'Namespace', metadata: { name: HCO_NAME } } }).catch((e) => {
        if (e.status !== 409) throw e;
      });
      const hco = await api(`${HCO}/namespaces/${HCO_NAME}/hyperconvergeds`, {
        method: 'POST',
        body: { apiVersion: 'hco.kubevirt.io/v1beta1', kind: 'HyperConverged', metadata: { name: HCO_NAME, namespace: HCO_NAME }, spec: {} },
      });
      status.textContent = 'Created';
      show(hco);
    } catch (e) {
      status.className = 'result error';
      status.textContent = `Create failed: ${e.message}`;
    }
  };
  mount(main, h('h1', {}, 'Settings'), status, body);
  api(`${HCO}/hyperconvergeds`)
    .then((list) => {
      const hco = (list.items || [])[0];
      if (hco) show(hco);
      else mount(body, h('p', {}, 'There is no HyperConverged object yet: the defaults apply.'), h('button#hco-create', { type: 'button', onclick: create }, 'Create HyperConverged'));
    })
    .catch((e) => {
      status.className = 'result error';
      status.textContent = e.message;
    });
  return () => stop();
}
