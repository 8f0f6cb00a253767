// The Metrics tab: polls the VMI's node's metrics through the API server's Node proxy
// (`GET /api/v1/nodes/<node>/proxy/metrics`, which needs `get` on `nodes/proxy`), keeps a short
// history in memory and draws SVG line charts: CPU usage (rate of
// kubevirt_vmi_cpu_usage_seconds_total), memory resident vs domain, network rx/tx bytes/s per
// interface and storage read/write bytes/s per drive. The parsing and the maths are the pure
// functions of promtext.js.

import { h, mount } from './dom.js';
import { apiText } from './api.js';
import { History, formatValue, gauge, keysOf, parsePrometheus, polylinePoints, rates, vmiSnapshot } from './promtext.js';

/** How often the node's metrics are fetched. */
export const POLL_MS = 2000;
const W = 480;
const H = 140;
const SVG = 'http://www.w3.org/2000/svg';

function svg(tag, attrs = {}) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  return el;
}

/** One chart: `series` is [{label, points: [[t, v]]}]; the first series is the headline. */
function chart(id, title, unit, series, t0, t1) {
  const all = series.flatMap((s) => s.points.map(([, v]) => v));
  const yMax = Math.max(0, ...all.filter(Number.isFinite)) * 1.1;
  const plot = svg('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart-svg', role: 'img', 'aria-label': title, preserveAspectRatio: 'none' });
  for (const frac of [0.25, 0.5, 0.75]) plot.append(svg('line', { x1: 0, x2: W, y1: H * frac, y2: H * frac, class: 'grid' }));
  series.forEach((s, i) => {
    if (s.points.length) plot.append(svg('polyline', { points: polylinePoints(s.points, { w: W, h: H, t0, t1, yMax }), class: `line c${i % 6}` }));
  });
  const head = series[0]?.points ?? [];
  const last = head.length ? head[head.length - 1][1] : null;
  return h(
    `figure.chart#${id}`,
    { 'data-points': head.length, 'data-last': last ?? '' },
    h('figcaption', {}, title, h('span.scale', {}, ` (max ${formatValue(yMax, unit)})`)),
    plot,
    h(
      'ul.legend',
      {},
      series.map((s, i) => {
        const p = s.points[s.points.length - 1];
        return h('li', {}, h(`span.swatch.c${i % 6}`, { 'aria-hidden': 'true' }), `${s.label}: ${formatValue(p ? p[1] : null, unit)}`);
      }),
    ),
  );
}

export function metricsTab(panel, ns, name, onState) {
  const status = h('p.result#metrics-status', { role: 'status', 'aria-live': 'polite' }, 'Loading…');
  const charts = h('div.charts#metrics-charts');
  mount(panel, h('h2', {}, 'Metrics'), status, charts);
  const history = new History(90);
  let vmi = null;
  let listed = false;
  let node = null;
  let stopped = false;
  let timer = null;
  const ctl = new AbortController();

  const draw = () => {
    const items = history.items;
    if (!items.length) {
      charts.replaceChildren();
      return;
    }
    const t1 = items[items.length - 1].t;
    const t0 = Math.min(items[0].t, t1 - POLL_MS * 10);
    const nics = keysOf(items, 'net');
    const drives = keysOf(items, 'disk');
    charts.replaceChildren(
      chart('chart-cpu', 'CPU usage', 'cores', [{ label: 'CPU', points: rates(items, (s) => s.cpu) }], t0, t1),
      chart('chart-memory', 'Memory', 'B', [{ label: 'resident', points: gauge(items, (s) => s.rss) }, { label: 'domain', points: gauge(items, (s) => s.domain) }], t0, t1),
      nics.length
        ? chart('chart-network', 'Network', 'B/s', nics.flatMap((n) => [{ label: `${n} rx`, points: rates(items, (s) => s.net[n]?.rx) }, { label: `${n} tx`, points: rates(items, (s) => s.net[n]?.tx) }]), t0, t1)
        : h('figure.chart#chart-network', { 'data-points': 0 }, h('figcaption', {}, 'Network'), h('p.help', {}, 'No network series (a NIC on QEMU user networking has no counters).')),
      drives.length
        ? chart('chart-storage', 'Storage', 'B/s', drives.flatMap((d) => [{ label: `${d} read`, points: rates(items, (s) => s.disk[d]?.rd) }, { label: `${d} write`, points: rates(items, (s) => s.disk[d]?.wr) }]), t0, t1)
        : h('figure.chart#chart-storage', { 'data-points': 0 }, h('figcaption', {}, 'Storage'), h('p.help', {}, 'No storage series yet.')),
    );
  };

  const poll = async () => {
    timer = null;
    if (stopped) return;
    const running = vmi?.status?.phase === 'Running' && node;
    if (!listed) {
      // The VMI watch has not answered yet.
    } else if (!running) {
      status.className = 'result';
      status.textContent = vmi ? `The VM is not running (phase ${vmi.status?.phase || 'Pending'}): no metrics.` : 'The VM is not running: no metrics.';
      history.clear();
      draw();
    } else {
      try {
        const text = await apiText(`/api/v1/nodes/${encodeURIComponent(node)}/proxy/metrics`, { signal: ctl.signal });
        const snap = vmiSnapshot(parsePrometheus(text), ns, name, Date.now());
        status.className = 'result';
        if (snap.found) {
          history.push(snap);
          status.textContent = `Node ${node}: ${history.items.length} samples, every ${POLL_MS / 1000} s.`;
        } else {
          status.textContent = `Node ${node} has no series for this VMI yet.`;
        }
        draw();
      } catch (e) {
        if (stopped) return;
        status.className = 'result error';
        status.textContent = `Metrics unavailable: ${e.message}`;
      }
    }
    if (!stopped) timer = setTimeout(poll, listed ? POLL_MS : 250);
  };

  onState((state) => {
    if (stopped) return;
    const next = state.vmi?.status?.nodeName || null;
    // Another node or another VMI (a restart): the old series are not comparable.
    if (next !== node || state.vmi?.metadata?.uid !== vmi?.metadata?.uid) history.clear();
    vmi = state.vmi;
    listed = state.vmiListed;
    node = next;
  });
  poll();
  return () => {
    stopped = true;
    ctl.abort();
    if (timer) clearTimeout(timer);
  };
}
