"""The dashboard page served at `/`: one HTML document with its script, no build step; it polls `/api/swarm` every
second and draws the coverage, the nodes, the live chains, the swarm graph, its persistence diagrams and the
topology change score over time in SVG."""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>nesa-node swarm</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; } h2 { font-size: 15px; margin: 18px 0 6px; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: 3px 6px; text-align: left; }
.cov td { width: 22px; height: 18px; padding: 0; text-align: center; font-size: 11px; }
.on { background: #4caf50; color: #fff; } .gap { background: #e53935; color: #fff; } .dr { background: #ffb300; }
.muted { color: #777; } .row { display: flex; gap: 24px; flex-wrap: wrap; } svg { border: 1px solid #ddd; }
#status.stale { color: #e53935; }
</style></head><body>
<h1>nesa-node swarm: <span id="model"></span></h1>
<div id="status" class="muted">loading</div>
<h2>Block coverage</h2><div id="coverage"></div>
<h2>Nodes</h2><table id="nodes"><thead><tr><th>peer</th><th>state</th><th>blocks</th>
<th>speed, ms/block/token</th><th>KV cache left, tokens</th><th>queue</th><th>codecs</th><th>quantization</th>
</tr></thead><tbody></tbody></table>
<h2>Live chains</h2><div id="chains" class="muted"></div>
<div class="row">
<div><h2>Swarm graph</h2><svg id="graph" width="360" height="300"></svg></div>
<div><h2>Persistence diagram (H0 dots, H1 squares; ms)</h2><svg id="diagram" width="320" height="300"></svg></div>
</div>
<h2>Topology change score over time <span class="muted">(above 1: a change, as the nodes' homology trigger
decides)</span></h2><div id="change-status" class="muted"></div><svg id="change" width="700" height="140"></svg>
<h2>Events</h2><ul id="events" class="muted"></ul>
<script>
"use strict";
// every string of the document comes from peers' records: escaped before it goes into markup
const esc = v => String(v).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);
const short = id => esc(String(id).slice(-8));
const NS = "http://www.w3.org/2000/svg";
function el(tag, attrs, text) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
function coverage(doc) {
  const rows = doc.nodes.map(n => {
    const cells = [];
    for (let b = 0; b < doc.num_blocks; b++) {
      const inside = b >= n.blocks[0] && b < n.blocks[1];
      const cls = inside ? (n.state === "online" ? "on" : "dr") : "";
      cells.push(`<td class="${cls}"></td>`);
    }
    return `<tr data-peer="${esc(n.peer_id)}"><th>${short(n.peer_id)}</th>${cells.join("")}</tr>`;
  });
  const counts = doc.coverage.map((s, b) => `<td class="${s.length ? "on" : "gap"}" title="block ${b}">${esc(s.length)}</td>`);
  const head = [...Array(doc.num_blocks).keys()].map(b => `<td>${b}</td>`).join("");
  document.getElementById("coverage").innerHTML =
    `<table class="cov"><tr><th>block</th>${head}</tr>${rows.join("")}<tr><th>servers</th>${counts.join("")}</tr></table>` +
    (doc.gaps.length ? `<p class="gap" id="gaps">no node serves blocks ${esc(doc.gaps.join(", "))}</p>` : "");
}
function nodes(doc) {
  document.querySelector("#nodes tbody").innerHTML = doc.nodes.map(n =>
    `<tr class="node" data-peer="${esc(n.peer_id)}"><td title="${esc(n.peer_id)}">${short(n.peer_id)}</td><td>${esc(n.state)}</td>` +
    `<td>${esc(n.blocks[0])}:${esc(n.blocks[1])}</td><td>${n.block_ms === null ? "unknown" :
    `${esc(n.block_ms)} <span class="muted">(${esc(n.speed_source)})</span>`}</td><td>${esc(n.cache_tokens_left)}</td><td>${esc(n.queue)}</td>` +
    `<td>${esc(n.codecs.join(" "))}</td><td>${esc(n.quantization)}</td></tr>`).join("");
}
function graph(topo) {
  const svg = document.getElementById("graph"); svg.replaceChildren();
  if (!topo || topo.error || !topo.positions.length) {
    svg.append(el("text", {x: 10, y: 20}, topo && topo.error ? topo.error : "no graph yet")); return;
  }
  const xs = topo.positions.map(p => p[0]), ys = topo.positions.map(p => p[1]);
  const span = Math.max(1e-9, Math.max(...xs) - Math.min(...xs), Math.max(...ys) - Math.min(...ys));
  const at = p => [180 + 140 * (p[0] - (Math.max(...xs) + Math.min(...xs)) / 2) / span,
                   150 + 120 * (p[1] - (Math.max(...ys) + Math.min(...ys)) / 2) / span];
  const placed = topo.positions.map(at), groups = [];
  placed.forEach((p, i) => {  // nodes closer than their labels (one host, one region): a ring around the first
    const near = groups.find(g => Math.hypot(placed[g[0]][0] - p[0], placed[g[0]][1] - p[1]) < 24);
    if (near) near.push(i); else groups.push([i]);
  });
  for (const members of groups) {
    if (members.length < 2) continue;
    const [x, y] = placed[members[0]], radius = Math.min(100, 12 * members.length);
    members.forEach((i, k) => {
      const angle = 2 * Math.PI * k / members.length;
      placed[i] = [x + radius * Math.cos(angle), y + radius * Math.sin(angle)];
    });
  }
  for (const [a, b] of topo.edges) {
    const [x1, y1] = placed[a], [x2, y2] = placed[b];
    svg.append(el("line", {x1, y1, x2, y2, stroke: "#bbb"}));
  }
  topo.positions.forEach((p, i) => {
    const [cx, cy] = placed[i];
    svg.append(el("circle", {cx, cy, r: 6, fill: "#1e88e5", class: "vertex"}));
    svg.append(el("text", {x: cx + 8, y: cy + 4, "font-size": 10}, String(topo.peer_ids[i]).slice(-8)));  // text: no escape
  });
}
function diagram(topo) {
  const svg = document.getElementById("diagram"); svg.replaceChildren();
  if (!topo || topo.error) { svg.append(el("text", {x: 10, y: 20}, topo ? topo.error : "no diagram yet")); return; }
  const points = topo.h0.concat(topo.h1);
  const top = Math.max(topo.scale_cap_ms, 1e-9, ...points.flat());
  const X = v => 40 + 260 * v / top, Y = v => 270 - 250 * v / top;
  svg.append(el("line", {x1: X(0), y1: Y(0), x2: X(top), y2: Y(top), stroke: "#999", "stroke-dasharray": "4"}));
  svg.append(el("line", {x1: 40, y1: 270, x2: 300, y2: 270, stroke: "#333"}));
  svg.append(el("line", {x1: 40, y1: 270, x2: 40, y2: 20, stroke: "#333"}));
  svg.append(el("text", {x: 150, y: 292, "font-size": 11}, "birth"));
  svg.append(el("text", {x: 4, y: 14, "font-size": 11}, "death"));
  for (const [b, d] of topo.h0) svg.append(el("circle", {cx: X(b), cy: Y(d), r: 4, fill: "#e53935", class: "h0"}));
  for (const [b, d] of topo.h1) svg.append(el("rect", {x: X(b) - 4, y: Y(d) - 4, width: 8, height: 8, fill: "#8e24aa", class: "h1"}));
}
function change(doc) {
  const svg = document.getElementById("change"); svg.replaceChildren();
  const status = document.getElementById("change-status");
  const c = doc.change;
  if (!c || c.calibrating) {
    status.textContent = c ? `calibrating: ${c.calibrating[0]} of ${c.calibrating[1]} snapshots` : "";
    return;
  }
  status.textContent = `watching: ${c.scores.length} snapshots scored`;
  status.dataset.watching = "yes";
  const top = Math.max(2, ...c.scores.map(p => Math.min(p[1], 10)));
  const t0 = c.scores.length ? c.scores[0][0] : 0, t1 = c.scores.length ? c.scores[c.scores.length - 1][0] : 1;
  const X = t => 40 + 640 * (t - t0) / Math.max(1e-9, t1 - t0), Y = v => 120 - 100 * Math.min(v, 10) / top;
  svg.append(el("line", {x1: 40, y1: Y(1), x2: 680, y2: Y(1), stroke: "#e53935", "stroke-dasharray": "4"}));
  svg.append(el("text", {x: 4, y: Y(1) + 4, "font-size": 10}, "1"));
  svg.append(el("line", {x1: 40, y1: 120, x2: 680, y2: 120, stroke: "#333"}));
  for (const [t, v] of c.scores) {
    svg.append(el("circle", {cx: X(t), cy: Y(v), r: 3, fill: v > 1 ? "#e53935" : "#1e88e5", class: "score"}));
  }
}
async function refresh() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("/api/swarm", {cache: "no-store"});
    const doc = await response.json();
    document.getElementById("model").textContent = doc.model;
    coverage(doc); nodes(doc); graph(doc.topology); diagram(doc.topology); change(doc);
    document.getElementById("chains").innerHTML = doc.chains.length ?
      doc.chains.map(c => `<div class="chain">${c.map(short).join(" &rarr; ")}</div>`).join("") : "no open session";
    document.getElementById("events").innerHTML = doc.events.map(e =>
      `<li>${new Date(e.time * 1000).toLocaleTimeString()} ${e.peer_id ? short(e.peer_id) : "swarm"} ${esc(e.event)}</li>`).join("");
    status.textContent = `${doc.nodes.length} nodes, ${doc.num_blocks} blocks; updated ${new Date(doc.time * 1000).toLocaleTimeString()}`;
    status.className = "muted"; document.body.dataset.updated = String(doc.time);
  } catch (error) { status.textContent = `no answer from the gateway: ${error}`; status.className = "stale"; }
}
refresh(); setInterval(refresh, 1000);
</script></body></html>
"""
