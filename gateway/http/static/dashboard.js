// Sluice status page: poll ./status every POLL_INTERVAL_MS, render every section, keep HISTORY_S seconds of
// history for the charts (hand-drawn on <canvas>; no libraries, no network beyond this gateway). The charts' time
// axis spans the history seen since the page opened (at least 20 s), up to HISTORY_S.
//
// Every number is rendered as <span data-field="NAME" data-value="RAW">formatted</span>; NAME is stable:
//   model, uptime_s, active_requests, poll.state
//   pressure.level, pressure.in_level_s, pressure.kv_used_fraction, pressure.queue_wait_s, pressure.num_transitions
//   tier.<tier>.{priority, queue_depth, queue_capacity, oldest_wait_s, predicted_wait_s, in_flight, admitted,
//                rejected, deferred, cancelled, admitted_per_s, rejected_per_s, deferred_per_s}
//   totals.{queue_depth, admitted_per_s, rejected_per_s}
//   worker.<worker>.{backend, simulator, pool, state, device, ready, breaker, kv_usage, kv_used_blocks,
//                    kv_total_blocks, kv_cached_blocks, prefix_hit_rate, decode_tokens_per_s, prefill_tokens_per_s,
//                    running, waiting, in_flight, preemptions}
//   jobs.{queued, running, succeeded, failed, cancelled, expired, oldest_queued_age_s, batches_in_progress}
//        (/status jobs; a count the job store does not keep is null there and left out here)
// Rates (…_per_s) are counter deltas over the last RATE_WINDOW_S seconds of server time (/status uptime_s).
// A section whose data /status does not carry (yet) says "no data yet".
"use strict";

const POLL_INTERVAL_MS = 1000;
const HISTORY_S = 300;
const RATE_WINDOW_S = 10;
const MIN_RATE_SPAN_S = 1.5;
const PALETTE = ["#2f5fd0", "#d0542f", "#1f8a4c", "#8e44ad", "#c27c00", "#16a0b5", "#b5166d", "#5d6d7e"];

const state = {
  history: [],      // [{t_s, tiers: {name: {...}}, workers: {name: {...}}, totals: {...}}], oldest first
  lastStatus: null,
  lastError: null,
};

// ------------------------------------------------------------------------------------------- reading /status

function sumCounts(value) {
  if (value === undefined || value === null) return null;
  if (typeof value === "number") return value;
  if (typeof value === "object") return Object.values(value).reduce((a, v) => a + (Number(v) || 0), 0);
  return null;
}

function firstDefined(...values) {
  for (const v of values) if (v !== undefined && v !== null) return v;
  return null;
}

function readPressure(status) {
  const p = firstDefined(status.pressure, status.admission && status.admission.pressure);
  if (p === null) return null;
  return typeof p === "string" ? {level: p} : p;
}

function readTiers(status) {
  const raw = firstDefined(status.admission && status.admission.tiers, status.tiers);
  if (raw === null) return null;
  const entries = Array.isArray(raw) ? raw.map((t) => [t.name, t]) : Object.entries(raw);
  return entries.map(([name, t]) => ({
    name,
    priority: firstDefined(t.priority),
    queue_depth: firstDefined(t.queue_depth, t.depth),
    queue_capacity: firstDefined(t.queue_capacity),
    oldest_wait_s: firstDefined(t.oldest_wait_s),
    predicted_wait_s: firstDefined(t.predicted_wait_s),
    in_flight: firstDefined(t.in_flight),
    admitted: sumCounts(t.admitted),
    rejected: sumCounts(t.rejected),
    rejected_by_reason: t.rejected && typeof t.rejected === "object" ? t.rejected : null,
    deferred: sumCounts(t.deferred),
    cancelled: sumCounts(t.cancelled),
  }));
}

function readWorkers(status) {
  if (!Array.isArray(status.workers)) return null;
  return status.workers.map((w) => {
    const hello = w.hello || {};
    const cap = w.capacity || null;
    const backend = firstDefined(w.backend, hello.backend);
    const total = cap ? cap.total_kv_blocks : null;
    const breaker = w.breaker && typeof w.breaker === "object" ? w.breaker.state : w.breaker;
    return {
      name: w.name,
      backend,
      simulator: Boolean(w.simulator) || backend === "sim",
      pool: firstDefined(w.pool, hello.pool),
      state: firstDefined(w.state),
      device: firstDefined(hello.device),
      ready: Boolean(w.ready),
      breaker: firstDefined(breaker),
      in_flight: firstDefined(w.in_flight),
      has_capacity: cap !== null,
      kv_usage: cap && total ? cap.used_kv_blocks / total : (cap ? 0 : null),
      kv_used_blocks: cap ? cap.used_kv_blocks : null,
      kv_total_blocks: total,
      kv_cached_blocks: cap ? cap.cached_kv_blocks : null,
      prefix_hit_rate: cap ? cap.prefix_hit_rate : null,
      decode_tokens_per_s: cap ? cap.decode_tokens_per_s : null,
      prefill_tokens_per_s: cap ? cap.prefill_tokens_per_s : null,
      running: cap ? cap.num_running : null,
      waiting: cap ? cap.num_waiting : null,
      preemptions: cap ? cap.num_preemptions : null,
    };
  });
}

function readJobs(status) {
  const jobs = status.jobs;
  if (!jobs || typeof jobs !== "object") return null;
  const counts = {};
  const source = jobs.counts && typeof jobs.counts === "object" ? {...jobs, ...jobs.counts} : jobs;
  for (const [key, value] of Object.entries(source)) {
    if (typeof value === "number") counts[key.replace(/^num_/, "")] = value;
  }
  return Object.keys(counts).length ? counts : null;
}

// ------------------------------------------------------------------------------------------- history and rates

function record(status, tiers, workers) {
  const t_s = Number(status.uptime_s);
  const last = state.history[state.history.length - 1];
  if (last && t_s < last.t_s) state.history.length = 0;  // the gateway restarted
  const sample = {t_s, tiers: {}, workers: {}, totals: {}};
  for (const t of tiers || []) {
    sample.tiers[t.name] = {queue_depth: t.queue_depth, admitted: t.admitted, rejected: t.rejected,
                            deferred: t.deferred};
  }
  for (const w of workers || []) {
    sample.workers[w.name] = {kv_usage: w.kv_usage, decode_tokens_per_s: w.decode_tokens_per_s};
  }
  state.history.push(sample);
  while (state.history.length && state.history[0].t_s < t_s - HISTORY_S - RATE_WINDOW_S) state.history.shift();
  sample.totals = {
    admitted_per_s: totalRate("admitted"),
    rejected_per_s: totalRate("rejected"),
  };
  return sample;
}

function windowStart() {
  const now = state.history[state.history.length - 1];
  for (const s of state.history) if (s.t_s >= now.t_s - RATE_WINDOW_S) return s;
  return now;
}

/** Return the per-second rate of a tier counter over the rate window, or null (too little history / no data). */
function tierRate(tier, key) {
  const now = state.history[state.history.length - 1];
  const old = windowStart();
  const span_s = now.t_s - old.t_s;
  const a = old.tiers[tier], b = now.tiers[tier];
  if (!a || !b || a[key] === null || b[key] === null || span_s < MIN_RATE_SPAN_S) return null;
  return Math.max(0, b[key] - a[key]) / span_s;
}

function totalRate(key) {
  const now = state.history[state.history.length - 1];
  let total = null;
  for (const tier of Object.keys(now.tiers)) {
    const r = tierRate(tier, key);
    if (r !== null) total = (total || 0) + r;
  }
  return total;
}

// ------------------------------------------------------------------------------------------- rendering

function esc(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;",
                                                    "'": "&#39;"}[c]));
}

function fmtNumber(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  if (typeof value !== "number") return String(value);
  if (digits === undefined) digits = Number.isInteger(value) ? 0 : 2;
  return value.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
}

function fmtPercent(fraction) {
  return fraction === null || fraction === undefined ? "—" : `${(fraction * 100).toFixed(1)}%`;
}

/** Return a span carrying a stable data-field and the raw value; `text` defaults to the formatted number. */
function field(name, value, text, cls) {
  const raw = value === null || value === undefined ? "" : String(value);
  const shown = text === undefined ? fmtNumber(value) : text;
  const missing = value === null || value === undefined ? ' data-missing="true"' : "";
  return `<span class="num${cls ? " " + cls : ""}" data-field="${esc(name)}" data-value="${esc(raw)}"${missing}>` +
         `${esc(shown)}</span>`;
}

function fact(label, html) {
  return `<div class="fact"><span class="label">${esc(label)}</span><span class="value">${html}</span></div>`;
}

function setField(name, value, text) {
  const el = document.querySelector(`[data-field="${name}"]`);
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.textContent = text === undefined ? fmtNumber(value) : text;
}

function renderHeader(status) {
  setField("model", status.model, status.model || "—");
  const uptime = Number(status.uptime_s);
  const h = Math.floor(uptime / 3600), m = Math.floor((uptime % 3600) / 60), s = Math.floor(uptime % 60);
  setField("uptime_s", status.uptime_s, h ? `${h}h ${m}m` : m ? `${m}m ${s}s` : `${uptime.toFixed(1)} s`);
  setField("active_requests", firstDefined(status.active_requests));
}

function renderPressure(pressure) {
  const el = document.getElementById("pressure");
  if (!pressure || !pressure.level) { el.innerHTML = '<p class="empty">no data yet</p>'; return; }
  el.innerHTML = `<div class="facts">` +
    fact("level", field("pressure.level", pressure.level, pressure.level, `level ${esc(pressure.level)}`)) +
    fact("in level", field("pressure.in_level_s", firstDefined(pressure.in_level_s),
                           `${fmtNumber(firstDefined(pressure.in_level_s), 1)} s`)) +
    fact("KV used", field("pressure.kv_used_fraction", firstDefined(pressure.kv_used_fraction),
                          fmtPercent(firstDefined(pressure.kv_used_fraction)))) +
    fact("queue wait", field("pressure.queue_wait_s", firstDefined(pressure.queue_wait_s),
                             `${fmtNumber(firstDefined(pressure.queue_wait_s), 2)} s`)) +
    fact("transitions", field("pressure.num_transitions", firstDefined(pressure.num_transitions))) +
    `</div>`;
}

function renderTiers(tiers) {
  const el = document.getElementById("tiers");
  if (!tiers || !tiers.length) { el.innerHTML = '<p class="empty">no data yet</p>'; return; }
  const rows = tiers.map((t) => {
    const f = (key, value, text) => `<td>${field(`tier.${t.name}.${key}`, value, text)}</td>`;
    const rate = (key) => {
      const r = t[key] === null ? null : tierRate(t.name, key);
      return f(`${key}_per_s`, r === null ? null : Number(r.toFixed(3)), r === null ? "—" : `${r.toFixed(2)}/s`);
    };
    const reasons = t.rejected_by_reason
      ? Object.entries(t.rejected_by_reason).filter(([, n]) => n).map(([r, n]) => `${r} ${n}`).join(", ") : "";
    return `<tr><td><b>${esc(t.name)}</b></td>` +
      f("priority", t.priority) +
      `<td>${field(`tier.${t.name}.queue_depth`, t.queue_depth)} / ` +
      `${field(`tier.${t.name}.queue_capacity`, t.queue_capacity)}</td>` +
      f("oldest_wait_s", t.oldest_wait_s, `${fmtNumber(t.oldest_wait_s, 2)} s`) +
      f("predicted_wait_s", t.predicted_wait_s,
        t.predicted_wait_s === null ? "—" : `${fmtNumber(t.predicted_wait_s, 2)} s`) +
      f("in_flight", t.in_flight) +
      f("admitted", t.admitted) + rate("admitted") +
      f("rejected", t.rejected) + rate("rejected") +
      f("deferred", t.deferred) + rate("deferred") +
      f("cancelled", t.cancelled) +
      `<td class="reasons">${esc(reasons)}</td></tr>`;
  });
  const totalDepth = tiers.reduce((a, t) => a + (t.queue_depth || 0), 0);
  const totals = state.history[state.history.length - 1].totals;
  const totalRateText = (r) => (r === null ? "—" : `${r.toFixed(2)}/s`);
  el.innerHTML = `<table><thead><tr><th>tier</th><th>priority</th><th>queued / capacity</th><th>oldest wait</th>` +
    `<th>predicted wait</th><th>in flight</th><th>admitted</th><th>admitted rate</th><th>rejected</th>` +
    `<th>rejected rate</th><th>deferred</th><th>deferred rate</th><th>cancelled</th><th>rejections by reason</th>` +
    `</tr></thead><tbody>${rows.join("")}</tbody>` +
    `<tfoot><tr><td>all tiers</td><td></td><td>${field("totals.queue_depth", totalDepth)}</td><td></td><td></td>` +
    `<td></td><td></td><td>${field("totals.admitted_per_s", totals.admitted_per_s,
                                   totalRateText(totals.admitted_per_s))}</td>` +
    `<td></td><td>${field("totals.rejected_per_s", totals.rejected_per_s, totalRateText(totals.rejected_per_s))}` +
    `</td><td></td><td></td><td></td><td></td></tr></tfoot></table>`;
}

function renderWorkers(workers) {
  const el = document.getElementById("workers");
  document.getElementById("sim-banner").hidden = !(workers || []).some((w) => w.simulator);
  if (!workers || !workers.length) { el.innerHTML = '<p class="empty">no data yet</p>'; return; }
  const cards = workers.map((w) => {
    const p = `worker.${w.name}`;
    const stat = (label, key, value, text) => `<dt>${esc(label)}</dt><dd>${field(`${p}.${key}`, value, text)}</dd>`;
    const sim = w.simulator
      ? `<span class="badge sim" title="roofline simulator, not a GPU">SIMULATOR</span>` : "";
    const usagePct = w.kv_usage === null ? 0 : Math.min(100, w.kv_usage * 100);
    const capacityNote = w.has_capacity ? "" : '<p class="empty">no capacity report yet</p>';
    return `<div class="worker${w.simulator ? " sim" : ""}">` +
      `<div class="worker-head"><span class="name">${esc(w.name)}</span>${sim}` +
      `<span class="badge">backend ${field(`${p}.backend`, w.backend, w.backend || "—")}</span>` +
      `<span class="badge">pool ${field(`${p}.pool`, w.pool, w.pool || "default")}</span>` +
      `<span class="badge ${w.ready ? "ready" : "not-ready"}">` +
      `${field(`${p}.ready`, w.ready, w.ready ? "ready" : "not ready")}</span>` +
      (w.state === null ? "" : `<span class="badge">state ${field(`${p}.state`, w.state, w.state)}</span>`) +
      `<span class="badge ${esc(w.breaker || "")}">breaker ${field(`${p}.breaker`, w.breaker, w.breaker || "—")}` +
      `</span><span hidden>${field(`${p}.simulator`, w.simulator, String(w.simulator))}</span></div>` +
      capacityNote +
      `<div>KV usage ${field(`${p}.kv_usage`, w.kv_usage, fmtPercent(w.kv_usage))} ` +
      `(${field(`${p}.kv_used_blocks`, w.kv_used_blocks)} / ${field(`${p}.kv_total_blocks`, w.kv_total_blocks)} ` +
      `blocks)</div><div class="kv-bar"><div style="width:${usagePct.toFixed(1)}%"></div></div>` +
      `<dl class="stats">` +
      stat("decode", "decode_tokens_per_s", w.decode_tokens_per_s,
           w.decode_tokens_per_s === null ? "—" : `${fmtNumber(w.decode_tokens_per_s, 1)} tok/s`) +
      stat("prefill", "prefill_tokens_per_s", w.prefill_tokens_per_s,
           w.prefill_tokens_per_s === null ? "—" : `${fmtNumber(w.prefill_tokens_per_s, 1)} tok/s`) +
      stat("prefix hit rate", "prefix_hit_rate", w.prefix_hit_rate, fmtPercent(w.prefix_hit_rate)) +
      stat("cached blocks", "kv_cached_blocks", w.kv_cached_blocks) +
      stat("running", "running", w.running) +
      stat("waiting", "waiting", w.waiting) +
      stat("in flight", "in_flight", w.in_flight) +
      stat("preemptions", "preemptions", w.preemptions) +
      `</dl><div class="device">device ${field(`${p}.device`, w.device, w.device || "—")}</div></div>`;
  });
  el.innerHTML = `<div class="workers">${cards.join("")}</div>`;
}

// Jobs facts in reading order (life cycle, then batches and the queue's age); other numeric keys follow, sorted.
const JOB_FACTS = [["queued", "queued"], ["running", "running"], ["succeeded", "succeeded"], ["failed", "failed"],
                   ["cancelled", "cancelled"], ["expired", "expired"], ["batches_in_progress", "batches running"],
                   ["oldest_queued_age_s", "oldest queued"]];

function renderJobs(jobs) {
  const el = document.getElementById("jobs");
  if (!jobs) { el.innerHTML = '<p class="empty">no data yet</p>'; return; }
  const known = JOB_FACTS.map(([k]) => k);
  const main = JOB_FACTS.filter(([k]) => k === "queued" || k === "running" || jobs[k] !== undefined);
  const rest = Object.keys(jobs).filter((k) => !known.includes(k)).sort();
  el.innerHTML = `<div class="facts">` +
    main.map(([k, label]) => fact(label, k.endsWith("_s")
      ? field(`jobs.${k}`, jobs[k], `${fmtNumber(jobs[k], 1)} s`)
      : field(`jobs.${k}`, firstDefined(jobs[k])))).join("") +
    rest.map((k) => fact(k.replace(/_/g, " "), field(`jobs.${k}`, jobs[k]))).join("") + `</div>`;
}

// ------------------------------------------------------------------------------------------- charts

/** Draw line series on a canvas; x is server time (s), the last HISTORY_S seconds; y from 0 to max. */
function drawChart(canvas, series, options) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * dpr)) canvas.width = Math.round(width * dpr);
  if (canvas.height !== Math.round(height * dpr)) canvas.height = Math.round(height * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  const withPoints = series.filter((s) => s.points.length > 0);
  if (!withPoints.length) {
    ctx.fillStyle = "#6b7385";
    ctx.textAlign = "center";
    ctx.fillText("no data yet", width / 2, height / 2);
    canvas.dataset.series = "0";
    return;
  }
  const left = 48, right = 10, top = 22, bottom = 20;
  const plotW = width - left - right, plotH = height - top - bottom;
  const tMax = state.history[state.history.length - 1].t_s;
  const span_s = chartSpanS(), tMin = tMax - span_s;
  let yMax = options.yMax || 0;
  if (!options.yMax) {
    for (const s of withPoints) for (const [, v] of s.points) yMax = Math.max(yMax, v);
    const step = niceCeil((yMax || 1) / 4);  // 4 grid steps of a round size
    yMax = 4 * (options.integer ? Math.max(1, Math.ceil(step)) : step);
  }
  const x = (t) => left + ((t - tMin) / span_s) * plotW;
  const y = (v) => top + plotH - (Math.min(v, yMax) / yMax) * plotH;
  ctx.strokeStyle = "#e2e5ea";
  ctx.fillStyle = "#6b7385";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const v = (yMax * i) / 4;
    ctx.beginPath(); ctx.moveTo(left, y(v)); ctx.lineTo(left + plotW, y(v)); ctx.stroke();
    ctx.fillText(options.format(v), left - 4, y(v));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const tick_s = [5, 10, 15, 30, 60].find((step) => span_s / step <= 6) || 60;
  for (let ago_s = 0; ago_s <= span_s + 1e-9; ago_s += tick_s) {
    const label = ago_s === 0 ? "now" : ago_s % 60 === 0 ? `-${ago_s / 60}m` : `-${ago_s}s`;
    ctx.fillText(label, x(tMax - ago_s), top + plotH + 4);
  }
  let legendX = left;
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  for (const s of withPoints) {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.8;
    ctx.beginPath();
    s.points.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
    ctx.stroke();
    ctx.fillStyle = s.color;
    ctx.fillRect(legendX, 7, 10, 3);
    ctx.fillStyle = "#1d2330";
    const label = `${s.label} ${options.format(s.points[s.points.length - 1][1])}`;
    ctx.fillText(label, legendX + 14, 9);
    legendX += ctx.measureText(label).width + 28;
  }
  canvas.dataset.series = String(withPoints.length);
  canvas.dataset.points = String(Math.max(...withPoints.map((s) => s.points.length)));
}

/** Return the charts' time span in seconds: the history seen so far (at least 20 s), at most HISTORY_S. */
function chartSpanS() {
  const first = state.history[0].t_s, last = state.history[state.history.length - 1].t_s;
  return Math.min(HISTORY_S, Math.max(20, Math.ceil((last - first) / 10) * 10));
}

function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function seriesOf(group, key, scale) {
  const names = new Set();
  for (const s of state.history) for (const n of Object.keys(s[group])) names.add(n);
  const tMin = state.history[state.history.length - 1].t_s - HISTORY_S;
  return [...names].map((name, i) => ({
    label: name,
    color: PALETTE[i % PALETTE.length],
    points: state.history
      .filter((s) => s.t_s >= tMin && s[group][name] && s[group][name][key] !== null)
      .map((s) => [s.t_s, s[group][name][key] * (scale || 1)]),
  }));
}

function renderCharts() {
  const count = (v) => fmtNumber(v, v < 10 && !Number.isInteger(v) ? 1 : 0);
  drawChart(document.getElementById("chart-queue-depth"), seriesOf("tiers", "queue_depth"),
            {format: count, integer: true});
  drawChart(document.getElementById("chart-kv-usage"), seriesOf("workers", "kv_usage", 100),
            {format: (v) => `${v.toFixed(0)}%`, yMax: 100});
  drawChart(document.getElementById("chart-decode"), seriesOf("workers", "decode_tokens_per_s"), {format: count});
  drawChart(document.getElementById("chart-admission"), [
    {label: "admitted/s", color: PALETTE[2], points: totalsPoints("admitted_per_s")},
    {label: "rejected/s", color: "#c0392b", points: totalsPoints("rejected_per_s")},
  ], {format: (v) => fmtNumber(v, v < 10 ? 1 : 0)});
}

function totalsPoints(key) {
  const tMin = state.history[state.history.length - 1].t_s - HISTORY_S;
  return state.history.filter((s) => s.t_s >= tMin && s.totals[key] !== null && s.totals[key] !== undefined)
    .map((s) => [s.t_s, s.totals[key]]);
}

// ------------------------------------------------------------------------------------------- polling

function render(status) {
  const tiers = readTiers(status);
  const workers = readWorkers(status);
  record(status, tiers, workers);
  renderHeader(status);
  renderPressure(readPressure(status));
  renderTiers(tiers);
  renderWorkers(workers);
  renderJobs(readJobs(status));
  renderCharts();
}

/** Fetch /status once and render it; resolves to the /status JSON (or null after an error). */
async function refresh() {
  const poll = document.getElementById("poll-state");
  try {
    const response = await fetch("status", {cache: "no-store"});
    if (!response.ok) throw new Error(`/status answered ${response.status}`);
    const status = await response.json();
    state.lastStatus = status;
    state.lastError = null;
    render(status);
    poll.className = "poll ok";
    poll.textContent = `updated ${new Date().toLocaleTimeString("en-GB")}`;
    poll.dataset.value = "ok";
    return status;
  } catch (error) {
    state.lastError = String(error);
    poll.className = "poll error";
    poll.textContent = `cannot reach /status: ${error.message || error}`;
    poll.dataset.value = "error";
    return null;
  }
}

let timer = null;
let stopped = false;

async function loop() {
  await refresh();
  if (!stopped) timer = setTimeout(loop, POLL_INTERVAL_MS);
}

document.getElementById("history-minutes").textContent = String(HISTORY_S / 60);
window.sluiceDashboard = {
  refresh,
  state,
  /** Stop polling (tests freeze the page before comparing it with /status). */
  stop() { stopped = true; clearTimeout(timer); timer = null; },
};
loop();
