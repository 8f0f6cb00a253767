// Unit tests of the websocket token subprotocol (node --test; run by crates/webui/tests/ui_unit.rs).
import { test } from 'node:test';
import assert from 'node:assert/strict';

const store = new Map();
globalThis.sessionStorage = { getItem: (k) => store.get(k) ?? null, setItem: (k, v) => store.set(k, v), removeItem: (k) => store.delete(k) };
const { setToken, wsProtocols } = await import('../src/api.js');

test('the token travels as unpadded base64url next to plain.kubevirt.io', () => {
  setToken('a?b>c~d');
  const [kubevirt, token] = wsProtocols();
  assert.equal(kubevirt, 'plain.kubevirt.io');
  const enc = token.slice('base64url.bearer.authorization.k8s.io.'.length);
  assert.match(enc, /^[A-Za-z0-9_-]+$/, 'only subprotocol-safe characters, no padding');
  assert.equal(Buffer.from(enc, 'base64url').toString(), 'a?b>c~d');
});

test('non-ASCII tokens are encoded as UTF-8', () => {
  setToken('tökén');
  const enc = wsProtocols()[1].split('.').pop();
  assert.equal(Buffer.from(enc, 'base64url').toString('utf8'), 'tökén');
});
