// Texel's page: formulas to LaTeX and prompts to images, through this server's own API.
// Plain JavaScript, no build step; KaTeX is served by Texel itself (static/vendor/).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "texel.apiKey";

// ---- API key: asked for only once the server answers 401 ---------------------------

let stoppedByKey = null; // what a 401 stopped, run again once a key is saved

function storedKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return ""; // storage disabled: the key lives in the field only
  }
}

function currentKey() {
  return storedKey() || $("api-key").value.trim();
}

function showKeySection(focus) {
  $("key-section").hidden = false;
  $("api-key").value = storedKey();
  if (focus) $("api-key").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  try {
    localStorage.setItem(KEY_STORAGE, key);
  } catch {
    // not kept across visits, still sent from the field
  }
  const again = stoppedByKey;
  stoppedByKey = null;
  if (again) again();
});

$("key-forget").addEventListener("click", () => {
  try {
    localStorage.removeItem(KEY_STORAGE);
  } catch {}
  $("api-key").value = "";
});

if (storedKey()) showKeySection(false);

// ---- Errors: one clear sentence for every code of docs/api.md ----------------------

const BY_CODE = {
  malformed_request: "The server could not read this request.",
  corrupt_image: "This picture is damaged or truncated.",
  unauthorized: "This server needs an API key: enter it above, then it is sent again.",
  model_disabled: "This model is disabled on this server.",
  request_timeout: "The upload did not arrive in time; check the connection and try again.",
  payload_too_large: "Too large: the upload exceeds this server's limit.",
  image_too_large: "Too large: the picture exceeds this server's limit in bytes or pixels.",
  unsupported_media_type: "Unsupported: the server does not take this kind of request body.",
  unsupported_image: "Unsupported file: send a PNG, JPEG, WebP, BMP or GIF picture.",
  invalid_parameter: "A value is not accepted.",
  queue_full: "The server is overloaded: its queue is full.",
  headers_too_large: "The request's headers are too large.",
  not_ready: "The server is still loading its models.",
  model_failed: "The model failed to load on this server; see the server log.",
  draining: "The server is shutting down.",
  unavailable: "The server is unavailable.",
  engine_unavailable: "The server's engine is unavailable.",
  stalled: "The server's device has stopped making progress; try again later.",
  deadline_exceeded: "Timed out: the server did not finish before the request's deadline.",
  batch_failed: "The server failed on the batch this request was in; try again.",
  internal_error: "The server failed (a bug); see the server log.",
};
const BY_STATUS = {
  400: "The server could not read this request.",
  401: BY_CODE.unauthorized,
  404: "Not found on this server.",
  408: BY_CODE.request_timeout,
  413: "Too large for this server.",
  415: "Unsupported by this server.",
  422: BY_CODE.invalid_parameter,
  429: BY_CODE.queue_full,
  431: BY_CODE.headers_too_large,
  503: "The server is unavailable for now.",
  504: "Timed out on the server.",
};

// Seconds to wait from a Retry-After header: a number of seconds or an HTTP date.
function retryAfterSeconds(header) {
  if (!header) return null;
  if (/^\d+$/.test(header.trim())) return Number(header.trim());
  const when = Date.parse(header);
  return Number.isNaN(when) ? null : Math.max(0, Math.ceil((when - Date.now()) / 1000));
}

function showError(box, summary, detail) {
  box.replaceChildren();
  const line = document.createElement("p");
  line.textContent = summary;
  box.append(line);
  if (detail) {
    const small = document.createElement("p");
    small.className = "detail";
    small.textContent = detail;
    box.append(small);
  }
  box.hidden = false;
}

function clearError(box) {
  box.hidden = true;
  box.replaceChildren();
}

// POST to the API; the answer's JSON on success, null once an error is shown in `box`.
// `again` runs the same action after a 401 once the user saves a key. With `onProgress`,
// the answer comes as server-sent events: each `progress` event goes to it, and the
// `image` event is the answer.
async function post(path, init, box, again, onProgress) {
  const accept = onProgress ? "text/event-stream" : "application/json";
  const headers = { Accept: accept, ...(init.headers || {}) };
  const key = currentKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  let response;
  try {
    response = await fetch(path, { ...init, headers });
  } catch (error) {
    showError(box, "Could not reach the server.", String(error));
    return null;
  }
  const type = response.headers.get("Content-Type") || "";
  if (response.ok && onProgress && type.startsWith("text/event-stream")) {
    return readEvents(response, box, onProgress);
  }
  const text = await response.text();
  let body = null;
  try {
    body = JSON.parse(text);
  } catch {
    // a plain-text answer (the HTTP server's own 503 when it holds too many connections)
  }
  if (response.ok && body) return body;
  showApiError(box, response.status, response.statusText, body, text, response.headers);
  if (response.status === 401) {
    stoppedByKey = again;
    showKeySection(true);
  }
  return null;
}

function showApiError(box, status, statusText, body, text, headers) {
  const error = (body && body.error) || {};
  const code = error.code || "";
  let summary = BY_CODE[code] || BY_STATUS[status] || `The server answered ${status}.`;
  const wait = retryAfterSeconds(headers ? headers.get("Retry-After") : null);
  if (wait !== null) summary += ` Try again in ${wait} s.`;
  const detail = `${status} ${code || statusText}: ${error.message || text.slice(0, 300)}`;
  showError(box, summary, detail);
}

// The events of a text/event-stream answer: progress to `onProgress`, then the answer of
// its `image` event, or null once its `error` event is shown in `box`.
async function readEvents(response, box, onProgress) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      let data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      const payload = JSON.parse(data);
      if (name === "progress") onProgress(payload);
      else if (name === "image") return payload;
      else if (name === "error") {
        showApiError(box, 200, "error event", payload, data, null);
        return null;
      }
    }
  }
  showError(box, "The server ended the answer early.", "no image event");
  return null;
}

function milliseconds(value) {
  return `${Math.round(value).toLocaleString("en")} ms`;
}

function stagesText(timings) {
  return Object.entries(timings || {})
    .map(([stage, ms]) => `${stage} ${ms.toFixed(1)} ms`)
    .join(", ");
}

// ---- Formulas ---------------------------------------------------------------------

let recognized = { latex: "", latex_compact: "" };
$("formula-picture").addEventListener("error", (event) => {
  event.target.hidden = true; // not a picture the browser shows either
});

function renderLatex() {
  const source = $("latex").value;
  const preview = $("preview");
  const problem = $("render-error");
  if (typeof katex === "undefined") {
    problem.textContent = "KaTeX did not load; the LaTeX is shown as text only.";
    problem.hidden = false;
    return;
  }
  try {
    katex.render(source, preview, { displayMode: true, throwOnError: true, output: "htmlAndMathml" });
    problem.hidden = true;
  } catch (error) {
    preview.replaceChildren();
    problem.textContent = `KaTeX cannot render this: ${error.message}`;
    problem.hidden = false;
  }
}

// The compact form of edited LaTeX, as the server's `compact_latex` makes it
// (models/formula/adapter.py): no spaces, except after a control word before a letter.
function compactLatex(latex) {
  let out = "";
  for (const token of latex.split(/\s+/).filter(Boolean)) {
    if (/\\[A-Za-z]+$/.test(out) && /^[A-Za-z]/.test(token)) out += " ";
    out += token;
  }
  return out;
}

$("latex").addEventListener("input", () => {
  renderLatex();
  const latex = $("latex").value;
  const edited = latex !== recognized.latex;
  $("latex-compact").textContent = edited ? compactLatex(latex) : recognized.latex_compact;
  if (edited) $("formula-status").textContent = "Edited: the rendering shows your LaTeX.";
});

async function recognize(file) {
  const picture = $("formula-picture");
  if (picture.src) URL.revokeObjectURL(picture.src);
  picture.src = URL.createObjectURL(file);
  picture.hidden = false;
  clearError($("formula-error"));
  $("formula-status").textContent = "Reading the formula…";
  $("formula-meta").textContent = "";
  const form = new FormData();
  form.append("image", file, file.name || "pasted-image");
  const started = performance.now();
  const answer = await post("recognize", { method: "POST", body: form }, $("formula-error"), () =>
    recognize(file)
  );
  if (!answer) {
    $("formula-status").textContent = "";
    return;
  }
  const took = performance.now() - started;
  recognized = answer;
  $("latex").value = answer.latex;
  $("latex-compact").textContent = answer.latex_compact;
  renderLatex();
  $("formula-status").textContent = answer.latex
    ? "Recognized."
    : "No formula found in this picture (the model answered an empty LaTeX).";
  const how = answer.cached ? "answered from the cache" : `in a batch of ${answer.batch_size}`;
  // How sure the model was (not a chance of being right): low values deserve a look.
  const sure = answer.confidence == null ? "" : `, confidence ${answer.confidence.toFixed(2)}`;
  $("formula-meta").textContent =
    `Took ${milliseconds(took)}, ${how}${sure} ` +
    `(model ${answer.model}; server stages: ${stagesText(answer.timings_ms)}).`;
}

$("formula-file").addEventListener("change", (event) => {
  const file = event.target.files[0];
  if (file) recognize(file);
  event.target.value = ""; // choosing the same file again sends it again
});

// Ctrl+V anywhere on the page: a pasted picture is recognized; pasted text goes where
// the user pastes it.
document.addEventListener("paste", (event) => {
  const items = Array.from((event.clipboardData && event.clipboardData.items) || []);
  const item = items.find((entry) => entry.kind === "file");
  if (!item) return;
  event.preventDefault();
  recognize(item.getAsFile());
});

// A file dropped anywhere on the page is recognized, rather than opened by the browser.
const dropZone = $("drop-zone");
document.addEventListener("dragover", (event) => {
  if (!event.dataTransfer || !Array.from(event.dataTransfer.types).includes("Files")) return;
  event.preventDefault();
  dropZone.classList.add("dragging");
});
document.addEventListener("dragleave", (event) => {
  if (event.relatedTarget === null) dropZone.classList.remove("dragging");
});
document.addEventListener("drop", (event) => {
  const file = event.dataTransfer && event.dataTransfer.files[0];
  dropZone.classList.remove("dragging");
  if (!file) return;
  event.preventDefault();
  recognize(file);
});

async function copy(text, what) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no Clipboard API (a page served over plain HTTP to another host): the old way
    const scratch = document.createElement("textarea");
    scratch.value = text;
    document.body.append(scratch);
    scratch.select();
    document.execCommand("copy");
    scratch.remove();
  }
  $("copy-status").textContent = `${what} copied.`;
}

$("copy-latex").addEventListener("click", () => copy($("latex").value, "LaTeX"));
$("copy-compact").addEventListener("click", () =>
  copy($("latex-compact").textContent, "Compact LaTeX")
);

// ---- Images -----------------------------------------------------------------------

let imageUrls = [];

function generateBody() {
  const body = { prompt: $("prompt").value };
  const numbers = { width: "width", height: "height", steps: "num_inference_steps",
                    guidance: "guidance_scale", seed: "seed" };
  for (const [id, field] of Object.entries(numbers)) {
    const value = $(id).value.trim();
    if (value !== "") body[field] = Number(value);
  }
  return body;
}

function pngUrl(base64) {
  const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
  return URL.createObjectURL(new Blob([bytes], { type: "image/png" }));
}

function showImages(answer, took) {
  imageUrls.forEach((url) => URL.revokeObjectURL(url));
  imageUrls = answer.images.map((image) => pngUrl(image.png_base64));
  const figures = answer.images.map((image, i) => {
    const figure = document.createElement("figure");
    const img = document.createElement("img");
    img.src = imageUrls[i];
    img.alt = `Generated for the prompt “${$("prompt").value}”, seed ${image.seed}`;
    img.className = "generated";
    img.addEventListener("load", () => img.classList.toggle("upscaled", img.naturalWidth < 256));
    const caption = document.createElement("figcaption");
    const link = document.createElement("a");
    link.href = imageUrls[i];
    link.download = `texel-seed-${image.seed}.png`;
    link.textContent = "Download PNG";
    caption.append(`Seed ${image.seed}. `, link);
    figure.append(img, caption);
    return figure;
  });
  $("images").replaceChildren(...figures);
  $("image-status").textContent =
    `Took ${milliseconds(took)}, in a batch of ${answer.batch_size} ` +
    `(model ${answer.model}; server stages: ${stagesText(answer.timings_ms)}).`;
}

async function generate() {
  clearError($("image-error"));
  $("image-status").textContent = "";
  const bar = $("image-progress-bar");
  bar.removeAttribute("value"); // indeterminate until the first step is done
  $("image-progress-text").textContent = "Waiting for the GPU…";
  $("image-progress").hidden = false;
  $("generate").disabled = true;
  const started = performance.now();
  try {
    const answer = await post(
      "generate",
      { method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(generateBody()) },
      $("image-error"),
      generate,
      (progress) => {
        if (progress.step > 0) {
          bar.max = progress.total;
          bar.value = progress.step;
          $("image-progress-text").textContent = `Step ${progress.step} of ${progress.total}`;
        } else if (progress.queue_position) {
          $("image-progress-text").textContent =
            `Queued behind ${progress.queue_position} request(s)…`;
        }
      }
    );
    if (answer) showImages(answer, performance.now() - started);
  } finally {
    $("image-progress").hidden = true;
    $("generate").disabled = false;
  }
}

$("image-form").addEventListener("submit", (event) => {
  event.preventDefault();
  generate();
});

// Ctrl+Enter in the prompt generates, as in a chat box.
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
    event.preventDefault();
    $("image-form").requestSubmit();
  }
});

renderLatex();
