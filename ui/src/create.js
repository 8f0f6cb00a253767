// The Create VM form: name, namespace, an instancetype and preference (cluster-wide ones
// offered) or CPU and memory, a root disk imported from a URL, a registry image or a CDI
// DataSource (a dataVolumeTemplate the VM owns), an SSH public key (cloud-init NoCloud), and
// whether to start it. `buildVm` is the pure form → manifest step; the API validates the rest
// and its error is shown naming the field. After creation the VM's page shows import progress.

import { h, mount } from './dom.js';
import { api, kv } from './api.js';

const DNS1123 = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;

/** The VirtualMachine the form describes; throws an Error naming the bad field. */
export function buildVm(f) {
  if (!DNS1123.test(f.name || '') || f.name.length > 63) {
    throw new Error('Name: lower-case letters, digits and "-", starting and ending with a letter or digit');
  }
  if (!f.image) throw new Error('Image: give a URL, a registry image or a DataSource');
  const root = `${f.name}-root`;
  let source = null;
  let sourceRef = null;
  if (f.sourceType === 'url') source = { http: { url: f.image } };
  else if (f.sourceType === 'registry') source = { registry: { url: f.image.includes('://') ? f.image : `docker://${f.image}` } };
  else {
    const [ns, name] = f.image.includes('/') ? f.image.split('/', 2) : [f.namespace, f.image];
    sourceRef = { kind: 'DataSource', namespace: ns, name };
  }
  const domain = { devices: { disks: [{ name: 'root', disk: { bus: 'virtio' } }] } };
  const volumes = [{ name: 'root', dataVolume: { name: root } }];
  if (!f.instancetype) {
    domain.cpu = { cores: Number(f.cpu) || 1 };
    domain.memory = { guest: f.memory || '128Mi' };
  }
  if (f.sshKey?.trim()) {
    domain.devices.disks.push({ name: 'cloudinit', disk: { bus: 'virtio' } });
    const keys = f.sshKey.trim().split('\n').map((k) => `  - ${JSON.stringify(k.trim())}`).join('\n');
    volumes.push({ name: 'cloudinit', cloudInitNoCloud: { userData: `#cloud-config\nssh_authorized_keys:\n${keys}\n` } });
  }
  const spec = {
    runStrategy: f.start ? 'Always' : 'Halted',
    dataVolumeTemplates: [
      {
        metadata: { name: root },
        spec: { ...(source ? { source } : { sourceRef }), storage: { resources: { requests: { storage: f.size || '1Gi' } } } },
      },
    ],
    template: { metadata: { labels: { 'kubevirt.io/vm': f.name } }, spec: { domain, volumes } },
  };
  if (f.instancetype) spec.instancetype = { kind: 'VirtualMachineClusterInstancetype', name: f.instancetype };
  if (f.preference) spec.preference = { kind: 'VirtualMachineClusterPreference', name: f.preference };
  return { apiVersion: 'kubevirt.io/v1', kind: 'VirtualMachine', metadata: { name: f.name, namespace: f.namespace || 'default' }, spec };
}

const field = (label, id, input, help) => h('div.field', {}, h('label', { for: id }, label), input, help ? h('p.help', {}, help) : null);

export function createPage(main) {
  const name = h('input#c-name', { required: true, autocomplete: 'off' });
  const namespace = h('input#c-namespace', { value: 'default' });
  const instancetype = h('select#c-instancetype', {}, h('option', { value: '' }, '(none: CPU and memory below)'));
  const preference = h('select#c-preference', {}, h('option', { value: '' }, '(none)'));
  const cpu = h('input#c-cpu', { type: 'number', min: 1, value: '1' });
  const memory = h('input#c-memory', { value: '128Mi' });
  const sourceType = h(
    'select#c-source',
    {},
    h('option', { value: 'url' }, 'URL (http/https import)'),
    h('option', { value: 'registry' }, 'Registry image'),
    h('option', { value: 'datasource' }, 'DataSource ([namespace/]name)'),
  );
  const image = h('input#c-image', { required: true, placeholder: 'https://…/disk.qcow2' });
  const size = h('input#c-size', { value: '1Gi' });
  const sshKey = h('textarea#c-sshkey', { rows: 3, placeholder: 'ssh-ed25519 AAAA… user@host' });
  const start = h('input#c-start', { type: 'checkbox', checked: true });
  const result = h('p.result#create-result', { role: 'status', 'aria-live': 'polite' });
  sourceType.addEventListener('change', () => {
    image.placeholder = { url: 'https://…/disk.qcow2', registry: 'docker://quay.io/containerdisks/fedora:latest', datasource: 'os-images/fedora' }[sourceType.value];
  });
  for (const [sel, path] of [
    [instancetype, '/apis/instancetype.kubevirt.io/v1beta1/virtualmachineclusterinstancetypes'],
    [preference, '/apis/instancetype.kubevirt.io/v1beta1/virtualmachineclusterpreferences'],
  ]) {
    api(path)
      .then((l) => (l.items || []).forEach((o) => sel.append(h('option', { value: o.metadata.name }, o.metadata.name))))
      .catch(() => {});
  }
  const form = h(
    'form.card.create',
    {
      onsubmit: async (e) => {
        e.preventDefault();
        result.className = 'result';
        let vm;
        try {
          vm = buildVm({
            name: name.value.trim(),
            namespace: namespace.value.trim(),
            instancetype: instancetype.value,
            preference: preference.value,
            cpu: cpu.value,
            memory: memory.value.trim(),
            sourceType: sourceType.value,
            image: image.value.trim(),
            size: size.value.trim(),
            sshKey: sshKey.value,
            start: start.checked,
          });
        } catch (err) {
          result.className = 'result error';
          result.textContent = err.message;
          return;
        }
        result.textContent = 'Creating…';
        try {
          await api(`${kv(vm.metadata.namespace)}/virtualmachines`, { method: 'POST', body: vm });
          location.hash = `#/vms/${encodeURIComponent(vm.metadata.namespace)}/${encodeURIComponent(vm.metadata.name)}/overview`;
        } catch (err) {
          result.className = 'result error';
          result.textContent = `Create failed: ${err.message}`;
        }
      },
    },
    h('h1', {}, 'Create VirtualMachine'),
    field('Name', 'c-name', name),
    field('Namespace', 'c-namespace', namespace),
    field('Instancetype', 'c-instancetype', instancetype),
    field('Preference', 'c-preference', preference),
    field('CPU cores', 'c-cpu', cpu, 'Without an instancetype.'),
    field('Memory', 'c-memory', memory, 'Without an instancetype, e.g. 128Mi, 2Gi.'),
    field('Image source', 'c-source', sourceType),
    field('Image', 'c-image', image),
    field('Disk size', 'c-size', size),
    field('SSH public key', 'c-sshkey', sshKey, 'Put into cloud-init user data (ssh_authorized_keys).'),
    h('div.field', {}, h('label', {}, start, ' Start after creation')),
    h('button#c-create', { type: 'submit' }, 'Create'),
    result,
  );
  mount(main, form);
  name.focus();
  return () => {};
}
