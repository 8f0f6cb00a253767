// A list table shared by the overview pages: header cells, rows, an empty-state row, and the
// `data-label` every cell carries so that phone widths show labelled cards.

import { h } from './dom.js';

/** table(id, ['Name', …], rows of [key, [cells…]]) */
export function listTable(id, cols, rows) {
  const body = rows.length
    ? rows.map(([key, cells]) => h('tr', { 'data-key': key }, cells.map((c, i) => h('td', { 'data-label': cols[i] }, c))))
    : h('tr', {}, h('td', { colspan: cols.length }, 'None.'));
  return h('div.scroll', {}, h(`table.list#${id}`, {}, h('thead', {}, h('tr', {}, cols.map((c) => h('th', { scope: 'col' }, c)))), h('tbody', {}, body)));
}

/** A progress bar with its text, from a CDI progress string ("45.3%", "N/A"). */
export function progressBar(progress, phase, label) {
  const pct = parseFloat(progress) || (phase === 'Succeeded' ? 100 : 0);
  return [h('progress', { max: 100, value: pct, 'aria-label': label }), ` ${progress || ''}`];
}
