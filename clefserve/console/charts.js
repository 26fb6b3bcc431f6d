// Two small SVG charts for the last minute: requests per second (bars) and latency (p50/p95 lines).
// Plain SVG nodes, no library; the y-axis top is written in the corner.

import { formatMs, svg } from "./dom.js";

const W = 300;
const H = 64;
const PAD_TOP = 12;

function frame(label, top) {
  return svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": label },
    svg("title", {}, label),
    svg("line", { x1: 0, y1: H - 0.5, x2: W, y2: H - 0.5, class: "axis" }),
    svg("text", { x: 2, y: 9, class: "chart-label" }, top));
}

function niceMax(value) {
  if (value <= 0) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * power) return step * power;
  return 10 * power;
}

// points: [{count}] oldest first, one per second
export function requestChart(points) {
  const counts = points.map((p) => p.count);
  const errors = points.map((p) => p.errors || 0);
  const peak = Math.max(0, ...counts);
  const top = niceMax(peak);
  const chart = frame(`Requests per second over the last minute; peak ${peak}`, `${top}/s`);
  const step = W / Math.max(1, points.length);
  counts.forEach((count, i) => {
    if (!count) return;
    const h = (count / top) * (H - PAD_TOP);
    chart.append(svg("rect", { x: i * step + 0.5, y: H - h, width: Math.max(1, step - 1), height: h, class: "bar-ok" }));
    if (errors[i]) {
      const e = (errors[i] / top) * (H - PAD_TOP);
      chart.append(svg("rect", { x: i * step + 0.5, y: H - e, width: Math.max(1, step - 1), height: e, class: "bar-error" }));
    }
  });
  return chart;
}

function path(values, top, step) {
  // a line through the seconds that had requests; gaps where none did
  let d = "";
  let drawing = false;
  values.forEach((value, i) => {
    if (value === null || value === undefined) {
      drawing = false;
      return;
    }
    const x = (i + 0.5) * step;
    const y = H - (value / top) * (H - PAD_TOP);
    d += `${drawing ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`;
    drawing = true;
  });
  return d;
}

export function latencyChart(points) {
  const p50 = points.map((p) => p.p50_ms);
  const p95 = points.map((p) => p.p95_ms);
  const known = p95.filter((v) => v !== null && v !== undefined);
  const top = niceMax(Math.max(0, ...known));
  const chart = frame(`Latency over the last minute, p50 and p95; highest p95 ${formatMs(known.length ? Math.max(...known) : null)}`,
    formatMs(known.length ? top : null));
  const step = W / Math.max(1, points.length);
  for (const [values, cls] of [[p95, "line-p95"], [p50, "line-p50"]]) {
    const d = path(values, top, step);
    if (d) chart.append(svg("path", { d, class: cls }));
    values.forEach((value, i) => {
      if (value === null || value === undefined) return;
      const lonely = (i === 0 || values[i - 1] == null) && (i === values.length - 1 || values[i + 1] == null);
      if (lonely) {
        chart.append(svg("circle", { cx: (i + 0.5) * step, cy: H - (value / top) * (H - PAD_TOP), r: 1.8, class: cls }));
      }
    });
  }
  return chart;
}
