// Answers rendered as Markdown, safely: marked parses, highlight.js colours code, and every fragment goes
// through DOMPurify before it reaches the page. Model output is untrusted input: raw HTML in an answer is
// shown as text, images become links (fetching one would tell its server that the chat was read), links
// open in a new tab with no opener and no referrer, and the edge's Content-Security-Policy backs all of
// it. A streamed answer is rendered incrementally (StreamingAnswer), at most once per animation frame.
// Code is shown at once and coloured later, in the browser's idle time (highlightCode), so colouring never
// holds up a frame.
import { Marked } from "./vendor/marked/marked.esm.js";
import DOMPurify from "./vendor/dompurify/purify.es.js";
import hljs from "./vendor/highlight.js/highlight.min.js";

// Highlighting is linear but slow per character: longer code is shown uncoloured.
const HIGHLIGHT_MAX_CHARS = 20_000;
// A block still being written is re-rendered on each frame; past this size it is shown as plain text
// (appended, not re-rendered) until it is complete, and re-parsed only as it grows by a quarter, so an
// endless code block or table costs linear time overall.
const OPEN_BLOCK_MAX_CHARS = 16_000;
const PLAIN_RETRY_GROWTH = 1.25;

const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

const markdown = new Marked({
  gfm: true,
  renderer: {
    html({ text }) {
      return escapeHtml(text);
    },
    image({ href, text }) {
      return `<a href="${escapeHtml(href)}">${escapeHtml(`image: ${text || href}`)}</a>`;
    },
    code({ text, lang }) {
      const language = (lang || "").match(/^\S*/)[0];
      const known = Boolean(language) && Boolean(hljs.getLanguage(language));
      const label = known ? ` language-${language}` : "";
      const later = known && text.length <= HIGHLIGHT_MAX_CHARS ? ` data-highlight="${escapeHtml(language)}"` : "";
      return `<pre><code class="hljs${label}"${later}>${escapeHtml(text)}</code></pre>\n`;
    },
  },
});

const PURIFY = {
  USE_PROFILES: { html: true },
  FORBID_TAGS: ["style", "img", "picture", "video", "audio", "source", "iframe", "form", "button", "textarea", "select"],
  FORBID_ATTR: ["style", "srcset", "id", "name"],
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:)/i,
  RETURN_DOM_FRAGMENT: true,
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

// Code blocks waiting to be coloured (their <code> elements, data-highlight naming the language), oldest
// first: coloured in idle callbacks, a bounded slice of work each, so that no frame waits for them. The
// coloured HTML is remembered by language and text (a block shown again, from an answer's kept copy,
// is coloured at once from memory).
const IDLE_SLICE_MS = 8;
const IDLE_TIMEOUT_MS = 500; // coloured within this long even on a page never idle
const COLOURED_KEPT = 300;
const toColour = [];
const coloured = new Map(); // `${language}\n${text}` -> sanitized HTML, least recently used first
let colouring = false;
// Safari has no requestIdleCallback: a short timer stands in, its slice bounded the same way.
const whenIdle = window.requestIdleCallback
  ? (callback) => requestIdleCallback(callback, { timeout: IDLE_TIMEOUT_MS })
  : (callback) => setTimeout(() => callback({ timeRemaining: () => IDLE_SLICE_MS }), 50);

// Colours `root`'s code blocks: those coloured before at once, the others in idle time.
export function highlightCode(root) {
  for (const code of root.querySelectorAll("code[data-highlight]")) {
    const html = coloured.get(colourKey(code));
    if (html === undefined) toColour.push(code);
    else paint(code, html);
  }
  if (toColour.length && !colouring) {
    colouring = true;
    whenIdle(colourSome);
  }
}

const colourKey = (code) => `${code.dataset.highlight}\n${code.textContent}`;

function paint(code, html) {
  code.innerHTML = html;
  code.removeAttribute("data-highlight");
}

function colourSome(deadline) {
  const stop = performance.now() + IDLE_SLICE_MS;
  // At least one block per callback (one that timed out has no idle time left), then while time lasts.
  for (let done = 0; toColour.length && (!done || (deadline.timeRemaining() > 0 && performance.now() < stop)); done++) {
    const code = toColour.shift();
    if (!code.isConnected || !code.hasAttribute("data-highlight")) continue; // left the page, or coloured
    const key = colourKey(code);
    let html = coloured.get(key);
    if (html === undefined) {
      const { value } = hljs.highlight(code.textContent, { language: code.dataset.highlight, ignoreIllegals: true });
      html = DOMPurify.sanitize(value, { ALLOWED_TAGS: ["span"], ALLOWED_ATTR: ["class"] });
    }
    coloured.delete(key);
    coloured.set(key, html);
    if (coloured.size > COLOURED_KEPT) coloured.delete(coloured.keys().next().value);
    paint(code, html);
  }
  if (toColour.length) whenIdle(colourSome);
  else colouring = false;
}

// Sanitized HTML as a fragment, with a copy button on each code block and wide tables scrolling alone.
function fragmentOf(html) {
  const fragment = DOMPurify.sanitize(html, PURIFY);
  // The newlines marked puts between blocks: layout ignores them, but an answer's text should not have them.
  for (const node of [...fragment.childNodes]) {
    if (node.nodeType === Node.TEXT_NODE && !node.data.trim()) node.remove();
  }
  for (const pre of fragment.querySelectorAll("pre")) {
    const block = document.createElement("div");
    block.className = "code-block";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy-code";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", "Copy code");
    pre.replaceWith(block);
    block.append(copy, pre);
  }
  for (const table of fragment.querySelectorAll("table")) {
    const scroller = document.createElement("div");
    scroller.className = "table-scroll";
    scroller.tabIndex = 0; // a scrollable region must be reachable by keyboard
    scroller.setAttribute("role", "region");
    scroller.setAttribute("aria-label", "Table");
    table.replaceWith(scroller);
    scroller.append(table);
  }
  highlightCode(fragment);
  return fragment;
}

// Big tables are shown a chunk of rows at a time: their first rows at once, the rest appended in later
// tasks, a chunk per task, so sanitizing and laying out thousands of rows never freezes the page.
const TABLE_CHUNK_ROWS = 200;
const pendingRows = []; // {tbody, token, from, settle}: rows still to append, oldest first
let pumping = false;

// Blocks rendered and sanitized; `complete` resolves true once every row of every table is shown (false
// if the page dropped the table first).
function blocksOf(tokens) {
  const fragment = document.createDocumentFragment();
  const waits = [];
  let run = [];
  const flush = () => {
    if (run.length) fragment.append(fragmentOf(markdown.parser(run)));
    run = [];
  };
  for (const token of tokens) {
    if (token.type !== "table" || token.rows.length <= TABLE_CHUNK_ROWS) {
      run.push(token);
      continue;
    }
    flush();
    const first = fragmentOf(markdown.parser([{ ...token, rows: token.rows.slice(0, TABLE_CHUNK_ROWS) }]));
    const tbody = first.querySelector("tbody");
    waits.push(new Promise((settle) => pendingRows.push({ tbody, token, from: TABLE_CHUNK_ROWS, settle })));
    fragment.append(first);
  }
  flush();
  if (waits.length && !pumping) {
    pumping = true;
    setTimeout(appendRows, 0);
  }
  return { fragment, complete: Promise.all(waits).then((shown) => shown.every(Boolean)) };
}

function appendRows() {
  const job = pendingRows[0];
  if (!job) {
    pumping = false;
    return;
  }
  if (!job.tbody.isConnected) {
    pendingRows.shift();
    job.settle(false);
  } else {
    const rows = job.token.rows.slice(job.from, job.from + TABLE_CHUNK_ROWS);
    const part = fragmentOf(markdown.parser([{ ...job.token, rows }]));
    job.tbody.append(...part.querySelectorAll("tbody > tr"));
    job.from += rows.length;
    if (job.from >= job.token.rows.length) {
      pendingRows.shift();
      job.settle(true);
    }
  }
  setTimeout(appendRows, 0);
}

// A whole answer (a stored message): {fragment, complete} as blocksOf gives them.
export function renderMarkdown(text) {
  return blocksOf(markdown.lexer(text));
}

// Copies a code block when its button is pressed (one listener for a whole message list).
export function handleCopyButtons(container) {
  container.addEventListener("click", async (event) => {
    const copy = event.target.closest(".copy-code");
    if (!copy) return;
    const code = copy.parentElement.querySelector("pre").textContent;
    try {
      await navigator.clipboard.writeText(code);
      copy.textContent = "Copied";
    } catch {
      copy.textContent = "Copy failed: select the code";
    }
    setTimeout(() => { copy.textContent = "Copy"; }, 2000);
  });
}

// An answer as it streams in. Blocks that can no longer change (every top-level block but the last) are
// parsed, sanitized and appended once; only the last, open block is re-rendered, on the next animation
// frame after new text, so a frame's work depends on the open block's size, not the answer's.
export class StreamingAnswer {
  constructor(element, onRendered) {
    this.finished = document.createElement("div");
    this.open = document.createElement("div");
    this.finished.className = this.open.className = "blocks";
    element.replaceChildren(this.finished, this.open);
    this.onRendered = onRendered;
    this.text = "";
    this.committed = 0; // characters of text rendered into this.finished
    this.plain = null; // {node, retryAt} while the open block is too big to re-render
    this.table = null; // {tbody, head, consumed} while the open block is a big table growing row by row
    this.frame = 0;
  }

  update(text) {
    this.text = text;
    if (!this.frame) this.frame = requestAnimationFrame(() => this.render());
  }

  render() {
    this.frame = 0;
    const tail = this.text.slice(this.committed);
    const grown = this.table !== null && this.growTable(tail); // only the table's new rows parsed
    if (!grown && this.plain && tail.length < this.plain.retryAt) {
      this.plain.node.appendData(tail.slice(this.plain.node.length));
    } else if (!grown) {
      this.renderTail(tail);
    }
    if (this.onRendered) this.onRendered();
  }

  renderTail(tail) {
    let tokens = markdown.lexer(tail);
    let last = tokens.length - 1;
    while (last > 0 && tokens[last].type === "space") last--;
    if (last > 0) {
      const done = tokens.slice(0, last);
      done.links = tokens.links;
      const raw = done.map((token) => token.raw).join("");
      if (tail.startsWith(raw)) { // the lexer kept the text as it was (no \r\n to normalize)
        this.finished.append(blocksOf(done).fragment);
        this.committed += raw.length;
        tail = tail.slice(raw.length);
        const rest = tokens.slice(last);
        rest.links = tokens.links;
        tokens = rest;
      }
    }
    this.table = null;
    if (tokens.length === 1 && tokens[0].type === "table" && tokens[0].rows.length > TABLE_CHUNK_ROWS) {
      this.plain = null;
      this.startTable(tokens[0], tail);
      return;
    }
    if (tail.length > OPEN_BLOCK_MAX_CHARS) {
      const node = document.createTextNode(tail);
      const pre = document.createElement("pre");
      pre.className = "streaming-plain";
      pre.append(node);
      this.open.replaceChildren(pre);
      this.plain = { node, retryAt: tail.length * PLAIN_RETRY_GROWTH };
    } else {
      this.plain = null;
      this.open.replaceChildren(blocksOf(tokens).fragment);
    }
  }

  // A big table still being written: rows above its last cannot change, so from here on only the lines
  // new since the last frame are parsed (under the table's header), sanitized and appended; the last
  // line waits for its end. A frame's work is the rows that arrived, not the table.
  startTable(token, tail) {
    const consumed = tail.lastIndexOf("\n") + 1;
    const complete = consumed === tail.length ? token.rows.length : token.rows.length - 1;
    const first = fragmentOf(markdown.parser([{ ...token, rows: token.rows.slice(0, complete) }]));
    const head = token.raw.split("\n").slice(0, 2).join("\n") + "\n";
    this.table = { tbody: first.querySelector("tbody"), head, consumed };
    this.open.replaceChildren(first);
  }

  // Appends the table's new complete rows; false when the new lines are not all rows (the table may
  // have ended: the caller renders the open text again, whole).
  growTable(tail) {
    const fresh = tail.slice(this.table.consumed);
    const end = fresh.lastIndexOf("\n") + 1;
    if (!end) return true;
    const lines = fresh.slice(0, end);
    if (!lines.split("\n").slice(0, -1).every((line) => line.includes("|") && line.trim())) return false;
    const [token] = markdown.lexer(this.table.head + lines);
    if (!token || token.type !== "table") return false;
    const part = fragmentOf(markdown.parser([token]));
    this.table.tbody.append(...part.querySelectorAll("tbody > tr"));
    this.table.consumed += end;
    return true;
  }

  stop() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
  }

  // Renders the whole answer (the open block too) and returns a copy of it, so the stored message it
  // became can be shown without parsing and sanitizing the answer a second time. Null when the answer
  // defines reference links, which blocks rendered apart may have missed, or a table is still filling.
  finish() {
    this.stop();
    const tail = this.text.slice(this.committed);
    this.finished.append(blocksOf(markdown.lexer(tail)).fragment);
    this.committed = this.text.length;
    this.open.replaceChildren();
    this.plain = null;
    this.table = null;
    if (REFERENCE_DEFINITION.test(this.text)) return null;
    if (pendingRows.some((job) => this.finished.contains(job.tbody))) return null; // a table is still filling
    const whole = document.createDocumentFragment();
    for (const block of this.finished.childNodes) whole.append(block.cloneNode(true));
    return whole;
  }
}

const REFERENCE_DEFINITION = /^ {0,3}\[[^\]]+\]:/m;
