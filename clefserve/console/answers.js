// Answers as horizontal probability bars (highest first, the decision highlighted), usage, latency and the
// request id; errors with their status, code and message. All values are written as text.

import { clear, el, formatCount, formatMs } from "./dom.js";

function format(p) {
  return typeof p === "number" ? String(p) : "–";
}

function bars(rows, decided) {
  // rows: [{option, label, probability}] in request order; shown by probability, ties in request order
  const ordered = rows.map((row, i) => ({ ...row, i }))
    .sort((a, b) => (b.probability - a.probability) || (a.i - b.i));
  return el("ol", { class: "bars" }, ordered.map((row) => {
    const fill = el("span", { class: "bar-fill" });
    fill.style.width = `${Math.max(0, Math.min(1, Number(row.probability) || 0)) * 100}%`;
    const chosen = decided(row.option);
    return el("li", {
      class: `bar${chosen ? " decided" : ""}`,
      dataset: { option: row.option, probability: String(row.probability) },
    },
    el("span", { class: "bar-label", title: row.label, text: row.label }),
    el("span", { class: "bar-track", "aria-hidden": "true" }, fill),
    el("span", { class: "bar-value", text: format(row.probability) }),
    chosen ? el("span", { class: "visually-hidden", text: " (decision)" }) : null);
  }));
}

function choiceCard(answer) {
  const rows = Object.entries(answer.probabilities || {}).map(([option, probability]) => ({ option, label: option, probability }));
  return [
    el("p", { class: "summary" }, "choice ", el("strong", { class: "decision", text: answer.choice }),
      el("span", { class: "muted", text: ` · confidence ${format(answer.confidence)}` })),
    bars(rows, (option) => option === answer.choice),
  ];
}

function scoreCard(answer) {
  const legend = answer.legend || {};
  const probabilities = answer.probabilities || {};
  const rows = Object.entries(probabilities).map(([level, probability]) => ({
    option: level, label: legend[level] === null || legend[level] === undefined ? level : `${level} · ${legend[level]}`, probability,
  }));
  const top = rows.reduce((best, row) => (best === null || row.probability > best.probability ? row : best), null);
  return [
    el("p", { class: "summary" }, "score ", el("strong", { class: "decision", text: format(answer.score) }),
      el("span", { class: "muted", text: ` · confidence ${format(answer.confidence)}` })),
    bars(rows, (option) => top !== null && option === top.option),
  ];
}

function noulCard(answer) {
  const p = answer.noul;
  return [
    el("p", { class: "summary" }, "noul ", el("strong", { class: "decision", text: format(p) }),
      el("span", { class: "muted", text: typeof p === "number" ? ` · ${p >= 0.5 ? "true" : "false"}` : "" })),
    bars([{ option: "true", label: "true", probability: p }], () => typeof p === "number" && p >= 0.5),
  ];
}

export function renderAnswers(container, response, meta) {
  const answers = response.answers || {};
  const cards = Object.entries(answers).map(([id, answer]) => {
    const body = answer?.type === "choice" ? choiceCard(answer)
      : answer?.type === "score" ? scoreCard(answer)
        : answer?.type === "noul" ? noulCard(answer)
          : [el("pre", { text: JSON.stringify(answer, null, 2) })];
    return el("article", { class: "answer", dataset: { question: id, type: answer?.type ?? "" } },
      el("h3", {}, el("span", { class: "answer-id", text: id }), el("span", { class: "badge", text: answer?.type ?? "?" })),
      body);
  });
  const usage = response.usage || {};
  clear(container,
    el("dl", { class: "usage" },
      el("div", {}, el("dt", { text: "model" }), el("dd", { text: response.model ?? "–" })),
      el("div", {}, el("dt", { text: "input tokens" }), el("dd", { text: formatCount(usage.input_tokens) })),
      el("div", {}, el("dt", { text: "cached tokens" }), el("dd", { text: formatCount(usage.x_cached_tokens ?? 0) })),
      el("div", {}, el("dt", { text: "latency" }), el("dd", { id: "answer-latency", text: formatMs(meta.ms) })),
      el("div", {}, el("dt", { text: "request id" }), el("dd", { class: "mono", id: "answer-request-id", text: meta.requestId ?? "–" }))),
    cards);
}

export function renderError(container, error, meta) {
  const title = error.status === 401 ? "The server refused the API key"
    : error.status === 0 ? "No answer from the server" : "The server refused the request";
  const hint = error.status === 401 ? "Enter the server's API key in the key field above and submit again." : null;
  clear(container, el("div", { class: "error", role: "alert", dataset: { status: String(error.status) } },
    el("p", { class: "error-title" }, el("strong", { text: title }),
      el("span", { class: "badge", text: error.status ? `HTTP ${error.status}` : "network" }),
      el("span", { class: "badge mono error-code", text: error.code })),
    el("p", { class: "error-message", text: error.message }),
    hint ? el("p", { class: "hint", text: hint }) : null,
    error.retryAfter ? el("p", { class: "hint", text: `Retry after ${error.retryAfter} s.` }) : null,
    meta.requestId ? el("p", { class: "hint" }, "request id ", el("span", { class: "mono", text: meta.requestId })) : null));
}

export function renderLocalProblems(container, problems) {
  clear(container, el("div", { class: "error", role: "alert", dataset: { status: "local" } },
    el("p", { class: "error-title" }, el("strong", { text: "Fix the request first" })),
    problems.map((message) => el("p", { class: "error-message", text: message }))));
}
