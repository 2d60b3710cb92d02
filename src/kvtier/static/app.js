// kvtier status page: polls the admin API every 2 s and draws what it reads.
// No dependencies; every value is written with textContent, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const HISTORY_POINTS = 150; // 5 minutes at one point per refresh
const MIN_CHART_POINTS = 30;

const token = new URLSearchParams(window.location.search).get("token");
const samples = []; // {t, overall, recent} with rates in [0, 1] or null
let previousLookup = null;

function $(id) {
  return document.getElementById(id);
}

async function getJSON(path) {
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = "Bearer " + token;
  const response = await fetch(path, { headers, cache: "no-store" });
  const body = await response.json();
  // /health answers 503 with a useful body; everything else must be 2xx.
  if (!response.ok && path !== "/health") {
    throw new Error(path + ": HTTP " + response.status + " " + (body.error || ""));
  }
  return body;
}

function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return (unit === 0 ? value.toFixed(0) : value.toFixed(1)) + " " + units[unit];
}

function formatCount(n) {
  return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
}

function formatRate(rate) {
  return rate === null ? "–" : (rate * 100).toFixed(1) + " %";
}

function formatDuration(seconds) {
  const s = Math.floor(seconds);
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

function setText(id, text) {
  $(id).textContent = text;
}

function fillRows(tbodyId, rows, columns) {
  const tbody = $(tbodyId);
  tbody.replaceChildren();
  if (rows.length === 0) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = columns;
    td.className = "muted";
    td.textContent = "none";
    tr.appendChild(td);
    tbody.appendChild(tr);
    return;
  }
  for (const cells of rows) {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      if (cell instanceof Node) {
        td.appendChild(cell);
      } else if (typeof cell === "object" && cell !== null) {
        td.textContent = cell.text;
        td.className = cell.className;
      } else {
        td.textContent = cell;
      }
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
  }
}

function fillBar(used, capacity) {
  const outer = document.createElement("div");
  outer.className = "bar small";
  const inner = document.createElement("div");
  inner.className = "fill";
  inner.style.width = capacity > 0 ? Math.min(100, (100 * used) / capacity) + "%" : "0";
  outer.appendChild(inner);
  outer.title = formatBytes(used) + (capacity > 0 ? " of " + formatBytes(capacity) : "");
  return outer;
}

function recordHitRate(lookup) {
  const overall = lookup.requested_tokens > 0 ? lookup.hit_tokens / lookup.requested_tokens : null;
  let recent = null;
  if (previousLookup !== null) {
    const asked = lookup.requested_tokens - previousLookup.requested_tokens;
    const hit = lookup.hit_tokens - previousLookup.hit_tokens;
    recent = asked > 0 ? hit / asked : null;
  }
  previousLookup = { requested_tokens: lookup.requested_tokens, hit_tokens: lookup.hit_tokens };
  samples.push({ t: Date.now(), overall, recent });
  if (samples.length > HISTORY_POINTS) samples.shift();
  return { overall, recent };
}

function drawChart() {
  const canvas = $("hit-rate-chart");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);

  const left = 40;
  const top = 8;
  const plotW = width - left - 8;
  const plotH = height - top - 20;
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#6b7384";
  ctx.strokeStyle = "#e2e5eb";
  ctx.lineWidth = 1;
  for (const level of [0, 0.5, 1]) {
    const y = top + plotH * (1 - level);
    ctx.beginPath();
    ctx.moveTo(left, y);
    ctx.lineTo(left + plotW, y);
    ctx.stroke();
    ctx.fillText(level * 100 + "%", 4, y + 4);
  }
  // The window grows with the history up to HISTORY_POINTS, so a fresh page is readable too.
  const span = Math.min(HISTORY_POINTS, Math.max(samples.length, MIN_CHART_POINTS));
  ctx.fillText("last " + formatDuration((span * REFRESH_MS) / 1000), left, height - 4);

  const step = plotW / (span - 1);
  const offset = span - samples.length;
  const series = [
    ["recent", "#2f6fde", 2],
    ["overall", "#9aa3b5", 1],
  ];
  for (const [key, color, lineWidth] of series) {
    ctx.strokeStyle = color;
    ctx.lineWidth = lineWidth;
    ctx.beginPath();
    let drawing = false;
    samples.forEach((point, i) => {
      const value = point[key];
      if (value === null) {
        drawing = false;
        return;
      }
      const x = left + (offset + i) * step;
      const y = top + plotH * (1 - value);
      if (drawing) ctx.lineTo(x, y);
      else ctx.moveTo(x, y);
      drawing = true;
    });
    ctx.stroke();
    ctx.fillStyle = color;
    samples.forEach((point, i) => {
      if (point[key] === null) return;
      ctx.beginPath();
      ctx.arc(left + (offset + i) * step, top + plotH * (1 - point[key]), lineWidth, 0, 2 * Math.PI);
      ctx.fill();
    });
  }
}

function renderStatus(status) {
  setText("version", status.version);
  setText("uptime", formatDuration(status.uptime_s));

  const rates = recordHitRate(status.lookup);
  setText("hit-rate", formatRate(rates.overall));
  setText("hit-rate-recent", formatRate(rates.recent));
  setText("lookup-hit-tokens", formatCount(status.lookup.hit_tokens));
  setText("lookup-requested-tokens", formatCount(status.lookup.requested_tokens));
  drawChart();

  const l1 = status.l1;
  setText("l1-used", formatBytes(l1.used_bytes));
  setText("l1-capacity", formatBytes(l1.capacity_bytes));
  setText("l1-groups", formatCount(l1.groups));
  setText("l1-ready-groups", formatCount(l1.ready_groups));
  setText("l1-pinned-groups", formatCount(l1.pinned_groups));
  setText("l1-evictions", formatCount(l1.evictions) + " (" + formatBytes(l1.evicted_bytes) + ")");
  const l1Fill = l1.capacity_bytes > 0 ? (100 * l1.used_bytes) / l1.capacity_bytes : 0;
  $("l1-bar").style.width = Math.min(100, l1Fill) + "%";

  const l2 = status.l2;
  fillRows(
    "l2-tiers",
    l2.tiers.map((tier) => [
      tier.name,
      fillBar(tier.used_bytes, tier.capacity_bytes),
      formatCount(tier.objects),
      formatCount(tier.hits),
      formatCount(tier.misses),
      formatCount(tier.errors + tier.corrupt),
    ]),
    6,
  );
  setText("l2-queue", formatCount(l2.queue_depth) + " / " + formatCount(l2.queue_capacity));
  setText("l2-written", formatCount(l2.written));
  setText("l2-dropped", formatCount(l2.dropped));

  setText("sessions-active", formatCount(status.sessions.active));
  setText("sessions-created", formatCount(status.sessions.created));
  setText("sessions-expired", formatCount(status.sessions.expired));
  setText("sessions-orphaned", formatCount(status.sessions.orphaned));
  setText("clients-connected", formatCount(status.clients.length));

  const errors = status.recent_errors.slice().reverse().slice(0, 20);
  fillRows(
    "recent-errors",
    errors.map((e) => [new Date(e.time * 1000).toLocaleTimeString(), e.operation, e.code, e.message]),
    4,
  );
}

function renderThreads(threads) {
  const unhealthy = new Set(threads.health.unhealthy.map((item) => item.name));
  fillRows(
    "threads",
    threads.threads.map((t) => {
      let state = { text: "ok", className: "ok" };
      if (unhealthy.has(t.name)) state = { text: "stalled", className: "bad" };
      else if (!t.running) state = { text: "stopped", className: "muted" };
      else if (!t.active) state = { text: "idle", className: "muted" };
      return [t.name, t.level, formatCount(t.run_count), formatCount(t.failure_count), state];
    }),
    5,
  );
}

function renderHealth(health) {
  const badge = $("health");
  const ok = health.status === "ok";
  badge.textContent = ok ? "healthy" : "unavailable";
  badge.className = "badge " + (ok ? "ok" : "bad");
  badge.title = ok ? "" : (health.reasons || []).join("\n");
}

async function refresh() {
  try {
    const [status, threads, health] = await Promise.all([
      getJSON("/status"),
      getJSON("/threads"),
      getJSON("/health"),
    ]);
    renderStatus(status);
    renderThreads(threads);
    renderHealth(health);
    $("fetch-error").classList.add("hidden");
    setText("last-update", "updated " + new Date().toLocaleTimeString());
  } catch (err) {
    const banner = $("fetch-error");
    banner.textContent = "cannot read the admin API: " + err.message;
    banner.classList.remove("hidden");
    const badge = $("health");
    badge.textContent = "unreachable";
    badge.className = "badge bad";
  }
}

async function loop() {
  await refresh();
  window.setTimeout(loop, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", loop);
