// chatmesh chat page: plain JavaScript over the edge's REST + SSE API (see edge/chats_api.py).
// Answers stream over fetch() (POST bodies and the Authorization header rule out EventSource). The run
// being streamed is remembered in sessionStorage, so a reload mid-answer resumes it with Last-Event-ID.
import { handleCopyButtons, highlightCode, renderMarkdown, StreamingAnswer } from "./render.js";
import { recordStep, stepsView } from "./steps.js";
import { authHeaders, keepToken, signOut, takeTokenFromUrl } from "./token.js";
import { WindowedList } from "./window.js";

const $ = (selector) => document.querySelector(selector);
const RUN_KEY = "chatmesh.run";
const TOKEN_KEY = "chatmesh.token";

// Busy servers (429, 503): the page retries a send by itself, waiting at least the server's Retry-After.
// Paid tiers back off linearly (1, 2, 3 … s), the free tier exponentially (1, 2, 4 … s), as the server
// asks the free tier to yield first; after RETRIES.attempts retries it gives up and says so. A wait
// longer than RETRIES.maxS (a spent token budget) is not a busy server: it is reported at once.
const RETRIES = { attempts: 4, baseS: 1, maxS: 60 };

const state = {
  token: null,
  tier: "free",     // from /v1/me: how this page backs off when the servers are busy
  chats: [],
  nextChats: null,
  search: null,     // {query, hits, next} while the sidebar shows search results
  chatId: null,
  path: [],         // the branch on screen as loaded so far, oldest first
  known: new Map(), // message_id -> message: every message of the open chat loaded (for branch arrows)
  versions: new Map(), // message_id -> its versions ({count, number, previous_id, next_id}), as branch pages give them
  byParent: null,   // known messages by parent id, newest first (children(); null: to be made again)
  older: null,      // page token of the branch's next older page (null: the root is loaded)
  branchFrom: null, // the URL the branch's pages come from (a page token is good for its own URL only)
  loadingOlder: false,
  leafId: null,     // the branch on screen ends here
  rendered: new Map(), // message_id -> its answer rendered (a message's content never changes), oldest first
  steps: new Map(), // message_id -> the tool steps of an answer streamed on this page (not stored with it)
  models: null,     // the model picker's list loading (a promise), then loaded
  opening: false,   // a chat's first page is on its way (its skeleton shows)
  live: null,       // {runId, chatId, lastSeq, text, steps, usage, model, degraded, baseEnd: last message before, user: text|null, view, item}
};

class ApiError extends Error {
  constructor(status, message, retryAfter) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

// ---- API --------------------------------------------------------------------------------------------

async function call(path, { method = "GET", body, headers = {}, signal } = {}) {
  const response = await fetch(path, {
    method,
    signal,
    headers: {
      ...authHeaders(state.token),
      ...(body !== undefined ? { "Content-Type": "application/json" } : {}),
      ...(state.chatId ? { "x-chatmesh-chat-id": state.chatId } : {}),
      ...headers,
    },
    body: body !== undefined ? JSON.stringify(body) : undefined,
  });
  if (!response.ok) throw await errorOf(response);
  return response;
}

async function json(path, options) {
  const response = await call(path, options);
  return response.status === 204 ? null : response.json();
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    message = (await response.json()).error.message || message;
  } catch { /* not JSON */ }
  return new ApiError(response.status, message, Number(response.headers.get("retry-after")) || null);
}

// ---- notices ----------------------------------------------------------------------------------------

function notice(text) {
  const banner = $("#banner");
  banner.textContent = text;
  banner.hidden = !text;
}

function explain(error) {
  if (!(error instanceof ApiError)) return `Connection problem: ${error.message}. Check the server and retry.`;
  const wait = error.retryAfter ? ` Try again in ${error.retryAfter} s.` : " Try again shortly.";
  switch (error.status) {
    case 401: return state.token ? "Your token is missing, invalid or expired. Paste a new one." : "You are signed out. Sign in again.";
    case 429: return `You are sending requests too fast or your token budget is spent (rate limited).${wait}`;
    case 503: return `Our servers are busy and cannot take this request right now.${wait}`;
    default: return error.message;
  }
}

function isBusy(error) {
  return error instanceof ApiError && (error.status === 429 || error.status === 503);
}

// Seconds to wait before retry number `attempt` (from 1): the tier's backoff, never less than Retry-After.
function backoffS(tier, attempt, retryAfterS) {
  const grown = tier === "free" ? RETRIES.baseS * 2 ** (attempt - 1) : RETRIES.baseS * attempt;
  return Math.min(RETRIES.maxS, Math.max(retryAfterS || 0, grown));
}

// Runs `request`, retrying it while the servers are busy, with a countdown in the banner.
async function withRetries(request) {
  for (let attempt = 1; ; attempt++) {
    try {
      return await request();
    } catch (error) {
      if (!isBusy(error) || attempt > RETRIES.attempts || error.retryAfter > RETRIES.maxS) throw error;
      await countdown(Math.ceil(backoffS(state.tier, attempt, error.retryAfter)), attempt);
    }
  }
}

async function countdown(seconds, attempt) {
  for (let left = seconds; left > 0; left--) {
    notice(`Our servers are busy. Retrying in ${left} s (retry ${attempt} of ${RETRIES.attempts}).`);
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
  notice("Our servers are busy. Retrying now…");
}

function fail(error) {
  notice(explain(error));
  if (error instanceof ApiError && error.status === 401) showSignin(true);
}

// ---- sign in ----------------------------------------------------------------------------------------

function showSignin(show) {
  $("#signin").hidden = !show;
  $("#composer").hidden = show;
}

// ---- chats sidebar ----------------------------------------------------------------------------------

async function loadChats(more = false) {
  const params = new URLSearchParams({ page_size: "30" });
  if (more && state.nextChats) params.set("page_token", state.nextChats);
  const page = await json(`/v1/chats?${params}`);
  state.chats = more ? state.chats.concat(page.chats) : page.chats;
  state.nextChats = page.next_page_token;
  renderChats();
}

function renderChats() {
  const list = $("#chat-list");
  keepingFocus(list, () => list.replaceChildren(...state.chats.map((chat) => {
    const item = document.createElement("li");
    const current = chat.chat_id === state.chatId;
    item.setAttribute("aria-current", String(current));
    const open = button(chat.title || "Untitled chat", () => openChat(chat.chat_id), "open", `open:${chat.chat_id}`);
    if (current) open.setAttribute("aria-current", "page");
    const rename = button("✎", () => renameChat(chat), "icon", `rename:${chat.chat_id}`);
    rename.setAttribute("aria-label", `Rename ${chat.title}`);
    const remove = button("×", () => deleteChat(chat), "icon");
    remove.setAttribute("aria-label", `Delete ${chat.title}`);
    item.append(open, rename, remove);
    return item;
  })), () => $("#new-chat"));
  $("#more-chats").hidden = !state.nextChats || state.search !== null;
}

// Re-rendering a list replaces its buttons: focus moves to the new button that does the same thing
// (the same data-focus-key), or else to `fallback()`, instead of being dropped on the page's body.
function keepingFocus(container, render, fallback) {
  const active = document.activeElement;
  const inside = active !== null && active !== document.body && container.contains(active);
  const key = inside ? active.dataset.focusKey : undefined;
  render();
  if (!inside || container.contains(active)) return;
  const twin = key && container.querySelector(`[data-focus-key="${CSS.escape(key)}"]`);
  (twin || fallback()).focus();
}

// ---- search -----------------------------------------------------------------------------------------

// Searches the caller's chats (titles and messages, every word); an empty box shows the chats again.
async function searchChats(more = false) {
  const query = $("#search-input").value.trim();
  if (!query) {
    state.search = null;
  } else {
    const params = new URLSearchParams({ q: query, page_size: "20" });
    if (more && state.search) params.set("page_token", state.search.next);
    const page = await json(`/v1/search?${params}`);
    const earlier = more && state.search ? state.search.hits : [];
    state.search = { query, hits: earlier.concat(page.hits), next: page.next_page_token };
  }
  renderSearch();
}

function renderSearch() {
  const searching = state.search !== null;
  $("#chat-list").hidden = searching;
  $("#search-results").hidden = !searching;
  $("#more-results").hidden = !searching || !state.search.next;
  $("#more-chats").hidden = searching || !state.nextChats;
  if (!searching) return;
  const items = state.search.hits.map((hit) => {
    const item = document.createElement("li");
    const open = button(hit.chat_title || "Untitled chat", () => openChat(hit.chat_id), "open");
    const snippet = document.createElement("span");
    snippet.className = "snippet muted";
    snippet.textContent = hit.role === "title" ? "matched the title" : `${hit.role}: ${hit.snippet}`;
    open.append(snippet);
    item.append(open);
    return item;
  });
  if (!items.length) {
    const none = document.createElement("li");
    none.className = "muted";
    none.textContent = `No chats match "${state.search.query}".`;
    items.push(none);
  }
  $("#search-results").replaceChildren(...items);
}

// `focusKey` names what the button does, so that focus finds its twin after a re-render (keepingFocus).
function button(label, onClick, className, focusKey) {
  const element = document.createElement("button");
  element.type = "button";
  element.textContent = label;
  if (className) element.className = className;
  if (focusKey) element.dataset.focusKey = focusKey;
  element.addEventListener("click", () => onClick().catch(fail));
  return element;
}

async function renameChat(chat) {
  const title = prompt("New title", chat.title);
  if (!title) return;
  await json(`/v1/chats/${chat.chat_id}`, { method: "PATCH", body: { title } });
  await loadChats();
  if (chat.chat_id === state.chatId) $("#chat-title").textContent = title;
}

async function deleteChat(chat) {
  if (!confirm(`Delete "${chat.title}"? This cannot be undone.`)) return;
  await json(`/v1/chats/${chat.chat_id}`, { method: "DELETE" });
  if (chat.chat_id === state.chatId) newChat();
  await loadChats();
}

function newChat() {
  state.chatId = null;
  forgetChat();
  $("#chat-title").textContent = "New chat";
  $("#model").value = "";
  history.replaceState(null, "", "/");
  renderChats();
  renderMessages({ toEnd: true });
  $("#prompt").focus();
}

// ---- messages: a tree, shown one branch at a time --------------------------------------------------

// A chat opens on its branch's newest page (GetBranch from the chat's newest message); older pages of
// the branch load as the reader scrolls up (loadOlder). Each page gives its messages' versions, so the
// branch arrows show on every page, and an arrow opens the other version's newest branch (newest_leaf).
// Messages stored before the server indexed versions have none: for those the arrows come from the
// newest page of all the chat's messages (ListMessages), as far as it reaches. Only messages near the
// viewport are in the page (edge/static/window.js), so a chat of thousands of messages opens and
// scrolls as a short one.
const MESSAGE_PAGE = 100;
const RENDERED_KEPT = 100; // answers kept rendered (parsed and sanitized) off screen: the last shown

function forgetChat() {
  state.opening = false;
  state.path = [];
  state.known.clear();
  state.versions.clear();
  state.byParent = null;
  state.older = null;
  state.branchFrom = null;
  state.rendered.clear();
  state.leafId = null;
}

async function openChat(chatId, { resume = true } = {}) {
  state.chatId = chatId;
  forgetChat();
  history.replaceState(null, "", `/?chat=${encodeURIComponent(chatId)}`);
  showSkeleton();
  state.opening = true;
  // The picker's list too, so that the chat's model shows picked.
  const [chat] = await Promise.all([json(`/v1/chats/${chatId}`), loadBranch(null), loadRecent(), state.models]);
  if (chatId !== state.chatId) return;
  state.opening = false;
  $("#chat-title").textContent = chat.title || "Untitled chat";
  $("#model").value = chat.model || ""; // a model no longer served shows as the default
  renderChats();
  renderMessages({ fresh: true, toEnd: true });
  if (resume && chat.active_run_id && !state.live) await resumeRun(chat.active_run_id);
}

function branchUrl(leafId) {
  const chat = `/v1/chats/${encodeURIComponent(state.chatId)}`;
  return leafId ? `${chat}/messages/${encodeURIComponent(leafId)}/branch` : `${chat}/branch`;
}

function learn(messages) {
  for (const message of messages) {
    state.known.set(message.message_id, message);
    if (message.versions && message.versions.count) state.versions.set(message.message_id, message.versions);
  }
  state.byParent = null;
}

// A page of the branch from `from` (a URL of branchUrl's, or one with newest_leaf) after `pageToken`.
function branchPage(from, pageToken = null) {
  const url = new URL(from, location.origin);
  url.searchParams.set("page_size", String(MESSAGE_PAGE));
  if (pageToken) url.searchParams.set("page_token", pageToken);
  return json(url.pathname + url.search);
}

// The branch that ends at `leafId` (null: at the chat's newest message; `newest`: at the newest message
// under `leafId`, the way to another version): its newest page replaces the path on screen.
async function loadBranch(leafId, { newest = false } = {}) {
  const chatId = state.chatId;
  const from = newest ? `${branchUrl(leafId)}?newest_leaf=true` : branchUrl(leafId);
  const page = await branchPage(from);
  if (chatId !== state.chatId) return;
  learn(page.messages);
  state.path = page.messages.slice().reverse();
  state.older = page.next_page_token;
  state.branchFrom = from;
  state.leafId = state.path.length ? state.path[state.path.length - 1].message_id : null;
}

// The chat's newest messages of every branch: the versions a branch arrow can switch to.
async function loadRecent() {
  const chatId = state.chatId;
  const page = await json(`/v1/chats/${encodeURIComponent(chatId)}/messages?page_size=${MESSAGE_PAGE}`);
  if (chatId === state.chatId) learn(page.messages);
}

// After an answer: the branch from the chat's newest message, joined onto the path on screen where the
// two meet (a few messages back), so what was loaded above stays loaded.
async function extendBranch() {
  const chatId = state.chatId;
  const page = await json(`${branchUrl(null)}?page_size=8`);
  if (chatId !== state.chatId) return;
  learn(page.messages);
  const onScreen = new Map(state.path.map((m, index) => [m.message_id, index]));
  const meet = page.messages.findIndex((m) => onScreen.has(m.message_id));
  if (meet < 0 && page.next_page_token) {
    await loadBranch(null);
    return;
  }
  const kept = meet < 0 ? [] : state.path.slice(0, onScreen.get(page.messages[meet].message_id) + 1);
  if (meet < 0) state.older = null;
  state.path = kept.concat(page.messages.slice(0, meet < 0 ? undefined : meet).reverse());
  state.leafId = state.path.length ? state.path[state.path.length - 1].message_id : null;
}

// The next older page of the branch, shown above what is on screen without moving it.
async function loadOlder() {
  // Not while the chat opens: its first page is known but the skeleton (at the top) is still shown.
  if (!state.older || state.loadingOlder || state.opening) return;
  const chatId = state.chatId;
  const from = state.branchFrom;
  state.loadingOlder = true;
  try {
    const page = await branchPage(from, state.older);
    if (chatId !== state.chatId || from !== state.branchFrom) return;
    learn(page.messages);
    state.path = page.messages.slice().reverse().concat(state.path);
    state.older = page.next_page_token;
    renderMessages();
  } finally {
    state.loadingOlder = false;
  }
}

// Placeholders while a chat's messages load (hidden from assistive technology: the list is aria-busy).
function showSkeleton() {
  const list = $("#messages");
  list.setAttribute("aria-busy", "true");
  messageList().setItems(["user", "assistant", "user", "assistant"].map((role, index) => ({ key: `skeleton:${index}`, skeleton: role })), { fresh: true, toEnd: true, headShown: false });
}

// Every known message by its parent's id, newest first; made again only once more are known.
function children() {
  if (state.byParent) return state.byParent;
  const byParent = new Map();
  const time = (message) => Date.parse(message.create_time) || 0;
  for (const message of state.known.values()) {
    const key = message.parent_id || "";
    if (!byParent.has(key)) byParent.set(key, []);
    byParent.get(key).push(message);
  }
  for (const siblings of byParent.values()) if (siblings.length > 1) siblings.sort((a, b) => time(b) - time(a));
  state.byParent = byParent;
  return byParent;
}

// The path on screen up to (and with) `lastId`; all of it for undefined, none of it for null.
function pathUpTo(lastId) {
  if (lastId === undefined) return state.path;
  return state.path.slice(0, state.path.findIndex((m) => m.message_id === lastId) + 1);
}

// A message's versions: as its branch page gave them, or else (a message stored before the server
// indexed versions) as the messages loaded show them.
function versionsOf(message, byParent) {
  const given = state.versions.get(message.message_id);
  if (given) return { ...given, given: true };
  const siblings = byParent.get(message.parent_id || "") || [message]; // newest first
  const at = siblings.findIndex((m) => m.message_id === message.message_id);
  return {
    count: siblings.length,
    number: siblings.length - at,
    previous_id: siblings[at + 1]?.message_id ?? null,
    next_id: siblings[at - 1]?.message_id ?? null,
  };
}

function newestLeaf(message, byParent) {
  let current = message;
  while (byParent.has(current.message_id)) current = byParent.get(current.message_id)[0];
  return current;
}

let windowed = null;

function messageList() {
  if (!windowed) {
    const head = olderItem();
    windowed = new WindowedList($("#messages"), {
      render: renderItem,
      refine: refineItem,
      head,
      onScroll: () => {
        if ($("#messages").scrollTop < OLDER_SLACK_PX) loadOlder().catch(fail);
      },
      focusFallback: () => $("#messages"),
    });
  }
  return windowed;
}

// `fresh`: every message's element is made again (a branch switched, the last answer changed);
// `toEnd`: the list scrolls to its end. Otherwise the reader's place is kept.
function renderMessages({ fresh = false, toEnd = false } = {}) {
  const list = $("#messages");
  const byParent = children();
  const path = state.live ? pathUpTo(state.live.baseEnd) : state.path;
  const last = path.length ? path[path.length - 1].message_id : null;
  const items = path.map((message) => ({ key: message.message_id, message, byParent, isLast: message.message_id === last && !state.live }));
  if (state.live) {
    if (state.live.user !== null) items.push({ key: "live:user", message: { role: "user", content: state.live.user }, byParent });
    items.push({ key: "live", live: true });
  }
  const headShown = Boolean(state.older);
  keepingFocus(list, () => messageList().setItems(items, { fresh, toEnd, headShown }), () => $("#prompt"));
  list.setAttribute("aria-busy", String(Boolean(state.live)));
}

function renderItem(item) {
  if (item.skeleton) {
    const element = document.createElement("li");
    element.className = `message ${item.skeleton} skeleton`;
    element.setAttribute("aria-hidden", "true");
    return element;
  }
  if (item.live) return state.live.item;
  return messageItem(item.message, item.byParent, item.isLast);
}

// The way to older messages for keyboards and screen readers (scrolling near the top loads them too).
function olderItem() {
  const item = document.createElement("li");
  item.className = "older";
  item.id = "older";
  item.hidden = true;
  item.append(button("Load older messages", loadOlder, null, "older"));
  return item;
}

function messageItem(message, byParent, isLast) {
  const item = document.createElement("li");
  item.className = `message ${message.role}`;
  item.dataset.messageId = message.message_id || "";
  const content = document.createElement("div");
  content.className = "content";
  if (message.role === "assistant") showAnswer(message, content);
  else content.textContent = message.content;
  for (const call of message.tool_calls || []) {
    const line = document.createElement("code"); // a tool the caller runs (docs/tools.md)
    line.textContent = `${call.function.name}(${call.function.arguments})`;
    content.append(line);
  }
  const meta = document.createElement("div");
  meta.className = "meta muted";
  item.append(content, meta);
  if (!message.message_id) return item;
  const steps = state.steps.get(message.message_id);
  if (steps) content.before(stepsView(steps));

  const versions = versionsOf(message, byParent);
  if (versions.count > 1) {
    const show = (targetId) => async () => {
      if (!targetId) return;
      if (versions.given) await loadBranch(targetId, { newest: true });
      else await loadBranch(newestLeaf(state.known.get(targetId), byParent).message_id);
      renderMessages({ fresh: true, toEnd: true });
    };
    const branchPoint = message.parent_id || "root";
    const previous = button("‹", show(versions.previous_id), null, `previous:${branchPoint}`);
    previous.setAttribute("aria-label", "Previous version");
    const next = button("›", show(versions.next_id), null, `next:${branchPoint}`);
    next.setAttribute("aria-label", "Next version");
    const label = document.createElement("span");
    label.textContent = `${versions.number} / ${versions.count}`;
    meta.append(previous, label, next);
  }
  if (message.role === "assistant") {
    if (message.model) meta.append(modelLabel(message.model));
    meta.append(usageLabel(message.usage, message.finish_reason));
    if (isLast) meta.append(button("Regenerate", () => regenerate(message), null, "regenerate"));
  } else if (message.parent_id && message.role === "user") {
    // Editing the first message would need a "no parent" branch point, which the API cannot express yet.
    meta.append(button("Edit", async () => editMessage(item, message), null, `edit:${message.message_id}`));
  }
  return item;
}

// A stored answer's Markdown, parsed and sanitized once per message (a message's content never changes):
// kept once it is wholly shown (a big table fills in over a few tasks), and copied from then on. The
// most recently shown RENDERED_KEPT are kept: a long chat scrolled end to end keeps no more. An answer
// not kept shows its text first (`rough`), rendered when the list refines it (refineItem): a frame
// that brings several answers into view parses none of them.
function showAnswer(message, content) {
  const kept = state.rendered.get(message.message_id);
  if (kept) {
    state.rendered.delete(message.message_id);
    state.rendered.set(message.message_id, kept);
    content.append(kept.cloneNode(true));
    highlightCode(content);
    return;
  }
  content.classList.add("rough");
  content.textContent = message.content;
}

// Renders a rough answer's Markdown into its element (made by messageItem); false if it had none.
function refineItem(item, element) {
  const content = element.querySelector(".content.rough");
  if (!content) return false;
  content.classList.remove("rough");
  content.replaceChildren();
  renderAnswer(item.message, content);
  return true;
}

function renderAnswer(message, content) {
  const { fragment, complete } = renderMarkdown(message.content);
  content.append(fragment);
  complete.then((whole) => {
    if (!whole || !message.message_id) return;
    const copy = document.createDocumentFragment();
    for (const block of content.childNodes) copy.append(block.cloneNode(true));
    keepRendered(message.message_id, copy);
  });
}

function keepRendered(messageId, fragment) {
  state.rendered.set(messageId, fragment);
  if (state.rendered.size > RENDERED_KEPT) state.rendered.delete(state.rendered.keys().next().value);
}

// Which model wrote an answer: under load a free-tier answer may come from a cheaper model.
function modelLabel(model, degraded = false) {
  const label = document.createElement("span");
  label.className = "model";
  label.textContent = degraded ? `${model} (a lighter model: our servers are busy)` : model;
  return label;
}

function usageLabel(usage, finishReason) {
  const label = document.createElement("span");
  label.className = "usage";
  if (usage) {
    const cached = usage.cached_prompt_tokens ? ` (${usage.cached_prompt_tokens} cached)` : "";
    label.textContent = `${usage.prompt_tokens} prompt${cached} + ${usage.completion_tokens} completion tokens`;
  }
  if (finishReason && finishReason !== "stop") label.textContent += ` · ${finishReason}`;
  return label;
}

// The live answer's element, made once per run: the window takes it out and puts it back as the reader
// scrolls, and the answer goes on rendering into it either way.
function liveItem() {
  const item = document.createElement("li");
  item.className = "message assistant";
  item.id = "live";
  item.dataset.streaming = "true";
  const content = document.createElement("div");
  content.className = "content";
  state.live.view = new StreamingAnswer(content, followBottom);
  state.live.view.update(state.live.text);
  const meta = document.createElement("div");
  meta.className = "meta muted";
  if (state.live.model) meta.append(modelLabel(state.live.model, state.live.degraded));
  item.append(content, meta);
  showLiveSteps(item);
  return item;
}

// The live answer's tool steps, above its text, as they start and end.
function showLiveSteps(item = state.live.item) {
  const view = stepsView(state.live.steps);
  const shown = item.querySelector(".steps");
  if (shown && view) shown.replaceWith(view);
  else if (view) item.prepend(view);
  followBottom();
}

// While an answer streams, the list follows it only if the reader was at the bottom: someone who
// scrolled up to read stays where they are.
const OLDER_SLACK_PX = 400; // this close to the top, the next older page is fetched

function followBottom() {
  if (messageList().atBottom) messageList().scrollToEnd();
}

function editMessage(item, message) {
  const editor = document.createElement("textarea");
  editor.value = message.content;
  editor.rows = 3;
  editor.setAttribute("aria-label", "Edit message");
  const save = button("Save & send", async () => {
    const text = editor.value.trim();
    if (text) await send(text, message.parent_id);
  });
  const cancel = button("Cancel", async () => renderMessages({ fresh: true }));
  item.replaceChildren(editor, save, cancel);
  editor.focus();
}

// ---- streaming answers ------------------------------------------------------------------------------

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const event = { event: "message", data: "", id: null };
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith(":")) continue; // keep-alive
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") event.event = text;
        else if (field === "data") event.data += (event.data ? "\n" : "") + text;
        else if (field === "id") event.id = text;
      }
      if (event.data) yield event;
    }
  }
}

function remember() {
  const { runId, chatId, lastSeq, text, steps } = state.live;
  if (runId) sessionStorage.setItem(RUN_KEY, JSON.stringify({ runId, chatId, lastSeq, text, steps }));
}

// A run that ended busy before its answer began (the engine's queue limit refused it after its question
// was stored): an error like a busy server's refusal, so that the request is sent again with the same
// idempotency key, which answers the stored question instead of storing it twice.
const BUSY_RUN_ERRORS = { RESOURCE_EXHAUSTED: 429, UNAVAILABLE: 503 };

function refusedBeforeAnswer(error) {
  const status = BUSY_RUN_ERRORS[error.code];
  if (!status || state.live.text) return null;
  return new ApiError(status, error.message, error.retry_after_ms ? Math.ceil(error.retry_after_ms / 1000) : null);
}

// Reads one response's events into the live answer. Returns "done", "error", "dropped", or the ApiError
// of a run refused before its answer began.
async function consume(response) {
  try {
    for await (const event of sseEvents(response)) {
      const data = JSON.parse(event.data);
      if (event.id) state.live.lastSeq = Number(event.id);
      if (event.event === "started") {
        state.live.runId = data.run_id;
        state.live.chatId = data.chat_id;
        state.live.model = data.model;
        state.live.degraded = data.degraded;
        const meta = state.live.item.querySelector(".meta");
        if (meta) meta.replaceChildren(modelLabel(data.model, data.degraded));
        $("#stop").disabled = false;
      } else if (event.event === "delta") {
        state.live.text += data.text;
        if (state.live.view) state.live.view.update(state.live.text);
      } else if (event.event === "step_started" || event.event === "step_result") {
        recordStep(state.live.steps, event.event, data);
        showLiveSteps();
      } else if (event.event === "usage") {
        state.live.usage = data;
      } else if (event.event === "done") {
        return "done";
      } else if (event.event === "error" && !event.id) {
        // The stream broke, not the run (a run's own error has a sequence number): resume it.
        return "dropped";
      } else if (event.event === "error") {
        const refused = refusedBeforeAnswer(data);
        if (refused) return refused;
        notice(data.retry_after_ms ? `${data.message} (retry in ${Math.ceil(data.retry_after_ms / 1000)} s)` : data.message);
        return "error";
      }
      remember();
    }
  } catch (error) {
    if (error.name === "AbortError") return "done";
  }
  return "dropped";
}

// Streams a run to the end, resuming with Last-Event-ID whenever the connection drops.
async function follow(firstResponse) {
  let outcome = await consume(firstResponse);
  for (let attempt = 1; outcome === "dropped" && state.live.runId && attempt <= 8; attempt++) {
    await new Promise((resolve) => setTimeout(resolve, Math.min(250 * 2 ** attempt, 4000)));
    try {
      const response = await call(`/v1/runs/${state.live.runId}/events`, {
        headers: { "Last-Event-ID": String(state.live.lastSeq) },
      });
      outcome = await consume(response);
    } catch (error) {
      if (error instanceof ApiError && error.status < 500 && error.status !== 429) break;
    }
  }
  sessionStorage.removeItem(RUN_KEY);
  return outcome;
}

// `baseEnd`: the message the answer follows on screen (null: none; undefined: the whole path).
function startLive(baseEnd, userText, seed = {}) {
  state.live = { runId: null, chatId: state.chatId, lastSeq: 0, text: "", steps: [], usage: null, baseEnd, user: userText, ...seed };
  state.live.item = liveItem();
  setBusy(true);
  renderMessages({ toEnd: true });
}

async function finishLive() {
  const { runId, view, text, steps } = state.live;
  const streamed = view ? view.finish() : null;
  state.live = null;
  setBusy(false);
  await Promise.all([extendBranch(), loadChats()]);
  // The answer as stored is the text just rendered while streaming: it is shown as it is.
  const stored = runId && state.path.find((m) => m.run_id === runId && m.role === "assistant");
  if (streamed && stored && stored.content === text) keepRendered(stored.message_id, streamed);
  if (stored && steps.length) state.steps.set(stored.message_id, steps);
  renderMessages({ fresh: true });
  announceAnswer(stored);
  showUsage();
}

// The live region (#announcer) speaks an answer once, when it is complete: the whole streamed list is
// not live, so assistive technology is never told about single tokens.
const ANNOUNCE_MAX_CHARS = 4000;

function announceAnswer(answer) {
  if (!answer) return;
  // Its element, or (scrolled out of the window, or not rendered yet) its rendering kept, or made.
  const content = messageList().node(answer.message_id)?.querySelector(".content:not(.rough)");
  const kept = state.rendered.get(answer.message_id);
  const spoken = document.createElement("div");
  if (content) spoken.append(content.cloneNode(true));
  else spoken.append(kept ? kept.cloneNode(true) : renderMarkdown(answer.content).fragment);
  for (const copy of spoken.querySelectorAll(".copy-code")) copy.remove();
  let text = spoken.textContent.replace(/\s+/g, " ").trim();
  if (text.length > ANNOUNCE_MAX_CHARS) text = `${text.slice(0, ANNOUNCE_MAX_CHARS)}… (the answer continues in the chat)`;
  const stopped = answer.finish_reason && answer.finish_reason !== "stop" ? ` (${answer.finish_reason})` : "";
  $("#announcer").textContent = `Answer${stopped}: ${text}`;
}

// The token budget is shown for information; if it cannot be read, the label stays empty.
async function showUsage() {
  try {
    const usage = await json("/v1/usage");
    $("#usage").textContent =
      `${usage.used_tokens.toLocaleString()} of ${usage.limit_tokens.toLocaleString()} tokens used (${usage.tier})`;
  } catch {
    $("#usage").textContent = "";
  }
}

function setBusy(busy) {
  if (busy) $("#announcer").textContent = "";
  else if (document.activeElement === $("#stop")) $("#prompt").focus(); // #stop is about to hide
  $("#send").disabled = busy;
  $("#stop").hidden = !busy;
  $("#stop").disabled = !(state.live && state.live.runId);
  $("#messages").setAttribute("aria-busy", String(busy));
}

// Returns false when the request was refused before any answer (the caller may restore the input). A
// run refused before its answer began is retried as a refused request is: the same request, its key too.
async function withLive(base, userText, request) {
  startLive(base, userText);
  let opened = false;
  try {
    await withRetries(async () => {
      const response = await request();
      opened = true;
      notice("");
      const outcome = await follow(response);
      if (outcome instanceof ApiError) {
        Object.assign(state.live, { runId: null, lastSeq: 0, steps: [] });
        throw outcome;
      }
    });
  } catch (error) {
    fail(error);
  } finally {
    await finishLive().catch(fail);
  }
  return opened;
}

// ---- models: the chat models a chat may be answered by ----------------------------------------------

// The picker lists the chat models (a completion model takes no chats) and shows only when there is a
// choice. A request naming the picked model is answered by it and switches the chat to it.
async function loadModels() {
  const models = (await json("/v1/models")).data.filter((model) => model.kind === "chat");
  const picker = $("#model");
  for (const model of models) picker.append(new Option(model.id, model.id));
  picker.hidden = models.length < 2;
}

function pickedModel() {
  const model = $("#model").value;
  return model ? { model } : {};
}

// `parentId`: the message the new one follows (an edit's); the branch on screen's last by default.
async function send(text, parentId = state.leafId || "") {
  if (!state.chatId) {
    const chat = await json("/v1/chats", { method: "POST", body: pickedModel() });
    state.chatId = chat.chat_id;
    history.replaceState(null, "", `/?chat=${encodeURIComponent(chat.chat_id)}`);
  }
  const body = {
    content: text, parent_message_id: parentId, idempotency_key: crypto.randomUUID(), options: pickedModel(),
  };
  return withLive(parentId || null, text, () => call(`/v1/chats/${state.chatId}/messages`, { method: "POST", body }));
}

async function regenerate(answer) {
  const body = { idempotency_key: crypto.randomUUID(), options: pickedModel() };
  await withLive(answer.parent_id || null, null, () =>
    call(`/v1/chats/${state.chatId}/messages/${answer.message_id}/regenerate`, { method: "POST", body }));
}

async function resumeRun(runId) {
  const saved = JSON.parse(sessionStorage.getItem(RUN_KEY) || "null");
  const seed = saved && saved.runId === runId
    ? { runId, lastSeq: saved.lastSeq, text: saved.text, steps: saved.steps || [] }
    : { runId };
  startLive(undefined, null, seed);
  try {
    const response = await call(`/v1/runs/${runId}/events`, { headers: { "Last-Event-ID": String(state.live.lastSeq) } });
    await follow(response);
  } catch (error) {
    fail(error);
  } finally {
    await finishLive().catch(fail);
  }
}

async function stop() {
  if (!state.live || !state.live.runId) return;
  if (document.activeElement === $("#stop")) $("#prompt").focus(); // a disabled button drops focus
  $("#stop").disabled = true;
  await json(`/v1/runs/${state.live.runId}/cancel`, { method: "POST" });
}

// ---- start ------------------------------------------------------------------------------------------

async function start() {
  state.token = takeTokenFromUrl(TOKEN_KEY);
  $("#signin-form").addEventListener("submit", (event) => {
    event.preventDefault();
    keepToken(TOKEN_KEY, $("#token-input").value.trim());
    location.reload();
  });
  // Without a token the page may still be signed in: through the identity provider, with Envoy's
  // session cookies. /v1/me answering 401 below shows the sign-in box.
  $("#sign-out").addEventListener("click", () => signOut(TOKEN_KEY, state.token));
  $("#composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("#prompt").value.trim();
    if (!text || state.live) return;
    $("#prompt").value = "";
    // A refused message goes back into the box, so nothing typed is lost.
    send(text).then((sent) => { if (!sent && !$("#prompt").value) $("#prompt").value = text; }, fail);
  });
  $("#prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("#composer").requestSubmit();
    }
  });
  $("#stop").addEventListener("click", () => stop().catch(fail));
  handleCopyButtons($("#messages"));
  $("#new-chat").addEventListener("click", newChat);
  $("#more-chats").addEventListener("click", () => loadChats(true).catch(fail));
  $("#search").addEventListener("submit", (event) => {
    event.preventDefault();
    searchChats().catch(fail);
  });
  $("#search-input").addEventListener("input", () => {
    if (!$("#search-input").value.trim() && state.search) searchChats().catch(fail);
  });
  $("#more-results").addEventListener("click", () => searchChats(true).catch(fail));
  try {
    // The chat in the URL opens at once, alongside who the caller is and their chats.
    const saved = JSON.parse(sessionStorage.getItem(RUN_KEY) || "null");
    const chatId = new URLSearchParams(location.search).get("chat") || (saved && saved.chatId);
    // The picker is optional: chats go on with the default model if the list cannot be read. A chat
    // opening shows its model picked once the list is in (state.models).
    state.models = loadModels().catch(() => { $("#model").hidden = true; });
    const opening = chatId ? openChat(chatId).catch(fail) : null;
    const [me] = await Promise.all([json("/v1/me"), loadChats()]);
    state.tier = me.tier;
    $("#whoami").textContent = `Signed in as ${me.user_id} (${me.tier})`;
    $("#sign-out").hidden = false;
    showUsage();
    if (opening) await opening;
    else newChat();
  } catch (error) {
    fail(error);
  }
}

start();
