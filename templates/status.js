// The b70 status page: polls /api/state and draws it. No library: the chart is a few SVG paths.
"use strict";
const TOKEN = document.querySelector('meta[name="b70-token"]').content;
const HOUR = 3600, POLL_MS = 1500, NS = "http://www.w3.org/2000/svg";
const PHASE_COLORS = ["#5aa9ff", "#3ecf8e", "#f5b942", "#c792ea", "#ff6b6b", "#7fdbca", "#ffcb6b"];
let samples = [], last = null, view = null, lastPoll = 0;

const $ = (id) => document.getElementById(id);
const el = (tag, attrs = {}, text) => {
  const node = tag.startsWith("svg:") ? document.createElementNS(NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
};
const gib = (b) => (b == null ? "–" : (b / 2 ** 30).toFixed(1) + " GiB");
const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });
const secs = (s) => (s == null ? "–" : s < 10 ? s.toFixed(2) + " s" : s.toFixed(1) + " s");

async function poll() {
  try {
    const q = last == null ? "" : "?since=" + last;
    const r = await fetch("/api/state" + q, { credentials: "same-origin" });
    if (!r.ok) throw new Error((await r.json()).error.message);
    view = await r.json();
    samples = samples.concat(view.samples).filter((s) => s.t > view.now - HOUR);
    if (samples.length) last = samples[samples.length - 1].t;
    lastPoll = Date.now();
    draw();
  } catch (e) {
    $("age").textContent = "no answer: " + e.message;
  }
  setTimeout(poll, POLL_MS);
}

function draw() {
  $("model").textContent = "model " + view.model;
  drawUnits();
  drawNow();
  drawDemand();
  drawJob();
  drawCharts();
  drawSwitches();
  drawKeys();
  $("journal").textContent = view.journal || "(no runtime serves)";
}

function drawUnits() {
  const table = $("units");
  table.querySelectorAll("tr.unit").forEach((r) => r.remove());
  const busy = (view.job && !view.job.done) || view.switching_to;
  const latest = works(samples[samples.length - 1]), rated = rates();
  for (const u of view.units) {
    const row = el("tr", { class: "unit", "data-runtime": u.runtime, "data-active": u.active });
    const name = el("td");
    name.append(el("span", { class: "dot " + u.active }), u.runtime + " ");
    if (u.engine !== u.runtime) name.append(el("span", { class: "dim" }, u.engine));
    // The APIs it speaks through :8000 (chat.completions, responses, embeddings, ...)
    if (u.apis) name.append(el("div", { class: "dim apis", "data-apis": u.runtime }, u.apis.join(" · ")));
    row.append(name, el("td", { class: "dim" }, u.active + " (" + u.sub + ")"));
    row.append(el("td", { class: "dim" }, u.cards || "the card"));
    const work = latest[u.runtime];
    const tps = rated[u.runtime];
    const doing = work && work.in_flight != null ? work.in_flight + " in flight" : "";
    row.append(el("td", { class: "dim", "data-tps": u.runtime }, tps == null ? doing : rate(tps) + " tok/s" + (doing && " · " + doing)));
    const cell = el("td");
    const button = el("button", { "data-switch": u.runtime }, u.active === "active" ? "serving" : "switch");
    button.disabled = u.active === "active" || !!busy;
    button.addEventListener("click", () => startSwitch(u.runtime));
    cell.append(button);
    row.append(cell);
    table.append(row);
  }
}

// Each runtime's work in a sample; a line written before samples named their runtimes has
// the one runtime's figures at its top.
function works(s) {
  if (!s) return {};
  if (s.runtimes) return s.runtimes;
  return s.runtime ? { [s.runtime]: { generated: s.generated, in_flight: s.in_flight } } : {};
}

// Tokens/s per runtime, between the last two samples in which it said how many it generated.
function rates() {
  const out = {};
  for (let i = samples.length - 1; i > 0; i--) {
    const a = samples[i - 1], b = samples[i], wa = works(a), wb = works(b);
    for (const name of Object.keys(wb)) {
      if (name in out || !wa[name] || b.t <= a.t) continue;
      const ga = wa[name].generated, gb = wb[name].generated;
      if (ga != null && gb != null && gb >= ga) out[name] = (gb - ga) / (b.t - a.t);
    }
    if (Object.keys(out).length >= Object.keys(works(samples[samples.length - 1])).length) break;
  }
  return out;
}

function rate(tps) {
  return tps == null ? "–" : tps.toFixed(tps < 10 ? 1 : 0);
}

function drawNow() {
  const s = samples[samples.length - 1];
  const r = Object.values(rates());
  $("tps").textContent = r.length ? rate(r.reduce((x, y) => x + y, 0)) : "–";
  $("inflight").textContent = s && s.in_flight != null ? s.in_flight : "–";
  $("held").textContent = view.held_now;
  const h = $("health");
  h.textContent = !s ? "–" : s.healthy ? "ok" : s.switching ? "switching" : "down";
  h.className = !s ? "" : s.healthy ? "ok" : "bad";
  $("age").textContent = "updated " + clock(view.now) + (s ? " · last sample " + clock(s.t) : "");
}

// Switching on demand: what waits for which runtime and why, the pin, a runtime refused
function drawDemand() {
  const box = $("demand");
  box.replaceChildren();
  const d = view.demand;
  if (!d) return;
  if (d.on_demand) {
    const why = d.decision && d.decision.reason ? " · " + d.decision.reason : "";
    box.append(el("div", { class: "dim", "data-on-demand": "" }, "switching on demand" + why));
  }
  for (const q of d.queues) {
    box.append(el("div", { "data-queue": q.runtime }, `${q.waiting} waiting for ${q.model} (${q.runtime}), the oldest ${secs(q.oldest_s)}`));
  }
  if (d.pin) box.append(el("div", { "data-pin": d.pin.runtime }, `${d.pin.runtime} pinned until ${clock(d.pin.until)}`));
  for (const r of d.refused) {
    box.append(el("div", { class: "bad", "data-refused": r.runtime }, `${r.runtime} failed to start on demand, not tried for ${secs(r.left_s)}: ${r.why}`));
  }
}

function drawJob() {
  const box = $("job");
  box.replaceChildren();
  const job = view.job;
  if (!job) return;
  const title = job.done ? (job.ok ? "switched to " : "switch failed: ") + job.target : "switching to " + job.target + "…";
  box.append(el("h2", { style: "margin-top:1rem" }, title));
  const list = el("ol", { class: "phases", id: "phases" });
  job.lines.filter((l) => /^\d\d:\d\d:\d\d /.test(l)).forEach((line, i, all) => {
    list.append(el("li", { class: !job.done && i === all.length - 1 ? "current" : "" }, line));
  });
  box.append(list);
  if (job.error) box.append(el("pre", { class: "bad" }, job.error));
}

async function startSwitch(runtime) {
  const r = await fetch("/api/switch", {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-B70-Token": TOKEN },
    body: JSON.stringify({ runtime }),
  });
  if (!r.ok) alert((await r.json()).error.message);
}

function switchSpans() {
  const spans = (view.switches || []).map((w) => [w.at - (w.seconds || 0), w.at]);
  if (view.job && !view.job.done) spans.push([view.job.started, view.now]);
  return spans;
}

function drawCharts() {
  const box = $("charts");
  box.replaceChildren();
  const devices = new Map();
  for (const s of samples) for (const c of s.cards || []) {
    if (!devices.has(c.pci)) devices.set(c.pci, []);
    devices.get(c.pci).push([s.t, c.used, c.total]);
  }
  $("vram-note").textContent = devices.size ? "" : "(no Intel GPU in the samples)";
  for (const [pci, points] of devices) box.append(chart(pci, points));
  box.dataset.points = samples.length;
}

function chart(pci, points) {
  // The last hour, or less when the samples begin later: the data fills the width.
  const W = 1000, H = 180, L = 52, B = 18, t1 = view.now;
  const t0 = Math.max(t1 - HOUR, Math.min(points[0][0], t1 - 60) - 5), span = t1 - t0;
  const top = Math.max(...points.map((p) => p[2] || p[1] || 0), 1);
  const x = (t) => L + ((t - t0) / span) * (W - L), y = (b) => H - B - (b / top) * (H - B - 8);
  const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", "data-card": pci });
  for (let i = 0; i <= 4; i++) {
    svg.append(el("svg:line", { class: "grid", x1: L, x2: W, y1: y((top * i) / 4), y2: y((top * i) / 4) }));
    svg.append(el("svg:text", { x: 2, y: y((top * i) / 4) + 4 }, gib((top * i) / 4)));
  }
  for (const [a, b] of switchSpans()) {
    if (b < t0) continue;
    const xa = Math.max(x(a), L), xb = Math.max(Math.min(x(b), W), xa + 2);
    svg.append(el("svg:rect", { class: "switch", x: xa, y: 0, width: xb - xa, height: H - B }));
    svg.append(el("svg:line", { class: "switch-edge", x1: xb, x2: xb, y1: 0, y2: H - B }));
  }
  const pts = points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1] || 0).toFixed(1)}`);
  if (pts.length) {
    const first = x(points[0][0]).toFixed(1), lastX = x(points[points.length - 1][0]).toFixed(1);
    svg.append(el("svg:path", { class: "area", d: `M${first},${H - B} L${pts.join(" L")} L${lastX},${H - B} Z` }));
    svg.append(el("svg:polyline", { class: "used", points: pts.join(" "), "data-samples": points.length }));
  }
  for (let i = 0; i <= 4; i++) {
    const ago = span * (1 - i / 4);
    const label = i === 4 ? "now" : ago >= 120 ? "-" + Math.round(ago / 60) + " min" : "-" + Math.round(ago) + " s";
    svg.append(el("svg:text", { x: x(t1 - ago) - (i === 4 ? 24 : 0), y: H - 4 }, label));
  }
  const wrap = el("div");
  const now = points[points.length - 1];
  wrap.append(el("div", { class: "dim" }, `${pci}: ${gib(now[1])} used of ${gib(now[2])}`), svg);
  return wrap;
}

function drawSwitches() {
  const table = $("switches");
  table.querySelectorAll("tr.switch").forEach((r) => r.remove());
  for (const w of [...(view.switches || [])].reverse()) {
    const row = el("tr", { class: "switch" });
    row.append(el("td", {}, clock(w.at)), el("td", {}, (w.from || "–") + " → " + w.to), el("td", {}, secs(w.seconds)));
    const bar = el("div", { class: "bar", title: "" });
    const phases = Object.entries(w.phases || {}).filter(([k]) => k !== "unit");
    const total = phases.reduce((a, [, v]) => a + v, 0) || 1;
    phases.forEach(([k, v], i) => {
      const part = el("i", { title: `${k} ${secs(v)}` });
      part.style.width = (100 * v) / total + "%";
      part.style.background = PHASE_COLORS[i % PHASE_COLORS.length];
      bar.append(part);
    });
    bar.title = phases.map(([k, v]) => `${k} ${secs(v)}`).join(", ");
    const cell = el("td");
    cell.append(bar);
    row.append(cell);
    row.append(el("td", { class: "dim", "data-reason": w.reason || "by hand" }, w.reason || "by hand"));
    const outcome = w.ok ? "ok" : w.rolled_back ? "failed, rolled back" : "failed";
    const out = el("td", { class: w.ok ? "ok" : "bad", title: w.error || "" }, outcome);
    if (w.error) out.append(el("div", { class: "dim" }, w.error.split("\n")[0]));
    row.append(out);
    table.append(row);
  }
}

// Who used what in the last hour, per key (b70ctl usage); the master key is "master"
function drawKeys() {
  const table = $("keys");
  table.querySelectorAll("tr.key").forEach((r) => r.remove());
  for (const k of view.keys || []) {
    const row = el("tr", { class: "key", "data-key": k.key });
    row.append(el("td", {}, k.key), el("td", {}, String(k.requests)), el("td", {}, String(k.in)),
      el("td", {}, String(k.out)), el("td", {}, secs(k.queued_s)), el("td", { class: k.limited ? "bad" : "" }, String(k.limited)));
    table.append(row);
  }
}

poll();
