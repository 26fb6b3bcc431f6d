// The current request as a shell `curl` command and as a Python snippet for the official typesafe-sdk.
// The key is never written into a snippet: both read it from $CLEF_API_KEY.

// JSON text -> the same value as a Python literal, token by token, so that the layout, key order and number
// spellings (1 vs 1.0 reach the model's tokens) stay exactly as written.
export function pythonLiteral(jsonText) {
  let out = "";
  let i = 0;
  while (i < jsonText.length) {
    const c = jsonText[i];
    if (c === '"') {
      let j = i + 1;
      while (j < jsonText.length && jsonText[j] !== '"') j += jsonText[j] === "\\" ? 2 : 1;
      // JSON string escapes are Python's, except "\/" which Python leaves as two characters
      out += jsonText.slice(i, j + 1).replace(/\\\\|\\\//g, (m) => (m === "\\/" ? "/" : m));
      i = j + 1;
    } else if (jsonText.startsWith("true", i)) {
      out += "True";
      i += 4;
    } else if (jsonText.startsWith("false", i)) {
      out += "False";
      i += 5;
    } else if (jsonText.startsWith("null", i)) {
      out += "None";
      i += 4;
    } else {
      out += c;
      i += 1;
    }
  }
  return out;
}

function shellQuote(text) {
  return `'${text.replaceAll("'", "'\\''")}'`;
}

function indent(text, spaces) {
  const pad = " ".repeat(spaces);
  return text.split("\n").map((line, i) => (i === 0 ? line : pad + line)).join("\n");
}

// request: {origin, model, stateText, questionsText, imagesText (or null), auth}
export function curlSnippet(request) {
  const lines = [`curl -s ${request.origin}/v1/systemone`, "  -H 'content-type: application/json'"];
  if (request.auth) lines.push('  -H "authorization: Bearer $CLEF_API_KEY"');
  lines.push(`  -d ${shellQuote(request.bodyText)}`);
  return lines.join(" \\\n");
}

export function pythonSnippet(request) {
  const args = [
    `        model=${pythonLiteral(JSON.stringify(request.model))},`,
    `        state=${indent(pythonLiteral(request.stateText), 8)},`,
    `        questions=${indent(pythonLiteral(request.questionsText), 8)},`,
  ];
  if (request.imagesText) args.push(`        extra_body={"images": ${indent(pythonLiteral(request.imagesText), 8)}},`);
  return [
    "# pip install typesafe-sdk",
    "import os",
    "",
    "from typesafe_sdk import TypeSafeClient",
    "",
    `with TypeSafeClient(base_url=${pythonLiteral(JSON.stringify(request.origin))},`,
    `                    api_key=os.environ.get("CLEF_API_KEY", "unused")) as client:`,
    "    result = client.system_one(",
    ...args,
    "    )",
    "print(result.model_dump_json(indent=2))",
    "",
  ].join("\n");
}
