// Unit tests of the Snapshots tab's objects (node --test; run by crates/webui/tests/ui_unit.rs).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { restoreOf, snapshotOf } from '../src/snapshots.js';

test('a snapshot names its VM as the source and gets a generated name', () => {
  const s = snapshotOf('web');
  assert.equal(s.kind, 'VirtualMachineSnapshot');
  assert.equal(s.metadata.generateName, 'web-snapshot-');
  assert.deepEqual(s.spec.source, { apiGroup: 'kubevirt.io', kind: 'VirtualMachine', name: 'web' });
});

test('a restore targets the VM with the chosen snapshot', () => {
  const r = restoreOf('web', 'web-snapshot-abc');
  assert.equal(r.kind, 'VirtualMachineRestore');
  assert.deepEqual(r.spec.target, { apiGroup: 'kubevirt.io', kind: 'VirtualMachine', name: 'web' });
  assert.equal(r.spec.virtualMachineSnapshotName, 'web-snapshot-abc');
});
