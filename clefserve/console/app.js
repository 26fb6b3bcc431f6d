// The console: wires the request form, the answers and the engine panel to the server's public API.

import { renderAnswers, renderError, renderLocalProblems } from "./answers.js";
import { apiKey, call, setApiKey } from "./api.js";
import { clear, el } from "./dom.js";
import { phaseBadge, renderEngine, renderEngineProblem } from "./engine.js";
import { QuestionForm } from "./form.js";
import { ImagePicker } from "./images.js";
import { curlSnippet, pythonSnippet } from "./snippets.js";

const REFRESH_MS = 2000;
const QUESTION_TYPES = new Set(["choice", "score", "noul"]);
const DEMO_MODEL = "clef-demo";
const GENERIC_EXAMPLE = {
  model: "",
  state: { message: "The package arrived two weeks late and the box was crushed, but support refunded the shipping fee." },
  questions: {
    sentiment: { type: "choice", instructions: "What is the overall tone of the message?", criteria: { positive: null, neutral: null, negative: null } },
    severity: { type: "score", instructions: "How serious is the problem described?", criteria: ["None", "Minor", "Major", "Critical"] },
    resolved: { type: "noul", instructions: "Has the problem been resolved?" },
  },
};

const $ = (id) => document.getElementById(id);
const ui = {
  form: $("request-form"), model: $("model"), state: $("state"), stateKind: $("state-kind"),
  stateStatus: $("state-status"), answers: $("answers"), engine: $("engine"), served: $("served"),
  key: $("api-key"), submit: $("submit"), snippet: $("snippet"), snippetBox: $("snippet-box"),
  copyStatus: $("copy-status"),
};

let touched = false; // the user changed the request: never replace it with an example
let exampleModel = null; // which example is loaded
let lastStatus = null;
let inFlight = false;

const questions = new QuestionForm($("questions"), { onChange: () => { touched = true; } });
const images = new ImagePicker({
  input: $("image-input"), zone: $("image-zone"), list: $("image-list"), note: $("image-note"),
  onChange: () => { touched = true; },
});

// ---- the state editor ----

function stateText() {
  return ui.stateKind.value === "text" ? JSON.stringify(ui.state.value) : ui.state.value.trim();
}

function checkState() {
  if (ui.stateKind.value === "text") {
    setStateNote(`plain text, ${ui.state.value.length} characters`, false);
    return true;
  }
  try {
    const value = JSON.parse(ui.state.value);
    const kind = Array.isArray(value) ? "array" : value === null ? "null" : typeof value;
    const ok = kind === "object" || kind === "array" || kind === "string";
    setStateNote(ok ? `valid JSON ${kind}` : `valid JSON, but a state is an object, an array or a string (this is ${kind})`, !ok);
    return ok;
  } catch (err) {
    setStateNote(`not valid JSON: ${err.message}`, true);
    return false;
  }
}

function setStateNote(text, bad) {
  ui.stateStatus.textContent = text;
  ui.stateStatus.classList.toggle("bad", bad);
  ui.state.setAttribute("aria-invalid", String(bad));
}

// ---- the request ----

function loadExample(request) {
  ui.model.value = request.model || lastStatus?.model?.name || "";
  ui.stateKind.value = typeof request.state === "string" ? "text" : "json";
  ui.state.value = typeof request.state === "string" ? request.state : JSON.stringify(request.state, null, 2);
  questions.load(request.questions);
  checkState();
  touched = false;
}

async function loadDemoExample() {
  const result = await call("GET", "/console/demo-request.json");
  if (result.ok && !touched) {
    loadExample(result.json);
    exampleModel = DEMO_MODEL;
  }
}

function currentRequest() {
  const { questions: built, problems } = questions.toRequest();
  const stateTextValue = stateText();
  const questionsText = JSON.stringify(built, null, 2);
  const urls = images.dataUrls();
  const imagesText = urls.length ? JSON.stringify(urls) : null;
  // The state goes out as written (key order and number spellings reach the model), the rest as built.
  const parts = [`  "model": ${JSON.stringify(ui.model.value)}`, `  "state": ${indentLines(stateTextValue, 2)}`,
    `  "questions": ${indentLines(questionsText, 2)}`];
  if (imagesText) parts.push(`  "images": ${imagesText}`);
  return {
    origin: window.location.origin, model: ui.model.value, stateText: stateTextValue, questionsText, imagesText,
    auth: Boolean(apiKey()) || Boolean(lastStatus?.server?.auth_required), problems,
    bodyText: `{\n${parts.join(",\n")}\n}`,
  };
}

function indentLines(text, spaces) {
  return text.split("\n").map((line, i) => (i === 0 ? line : " ".repeat(spaces) + line)).join("\n");
}

function showServerError(error, meta) {
  renderError(ui.answers, error, meta);
  for (const field of error.fields || []) {
    const [, where, id] = field.loc;
    // ["body", "questions", id, <the question's type, from the tagged union>, field...]
    const path = field.loc.slice(where === "questions" ? 3 : 2).filter((part, i) => i > 0 || !QUESTION_TYPES.has(part));
    const text = `${path.join(".") || where || "body"}: ${field.msg}`;
    if (where === "questions" && id !== undefined) questions.showError({ id, message: text });
    else if (where === "state") setStateNote(`server: ${field.msg}`, true);
    else if (where === "model") ui.model.setAttribute("aria-invalid", "true");
  }
}

async function submit() {
  if (inFlight) return;
  questions.clearErrors();
  ui.model.removeAttribute("aria-invalid");
  if (!checkState()) {
    renderLocalProblems(ui.answers, [`State: ${ui.stateStatus.textContent}`]);
    ui.state.focus();
    return;
  }
  const request = currentRequest();
  if (request.problems.length) {
    for (const problem of request.problems) questions.showError(problem);
    renderLocalProblems(ui.answers, request.problems.map((p) => p.message));
    return;
  }
  inFlight = true;
  ui.submit.disabled = true;
  ui.answers.setAttribute("aria-busy", "true");
  clear(ui.answers, el("p", { class: "muted", text: "Asking…" }));
  try {
    const result = await call("POST", "/v1/systemone", request.bodyText);
    if (result.ok) renderAnswers(ui.answers, result.json, result);
    else showServerError(result.error, result);
    if (window.matchMedia("(max-width: 720px)").matches) $("answers-card").scrollIntoView({ block: "start" });
  } finally {
    inFlight = false;
    ui.submit.disabled = false;
    ui.answers.removeAttribute("aria-busy");
    refreshStatus();
  }
}

// ---- snippets ----

async function copy(kind) {
  const request = currentRequest();
  const text = kind === "curl" ? curlSnippet(request) : pythonSnippet(request);
  ui.snippet.textContent = text;
  ui.snippet.dataset.kind = kind;
  ui.snippetBox.open = true;
  let copied = false;
  try {
    await navigator.clipboard.writeText(text);
    copied = true;
  } catch {
    copied = false;
  }
  const key = request.auth ? " It reads the key from $CLEF_API_KEY." : "";
  ui.copyStatus.textContent = copied ? `Copied the request as ${kind === "curl" ? "curl" : "Python"}.${key}`
    : `The clipboard is not available here: select the code below.${key}`;
}

// ---- the engine panel ----

let timer = null;
let refreshes = 0;

async function refreshStatus() {
  clearTimeout(timer);
  refreshes += 1;
  const mine = refreshes;
  const result = await call("GET", "/v1/status");
  if (mine !== refreshes) return; // a newer refresh started meanwhile: it draws and schedules the next one
  if (result.ok) {
    lastStatus = result.json;
    showServed(result.json);
    renderEngine(ui.engine, result.json);
    // with images a body may pass --max-body-bytes by their allowance (images.max_body_bytes)
    images.configure(result.json.images, result.json.images?.max_body_bytes ?? result.json.limits?.max_body_bytes);
    if (!ui.model.value) ui.model.value = result.json.model.name || "";
    if (!touched && result.json.model.name === DEMO_MODEL && exampleModel !== DEMO_MODEL) await loadDemoExample();
  } else if (result.status === 401) {
    clear(ui.served, el("span", { class: "badge tone-bad", text: "API key needed" }));
    renderEngineProblem(ui.engine, `The server needs an API key (401: ${result.error.message}). Enter it above to see the engine.`);
  } else {
    renderEngineProblem(ui.engine, `GET /v1/status failed: ${result.error.status || "no answer"} ${result.error.message}`);
  }
  if (!document.hidden) timer = setTimeout(refreshStatus, REFRESH_MS);
}

function showServed(status) {
  clear(ui.served, el("span", { class: "model-name", text: status.model.name ?? "no model" }), " ", phaseBadge(status.model));
}

// ---- wiring ----

function init() {
  ui.key.value = apiKey();
  ui.key.addEventListener("input", () => setApiKey(ui.key.value.trim()));
  ui.key.addEventListener("change", () => refreshStatus());
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    refreshStatus();
  });
  ui.state.addEventListener("input", () => {
    touched = true;
    checkState();
  });
  ui.stateKind.addEventListener("change", () => {
    touched = true;
    checkState();
  });
  ui.model.addEventListener("input", () => { touched = true; });
  ui.form.addEventListener("submit", (event) => {
    event.preventDefault();
    submit();
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      submit();
    }
  });
  for (const type of ["choice", "score", "noul"]) $(`add-${type}`).addEventListener("click", () => questions.add(type));
  $("copy-curl").addEventListener("click", () => copy("curl"));
  $("copy-python").addEventListener("click", () => copy("python"));
  $("reset-example").addEventListener("click", () => {
    touched = false;
    if (lastStatus?.model?.name === DEMO_MODEL) loadDemoExample();
    else {
      loadExample(GENERIC_EXAMPLE);
      exampleModel = null;
    }
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refreshStatus();
  });
  if (/Mac|iPhone|iPad/.test(navigator.platform)) {
    for (const kbd of document.querySelectorAll("kbd")) if (kbd.textContent === "Ctrl") kbd.textContent = "⌘";
  }
  loadExample(GENERIC_EXAMPLE);
  refreshStatus();
}

init();
