// ferrovirt web console: hash routing between the sign-in page, the VirtualMachines list, the
// Create VM form, a VM's details, Storage, Nodes and Settings. Each page returns a cleanup function that stops its
// watches and sockets.

import '@xterm/xterm/css/xterm.css';
import './app.css';
import { h, mount } from './dom.js';
import { api, setToken, signOut, token } from './api.js';
import { vmList } from './vms.js';
import { vmDetails } from './vm.js';
import { createPage } from './create.js';
import { nodesPage } from './nodes.js';
import { storagePage } from './storage.js';
import { settingsPage } from './settings.js';

let cleanup = () => {};

// Content-Security-Policy violations are noted on the root element, so that they are visible
// in the inspector and the end-to-end test can assert there are none.
document.addEventListener('securitypolicyviolation', (e) => {
  const el = document.documentElement;
  el.dataset.cspViolations = `${el.dataset.cspViolations || ''} ${e.violatedDirective}:${e.blockedURI}`.trim();
});

function loginPage(main) {
  const input = h('input#token', {
    type: 'password',
    name: 'token',
    autocomplete: 'off',
    required: true,
    'aria-describedby': 'token-help',
  });
  const status = h('p.error#login-error', { role: 'alert' });
  const form = h(
    'form.card.login',
    {
      onsubmit: async (e) => {
        e.preventDefault();
        setToken(input.value.trim());
        status.textContent = '';
        try {
          // Any authenticated request proves the token; whoami names the user.
          const review = await api('/apis/authentication.k8s.io/v1/selfsubjectreviews', {
            method: 'POST',
            body: { apiVersion: 'authentication.k8s.io/v1', kind: 'SelfSubjectReview' },
          });
          sessionStorage.setItem('ferrovirt.user', review?.status?.userInfo?.username || '');
          location.hash = '#/vms';
        } catch (err) {
          sessionStorage.removeItem('ferrovirt.token');
          status.textContent = `Sign-in failed: ${err.message}`;
          location.hash = '#/login';
        }
      },
    },
    h('h1', {}, 'Sign in'),
    h('label', { for: 'token' }, 'Bearer token'),
    input,
    h('p.help#token-help', {}, 'The token of your kubeconfig (the admin token is in the server data dir, file "token"). It is kept in this tab only.'),
    h('button#signin', { type: 'submit' }, 'Sign in'),
    status,
  );
  mount(main, form);
  input.focus();
  return () => {};
}

function nav() {
  const el = document.getElementById('nav');
  if (!token()) {
    mount(el);
    return;
  }
  const user = sessionStorage.getItem('ferrovirt.user');
  mount(
    el,
    h('a', { href: '#/vms' }, 'VirtualMachines'),
    h('a#nav-create', { href: '#/create' }, 'Create VM'),
    h('a#nav-storage', { href: '#/storage' }, 'Storage'),
    h('a#nav-nodes', { href: '#/nodes' }, 'Nodes'),
    h('a#nav-settings', { href: '#/settings' }, 'Settings'),
    user ? h('span.user', {}, user) : null,
    h('button.link#signout', { type: 'button', onclick: signOut }, 'Sign out'),
  );
}

function route() {
  cleanup();
  cleanup = () => {};
  const main = document.getElementById('main');
  const parts = location.hash.replace(/^#\/?/, '').split('/').map(decodeURIComponent);
  if (!token() && parts[0] !== 'login') {
    location.hash = '#/login';
    return;
  }
  nav();
  if (parts[0] === 'login') cleanup = loginPage(main);
  else if (parts[0] === 'create') cleanup = createPage(main);
  else if (parts[0] === 'nodes') cleanup = nodesPage(main);
  else if (parts[0] === 'storage') cleanup = storagePage(main);
  else if (parts[0] === 'settings') cleanup = settingsPage(main);
  else if (parts[0] === 'vms' && parts.length >= 3) cleanup = vmDetails(main, parts[1], parts[2], parts[3] || 'overview');
  else cleanup = vmList(main);
}

window.addEventListener('hashchange', route);
route();
