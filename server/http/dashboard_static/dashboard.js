// The corectl ops dashboard: polls /dashboard/stats once a second and draws it. No dependencies.
// The API key (when the server has one) is kept in this tab's sessionStorage and sent as a bearer token.
"use strict";

const KEY = "corectl-api-key";
const POLL_MS = 1000;
const COLORS = { used: "#3565d9", cached: "#e0a31a", free: "#e4e7ee", p50: "#3565d9", p99: "#d9475b",
                 grid: "#dde1e8", ink: "#6b7385" };
const GUTTER = 28;  // left margin of the charts, for the axis label
const $ = (id) => document.getElementById(id);
const aborting = new Set();
let timer = null;

function authHeaders() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : `HTTP ${response.status}`;
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

function setStatus(kind, text) {
  const status = $("status");
  status.className = `status ${kind}`;
  status.textContent = text;
}

async function poll() {
  clearTimeout(timer);
  let response;
  try {
    response = await fetch("/dashboard/stats", { headers: authHeaders(), cache: "no-store" });
  } catch (_) {
    setStatus("error", "server unreachable");
    timer = setTimeout(poll, POLL_MS);
    return;
  }
  if (response.status === 401) {
    askForKey(await errorMessage(response));
    return;
  }
  if (!response.ok) {
    setStatus("error", await errorMessage(response));
  } else {
    render(await response.json());
    setStatus("live", "live");
  }
  timer = setTimeout(poll, POLL_MS);
}

function askForKey(message) {
  setStatus("error", "API key needed");
  $("key-form").hidden = false;
  $("key-error").textContent = sessionStorage.getItem(KEY) ? message : "";
  $("key-input").focus();
}

function fmtInt(n) { return Math.round(n).toLocaleString("en-US"); }
function fmtPct(x) { return x === null || x === undefined ? "-" : `${(100 * x).toFixed(1)}%`; }
function fmtSeconds(s) {
  if (s === null || s === undefined) return "-";
  if (s < 1) return `${(1000 * s).toFixed(s < 0.01 ? 1 : 0)} ms`;
  return s < 100 ? `${s.toFixed(2)} s` : `${fmtInt(s)} s`;
}
function fmtAge(s) {
  if (s < 60) return `${s.toFixed(1)} s`;
  return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
}

function render(stats) {
  const a = stats.activity;
  $("model").textContent = stats.model;
  $("uptime").textContent = `up ${fmtAge(stats.uptime_s)}`;
  $("num-running").textContent = fmtInt(stats.num_running);
  $("server-load").textContent = `${stats.server_load} HTTP requests in flight`;
  $("num-waiting").textContent = fmtInt(stats.num_waiting);
  $("tokens-per-s").textContent = a.output_tokens_per_s.toFixed(1);
  $("ttft").textContent = `${fmtSeconds(a.ttft_p50)} / ${fmtSeconds(a.ttft_p99)}`;
  $("itl").textContent = `${fmtSeconds(a.itl_p50)} / ${fmtSeconds(a.itl_p99)}`;
  for (const el of document.querySelectorAll(".window")) el.textContent = `last ${a.window_s / 60} min`;
  $("hit-rate").textContent = fmtPct(a.prefix_hit_rate);
  const total = stats.prefix_cache_queries ? stats.prefix_cache_hits / stats.prefix_cache_queries : null;
  $("hit-rate-total").textContent = `last ${a.window_s / 60} min; ${fmtPct(total)} since start`;
  $("preemptions").textContent = fmtInt(a.preemptions);
  $("preemptions-total").textContent = `last ${a.window_s / 60} min; ${fmtInt(stats.num_preemptions)} since start`;
  $("kv-usage").textContent = fmtPct(stats.kv_cache_usage);
  renderSteps(stats.steps);
  renderActivity(a);
  renderBlocks(stats.kv_blocks);
  renderRequests(stats.requests, stats.num_requests);
  renderAdapters(stats.adapters);
}

function renderAdapters(adapters) {
  // null: the server runs without --enable-lora, and the panel stays hidden.
  $("adapters-panel").hidden = adapters === null;
  if (adapters === null) return;
  const busy = adapters.filter((a) => a.state !== "idle").length;
  $("adapters-caption").textContent = `${adapters.length} served, ${busy} in use`;
  $("adapters").tBodies[0].replaceChildren(...adapters.map((a) => {
    const tr = document.createElement("tr");
    tr.dataset.name = a.name;
    tr.append(cell(a.name), cell(String(a.id)), cell(a.base_model), cell(a.path, "path"),
              cell(a.state, `state-${a.state}`), cell(fmtInt(a.requests)));
    return tr;
  }));
}

function renderSteps(steps) {
  if (!steps) {
    $("steps-caption").textContent = "no step yet";
    return;
  }
  const n = steps.num_seqs.length;
  const last = n ? `last: batch ${steps.num_seqs[n - 1]}, ${steps.num_tokens[n - 1]} tokens` : "";
  $("steps-caption").textContent = `${fmtInt(steps.num_steps)} steps; ${last}; budget ${steps.token_budget} tokens, ` +
    `max ${steps.max_num_seqs} sequences; snapshot ${fmtSeconds(steps.age_s)} old`;
  bars($("chart-batch"), steps.num_seqs, steps.max_num_seqs, COLORS.used);
  bars($("chart-budget"), steps.num_tokens.map((t) => t / steps.token_budget), 1, COLORS.cached);
}

function renderActivity(a) {
  const xs = a.points.map((p) => -p.age_s);
  lines($("chart-tokens"), xs, [{ values: a.points.map((p) => p.output_tokens_per_s), color: COLORS.used }], a.window_s);
  lines($("chart-ttft"), xs, [{ values: a.points.map((p) => p.ttft_p50), color: COLORS.p50 },
                              { values: a.points.map((p) => p.ttft_p99), color: COLORS.p99 }], a.window_s);
  lines($("chart-itl"), xs, [{ values: a.points.map((p) => p.itl_p50), color: COLORS.p50 },
                             { values: a.points.map((p) => p.itl_p99), color: COLORS.p99 }], a.window_s);
}

function clear(canvas) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "11px system-ui, sans-serif";
  return ctx;
}

function bars(canvas, values, max, color) {
  const ctx = clear(canvas);
  const w = canvas.width - GUTTER, h = canvas.height - 14, slots = Math.max(values.length, 64);
  const width = w / slots;
  ctx.fillStyle = color;
  values.forEach((v, i) => {
    const height = Math.max(1, (h * Math.min(v, max)) / max);
    ctx.fillRect(GUTTER + i * width + 1, h - height, Math.max(1, width - 2), height);
  });
  ctx.fillStyle = COLORS.ink;
  ctx.fillText(max === 1 ? "100%" : String(max), 2, 10);
  ctx.fillText(`${values.length} steps`, GUTTER, canvas.height - 2);
}

function niceMax(values) {
  const top = Math.max(0, ...values.filter((v) => v !== null));
  if (top <= 0) return 1;
  const step = 10 ** Math.floor(Math.log10(top));
  return Math.ceil(top / step) * step;
}

function lines(canvas, xs, series, windowS) {
  const ctx = clear(canvas);
  const w = canvas.width - GUTTER, h = canvas.height - 14;
  const max = niceMax(series.flatMap((s) => s.values));
  const x = (t) => GUTTER + w * (1 + t / windowS);
  const y = (v) => h - (h * v) / max;
  ctx.strokeStyle = COLORS.grid;
  ctx.beginPath(); ctx.moveTo(GUTTER, h + 0.5); ctx.lineTo(GUTTER + w, h + 0.5); ctx.stroke();
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    s.values.forEach((v, i) => {
      if (v === null) { drawing = false; return; }
      if (drawing) ctx.lineTo(x(xs[i]), y(v)); else ctx.moveTo(x(xs[i]), y(v));
      ctx.fillRect(x(xs[i]) - 1.5, y(v) - 1.5, 3, 3);
      drawing = true;
    });
    ctx.stroke();
  }
  ctx.fillStyle = COLORS.ink;
  ctx.fillText(String(max), 2, 10);
  ctx.fillText(`-${windowS / 60} min`, GUTTER, canvas.height - 2);
  ctx.fillText("now", GUTTER + w - 22, canvas.height - 2);
}

function renderBlocks(kv) {
  if (!kv) return;
  $("kv-used").textContent = fmtInt(kv.used);
  $("kv-cached").textContent = fmtInt(kv.cached);
  $("kv-free").textContent = fmtInt(kv.free);
  $("kv-tokens").textContent = `${fmtInt(kv.used * kv.block_size)} of ${fmtInt(kv.num_blocks * kv.block_size)} tokens`;
  $("kv-cells").textContent = kv.blocks_per_cell > 1 ? `(one cell = ${kv.blocks_per_cell} blocks)` :
    `(one cell = one block of ${kv.block_size} tokens)`;
  const canvas = $("block-map");
  const ctx = clear(canvas);
  const n = kv.cell_used.length, w = canvas.width, h = canvas.height;
  const cols = Math.max(1, Math.ceil(Math.sqrt((n * w) / h)));
  const size = Math.min(w / cols, h / Math.ceil(n / cols));
  const gap = size > 4 ? 1 : 0;
  for (let i = 0; i < n; i++) {
    const blocks = Math.min(kv.blocks_per_cell, kv.num_blocks - i * kv.blocks_per_cell);
    const left = (i % cols) * size, top = Math.floor(i / cols) * size, inner = size - gap;
    const used = (inner * kv.cell_used[i]) / blocks, cached = (inner * kv.cell_cached[i]) / blocks;
    ctx.fillStyle = COLORS.free;
    ctx.fillRect(left, top, inner, inner);
    ctx.fillStyle = COLORS.used;
    ctx.fillRect(left, top + inner - used, inner, used);
    ctx.fillStyle = COLORS.cached;
    ctx.fillRect(left, top + inner - used - cached, inner, cached);
  }
}

function renderRequests(rows, total) {
  const shown = new Set(rows.map((r) => r.id));
  for (const id of aborting) if (!shown.has(id)) aborting.delete(id);
  $("requests-caption").textContent = rows.length < total ? `${rows.length} oldest of ${total}` : `${total}`;
  const body = $("requests").tBodies[0];
  body.replaceChildren(...rows.map(requestRow));
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function requestRow(r) {
  const tr = document.createElement("tr");
  tr.dataset.id = r.id;
  const id = document.createElement("td");
  const code = document.createElement("code");
  code.textContent = r.id;
  id.append(code);
  const button = document.createElement("button");
  button.type = "button";
  button.className = "abort";
  button.textContent = aborting.has(r.id) ? "aborting" : "abort";
  button.disabled = aborting.has(r.id);
  button.addEventListener("click", () => abort(r.id, button));
  const action = document.createElement("td");
  action.append(button);
  tr.append(id, cell(r.state, `state-${r.state}`), cell(fmtInt(r.prompt_tokens)), cell(fmtInt(r.output_tokens)),
            cell(fmtAge(r.age_s)), cell(fmtSeconds(r.ttft_s)), action);
  return tr;
}

async function abort(id, button) {
  aborting.add(id);
  button.disabled = true;
  button.textContent = "aborting";
  const response = await fetch(`/dashboard/requests/${encodeURIComponent(id)}/abort`,
                               { method: "POST", headers: authHeaders() });
  $("notice").textContent = response.ok ? "" : `abort of ${id} failed: ${await errorMessage(response)}`;
  if (!response.ok) aborting.delete(id);
  poll();
}

function start() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key-input").value.trim());
    $("key-form").hidden = true;
    $("forget-key").hidden = false;
    poll();
  });
  $("forget-key").hidden = !sessionStorage.getItem(KEY);
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    $("forget-key").hidden = true;
    poll();
  });
  poll();
}

start();
