// The question builder: choice (labels with descriptions), score (levels, lowest first) and noul questions,
// added, removed, renamed and retyped. It keeps a plain model of the questions and turns it into the
// request's "questions" object in the order shown.

import { clear, el, uid } from "./dom.js";

const TYPES = ["choice", "score", "noul"];

function describe(value) {
  // criteria descriptions may be any JSON; the form edits them as text
  if (value === null || value === undefined) return "";
  return typeof value === "string" ? value : JSON.stringify(value);
}

function instructionsText(value) {
  return describe(value);
}

function blank(type, id) {
  const question = { key: uid("q"), id, type, instructions: "", options: [], levels: [], yes: "", no: "" };
  if (type === "choice") question.options = [{ key: uid("o"), label: "", description: "" }, { key: uid("o"), label: "", description: "" }];
  if (type === "score") question.levels = [{ key: uid("l"), text: "" }, { key: uid("l"), text: "" }];
  return question;
}

export class QuestionForm {
  constructor(container, { onChange }) {
    this.container = container;
    this.onChange = onChange;
    this.questions = [];
    this.errors = new Map(); // question key -> messages
  }

  load(questions) {
    this.questions = Object.entries(questions || {}).map(([id, q]) => {
      const type = TYPES.includes(q?.type) ? q.type : "choice";
      const question = blank(type, id);
      question.instructions = instructionsText(q?.instructions);
      if (type === "choice") {
        question.options = Object.entries(q.criteria || {}).map(([label, description]) => ({
          key: uid("o"), label, description: describe(description),
        }));
      } else if (type === "score") {
        question.levels = (Array.isArray(q.criteria) ? q.criteria : []).map((text) => ({ key: uid("l"), text: describe(text) }));
      } else if (q?.criteria && typeof q.criteria === "object") {
        question.yes = describe(q.criteria.true);
        question.no = describe(q.criteria.false);
      }
      return question;
    });
    this.errors.clear();
    this.render();
  }

  add(type) {
    const taken = new Set(this.questions.map((q) => q.id));
    let n = this.questions.length + 1;
    while (taken.has(`question_${n}`)) n += 1;
    const question = blank(type, `question_${n}`);
    this.questions.push(question);
    this.render();
    this.focus(question.key, "[name=question-id]");
    this.onChange();
  }

  // {questions: {...}, problems: [...]}: problems are what JSON cannot express (duplicate ids or labels);
  // everything else is left to the server, whose message the page shows.
  toRequest() {
    const questions = {};
    const problems = [];
    for (const q of this.questions) {
      if (Object.prototype.hasOwnProperty.call(questions, q.id)) {
        problems.push({ key: q.key, message: `duplicate question id "${q.id}"` });
        continue;
      }
      const body = { type: q.type };
      if (q.instructions.trim() !== "") body.instructions = q.instructions;
      if (q.type === "choice") {
        const criteria = {};
        for (const option of q.options) {
          if (Object.prototype.hasOwnProperty.call(criteria, option.label)) {
            problems.push({ key: q.key, message: `duplicate option label "${option.label}"` });
          }
          criteria[option.label] = option.description.trim() === "" ? null : option.description;
        }
        body.criteria = criteria;
      } else if (q.type === "score") {
        body.criteria = q.levels.map((level) => level.text);
      } else if (q.yes.trim() !== "" || q.no.trim() !== "") {
        body.criteria = { true: q.yes.trim() === "" ? null : q.yes, false: q.no.trim() === "" ? null : q.no };
      }
      questions[q.id] = body;
    }
    return { questions, problems };
  }

  clearErrors() {
    this.errors.clear();
    for (const node of this.container.querySelectorAll(".field-error")) {
      node.hidden = true;
      node.textContent = "";
    }
    for (const node of this.container.querySelectorAll(".question.invalid")) node.classList.remove("invalid");
  }

  // Attach a message to the question with this id (or this key); false when there is no such question.
  showError({ id, key, message }) {
    const question = this.questions.find((q) => (key !== undefined ? q.key === key : q.id === id));
    if (!question) return false;
    const messages = this.errors.get(question.key) || [];
    messages.push(message);
    this.errors.set(question.key, messages);
    const card = this.container.querySelector(`[data-key="${question.key}"]`);
    if (card) {
      card.classList.add("invalid");
      const node = card.querySelector(".field-error");
      node.textContent = messages.join("\n");
      node.hidden = false;
    }
    return true;
  }

  focus(key, selector) {
    const node = this.container.querySelector(`[data-key="${key}"] ${selector}`);
    if (node) node.focus();
  }

  render() {
    clear(this.container, this.questions.map((q, index) => this.card(q, index)));
    if (this.questions.length === 0) {
      this.container.append(el("p", { class: "hint", text: "No questions yet: add one below." }));
    }
  }

  changed() {
    this.onChange();
  }

  card(q, index) {
    const errorId = uid("err");
    const idInput = el("input", {
      name: "question-id", value: q.id, autocomplete: "off", spellcheck: "false", required: true,
      "aria-describedby": errorId,
      oninput: (event) => {
        q.id = event.target.value;
        this.changed();
      },
    });
    const typeSelect = el("select", {
      name: "question-type",
      onchange: (event) => {
        const fresh = blank(event.target.value, q.id);
        Object.assign(q, { type: fresh.type, options: q.options.length ? q.options : fresh.options,
          levels: q.levels.length ? q.levels : fresh.levels });
        this.render();
        this.focus(q.key, "[name=question-type]");
        this.changed();
      },
    }, TYPES.map((type) => el("option", { value: type, text: type, selected: type === q.type })));
    const instructions = el("textarea", {
      name: "instructions", rows: 1, value: q.instructions, spellcheck: "true",
      placeholder: "The question (empty: the id is asked)",
      oninput: (event) => {
        q.instructions = event.target.value;
        this.changed();
      },
    });
    const idLabel = uid("f");
    const typeLabel = uid("f");
    const instrLabel = uid("f");
    idInput.id = idLabel;
    typeSelect.id = typeLabel;
    instructions.id = instrLabel;
    const messages = this.errors.get(q.key) || [];
    return el("fieldset", { class: `question${messages.length ? " invalid" : ""}`, dataset: { key: q.key, type: q.type } },
      el("legend", { text: `Question ${index + 1} · ${q.type}` }),
      el("div", { class: "question-head" },
        el("div", { class: "field grow" }, el("label", { for: idLabel, text: "Id" }), idInput),
        el("div", { class: "field" }, el("label", { for: typeLabel, text: "Type" }), typeSelect),
        el("button", {
          type: "button", class: "icon danger", name: "remove-question", "aria-label": `Remove question ${index + 1}`,
          title: "Remove this question", text: "✕",
          onclick: () => {
            this.questions = this.questions.filter((other) => other !== q);
            this.render();
            this.changed();
          },
        })),
      el("div", { class: "field" }, el("label", { for: instrLabel, text: "Instructions" }), instructions),
      this.criteria(q),
      el("p", { class: "field-error", id: errorId, role: "alert", hidden: messages.length === 0, text: messages.join("\n") }));
  }

  criteria(q) {
    if (q.type === "choice") return this.optionList(q);
    if (q.type === "score") return this.levelList(q);
    const yes = uid("f");
    const no = uid("f");
    return el("div", { class: "criteria noul" },
      el("div", { class: "field" }, el("label", { for: yes, text: "True means (optional)" }),
        el("input", { id: yes, name: "noul-true", value: q.yes, oninput: (e) => { q.yes = e.target.value; this.changed(); } })),
      el("div", { class: "field" }, el("label", { for: no, text: "False means (optional)" }),
        el("input", { id: no, name: "noul-false", value: q.no, oninput: (e) => { q.no = e.target.value; this.changed(); } })));
  }

  optionList(q) {
    const rows = q.options.map((option, i) => el("li", { class: "criterion", dataset: { key: option.key } },
      el("input", {
        name: "option-label", value: option.label, placeholder: "label", autocomplete: "off", spellcheck: "false",
        "aria-label": `Option ${i + 1} label`,
        oninput: (e) => { option.label = e.target.value; this.changed(); },
      }),
      el("input", {
        name: "option-description", value: option.description, placeholder: "description (optional)",
        "aria-label": `Option ${i + 1} description`,
        oninput: (e) => { option.description = e.target.value; this.changed(); },
      }),
      el("button", {
        type: "button", class: "icon", name: "remove-option", "aria-label": `Remove option ${i + 1}`, text: "✕",
        onclick: () => { q.options.splice(i, 1); this.render(); this.changed(); },
      })));
    return el("div", { class: "criteria" },
      el("p", { class: "criteria-title", text: "Options" }),
      el("ol", { class: "criteria-list" }, rows),
      el("button", {
        type: "button", class: "small", name: "add-option", text: "+ Option",
        onclick: () => {
          const option = { key: uid("o"), label: "", description: "" };
          q.options.push(option);
          this.render();
          this.focus(option.key, "[name=option-label]");
          this.changed();
        },
      }));
  }

  levelList(q) {
    const rows = q.levels.map((level, i) => el("li", { class: "criterion", dataset: { key: level.key } },
      el("span", { class: "level-index", text: String(i), "aria-hidden": "true" }),
      el("input", {
        name: "level", value: level.text, placeholder: `level ${i}`, "aria-label": `Level ${i}`,
        oninput: (e) => { level.text = e.target.value; this.changed(); },
      }),
      el("button", {
        type: "button", class: "icon", name: "remove-level", "aria-label": `Remove level ${i}`, text: "✕",
        onclick: () => { q.levels.splice(i, 1); this.render(); this.changed(); },
      })));
    return el("div", { class: "criteria" },
      el("p", { class: "criteria-title", text: "Levels, lowest first" }),
      el("ol", { class: "criteria-list", start: 0 }, rows),
      el("button", {
        type: "button", class: "small", name: "add-level", text: "+ Level",
        onclick: () => {
          const level = { key: uid("l"), text: "" };
          q.levels.push(level);
          this.render();
          this.focus(level.key, "[name=level]");
          this.changed();
        },
      }));
  }
}
