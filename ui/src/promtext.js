// The Metrics tab's pure steps: the Prometheus text format (0.0.4) parser, the selection of
// one VMI's kubevirt_vmi_* series into a snapshot, a bounded history of snapshots and the
// per-second rates of counters between them. No DOM, unit-tested in ui/test/promtext.test.js.

/** Parses one label set's inside (`a="x",b="y\"z"`); throws on malformed input. */
function parseLabels(text, line) {
  const labels = {};
  let i = 0;
  const fail = (why) => {
    throw new Error(`bad metrics line (${why}): ${line}`);
  };
  while (i < text.length) {
    while (text[i] === ' ' || text[i] === ',') i++;
    if (i >= text.length) break;
    const eq = text.indexOf('=', i);
    if (eq < 0) fail('label without value');
    const key = text.slice(i, eq).trim();
    if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(key)) fail(`label name ${key}`);
    i = eq + 1;
    if (text[i] !== '"') fail('unquoted label value');
    i++;
    let value = '';
    for (;;) {
      if (i >= text.length) fail('unterminated label value');
      const c = text[i];
      if (c === '\\') {
        const n = text[i + 1];
        value += n === 'n' ? '\n' : n;
        i += 2;
      } else if (c === '"') {
        i++;
        break;
      } else {
        value += c;
        i++;
      }
    }
    labels[key] = value;
  }
  return labels;
}

function parseValue(v) {
  switch (v) {
    case '+Inf':
      return Infinity;
    case '-Inf':
      return -Infinity;
    case 'NaN':
      return NaN;
    default: {
      const n = Number(v);
      if (v === '' || Number.isNaN(n)) throw new Error(`bad sample value ${JSON.stringify(v)}`);
      return n;
    }
  }
}

/**
 * Parses the Prometheus text exposition format: [{name, labels, value}] in order.
 * `# HELP`/`# TYPE`/comments and blank lines are skipped; an optional timestamp is ignored.
 */
export function parsePrometheus(text) {
  const out = [];
  for (const raw of text.split('\n')) {
    const line = raw.trim();
    if (!line || line.startsWith('#')) continue;
    let name;
    let labels = {};
    let rest;
    const brace = line.indexOf('{');
    const space = line.search(/\s/);
    if (brace >= 0 && (space < 0 || brace < space)) {
      name = line.slice(0, brace);
      // The closing brace is the last one not inside a quoted value: scan for it.
      let i = brace + 1;
      let quoted = false;
      for (; i < line.length; i++) {
        const c = line[i];
        if (quoted && c === '\\') i++;
        else if (c === '"') quoted = !quoted;
        else if (!quoted && c === '}') break;
      }
      if (i >= line.length) throw new Error(`bad metrics line (unclosed labels): ${line}`);
      labels = parseLabels(line.slice(brace + 1, i), line);
      rest = line.slice(i + 1).trim();
    } else {
      if (space < 0) throw new Error(`bad metrics line (no value): ${line}`);
      name = line.slice(0, space);
      rest = line.slice(space).trim();
    }
    if (!/^[A-Za-z_:][A-Za-z0-9_:]*$/.test(name)) throw new Error(`bad metric name ${JSON.stringify(name)}`);
    const [value] = rest.split(/\s+/);
    out.push({ name, labels, value: parseValue(value) });
  }
  return out;
}

const P = 'kubevirt_vmi_';

/**
 * One VMI's values at time `t` (ms) from parsed samples: {t, found, cpu, rss, domain,
 * net: {iface: {rx, tx}}, disk: {drive: {rd, wr}}} (counters as totals).
 */
export function vmiSnapshot(samples, ns, name, t) {
  const snap = { t, found: false, cpu: null, rss: null, domain: null, net: {}, disk: {} };
  for (const s of samples) {
    if (!s.name.startsWith(P) || s.labels.namespace !== ns || s.labels.name !== name) continue;
    snap.found = true;
    const key = s.name.slice(P.length);
    const nic = (i) => (snap.net[i] ??= { rx: null, tx: null });
    const drive = (d) => (snap.disk[d] ??= { rd: null, wr: null });
    switch (key) {
      case 'cpu_usage_seconds_total':
        snap.cpu = s.value;
        break;
      case 'memory_resident_bytes':
        snap.rss = s.value;
        break;
      case 'memory_domain_bytes':
        snap.domain = s.value;
        break;
      case 'network_receive_bytes_total':
        nic(s.labels.interface).rx = s.value;
        break;
      case 'network_transmit_bytes_total':
        nic(s.labels.interface).tx = s.value;
        break;
      case 'storage_read_traffic_bytes_total':
        drive(s.labels.drive).rd = s.value;
        break;
      case 'storage_write_traffic_bytes_total':
        drive(s.labels.drive).wr = s.value;
        break;
      default:
    }
  }
  return snap;
}

/** A bounded list of snapshots, oldest first. */
export class History {
  constructor(max = 60) {
    this.max = max;
    this.items = [];
  }

  push(snap) {
    const last = this.items[this.items.length - 1];
    if (last && snap.t <= last.t) return;
    this.items.push(snap);
    if (this.items.length > this.max) this.items.splice(0, this.items.length - this.max);
  }

  clear() {
    this.items = [];
  }
}

/**
 * Per-second rates of a counter between consecutive snapshots: [[t, rate]], `get(snap)`
 * reading the counter (null: absent). A counter that went down (the VMI restarted) starts
 * over: that interval has no point.
 */
export function rates(items, get) {
  const out = [];
  for (let i = 1; i < items.length; i++) {
    const a = get(items[i - 1]);
    const b = get(items[i]);
    const dt = (items[i].t - items[i - 1].t) / 1000;
    if (a == null || b == null || dt <= 0 || b < a) continue;
    out.push([items[i].t, (b - a) / dt]);
  }
  return out;
}

/** A gauge's values: [[t, value]] where present. */
export function gauge(items, get) {
  return items.filter((s) => get(s) != null).map((s) => [s.t, get(s)]);
}

/** The sorted keys that any snapshot has in `field` (`net` interfaces, `disk` drives). */
export function keysOf(items, field) {
  return [...new Set(items.flatMap((s) => Object.keys(s[field])))].sort();
}

/** Human units: bytes (binary), bytes/s, CPU cores. */
export function formatValue(v, unit) {
  if (v == null || !Number.isFinite(v)) return '–';
  if (unit === 'cores') return `${v.toFixed(v < 0.1 ? 3 : 2)} cores`;
  const suffix = unit === 'B/s' ? '/s' : '';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let x = v;
  let i = 0;
  while (Math.abs(x) >= 1024 && i < units.length - 1) {
    x /= 1024;
    i++;
  }
  return `${i === 0 ? Math.round(x) : x.toFixed(1)} ${units[i]}${suffix}`;
}

/**
 * The SVG polyline points of `series` ([[t, v]]) in a `w`×`h` box spanning times
 * [t0, t1] and values [0, yMax] (y grows downwards). Pure.
 */
export function polylinePoints(series, { w, h, t0, t1, yMax }) {
  const span = Math.max(1, t1 - t0);
  const top = yMax > 0 ? yMax : 1;
  return series
    .map(([t, v]) => {
      const x = ((t - t0) / span) * w;
      const y = h - (Math.max(0, v) / top) * h;
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    })
    .join(' ');
}
