// The Console tab (the VMI's serial console in xterm.js) and the VNC tab (noVNC), both over the
// VMI's subresource websockets with subprotocol plain.kubevirt.io; the bearer token travels in
// Kubernetes' token subprotocol since a browser cannot set an Authorization header there.

import { Terminal } from '@xterm/xterm';
import { FitAddon } from '@xterm/addon-fit';
import RFB from '@novnc/novnc';
import { h, mount } from './dom.js';
import { sub, wsProtocols, wsUrl } from './api.js';

const streamPath = (ns, name, kind) => `${sub(ns)}/virtualmachineinstances/${encodeURIComponent(name)}/${kind}`;

export function serialTab(panel, ns, name) {
  const status = h('p.result#console-status', { role: 'status', 'aria-live': 'polite' }, 'Connecting…');
  const screen = h('div.terminal#serial');
  const reconnect = h('button#console-reconnect', { type: 'button' }, 'Reconnect');
  mount(panel, h('h2', {}, 'Serial console'), h('div.actions', {}, reconnect), status, screen);
  const term = new Terminal({ convertEol: false, cursorBlink: true, scrollback: 5000, fontSize: 14 });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open(screen);
  const refit = () => {
    try {
      fit.fit();
    } catch {
      /* not laid out yet */
    }
  };
  refit();
  window.addEventListener('resize', refit);
  let ws = null;
  const enc = new TextEncoder();
  const connect = () => {
    if (ws) ws.close();
    status.textContent = 'Connecting…';
    status.className = 'result';
    ws = new WebSocket(wsUrl(streamPath(ns, name, 'console')), wsProtocols());
    ws.binaryType = 'arraybuffer';
    const me = ws;
    ws.onopen = () => {
      status.textContent = 'Connected (press Enter for a prompt)';
      term.focus();
    };
    ws.onmessage = (ev) => term.write(typeof ev.data === 'string' ? ev.data : new Uint8Array(ev.data));
    ws.onclose = (ev) => {
      if (me !== ws) return;
      status.className = 'result error';
      status.textContent = `Disconnected${ev.code && ev.code !== 1000 ? ` (code ${ev.code})` : ''}: is the VMI running?`;
    };
  };
  term.onData((d) => ws?.readyState === WebSocket.OPEN && ws.send(enc.encode(d)));
  reconnect.addEventListener('click', connect);
  connect();
  return () => {
    window.removeEventListener('resize', refit);
    const w = ws;
    ws = null;
    w?.close();
    term.dispose();
  };
}

export function vncTab(panel, ns, name) {
  const status = h('p.result#vnc-status', { role: 'status', 'aria-live': 'polite' }, 'Connecting…');
  const screen = h('div.vnc#vnc-screen');
  const reconnect = h('button#vnc-reconnect', { type: 'button' }, 'Reconnect');
  const cad = h('button#vnc-cad', { type: 'button' }, 'Send Ctrl+Alt+Del');
  mount(panel, h('h2', {}, 'VNC'), h('div.actions', {}, reconnect, cad), status, screen);
  let rfb = null;
  const connect = () => {
    if (rfb) rfb.disconnect();
    screen.replaceChildren();
    status.className = 'result';
    status.textContent = 'Connecting…';
    const r = new RFB(screen, wsUrl(streamPath(ns, name, 'vnc')), { wsProtocols: wsProtocols() });
    r.scaleViewport = true;
    r.resizeSession = false;
    r.addEventListener('connect', () => (status.textContent = 'Connected'));
    r.addEventListener('disconnect', (e) => {
      if (r !== rfb) return;
      status.className = 'result error';
      status.textContent = e.detail?.clean ? 'Disconnected' : 'Connection failed: is the VMI running?';
    });
    r.addEventListener('securityfailure', (e) => (status.textContent = `Security failure: ${e.detail?.reason || ''}`));
    rfb = r;
  };
  reconnect.addEventListener('click', connect);
  cad.addEventListener('click', () => rfb?.sendCtrlAltDel());
  connect();
  return () => {
    const r = rfb;
    rfb = null;
    r?.disconnect();
  };
}
