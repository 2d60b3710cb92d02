// kvtier status page: polls the admin API every 2 s and draws what it reads.
// No dependencies; every value is written with textContent, never as HTML. The hit-rate history
// comes from the server (a reload loses nothing). When reads need the admin token, the page asks
// for it once and trades it for an HttpOnly cookie (POST /login): the token never enters a URL.
"use strict";

const REFRESH_MS = 2000;
const MIN_CHART_SPAN_S = 300; // the chart shows at least the last 5 minutes

let history = []; // [[start_time_s, requested_tokens, hit_tokens], ...] from the server
let needLogin = false;

function $(id) {
  return document.getElementById(id);
}

class Unauthorized extends Error {}

async function getJSON(path) {
  const response = await fetch(path, {
    headers: { Accept: "application/json" },
    cache: "no-store",
    credentials: "same-origin",
  });
  if (response.status === 401) throw new Unauthorized(path);
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

function formatSeconds(s) {
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1e3).toPrecision(3) + " ms";
  return s.toPrecision(3) + " s";
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
    cells.forEach((cell, i) => {
      const td = document.createElement(columns === 0 && i === 0 ? "th" : "td");
      if (cell instanceof Node) {
        td.appendChild(cell);
      } else if (typeof cell === "object" && cell !== null) {
        td.textContent = cell.text;
        td.className = cell.className;
      } else {
        td.textContent = cell;
      }
      tr.appendChild(td);
    });
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
  const now = Date.now() / 1000;
  const first = history.length ? history[0][0] : now;
  const start = Math.min(first, now - MIN_CHART_SPAN_S);
  const span = Math.max(now - start, 1);
  ctx.fillText("last " + formatDuration(span), left, height - 4);
  setText("history-span", history.length + " intervals");

  const x = (t) => left + (plotW * (t - start)) / span;
  const y = (rate) => top + plotH * (1 - rate);
  const points = history.filter((p) => p[1] > 0).map((p) => [x(p[0]), y(p[2] / p[1])]);
  ctx.strokeStyle = "#2f6fde";
  ctx.fillStyle = "#2f6fde";
  ctx.lineWidth = 2;
  ctx.beginPath();
  points.forEach(([px, py], i) => (i ? ctx.lineTo(px, py) : ctx.moveTo(px, py)));
  ctx.stroke();
  for (const [px, py] of points) {
    ctx.beginPath();
    ctx.arc(px, py, 3, 0, 2 * Math.PI);
    ctx.fill();
  }
}

function renderStatus(status) {
  setText("version", status.version);
  setText("uptime", formatDuration(status.uptime_s));

  const lookup = status.lookup;
  const overall = lookup.requested_tokens > 0 ? lookup.hit_tokens / lookup.requested_tokens : null;
  history = status.hit_rate_history;
  const last = history.length ? history[history.length - 1] : null;
  setText("hit-rate", formatRate(overall));
  setText("hit-rate-recent", formatRate(last && last[1] > 0 ? last[2] / last[1] : null));
  setText("lookup-hit-tokens", formatCount(lookup.hit_tokens));
  setText("lookup-requested-tokens", formatCount(lookup.requested_tokens));
  setText("stored-bytes", formatBytes(status.traffic.stored_bytes));
  setText("retrieved-bytes", formatBytes(status.traffic.retrieved_bytes));
  drawChart();

  const l1 = status.l1;
  setText("l1-used", formatBytes(l1.used_bytes));
  setText("l1-capacity", formatBytes(l1.capacity_bytes));
  setText("l1-groups", formatCount(l1.groups));
  setText("l1-ready-groups", formatCount(l1.ready_groups));
  setText("l1-pinned-groups", formatCount(l1.pinned_groups));
  setText("l1-evictions", formatCount(l1.evictions) + " (" + formatBytes(l1.evicted_bytes) + ")");
  const adm = l1.admission;
  setText("l1-policy", adm ? adm.policy + (adm.stores_everything ? " (keeping everything)" : " (keeping chunks seen before)") : "–");
  setText("l1-admissions", adm ? formatCount(adm.admitted) + " / " + formatCount(adm.declined) : "–");
  const l1Fill = l1.capacity_bytes > 0 ? (100 * l1.used_bytes) / l1.capacity_bytes : 0;
  $("l1-bar").style.width = Math.min(100, l1Fill) + "%";

  const l2 = status.l2;
  const failing = new Set(l2.failing);
  const mean = (lat) => (lat.count ? formatSeconds(lat.total_s / lat.count) : "–");
  const codec = (c) =>
    c.name +
    " " +
    (c.stored_bytes ? (c.raw_bytes / c.stored_bytes).toFixed(2) : "1.00") +
    "x, " +
    formatSeconds(c.encode_s) +
    " / " +
    formatSeconds(c.decode_s);
  fillRows(
    "l2-tiers",
    l2.tiers.map((tier) => [
      tier.name,
      fillBar(tier.used_bytes, tier.capacity_bytes),
      formatCount(tier.objects),
      formatCount(tier.hits),
      formatCount(tier.misses),
      formatCount(tier.errors),
      formatCount(tier.corrupt),
      mean(tier.read_latency) + " / " + mean(tier.write_latency),
      codec(tier.codec),
      failing.has(tier.name)
        ? { text: "failing" + (tier.last_error ? ": " + tier.last_error : ""), className: "bad" }
        : { text: "ok", className: "ok" },
    ]),
    10,
  );
  setText("l2-queue", formatCount(l2.queue_depth) + " / " + formatCount(l2.queue_capacity));
  setText("l2-written", formatCount(l2.written));
  setText("l2-dropped", formatCount(l2.dropped));

  fillRows(
    "models",
    status.models.map((m) => [
      m.model,
      formatCount(m.lookups),
      formatRate(m.requested_tokens ? m.hit_tokens / m.requested_tokens : null),
      formatCount(m.hit_tokens) + " / " + formatCount(m.requested_tokens),
    ]),
    4,
  );
  const missed = status.misses.reduce((sum, m) => sum + m.tokens, 0);
  fillRows(
    "misses",
    status.misses.map((m) => [
      m.reason,
      m.tier || "–",
      formatCount(m.tokens),
      formatRate(missed ? m.tokens / missed : null),
    ]),
    4,
  );
  const stages = {};
  for (const f of status.funnel) {
    (stages[f.tier] = stages[f.tier] || {})[f.stage] = f.tokens;
  }
  fillRows(
    "funnel",
    Object.entries(stages).map(([tier, st]) => [
      tier,
      formatCount(st.present || 0),
      formatCount(st.worth_loading || 0),
      formatCount(st.loaded || 0),
    ]),
    4,
  );
  fillRows(
    "load-rates",
    status.load_rates.map((r) => [
      r.tier,
      r.bytes_per_s ? formatBytes(r.bytes_per_s) + "/s" : "not measured yet",
      formatSeconds(r.latency_s),
    ]),
    3,
  );
  fillRows(
    "latency",
    status.latency.map((r) => [
      r.operation,
      formatCount(r.count),
      formatSeconds(r.mean_s),
      formatSeconds(r.p50_s),
      formatSeconds(r.p99_s),
    ]),
    5,
  );
  fillRows(
    "clients",
    status.clients.map((c) => [
      c.client_id,
      formatDuration(c.connected_s),
      c.last_seen_s.toFixed(1) + " s ago",
      c.registrations
        .map((r) => r.model + " rank " + r.worker_id + "/" + r.world_size + " " + r.dtype
          + "[" + r.chunk_shape.join(", ") + "]")
        .join("; ") || "–",
    ]),
    4,
  );

  setText("sessions-active", formatCount(status.sessions.active));
  setText("sessions-created", formatCount(status.sessions.created));
  setText("sessions-expired", formatCount(status.sessions.expired));
  setText("sessions-orphaned", formatCount(status.sessions.orphaned));
  setText("clients-connected", formatCount(status.clients.length));

  fillRows(
    "config",
    Object.entries(status.config).map(([key, value]) => [
      key,
      Array.isArray(value) ? value.join(", ") : value === null ? "–" : String(value),
    ]),
    0,
  );

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
  const labels = { ok: ["healthy", "ok"], degraded: ["degraded", "warn"] };
  const [text, cls] = labels[health.status] || ["unavailable", "bad"];
  badge.textContent = text;
  badge.className = "badge " + cls;
  const reasons = health.reasons || [];
  const banner = $("health-reasons");
  banner.textContent = reasons.join(" · ");
  banner.classList.toggle("hidden", reasons.length === 0);
}

function showLogin(show) {
  needLogin = show;
  $("login").classList.toggle("hidden", !show);
  $("dashboard").classList.toggle("hidden", show);
}

async function login(event) {
  event.preventDefault();
  const response = await fetch("/login", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ token: $("login-token").value }),
    credentials: "same-origin",
  });
  if (!response.ok) {
    setText("login-error", "wrong token");
    return;
  }
  $("login-token").value = "";
  setText("login-error", "");
  showLogin(false);
  await refresh();
}

async function refresh() {
  try {
    renderHealth(await getJSON("/health")); // never needs the token
    const [status, threads] = await Promise.all([getJSON("/status"), getJSON("/threads")]);
    showLogin(false);
    renderStatus(status);
    renderThreads(threads);
    $("fetch-error").classList.add("hidden");
    setText("last-update", "updated " + new Date().toLocaleTimeString());
  } catch (err) {
    if (err instanceof Unauthorized) {
      if (!needLogin) showLogin(true);
      return;
    }
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

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", login);
  loop();
});
