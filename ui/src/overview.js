// The Overview tab: status, node, IPs, CPU and memory, disks, the import progress of the VM's
// DataVolumes, NICs and the guest OS (from the VMI's guestOSInfo when its guest agent reports
// one), redrawn whenever the VM, its VMI or a DataVolume changes.

import { h, mount } from './dom.js';
import { progressBar } from './table.js';

function cpuOf(spec) {
  const cpu = spec?.domain?.cpu;
  if (!cpu) return spec?.domain?.resources?.requests?.cpu || '1 (default)';
  const n = (cpu.sockets || 1) * (cpu.cores || 1) * (cpu.threads || 1);
  return `${n} vCPU (${cpu.sockets || 1} sockets × ${cpu.cores || 1} cores × ${cpu.threads || 1} threads)${cpu.model ? `, model ${cpu.model}` : ''}`;
}

const memoryOf = (spec) => spec?.domain?.memory?.guest || spec?.domain?.resources?.requests?.memory || '';

function volumeSource(v) {
  if (!v) return '';
  const [kind, src] = Object.entries(v).find(([k]) => k !== 'name') || ['', {}];
  const ref = src?.claimName || src?.name || src?.image || src?.secretName || '';
  return ref ? `${kind}: ${ref}` : kind;
}

const dl = (pairs) =>
  h('dl.facts', {}, pairs.filter(([, v]) => v !== undefined).map(([k, v]) => [h('dt', {}, k), h('dd', { 'data-field': k }, v || '—')]));

const table = (cols, rows) =>
  h('div.scroll', {}, h('table.list', {}, h('thead', {}, h('tr', {}, cols.map((c) => h('th', { scope: 'col' }, c)))), h('tbody', {}, rows.length ? rows : h('tr', {}, h('td', { colspan: cols.length }, 'None')))));

function dataVolumes(vm, dvs) {
  return (vm.spec?.dataVolumeTemplates || []).map((t) => {
    const dv = dvs.get(`${vm.metadata.namespace}/${t.metadata?.name}`);
    const phase = dv?.status?.phase || 'Pending';
    return h(
      `tr#dv-${t.metadata?.name}`,
      {},
      h('td', {}, t.metadata?.name),
      h('td.dv-phase', {}, phase),
      h('td', {}, progressBar(dv?.status?.progress, phase, `import progress of ${t.metadata?.name}`)),
    );
  });
}

export function overview(panel, onState, ipsOf) {
  onState(({ vm, vmi, dvs }) => {
    if (!vm) {
      mount(panel, h('p', {}, 'Loading…'));
      return;
    }
    const spec = vmi?.spec || vm.spec?.template?.spec || {};
    const os = vmi?.status?.guestOSInfo;
    const osText = os && (os.prettyName || os.name) ? `${os.prettyName || `${os.name} ${os.version || ''}`}${os.kernelRelease ? ` (kernel ${os.kernelRelease})` : ''}` : 'Not reported (no guest agent)';
    const volumes = new Map((spec.volumes || []).map((v) => [v.name, v]));
    const disks = (spec.domain?.devices?.disks || []).map((d) => {
      const type = ['disk', 'cdrom', 'lun'].find((t) => d[t]) || 'disk';
      return h('tr', {}, h('td', {}, d.name), h('td', {}, type), h('td', {}, d[type]?.bus || ''), h('td', {}, volumeSource(volumes.get(d.name))));
    });
    const nets = new Map((spec.networks || []).map((n) => [n.name, n]));
    const status = new Map((vmi?.status?.interfaces || []).map((i) => [i.name, i]));
    const nics = (spec.domain?.devices?.interfaces || []).map((i) => {
      const binding = ['masquerade', 'bridge', 'sriov', 'passt'].find((b) => i[b]) || (i.binding?.name ?? '');
      const net = nets.get(i.name);
      const netText = net?.pod ? 'pod' : net?.multus?.networkName || '';
      const st = status.get(i.name);
      return h('tr', {}, h('td', {}, i.name), h('td', {}, binding), h('td', {}, netText), h('td', {}, st?.mac || i.macAddress || ''), h('td', {}, (st?.ipAddresses || []).join(', ')));
    });
    mount(
      panel,
      h('h2', {}, 'Overview'),
      dl([
        ['Status', vm.status?.printableStatus || 'Unknown'],
        ['Phase', vmi?.status?.phase || 'No VMI'],
        ['Node', vmi?.status?.nodeName || ''],
        ['IP addresses', ipsOf(vmi).join(', ')],
        ['CPU', cpuOf(spec)],
        ['Memory', memoryOf(spec)],
        ['Guest OS', osText],
        ['Run strategy', vm.spec?.runStrategy || (vm.spec?.running ? 'Always (running: true)' : 'Halted')],
        ['Created', vm.metadata.creationTimestamp],
      ]),
      h('h3', {}, 'Disks'),
      table(['Name', 'Type', 'Bus', 'Source'], disks),
      (vm.spec?.dataVolumeTemplates || []).length ? [h('h3', {}, 'DataVolumes'), table(['Name', 'Phase', 'Progress'], dataVolumes(vm, dvs))] : null,
      h('h3', {}, 'Network interfaces'),
      table(['Name', 'Binding', 'Network', 'MAC', 'IP addresses'], nics),
    );
  });
  return () => {};
}
