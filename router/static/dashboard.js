// The live cluster page's code (router/http/dashboard.py serves it as /dashboard/app.js, under
// a Content-Security-Policy without inline script). Invariant: data from /dashboard/data is
// only ever written as text (`textContent`, attribute values through `setAttribute`, numbers
// through `num`), never parsed as HTML: a registration field holding markup shows as that
// text and runs nothing.
"use strict";
let prev = null;
let lastTime = 0;
const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
// A number to show: finite numbers as they are (fixed digits when asked), anything else "-".
const num = (v, digits) => (typeof v === "number" && isFinite(v) ? (digits == null ? String(v) : v.toFixed(digits)) : "-");
const text = (v) => (v == null ? "-" : String(v));
const ms = (s) => num(s * 1000, 1) + " ms";

// An element with attributes (set as values, never parsed) and children (nodes or text).
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, text(v));
  for (const c of children) e.append(c instanceof Node ? c : text(c));
  return e;
}

// The key for /dashboard/data: from the URL fragment (`/dashboard#key=...`: never sent to the
// server; removed from the address bar at once) or typed in, kept for this tab only.
const KEY_ITEM = "pdserve-dashboard-key";
const fragmentKey = /(?:^#|&)key=([^&]*)/.exec(location.hash);
if (fragmentKey) {
  sessionStorage.setItem(KEY_ITEM, decodeURIComponent(fragmentKey[1]));
  history.replaceState(null, "", location.pathname + location.search);
}

function spark(svg, values) {
  const w = +svg.getAttribute("width"), h = +svg.getAttribute("height");
  values = (Array.isArray(values) ? values : []).filter((v) => typeof v === "number" && isFinite(v));
  if (!values.length) { svg.replaceChildren(); return; }
  if (values.length === 1) values = [values[0], values[0]];
  const max = Math.max(...values) || 1, step = w / (values.length - 1);
  const pts = values.map((v, i) => (i * step).toFixed(1) + "," + (h - 2 - (v / max) * (h - 4)).toFixed(1));
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "#3b7ddd");
  line.setAttribute("stroke-width", "1.5");
  line.setAttribute("points", pts.join(" "));
  svg.replaceChildren(line);
}

function kvRate(w) {  // bytes moved since the previous poll, per second
  const before = prev && prev.workers.find((p) => p.worker_id === w.worker_id);
  if (typeof w.kv_bytes !== "number" || !before || typeof before.kv_bytes !== "number" || !(prev.time < lastTime)) return "-";
  return num((w.kv_bytes - before.kv_bytes) / (lastTime - prev.time) / 1e6, 2);
}

function workerRow(w) {
  const usage = typeof w.kv_usage === "number" && isFinite(w.kv_usage) ? Math.min(Math.max(w.kv_usage, 0), 1) : 0;
  const pct = (usage * 100).toFixed(1);
  const fill = el("i");
  fill.style.width = pct + "%";  // CSSOM, not a style attribute: allowed by the CSP
  const used = typeof w.total_blocks === "number" && typeof w.free_blocks === "number" ? w.total_blocks - w.free_blocks : NaN;
  return el("tr", {class: "worker", "data-worker-id": w.worker_id, "data-role": w.role},
    el("td", {}, text(w.worker_id)),
    el("td", {}, text(w.role)),
    el("td", {class: text(w.state)}, text(w.state)),
    el("td", {}, text(w.address)),
    el("td", {}, el("span", {class: "bar"}, fill), " " + pct + "% (" + num(used) + "/" + num(w.total_blocks) + ")"),
    el("td", {}, num(w.running) + " / " + num(w.waiting)),
    el("td", {}, num(w.queued_prefill_tokens)),
    el("td", {}, num(w.prefill_tokens_per_s, 0)),
    el("td", {}, kvRate(w)),
    el("td", {}, num(w.inflight)));
}

function pool(role, workers) {
  const head = el("tr", {}, ...["worker", "role", "state", "address", "KV usage", "running / waiting",
    "queued prefill tokens", "prefill tok/s", "KV transfer MB/s", "router in-flight"].map((h) => el("th", {}, h)));
  const rows = workers.length ? workers.map(workerRow) : [el("tr", {}, el("td", {colspan: "10", class: "muted"}, "none"))];
  return [el("h3", {}, role + " pool (" + workers.length + ")"), el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows))];
}

const clock = (t) => (typeof t === "number" ? new Date(t * 1000).toLocaleTimeString() : "-");

function render(d) {
  lastTime = d.time;
  $("model").textContent = text(d.model);
  $("updated").textContent = clock(d.time);
  $("requests-total").textContent = num(d.requests_total);
  $("router-load").textContent = num(d.running) + " / " + num(d.waiting);
  $("tools").textContent = num(d.tool_requests) + " / " + num(d.tool_calls);
  $("reasoning").textContent = num(d.reasoning_requests);
  $("hit-rate").textContent = d.prompt_tokens ? num(100 * d.prefix_hit_tokens / d.prompt_tokens, 1) + "%" : "-";
  if (prev && d.time > prev.time) {
    const dt = d.time - prev.time;
    $("prompt-rate").textContent = num((d.prompt_tokens - prev.prompt_tokens) / dt, 0);
    $("gen-rate").textContent = num((d.generation_tokens - prev.generation_tokens) / dt, 0);
  }
  const workers = Array.isArray(d.workers) ? d.workers : [];
  $("pools").replaceChildren(...["prefill", "decode"].flatMap((r) => pool(r, workers.filter((w) => w.role === r))));
  spark($("ttft"), d.ttft_s); spark($("itl"), d.itl_s);
  const last = (xs) => (Array.isArray(xs) && xs.length ? "last " + ms(xs[xs.length - 1]) : "");
  $("ttft-last").textContent = last(d.ttft_s);
  $("itl-last").textContent = last(d.itl_s);
  const decisions = d.decisions && typeof d.decisions === "object" ? d.decisions : {};
  const reasons = Object.keys(decisions).sort();
  $("decision-counts").replaceChildren(...(reasons.length
    ? reasons.map((r) => el("div", {class: "tile", "data-reason": r}, r + " ", el("b", {}, num(decisions[r]))))
    : [el("span", {class: "muted"}, "no decisions yet")]));
  const recent = Array.isArray(d.recent_decisions) ? d.recent_decisions : [];
  $("decisions").replaceChildren(...recent.map((x) => el("tr", {},
    el("td", {}, clock(x.time)), el("td", {}, text(x.policy)), el("td", {}, text(x.reason)),
    el("td", {}, text(x.prefill)), el("td", {}, text(x.decode)), el("td", {}, num(x.predicted_cached_tokens)))));
  prev = d;
}

async function poll() {
  try {
    const key = sessionStorage.getItem(KEY_ITEM);
    const r = await fetch(location.pathname.replace(/\/?$/, "/data"),
                          {cache: "no-store", headers: key ? {"Authorization": "Bearer " + key} : {}});
    $("key-form").hidden = r.status !== 401 && r.status !== 403;
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    $("error").textContent = "";
  } catch (e) {
    $("error").textContent = "(" + text(e.message) + ")";
  }
  setTimeout(poll, 1000);
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY_ITEM, $("key-input").value);
    $("key-input").value = "";
    $("key-form").hidden = true;
  });
  poll();
});
