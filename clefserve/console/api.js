// Calls to the server's public API, as any client makes them: the key from the field (kept in
// sessionStorage only) as a bearer token, errors turned into {status, code, message, fields}.

const KEY_STORAGE = "clef-console.api-key";

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

export async function call(method, path, bodyText) {
  const headers = { accept: "application/json" };
  if (bodyText !== undefined) headers["content-type"] = "application/json";
  const key = apiKey();
  if (key) headers.authorization = `Bearer ${key}`;
  const started = performance.now();
  let response;
  try {
    response = await fetch(path, { method, headers, body: bodyText, cache: "no-store", credentials: "omit" });
  } catch (err) {
    return {
      ok: false, status: 0, ms: performance.now() - started, requestId: null,
      error: { status: 0, code: "network_error", message: `the server did not answer (${err.message})`, fields: [] },
    };
  }
  const text = await response.text();
  const ms = performance.now() - started;
  const requestId = response.headers.get("x-request-id");
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {
    json = null;
  }
  if (response.ok && json !== null) return { ok: true, status: response.status, json, ms, requestId };
  const error = describeError(response.status, json, text);
  error.retryAfter = response.headers.get("retry-after");
  return { ok: false, status: response.status, ms, requestId, error };
}

// {"detail": {"message", "error_type"}}, FastAPI's {"detail": [{"loc", "msg", "type"}]} or anything else.
export function describeError(status, json, text) {
  const detail = json && typeof json === "object" ? json.detail : undefined;
  if (Array.isArray(detail)) {
    const fields = detail.map((item) => ({
      loc: Array.isArray(item.loc) ? item.loc.map(String) : [],
      msg: String(item.msg ?? ""),
      type: String(item.type ?? ""),
    }));
    const message = fields.map((f) => `${f.loc.filter((p) => p !== "body").join(".") || "body"}: ${f.msg}`).join("\n");
    return { status, code: fields[0]?.type || "validation_error", message, fields };
  }
  if (detail && typeof detail === "object") {
    return {
      status, code: String(detail.error_type ?? "error"), message: String(detail.message ?? ""), fields: [],
    };
  }
  if (typeof detail === "string") return { status, code: "error", message: detail, fields: [] };
  const body = (text || "").slice(0, 500);
  return { status, code: "error", message: body || `HTTP ${status}`, fields: [] };
}
