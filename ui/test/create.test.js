// Unit tests of the Create VM form's pure step (node --test; run by crates/webui/tests/ui_unit.rs).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { buildVm } from '../src/create.js';

const base = { name: 'web', namespace: 'default', sourceType: 'url', image: 'http://x/disk.qcow2', size: '2Gi', memory: '256Mi', cpu: '2', start: true };

test('a URL import becomes an owned dataVolumeTemplate and the root disk', () => {
  const vm = buildVm(base);
  assert.equal(vm.kind, 'VirtualMachine');
  assert.equal(vm.spec.runStrategy, 'Always');
  const t = vm.spec.dataVolumeTemplates[0];
  assert.equal(t.metadata.name, 'web-root');
  assert.deepEqual(t.spec.source, { http: { url: 'http://x/disk.qcow2' } });
  assert.equal(t.spec.storage.resources.requests.storage, '2Gi');
  assert.deepEqual(vm.spec.template.spec.volumes, [{ name: 'root', dataVolume: { name: 'web-root' } }]);
  assert.deepEqual(vm.spec.template.spec.domain.cpu, { cores: 2 });
  assert.deepEqual(vm.spec.template.spec.domain.memory, { guest: '256Mi' });
});

test('an instancetype and preference replace CPU and memory', () => {
  const vm = buildVm({ ...base, instancetype: 'u1.small', preference: 'fedora', start: false });
  assert.deepEqual(vm.spec.instancetype, { kind: 'VirtualMachineClusterInstancetype', name: 'u1.small' });
  assert.deepEqual(vm.spec.preference, { kind: 'VirtualMachineClusterPreference', name: 'fedora' });
  assert.equal(vm.spec.template.spec.domain.cpu, undefined);
  assert.equal(vm.spec.template.spec.domain.memory, undefined);
  assert.equal(vm.spec.runStrategy, 'Halted');
});

test('registry and DataSource sources', () => {
  const reg = buildVm({ ...base, sourceType: 'registry', image: 'quay.io/containerdisks/fedora:40' });
  assert.deepEqual(reg.spec.dataVolumeTemplates[0].spec.source, { registry: { url: 'docker://quay.io/containerdisks/fedora:40' } });
  const ds = buildVm({ ...base, sourceType: 'datasource', image: 'os-images/fedora' });
  assert.deepEqual(ds.spec.dataVolumeTemplates[0].spec.sourceRef, { kind: 'DataSource', namespace: 'os-images', name: 'fedora' });
  const local = buildVm({ ...base, sourceType: 'datasource', image: 'fedora' });
  assert.equal(local.spec.dataVolumeTemplates[0].spec.sourceRef.namespace, 'default');
});

test('an SSH key goes into cloud-init user data, quoted', () => {
  const vm = buildVm({ ...base, sshKey: 'ssh-ed25519 AAAA a@b\n' });
  const ci = vm.spec.template.spec.volumes.find((v) => v.name === 'cloudinit');
  assert.equal(ci.cloudInitNoCloud.userData, '#cloud-config\nssh_authorized_keys:\n  - "ssh-ed25519 AAAA a@b"\n');
  assert.ok(vm.spec.template.spec.domain.devices.disks.some((d) => d.name === 'cloudinit'));
});

test('bad input is refused naming the field', () => {
  assert.throws(() => buildVm({ ...base, name: 'Bad_Name' }), /^Error: Name:/);
  assert.throws(() => buildVm({ ...base, name: 'a'.repeat(64) }), /^Error: Name:/);
  assert.throws(() => buildVm({ ...base, image: '' }), /^Error: Image:/);
});
