// Images for the request: a file picker and a drop zone that turn files into data URLs, with thumbnails.
// Disabled, with the server's reason, while the served model takes no images.

import { clear, el, formatBytes } from "./dom.js";

export class ImagePicker {
  constructor({ input, zone, list, note, onChange }) {
    Object.assign(this, { input, zone, list, note, onChange });
    this.images = []; // [{name, size, url}]
    this.support = { supported: false, reason: "waiting for the server's status" };
    this.maxBodyBytes = null;
    input.addEventListener("change", () => {
      this.addFiles(input.files);
      input.value = "";
    });
    zone.addEventListener("dragover", (event) => {
      event.preventDefault();
      zone.classList.toggle("dragging", this.support.supported);
    });
    zone.addEventListener("dragleave", () => zone.classList.remove("dragging"));
    zone.addEventListener("drop", (event) => {
      event.preventDefault();
      zone.classList.remove("dragging");
      if (this.support.supported) this.addFiles(event.dataTransfer.files);
    });
    this.render();
  }

  configure(support, maxBodyBytes) {
    this.support = support || { supported: false, reason: "unknown" };
    this.maxBodyBytes = maxBodyBytes;
    if (!this.support.supported && this.images.length) this.images = [];
    this.render();
  }

  limit() {
    return this.support.max_images ?? Infinity;
  }

  addFiles(files) {
    const problems = [];
    for (const file of Array.from(files || [])) {
      if (!file.type.startsWith("image/")) {
        problems.push(`${file.name}: not an image`);
        continue;
      }
      if (this.images.length >= this.limit()) {
        problems.push(`at most ${this.limit()} images`);
        break;
      }
      const cap = this.support.max_image_bytes;
      if (cap && file.size > cap) {
        problems.push(`${file.name}: ${formatBytes(file.size)} is over the server's limit of ${formatBytes(cap)} per image`);
        continue;
      }
      // base64 makes 4 bytes of every 3; the whole request must stay under --max-body-bytes
      const encoded = this.images.reduce((sum, image) => sum + Math.ceil(image.size / 3) * 4, 0);
      if (this.maxBodyBytes && encoded + Math.ceil(file.size / 3) * 4 > this.maxBodyBytes) {
        problems.push(`${file.name}: the request would pass the server's body limit of ${formatBytes(this.maxBodyBytes)}`);
        continue;
      }
      const entry = { name: file.name, size: file.size, url: null };
      this.images.push(entry);
      const reader = new FileReader();
      reader.addEventListener("load", () => {
        entry.url = String(reader.result);
        this.render();
        this.onChange();
      });
      reader.readAsDataURL(file);
    }
    this.problems = problems;
    this.render();
  }

  dataUrls() {
    return this.images.filter((image) => image.url).map((image) => image.url);
  }

  render() {
    const { supported, reason } = this.support;
    this.input.disabled = !supported;
    this.zone.classList.toggle("disabled", !supported);
    this.zone.setAttribute("aria-disabled", String(!supported));
    clear(this.note, supported
      ? `Up to ${Number.isFinite(this.limit()) ? this.limit() : "the body limit of"} images${this.maxBodyBytes ? ` (${formatBytes(this.maxBodyBytes)} per request)` : ""}.`
      : `Images are off: ${reason || "the served model takes none"}.`);
    for (const problem of this.problems || []) this.note.append(el("span", { class: "field-error-inline", text: ` ${problem}.` }));
    clear(this.list, this.images.map((image, i) => el("li", { class: "thumb" },
      image.url ? el("img", { src: image.url, alt: image.name }) : el("span", { class: "muted", text: "reading…" }),
      el("span", { class: "thumb-name", title: image.name, text: image.name }),
      el("button", {
        type: "button", class: "icon", "aria-label": `Remove image ${image.name}`, text: "✕",
        onclick: () => {
          this.images.splice(i, 1);
          this.render();
          this.onChange();
        },
      }))));
  }
}
