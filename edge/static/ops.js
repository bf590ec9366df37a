// The operations page: polls /v1/ops/overview with an operator token and draws it; looks a run's trace up.
// Plain DOM and SVG: no libraries, nothing fetched from elsewhere.
import { authHeaders, keepToken, takeTokenFromUrl } from "./token.js";

// Its own key: an operator token never replaces the chat page's token.
const TOKEN_KEY = "chatmesh.opsToken";
const POLL_MS = 2000;
const $ = (selector) => document.querySelector(selector);
let token = null;
let timer = null;

function showBanner(text) {
  $("#banner").textContent = text;
  $("#banner").hidden = !text;
}

function showSignin(show) {
  $("#signin").hidden = !show;
  $("#dashboard").hidden = show;
}

async function getJson(path) {
  const reply = await fetch(path, { headers: authHeaders(token) });
  const body = await reply.json().catch(() => ({}));
  if (!reply.ok) {
    const error = new Error(body.error?.message || `HTTP ${reply.status}`);
    error.status = reply.status;
    throw error;
  }
  return body;
}

const fixed = (value, digits = 2) => (value === null || value === undefined ? "–" : Number(value).toFixed(digits));
const percent = (value) => (value === null || value === undefined ? "–" : `${(100 * value).toFixed(1)} %`);
const count = (value) => Math.round(value || 0).toLocaleString();

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function drawEngines(engines) {
  const body = $("#engines tbody");
  body.replaceChildren();
  for (const engine of engines) {
    const row = body.insertRow();
    row.dataset.engine = engine.engine;
    cell(row, engine.engine);
    cell(row, engine.healthy ? "up" : "down", engine.healthy ? "health-up" : "health-down");
    cell(row, count(engine.running), "running");
    cell(row, count(engine.waiting), "waiting");
    cell(row, percent(engine.kv_usage), "kv");
    cell(row, percent(engine.prefix_hit_ratio), "prefix");
    cell(row, count(engine.inflight), "inflight");
  }
}

function pairs(byLabel) {
  const entries = Object.entries(byLabel || {}).filter(([, n]) => n > 0);
  return entries.length ? entries.map(([label, n]) => `${label || "none"}: ${count(n)}`).join(", ") : "none";
}

function drawRouter(router) {
  const list = $("#router");
  list.replaceChildren();
  const total = Object.values(router.decisions).reduce((a, b) => a + b, 0);
  const rows = [
    ["decisions", `${count(total)} (${pairs(router.decisions)}), ${fixed(router.decisions_per_s)}/s now`, "decisions"],
    ["prefix hits predicted", `${percent(router.predicted_hit_ratio)} (${count(router.predicted_cached_tokens)} of ${count(router.prompt_tokens)} prompt tokens)`, "predicted"],
    ["prefix hits actual", `${percent(router.actual_hit_ratio)} (${count(router.cached_tokens)} tokens served from the engines' caches)`, "actual"],
    ["failovers", pairs(router.failovers), "failovers"],
    ["shed by tier", pairs(router.shed), "shed"],
  ];
  for (const [term, value, id] of rows) {
    const dt = document.createElement("dt");
    dt.textContent = term;
    const dd = document.createElement("dd");
    dd.textContent = value;
    dd.id = `router-${id}`;
    list.append(dt, dd);
  }
}

const SVG = "http://www.w3.org/2000/svg";
function svgElement(name, attributes) {
  const element = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  return element;
}

function drawChart(svg, points) {
  const width = 480, height = 180, left = 40, bottom = 20, top = 8;
  svg.replaceChildren();
  const values = points.flatMap((p) => [p.p50, p.p90, p.p99]).filter((v) => v !== null);
  const max = Math.max(...values, 1e-3) * 1.1;
  const first = points.length ? points[0].at : 0;
  const span = Math.max(points.length ? points[points.length - 1].at - first : 0, 1);
  const x = (at) => left + ((width - left - 4) * (at - first)) / span;
  const y = (v) => top + (height - top - bottom) * (1 - v / max);
  svg.append(svgElement("line", { class: "axis", x1: left, y1: height - bottom, x2: width, y2: height - bottom }));
  svg.append(svgElement("line", { class: "axis", x1: left, y1: top, x2: left, y2: height - bottom }));
  for (const fraction of [0, 0.5, 1]) {
    const label = svgElement("text", { x: 2, y: y(max * fraction) + 3 });
    label.textContent = (max * fraction).toPrecision(2);
    svg.append(label);
  }
  const axis = svgElement("text", { x: left, y: height - 5 });
  axis.textContent = span < 120 ? `last ${Math.round(span)} s` : `last ${Math.round(span / 60)} min`;
  svg.append(axis);
  let drawn = 0;
  for (const key of ["p50", "p90", "p99"]) {
    const line = points.filter((p) => p[key] !== null).map((p) => `${x(p.at).toFixed(1)},${y(p[key]).toFixed(1)}`);
    if (line.length) {
      svg.append(svgElement("polyline", { class: key, points: line.join(" ") }));
      drawn += line.length;
    }
  }
  svg.dataset.points = String(drawn);
  const last = points.filter((p) => p.p50 !== null).at(-1);
  svg.dataset.p50 = last ? String(last.p50) : "";
}

function drawBudgets(budgets, shed) {
  const tiers = new Set([...Object.keys(budgets.tokens), ...Object.keys(budgets.rejections), ...Object.keys(shed)]);
  const body = $("#budgets tbody");
  body.replaceChildren();
  for (const tier of [...tiers].sort()) {
    const row = body.insertRow();
    row.dataset.tier = tier;
    cell(row, tier);
    cell(row, count(budgets.tokens[tier]), "tokens");
    cell(row, count(budgets.rejections[tier]), "rejections");
    cell(row, count(shed[tier]), "shed");
  }
}

function drawTools(tools) {
  const body = $("#tools tbody");
  body.replaceChildren();
  for (const tool of tools) {
    const row = body.insertRow();
    row.dataset.tool = tool.tool;
    cell(row, tool.tool);
    cell(row, pairs(tool.calls), "calls");
    cell(row, tool.mean_s === null ? "" : `${(tool.mean_s * 1000).toFixed(1)} ms`, "mean");
  }
}

function drawTargets(targets) {
  $("#targets").replaceChildren(
    ...targets.map((t) => {
      const item = document.createElement("li");
      // A Python service's event loop this late is its one thread full: everything it does waits.
      const lag = t.loop_lag_p99_s === null ? "" : `, event loop lag p99 ${(t.loop_lag_p99_s * 1000).toFixed(1)} ms`;
      item.textContent = `${t.name} ${t.url}: ${t.up ? "up" : `down (${t.error})`}${lag}`;
      return item;
    }),
  );
}

async function refresh() {
  try {
    const view = await getJson("/v1/ops/overview");
    showBanner("");
    showSignin(false);
    if (view.at === null) {
      $("#updated").textContent = "waiting for the first scrape …";
      return;
    }
    $("#updated").textContent = `updated ${new Date(view.at * 1000).toLocaleTimeString()}`;
    drawEngines(view.engines);
    drawRouter(view.router);
    drawChart($("#chart-ttft"), view.latency.ttft);
    drawChart($("#chart-tpot"), view.latency.tpot);
    drawBudgets(view.budgets, view.router.shed);
    drawTools(view.tools);
    drawTargets(view.targets);
  } catch (error) {
    showBanner(error.message);
    if (error.status === 401 || error.status === 403) {
      clearInterval(timer);
      showSignin(true);
    }
  }
}

function drawWaterfall(trace) {
  const spans = trace.spans.filter((s) => s.start_ns && s.end_ns);
  const start = Math.min(...spans.map((s) => s.start_ns));
  const end = Math.max(...spans.map((s) => s.end_ns));
  const total = Math.max(end - start, 1);
  const byId = new Map(spans.map((s) => [s.span_id, s]));
  const depth = (s) => {
    let d = 0;
    for (let p = byId.get(s.parent_span_id); p && d < 32; p = byId.get(p.parent_span_id)) d += 1;
    return d;
  };
  $("#waterfall").replaceChildren(
    ...spans.map((s) => {
      const row = document.createElement("div");
      row.className = `span service-${s.service}`;
      row.dataset.service = s.service;
      const label = document.createElement("span");
      label.className = "label";
      label.style.paddingLeft = `${depth(s)}rem`;
      label.textContent = `${s.service}: ${s.name}`;
      label.title = label.textContent;
      const track = document.createElement("span");
      track.className = "track";
      const bar = document.createElement("span");
      bar.className = `bar${s.status === "ERROR" ? " error" : ""}`;
      bar.style.left = `${(100 * (s.start_ns - start)) / total}%`;
      bar.style.width = `${(100 * (s.end_ns - s.start_ns)) / total}%`;
      track.append(bar);
      const duration = document.createElement("span");
      duration.className = "duration";
      duration.textContent = `${((s.end_ns - s.start_ns) / 1e6).toFixed(1)} ms`;
      row.append(label, track, duration);
      return row;
    }),
  );
  const services = [...new Set(spans.map((s) => s.service))].join(", ");
  $("#trace-status").textContent = `trace ${trace.trace_id}: ${spans.length} spans (${services}), ${(total / 1e6).toFixed(1)} ms`;
}

async function showTrace(event) {
  event.preventDefault();
  const runId = $("#run-id").value.trim();
  $("#trace-status").textContent = "looking it up …";
  $("#waterfall").replaceChildren();
  try {
    drawWaterfall(await getJson(`/v1/ops/runs/${encodeURIComponent(runId)}/trace`));
  } catch (error) {
    $("#trace-status").textContent = error.message;
  }
}

function start() {
  clearInterval(timer);
  refresh();
  timer = setInterval(refresh, POLL_MS);
}

$("#signin-form").addEventListener("submit", (event) => {
  event.preventDefault();
  token = $("#token-input").value.trim();
  keepToken(TOKEN_KEY, token);
  start();
});
$("#trace-form").addEventListener("submit", showTrace);
token = takeTokenFromUrl(TOKEN_KEY);
// Without a token the page may be signed in through the identity provider (Envoy's session): the first
// poll says, showing the sign-in box on a 401.
start();
