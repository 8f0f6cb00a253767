// Unit tests of the Metrics tab's pure steps (node --test; run by crates/webui/tests/ui_unit.rs):
// the Prometheus text parser, one VMI's snapshot, the history, rates and chart geometry.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { History, formatValue, gauge, keysOf, parsePrometheus, polylinePoints, rates, vmiSnapshot } from '../src/promtext.js';

// As the agent renders it (prometheus-client), for two VMIs on node1.
const TEXT = `# HELP kubevirt_vmi_cpu_usage_seconds Total CPU time spent in all modes.
# TYPE kubevirt_vmi_cpu_usage_seconds counter
kubevirt_vmi_cpu_usage_seconds_total{name="web",namespace="default",node="node1"} 2.5
kubevirt_vmi_cpu_usage_seconds_total{name="other",namespace="default",node="node1"} 9
kubevirt_vmi_cpu_usage_seconds_total{name="web",namespace="elsewhere",node="node1"} 7
# TYPE kubevirt_vmi_memory_resident_bytes gauge
kubevirt_vmi_memory_resident_bytes{name="web",namespace="default",node="node1"} 209715200
kubevirt_vmi_memory_domain_bytes{name="web",namespace="default",node="node1"} 134217728
kubevirt_vmi_storage_read_traffic_bytes_total{name="web",namespace="default",node="node1",drive="root"} 4096
kubevirt_vmi_storage_write_traffic_bytes_total{name="web",namespace="default",node="node1",drive="root"} 512
kubevirt_vmi_network_receive_bytes_total{name="web",namespace="default",node="node1",interface="default"} 1000
kubevirt_vmi_network_transmit_bytes_total{name="web",namespace="default",node="node1",interface="default"} 300
kubevirt_vmi_info{name="web",namespace="default",node="node1",phase="running",os="<none>"} 1
# EOF
`;

test('parses names, labels and values, skipping comments', () => {
  const s = parsePrometheus(TEXT);
  assert.equal(s.length, 10);
  assert.deepEqual(s[0], { name: 'kubevirt_vmi_cpu_usage_seconds_total', labels: { name: 'web', namespace: 'default', node: 'node1' }, value: 2.5 });
  assert.equal(s[9].labels.os, '<none>');
});

test('label values keep escaped quotes, backslashes, newlines, braces and commas', () => {
  const [s] = parsePrometheus('m{a="x\\"y",b="c\\\\d",c="l1\\nl2",d="{},= }"} 3 1700000000000\n');
  assert.deepEqual(s.labels, { a: 'x"y', b: 'c\\d', c: 'l1\nl2', d: '{},= }' });
  assert.equal(s.value, 3, 'the timestamp is not the value');
});

test('samples without labels, special values and exponents', () => {
  const s = parsePrometheus('up 1\nx +Inf\ny -Inf\nz NaN\nw 1.5e3\nv{} 2\n');
  assert.deepEqual(s.map((x) => x.value).slice(0, 3), [1, Infinity, -Infinity]);
  assert.ok(Number.isNaN(s[3].value));
  assert.equal(s[4].value, 1500);
  assert.deepEqual(s[5], { name: 'v', labels: {}, value: 2 });
});

test('malformed lines are refused naming them', () => {
  assert.throws(() => parsePrometheus('m{a="x" 1\n'), /unclosed labels/);
  assert.throws(() => parsePrometheus('m{a=x} 1\n'), /unquoted label value/);
  assert.throws(() => parsePrometheus('m 1x\n'), /bad sample value/);
  assert.throws(() => parsePrometheus('novalue\n'), /no value/);
  assert.throws(() => parsePrometheus('9bad 1\n'), /bad metric name/);
});

test('a snapshot holds only this VMI (namespace and name) and groups NICs and drives', () => {
  const snap = vmiSnapshot(parsePrometheus(TEXT), 'default', 'web', 1000);
  assert.deepEqual(snap, {
    t: 1000,
    found: true,
    cpu: 2.5,
    rss: 209715200,
    domain: 134217728,
    net: { default: { rx: 1000, tx: 300 } },
    disk: { root: { rd: 4096, wr: 512 } },
  });
  const none = vmiSnapshot(parsePrometheus(TEXT), 'default', 'absent', 1000);
  assert.equal(none.found, false);
  assert.equal(none.cpu, null);
});

const snap = (t, cpu, extra = {}) => ({ t, found: true, cpu, rss: null, domain: null, net: {}, disk: {}, ...extra });

test('rates are per second between consecutive samples; a reset or a gap gives no point', () => {
  const items = [snap(0, 1), snap(2000, 2), snap(4000, 2.5), snap(6000, 0.1), snap(8000, 0.3), snap(9000, null), snap(10000, 1.3)];
  const r = rates(items, (s) => s.cpu);
  assert.deepEqual(
    r.map(([t, v]) => [t, Number(v.toFixed(6))]),
    [
      [2000, 0.5],
      [4000, 0.25],
      [8000, 0.1],
    ],
  );
  assert.deepEqual(rates([snap(0, 1)], (s) => s.cpu), [], 'one sample has no rate');
  assert.deepEqual(rates([snap(5, 1), snap(5, 2)], (s) => s.cpu), [], 'no time passed');
});

test('gauges and keys', () => {
  const items = [snap(0, 1, { rss: 10, net: { a: { rx: 1, tx: 1 } } }), snap(1, 1, { disk: { vdb: {}, root: {} } }), snap(2, 1, { rss: 12 })];
  assert.deepEqual(gauge(items, (s) => s.rss), [
    [0, 10],
    [2, 12],
  ]);
  assert.deepEqual(keysOf(items, 'net'), ['a']);
  assert.deepEqual(keysOf(items, 'disk'), ['root', 'vdb']);
});

test('the history is bounded, ordered and ignores stale samples', () => {
  const hist = new History(3);
  for (const t of [1, 2, 2, 3, 0, 4, 5]) hist.push(snap(t, t));
  assert.deepEqual(
    hist.items.map((s) => s.t),
    [3, 4, 5],
  );
  hist.clear();
  assert.equal(hist.items.length, 0);
});

test('units', () => {
  assert.equal(formatValue(0.5, 'cores'), '0.50 cores');
  assert.equal(formatValue(0.0123, 'cores'), '0.012 cores');
  assert.equal(formatValue(134217728, 'B'), '128.0 MiB');
  assert.equal(formatValue(512, 'B/s'), '512 B/s');
  assert.equal(formatValue(1536, 'B/s'), '1.5 KiB/s');
  assert.equal(formatValue(null, 'B'), '–');
});

test('polyline points span the box, clamp negatives and survive a zero maximum', () => {
  const box = { w: 100, h: 50, t0: 0, t1: 10, yMax: 4 };
  assert.equal(polylinePoints([[0, 0], [5, 2], [10, 4]], box), '0.0,50.0 50.0,25.0 100.0,0.0');
  assert.equal(polylinePoints([[10, -1]], box), '100.0,50.0');
  assert.equal(polylinePoints([[0, 0]], { ...box, yMax: 0 }), '0.0,50.0');
});
