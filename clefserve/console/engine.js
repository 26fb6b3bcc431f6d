// The engine panel: what GET /v1/status says, redrawn on every refresh. The audit block appears only when
// the status carries an "audit" object.

import { latencyChart, requestChart } from "./charts.js";
import { clear, el, formatBytes, formatCount, formatMs } from "./dom.js";

const PHASES = {
  ready: ["ready", "ok"],
  loading: ["loading", "wait"],
  self_check_running: ["self-check running", "wait"],
  self_check_failed: ["self-check failed", "bad"],
  load_failed: ["load failed", "bad"],
  stopping: ["stopping", "wait"],
  stopped: ["stopped", "bad"],
};

export function phaseBadge(model) {
  const [text, tone] = PHASES[model.phase] || [model.phase || "unknown", "wait"];
  return el("span", { class: `badge tone-${tone}`, id: "phase", text });
}

function row(label, value, id) {
  return el("div", { class: "stat" }, el("dt", { text: label }), el("dd", { id, text: value }));
}

function meter(label, parts, total) {
  // parts: [{value, cls, name}]; a stacked bar of the pool
  const track = el("span", { class: "meter", "aria-hidden": "true" });
  for (const part of parts) {
    const fill = el("span", { class: `meter-fill ${part.cls}` });
    fill.style.width = `${total ? Math.min(100, (100 * part.value) / total) : 0}%`;
    track.append(fill);
  }
  return el("div", { class: "pool" }, el("div", { class: "pool-head" }, el("span", { text: label }),
    el("span", { class: "muted", text: parts.map((p) => `${formatCount(p.value)} ${p.name}`).concat(`${formatCount(total)} total`).join(" · ") })),
  track);
}

function section(title, ...children) {
  return el("section", { class: "panel-section" }, el("h3", { text: title }), children);
}

function time(iso) {
  if (!iso) return "";
  const date = new Date(iso);
  return Number.isNaN(date.getTime()) ? iso : date.toLocaleTimeString();
}

function selfCheck(check) {
  if (!check) return "–";
  if (check.result === "passed") return `passed ${time(check.finished_at)}`;
  if (check.result === "failed") return `FAILED ${time(check.finished_at)}: ${check.problem ?? ""}`;
  return check.result;
}

function percent(rate) {
  return rate === null || rate === undefined ? "–" : `${(rate * 100).toFixed(1)}%`;
}

export function renderEngine(container, status) {
  const { model, engine, requests } = status;
  const minute = requests.last_minute;
  const device = model.device_name ? `${model.device} (${model.device_name})` : model.device;
  const parts = [
    section("Model",
      el("dl", { class: "stats" },
        row("name", model.name ?? "–", "engine-model"),
        row("state", PHASES[model.phase]?.[0] ?? model.phase),
        row("dtype · device", `${model.dtype} · ${device}`),
        row("ops", model.ops ?? "–"),
        row("self-check", selfCheck(model.self_check), "engine-self-check"))),
    section("Requests",
      el("dl", { class: "stats" },
        row("total", formatCount(requests.total), "stat-requests"),
        row("per second (1 min)", minute.per_second.toFixed(2), "stat-rps"),
        row("p50 · p95 (1 min)", `${formatMs(minute.p50_ms)} · ${formatMs(minute.p95_ms)}`, "stat-latency"),
        row("errors (1 min)", formatCount(minute.errors))),
      el("figure", { class: "chart-box" }, requestChart(minute.series),
        el("figcaption", { text: "requests per second, last minute" })),
      el("figure", { class: "chart-box" }, latencyChart(minute.series),
        el("figcaption", {}, el("span", { class: "key key-p50", text: "p50" }), " ", el("span", { class: "key key-p95", text: "p95" }), " latency, last minute"))),
  ];
  if (engine) {
    const prefix = engine.prefix_cache;
    parts.push(section("Engine",
      el("dl", { class: "stats" },
        row("running", `${engine.running} / ${engine.max_num_seqs}`, "stat-running"),
        row("waiting", `${engine.waiting} / ${engine.max_queue}`, "stat-waiting"),
        row("prefill tokens/s", formatCount(Math.round(engine.tokens_per_second))),
        row("sequences answered", formatCount(engine.sequences.finished))),
      meter(`KV pool · ${formatBytes(engine.kv_pool_bytes)}`, [
        { value: engine.kv_blocks.used, cls: "used", name: "in use" },
        { value: engine.kv_blocks.cached, cls: "cached", name: "cached" },
      ], engine.kv_blocks.total),
      meter(`GDN state slots · ${formatBytes(engine.gdn_pool_bytes)}`, [
        { value: engine.gdn_slots.used, cls: "used", name: "in use" },
      ], engine.gdn_slots.total)));
    parts.push(section("Prefix cache", prefix
      ? el("dl", { class: "stats" },
        row("token hit rate", percent(prefix.token_hit_rate), "stat-hit-rate"),
        row("hits", formatCount(prefix.hits)),
        row("size", `${formatBytes(prefix.bytes)} of ${formatBytes(prefix.budget_bytes)}`),
        row("evictions", formatCount(prefix.evictions)))
      : el("p", { class: "muted", text: "off (--no-prefix-cache)" })));
    const vision = engine.vision;
    if (vision) {
      const cache = vision.encoder_cache;
      parts.push(el("section", { class: "panel-section", id: "vision-panel" }, el("h3", { text: "Vision tower" }),
        el("dl", { class: "stats" },
          row("pictures encoded", formatCount(vision.images_encoded), "stat-images-encoded"),
          row("patches", formatCount(vision.patches_encoded)),
          row("time in the tower", `${vision.encode_seconds.toFixed(1)} s`),
          cache
            ? [row("encoder cache hit rate", percent(cache.hit_rate), "stat-encoder-hit-rate"),
              row("encoder cache hits · misses", `${formatCount(cache.hits)} · ${formatCount(cache.misses)}`),
              row("encoder cache size", `${formatBytes(cache.bytes)} of ${formatBytes(cache.budget_bytes)}`)]
            : row("encoder cache", "off (--image-cache-mb 0)"))));
    }
  } else {
    parts.push(section("Engine", el("p", { class: "muted", text: "the model is not loaded yet" })));
  }
  const errorTypes = Object.entries(requests.errors || {}).filter(([, n]) => n > 0);
  if (errorTypes.length) {
    parts.push(section("Refused or cut short", el("dl", { class: "stats" }, errorTypes.map(([type, n]) => row(type, formatCount(n))))));
  }
  if (status.audit && typeof status.audit === "object") {
    parts.push(el("section", { class: "panel-section", id: "audit-panel" }, el("h3", { text: "Audit" }),
      el("dl", { class: "stats" }, auditRows(status.audit))));
  }
  parts.push(el("p", { class: "muted small", id: "engine-updated", text: `clef-serve ${status.server.version} · up ${Math.round(status.server.uptime_s)} s · updated ${new Date().toLocaleTimeString()}` }));
  clear(container, parts);
}

export function renderEngineProblem(container, message) {
  clear(container, el("p", { class: "engine-problem", role: "status", text: message }));
}

// The status flattens the audit's counters to "a.b" keys; unset ones (null) and the histogram's buckets are
// left out, a fraction is a percentage, a byte count a size, seconds a duration; the histogram's sum and
// count become the mean of the per-request largest differences, and a fail-ready threshold of 0 is "never".
function auditRows(audit) {
  const rows = [];
  for (const [key, value] of Object.entries(audit)) {
    if (value === null || key.startsWith("max_difference.")) continue;
    const label = key.startsWith("skipped_because.")
      ? `skipped: ${key.slice("skipped_because.".length).replaceAll("_", " ")}`
      : key.replaceAll("_", " ").replaceAll(".", " ");
    if (key === "fraction") rows.push(row(label, percent(value)));
    else if (key === "fail_ready_after") rows.push(row(label, value ? formatCount(value) : "never"));
    else if (key.endsWith("seconds") && typeof value === "number") rows.push(row(label, `${value.toFixed(1)} s`));
    else if (key.endsWith("bytes") && typeof value === "number") rows.push(row(label, formatBytes(value)));
    else rows.push(row(label, auditValue(value)));
  }
  const count = audit["max_difference.count"];
  if (typeof count === "number" && count > 0) {
    rows.push(row("mean largest difference", (audit["max_difference.sum"] / count).toPrecision(3)));
  }
  return rows;
}

function auditValue(value) {
  if (typeof value !== "number") return String(value);
  return Number.isInteger(value) ? formatCount(value) : value.toPrecision(3);
}
