// The demo chat page: Send, Stop, Regenerate, and each reply's state as the server records it,
// its text shown as it is written (marked `data-streaming` until the saved reply replaces it).
// After a reload, or in another tab (`?conversation=<id>`), the conversation is read back from
// the server's listing; a press still unanswered at the reload is resumed under its own key by
// the client. Nothing here guesses a state: every badge is a state the server sent.
//
// Served by a product's own server (`/demo/config.json` says where replyd is), the page signs
// in as an end user and holds only that user's short-lived token, asking the product again when
// it runs out; served by replyd itself, it takes an API key, for a developer's own trials.

import {
  ProblemError,
  ReplydClient,
  isTerminal,
  type FollowText,
  type FollowWithdrawn,
  type MessagePage,
  type Press,
  type ReplyView,
  type RequestReport,
} from "@replyd/client";

interface Turn {
  id: string;
  message: string;
  tasks: string[];
}

interface Conversation {
  id: string;
  turns: Turn[];
}

/** What the page sent, for whoever watches it (the browser tests read it). */
interface Stats {
  requests: number;
  retries: number;
  reports: RequestReport[];
  /** End-user tokens the page got from the product's server (sign-ins and refreshes). */
  tokens: number;
}

/** Where a product's server says replyd is, and where to sign in. */
interface ProductConfig {
  api: string;
  session: string;
}

const STATE = "replyd.demo.conversation";
const KEY = "replyd.demo.key";
const USER = "replyd.demo.user";
const TOKEN = "replyd.demo.token";
const STATS = "replyd.demo.stats";

function load<T>(name: string, fallback: T): T {
  try {
    const text = sessionStorage.getItem(name);
    return text === null ? fallback : (JSON.parse(text) as T);
  } catch {
    return fallback;
  }
}

function save(name: string, value: unknown): void {
  sessionStorage.setItem(name, JSON.stringify(value));
}

function newId(): string {
  return Array.from(crypto.getRandomValues(new Uint8Array(8)), (b) => b.toString(16).padStart(2, "0")).join("");
}

function element<K extends keyof HTMLElementTagNameMap>(tag: K, attrs: Record<string, string> = {}, text?: string): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function byId<T extends HTMLElement>(id: string): T {
  const node = document.getElementById(id);
  if (node === null) throw new Error(`the page has no #${id}`);
  return node as T;
}

// A key in the fragment (`/demo#key=...`) is taken and removed from the address bar: a
// fragment never reaches a server, and the key then lives only in this tab's storage.
const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.get("key")) {
  sessionStorage.setItem(KEY, fragment.get("key")!);
  history.replaceState(null, "", location.pathname + location.search);
}

const stats: Stats = load(STATS, { requests: 0, retries: 0, reports: [], tokens: 0 });
stats.tokens = stats.tokens ?? 0;
let conversation: Conversation = load(STATE, { id: `demo-${newId()}`, turns: [] });
// Another tab opens a conversation by its id.
const asked = new URLSearchParams(location.search).get("conversation");
if (asked && asked !== conversation.id) conversation = { id: asked, turns: [] };

const onRequest = (report: RequestReport): void => {
  stats.requests++;
  if (report.retry > 0) stats.retries++;
  stats.reports.push(report);
  save(STATS, stats);
};

/** The product's server, when the page is served by one. */
async function productConfig(): Promise<ProductConfig | undefined> {
  try {
    const response = await fetch("/demo/config.json");
    return response.ok ? ((await response.json()) as ProductConfig) : undefined;
  } catch {
    return undefined;
  }
}

const product = await productConfig();

/** A token for `user` from the product's server (which alone holds the workspace's key). */
async function signIn(user: string): Promise<string> {
  if (product === undefined) throw new Error("no product server to sign in with");
  const response = await fetch(product.session, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ user_id: user }),
  });
  if (!response.ok) throw new Error(`the product refused to sign in ${user} (${response.status})`);
  const { token } = (await response.json()) as { token: string };
  sessionStorage.setItem(TOKEN, token);
  stats.tokens++;
  save(STATS, stats);
  return token;
}

const client =
  product === undefined
    ? new ReplydClient({ apiKey: () => sessionStorage.getItem(KEY) ?? "", onRequest })
    : new ReplydClient({
        baseUrl: product.api,
        apiKey: () => sessionStorage.getItem(TOKEN) ?? "",
        // The token ran out (or was revoked): ask the product for a new one.
        refreshToken: () => signIn(sessionStorage.getItem(USER) ?? ""),
        onRequest,
      });
(window as unknown as { replydDemo: unknown }).replydDemo = { stats, conversation: () => conversation };

function signedIn(): boolean {
  return sessionStorage.getItem(product === undefined ? KEY : TOKEN) !== null;
}

const transcript = byId<HTMLOListElement>("transcript");
const notice = byId<HTMLParagraphElement>("notice");
const compose = byId<HTMLFormElement>("compose");
const messageBox = byId<HTMLTextAreaElement>("message");
const sendButton = byId<HTMLButtonElement>("send");
const keyBox = byId<HTMLInputElement>("api-key");
const followed = new Set<string>();
let sending = false;

function saveConversation(): void {
  save(STATE, conversation);
  byId("conversation").textContent = `conversation ${conversation.id}`;
}

function say(text: string, attrs: Record<string, string> = {}): void {
  notice.hidden = false;
  notice.textContent = text;
  for (const name of notice.getAttributeNames()) if (name.startsWith("data-")) notice.removeAttribute(name);
  for (const [name, value] of Object.entries(attrs)) notice.setAttribute(name, value);
}

function quiet(): void {
  notice.hidden = true;
  notice.textContent = "";
}

/** What a failed press tells the user: when to try again, or why it cannot be taken. */
function explain(error: unknown): { text: string; attrs: Record<string, string> } {
  if (error instanceof ProblemError) {
    const attrs: Record<string, string> = { "data-kind": error.kind, "data-status": String(error.status) };
    if (error.status === 429 && error.retryAt !== undefined) {
      const seconds = Math.max(1, Math.ceil((error.retryAt.getTime() - Date.now()) / 1000));
      attrs["data-retry-at"] = error.retryAt.toISOString();
      const what = error.kind === "quota_exceeded" ? "The workspace's generation quota is used up" : "Too many requests";
      const at = seconds < 86_400 ? error.retryAt.toLocaleTimeString() : error.retryAt.toLocaleString();
      return { text: `${what}: try again in ${seconds} s (at ${at}).`, attrs };
    }
    return { text: `Not sent: ${error.problem.detail}`, attrs };
  }
  return { text: `No answer from the server (${String(error)}); your press is kept and can be sent again.`, attrs: { "data-kind": "network" } };
}

function turnNode(turn: Turn): HTMLLIElement {
  const existing = transcript.querySelector<HTMLLIElement>(`li[data-turn-id="${turn.id}"]`);
  if (existing) return existing;
  const node = element("li", { class: "turn", "data-turn-id": turn.id });
  node.append(element("p", { class: "question" }, turn.message), element("div", { class: "replies" }), element("p", { class: "turn-state" }));
  transcript.append(node);
  return node;
}

function replyNode(turn: Turn, taskId: string): HTMLDivElement {
  const replies = turnNode(turn).querySelector(".replies")!;
  const existing = replies.querySelector<HTMLDivElement>(`[data-task-id="${taskId}"]`);
  if (existing) return existing;
  const node = element("div", { class: "reply", "data-task-id": taskId, "data-status": "pending" });
  node.append(
    element("span", { class: "status" }, "still processing"),
    element("span", { class: "note" }),
    element("p", { class: "text" }),
    element("p", { class: "meta" }),
  );
  replies.append(node);
  return node;
}

const BADGE: Record<ReplyView["status"], string> = {
  pending: "still processing",
  running: "still processing",
  completed: "completed",
  failed: "failed",
  cancelled: "stopped",
};

/** Marks a reply as still being written, or no longer. */
function writing(node: HTMLElement, on: boolean): void {
  node.toggleAttribute("data-streaming", on);
  node.setAttribute("aria-busy", String(on));
}

function show(turn: Turn, view: ReplyView): void {
  const node = replyNode(turn, view.task_id);
  node.dataset.status = view.status;
  node.querySelector(".status")!.textContent = BADGE[view.status];
  const finished = isTerminal(view.status);
  // A text being written stays; otherwise the bubble holds the saved reply (in place of the
  // written text), the failure, or nothing (not written yet, stopped, or waiting to retry).
  if (view.status !== "running" || !node.hasAttribute("data-streaming")) {
    writing(node, false);
    node.querySelector(".text")!.textContent = view.reply ?? view.failure ?? "";
  }
  if (finished) node.querySelector(".note")!.textContent = "";
  const meta = node.querySelector(".meta")!;
  meta.textContent = `attempt ${view.attempts} of ${view.max_attempts} · task ${view.task_id.slice(0, 8)}`;
  const stopButton = node.querySelector<HTMLButtonElement>("button.stop");
  if (finished) {
    stopButton?.remove();
    if (!node.querySelector("button.regenerate")) {
      const again = element("button", { type: "button", class: "secondary regenerate" }, "Regenerate");
      again.addEventListener("click", () => void regenerate(turn, view.task_id, again));
      node.append(again);
    }
  } else if (!stopButton) {
    const stop = element("button", { type: "button", class: "secondary stop" }, "Stop");
    stop.addEventListener("click", () => void cancel(turn, view.task_id, stop));
    node.append(stop);
  }
}

/** The running attempt's text as it grows, or its withdrawal (it will not be saved). */
function live(turn: Turn, taskId: string, update: FollowText | FollowWithdrawn): void {
  const node = replyNode(turn, taskId);
  // A piece that comes after Stop (or after the saved reply) is not the answer.
  if (isTerminal(node.dataset.status as ReplyView["status"])) return;
  const text = node.querySelector(".text")!;
  const note = node.querySelector(".note")!;
  if (update.kind === "text") {
    text.textContent = update.text;
    note.textContent = "";
    writing(node, true);
  } else {
    text.textContent = "";
    writing(node, false);
    note.textContent = update.reason === "superseded" || update.reason === "retrying" ? "retrying…" : "";
  }
}

/** Stop: the task ends cancelled, unless its reply was saved first (then the reply shows). */
async function cancel(turn: Turn, taskId: string, button: HTMLButtonElement): Promise<void> {
  button.disabled = true;
  try {
    show(turn, await client.cancel(taskId));
    quiet();
  } catch (error) {
    if (error instanceof ProblemError && error.kind === "task_finished") {
      say("Too late to stop: the reply was already written.", { "data-kind": error.kind, "data-status": String(error.status) });
      show(turn, await client.get(taskId));
    } else {
      const { text, attrs } = explain(error);
      say(text, attrs);
      button.disabled = false;
    }
  }
}

async function follow(turn: Turn, taskId: string): Promise<void> {
  if (followed.has(taskId)) return;
  followed.add(taskId);
  replyNode(turn, taskId);
  try {
    for await (const update of client.follow(taskId, { text: true })) {
      if (update.kind === "status") show(turn, update.view);
      else live(turn, taskId, update);
    }
  } catch (error) {
    followed.delete(taskId);
    const node = replyNode(turn, taskId);
    writing(node, false);
    node.dataset.status = "unknown";
    node.querySelector(".status")!.textContent = "unknown";
    node.querySelector(".text")!.textContent = explain(error).text;
  }
}

function accepted(turn: Turn, taskId: string): void {
  const listed = conversation.turns.find((t) => t !== turn && t.tasks.includes(taskId));
  if (listed !== undefined) {
    // A press resumed after a reload that had reached the server: its turn is the listed one.
    conversation.turns = conversation.turns.filter((t) => t !== turn);
    transcript.querySelector(`li[data-turn-id="${turn.id}"]`)?.remove();
    saveConversation();
    void follow(listed, taskId);
    return;
  }
  if (!turn.tasks.includes(taskId)) {
    turn.tasks.push(taskId);
    saveConversation();
  }
  turnNode(turn).querySelector(".turn-state")!.textContent = "";
  void follow(turn, taskId);
}

/** Runs one press (new, or resumed after a reload or a failure) to its answer. */
async function settle(turn: Turn, press: () => Promise<{ task_id: string }>): Promise<void> {
  const state = turnNode(turn).querySelector<HTMLElement>(".turn-state")!;
  state.textContent = "sending…";
  try {
    const answer = await press();
    quiet();
    accepted(turn, answer.task_id);
  } catch (error) {
    const { text, attrs } = explain(error);
    say(text, attrs);
    state.textContent = "";
    const unsettled = client.pending().find((p) => p.meta?.turn === turn.id);
    if (unsettled) {
      state.textContent = "not sent yet";
      const retry = element("button", { type: "button", class: "secondary try-again" }, "Try again");
      retry.addEventListener("click", () => {
        retry.remove();
        void settle(turn, () => client.resume(unsettled));
      });
      state.append(" ", retry);
    } else {
      state.textContent = "not sent";
    }
  }
}

async function send(): Promise<void> {
  const text = messageBox.value.trim();
  if (sending || text === "") return;
  if (!signedIn()) {
    say(product === undefined ? "Enter an API key first." : "Sign in first.", { "data-kind": "no_key" });
    return;
  }
  sending = true;
  sendButton.disabled = true;
  const turn: Turn = { id: newId(), message: text, tasks: [] };
  conversation.turns.push(turn);
  saveConversation();
  messageBox.value = "";
  try {
    await settle(turn, () => client.send(conversation.id, text, { meta: { turn: turn.id } }));
  } finally {
    sending = false;
    sendButton.disabled = false;
  }
}

async function regenerate(turn: Turn, taskId: string, button: HTMLButtonElement): Promise<void> {
  button.disabled = true;
  try {
    await settle(turn, () => client.regenerate(taskId, { meta: { turn: turn.id } }));
  } finally {
    button.disabled = false;
  }
}

/** A press the client still holds (unanswered at the reload): its turn, found or rebuilt. */
function resume(press: Press): void {
  let turn = conversation.turns.find((t) => t.id === press.meta?.turn);
  if (turn === undefined) {
    turn = { id: press.meta?.turn ?? newId(), message: press.body?.message ?? "(regenerate)", tasks: [] };
    conversation.turns.push(turn);
    saveConversation();
  }
  const target = turn;
  void settle(target, () => client.resume(press));
}

compose.addEventListener("submit", (event) => {
  event.preventDefault();
  void send();
});
messageBox.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    void send();
  }
});
function newConversation(): void {
  conversation = { id: `demo-${newId()}`, turns: [] };
  transcript.replaceChildren();
  saveConversation();
}

byId<HTMLFormElement>("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const value = keyBox.value.trim();
  keyBox.value = "";
  if (product === undefined) {
    sessionStorage.setItem(KEY, value);
    quiet();
    return;
  }
  // Another user's conversations are not this one's to see: begin a new one.
  const before = sessionStorage.getItem(USER);
  if (before !== null && before !== value) newConversation();
  sessionStorage.setItem(USER, value);
  signIn(value).then(
    async () => {
      byId("user").textContent = `signed in as ${value}`;
      quiet();
      await render();
    },
    (error) => say(String(error), { "data-kind": "sign_in" }),
  );
});
byId<HTMLButtonElement>("new-conversation").addEventListener("click", newConversation);

/**
 * The conversation as the server has it: every message with its replies, in order. `undefined`
 * when it cannot be read (no credential yet, no such conversation yet, the server away): the
 * page then shows what it kept.
 */
async function listed(): Promise<Turn[] | undefined> {
  if (!signedIn()) return undefined;
  const turns: Turn[] = [];
  let after: string | undefined;
  try {
    // Bounded: 50 pages of 100 messages.
    for (let n = 0; n < 50; n++) {
      const page: MessagePage = await client.messages(conversation.id, after === undefined ? { limit: 100 } : { after, limit: 100 });
      for (const message of page.messages) {
        const turn: Turn = { id: message.message_id, message: message.content, tasks: message.replies.map((r) => r.task_id) };
        turns.push(turn);
        for (const view of message.replies) shownAtLoad.set(view.task_id, view);
      }
      if (!page.has_more || !page.next_cursor) break;
      after = page.next_cursor;
    }
  } catch {
    return undefined;
  }
  return turns;
}

const shownAtLoad = new Map<string, ReplyView>();

if (product !== undefined) {
  byId("api-key-label").textContent = "Your name";
  keyBox.type = "text";
  keyBox.placeholder = "alice";
  byId("use-key").textContent = "Sign in";
  const user = sessionStorage.getItem(USER);
  if (user !== null) byId("user").textContent = `signed in as ${user}`;
}
/** Shows the conversation as the server has it (or, unreadable, as kept) and follows it. */
async function render(): Promise<void> {
  const restored = await listed();
  if (restored !== undefined) {
    // What the page kept but the server does not have (a press not sent yet) is rebuilt
    // from the client's pending presses below.
    conversation.turns = restored;
    transcript.replaceChildren();
  }
  saveConversation();
  for (const turn of conversation.turns) {
    turnNode(turn);
    for (const taskId of turn.tasks) {
      const view = shownAtLoad.get(taskId);
      if (view !== undefined) show(turn, view);
      void follow(turn, taskId);
    }
  }
}

await render();
for (const press of client.pending()) resume(press);
document.body.dataset.ready = "true";
