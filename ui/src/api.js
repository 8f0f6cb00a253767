// The public API, as the page uses it: every request carries the signed-in user's bearer token
// (kept in sessionStorage only); errors are metav1.Status messages; watches are streamed fetches
// of `?watch=1` (one JSON event per line); websockets carry the token in Kubernetes' subprotocol
// `base64url.bearer.authorization.k8s.io.<token>` next to `plain.kubevirt.io`.

const KEY = 'ferrovirt.token';

export const token = () => sessionStorage.getItem(KEY);
export const setToken = (t) => sessionStorage.setItem(KEY, t);
export const signOut = () => {
  sessionStorage.removeItem(KEY);
  location.hash = '#/login';
};

/** An API error: HTTP status, the metav1.Status reason and message. */
export class ApiError extends Error {
  constructor(status, reason, message) {
    super(message);
    this.status = status;
    this.reason = reason;
  }
}

async function toError(resp) {
  const text = await resp.text().catch(() => '');
  let status = null;
  try {
    status = JSON.parse(text);
  } catch {
    /* not JSON */
  }
  const message = status?.message || text || resp.statusText || `HTTP ${resp.status}`;
  return new ApiError(resp.status, status?.reason || '', message);
}

function headers(extra = {}) {
  return { Authorization: `Bearer ${token() || ''}`, Accept: 'application/json', ...extra };
}

/** One request; resolves to the decoded JSON answer (or null when empty). */
export async function api(path, { method = 'GET', body, contentType = 'application/json', signal } = {}) {
  const init = { method, headers: headers(body !== undefined ? { 'Content-Type': contentType } : {}), signal };
  if (body !== undefined) init.body = typeof body === 'string' ? body : JSON.stringify(body);
  const resp = await fetch(path, init);
  if (resp.status === 401) {
    signOut();
    throw new ApiError(401, 'Unauthorized', 'the token was not accepted: sign in again');
  }
  if (!resp.ok) throw await toError(resp);
  const text = await resp.text();
  return text ? JSON.parse(text) : null;
}

/** One GET whose answer is text (e.g. Prometheus metrics); errors as for `api`. */
export async function apiText(path, { signal } = {}) {
  const resp = await fetch(path, { headers: headers({ Accept: 'text/plain' }), signal });
  if (resp.status === 401) {
    signOut();
    throw new ApiError(401, 'Unauthorized', 'the token was not accepted: sign in again');
  }
  if (!resp.ok) throw await toError(resp);
  return resp.text();
}

/** Yields the events of a watch from `resourceVersion` until the stream ends. */
export async function* watch(path, resourceVersion, signal) {
  const sep = path.includes('?') ? '&' : '?';
  const url = `${path}${sep}watch=1&allowWatchBookmarks=true&resourceVersion=${encodeURIComponent(resourceVersion)}`;
  const resp = await fetch(url, { headers: headers(), signal });
  if (resp.status === 401) signOut();
  if (!resp.ok) throw await toError(resp);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let nl;
    while ((nl = buf.indexOf('\n')) >= 0) {
      const line = buf.slice(0, nl).trim();
      buf = buf.slice(nl + 1);
      if (line) yield JSON.parse(line);
    }
  }
}

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let bin = '';
  for (const b of bytes) bin += String.fromCharCode(b);
  return btoa(bin).replace(/\+/g, '-').replace(/\//g, '_').replace(/=+$/, '');
}

/** The subprotocols of a console/VNC websocket: KubeVirt's and the token's. */
export function wsProtocols() {
  return ['plain.kubevirt.io', `base64url.bearer.authorization.k8s.io.${base64url(token() || '')}`];
}

/** `wss://` URL of an API path on this server. */
export function wsUrl(path) {
  return `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}${path}`;
}

export const kv = (ns) => `/apis/kubevirt.io/v1${ns ? `/namespaces/${encodeURIComponent(ns)}` : ''}`;
export const sub = (ns) => `/apis/subresources.kubevirt.io/v1/namespaces/${encodeURIComponent(ns)}`;
