// The client of `/v1/replies`: one idempotency key per press, kept until the server has
// answered that press for good; retries that reuse it; and a follow of a task's state (and, if
// asked, of its text as it is written) that reconnects, falls back to polling, and ends at a
// terminal state.

import { createParser, type EventSourceMessage } from "eventsource-parser";

import { NetworkError, ProblemError, type ReplydError } from "./errors.js";
import { memoryPresses, newKey, storagePresses, type Press, type PressStore } from "./presses.js";
import { DEFAULT_RETRY, fitsBudget, retryAfterMs, verdict, waitMs, type RetryPolicy } from "./retry.js";
import {
  isTerminal,
  type Accepted,
  type CreateReply,
  type DeltaData,
  type ErasedConversation,
  type MessagePage,
  type ProblemDetails,
  type QuotaView,
  type ReplyView,
  type WithdrawnData,
} from "./types.js";

/** One request this client sent, as `onRequest` reports it. */
export interface RequestReport {
  method: string;
  path: string;
  /** The `Idempotency-Key` it carried, for a press. */
  key?: string;
  /** Its place in the call: 0 for the first request, 1 for the first retry, ... */
  retry: number;
  /** The answer's status, or `network` when none came (an error or the attempt timeout). */
  outcome: number | "network";
}

export interface ClientOptions {
  /** Where the API is, e.g. `https://replies.example.com`; empty: this page's origin. */
  baseUrl?: string;
  /**
   * The credential (`Authorization: Bearer`): on a product's page, an end user's token from
   * `POST /v1/end-user-tokens` (asked for by the product's backend, which alone holds the
   * workspace's API key); on a server, the API key. Or a function that gives it per request.
   */
  apiKey: string | (() => string);
  /**
   * Gives a new end user's token when the API refuses the current one (401: it expired or
   * was revoked), by asking the product's backend. The request is sent once more with it,
   * under the same idempotency key; a second 401 is final. Concurrent refusals share one call.
   */
  refreshToken?: () => Promise<string>;
  /** Where unsettled presses are kept: `sessionStorage` when there is one, else memory. */
  presses?: PressStore;
  retry?: Partial<RetryPolicy>;
  /** The longest a follow stream may stay silent before it is taken for dead (ms). The server
   * sends a keep-alive every 15 s. */
  streamIdleMs?: number;
  /** Stream connections in a row that bring no event before `follow` polls instead. */
  streamFailuresBeforePolling?: number;
  /** How often `follow` reads the task when it polls (ms). */
  pollIntervalMs?: number;
  /** Called once per request sent. */
  onRequest?: (report: RequestReport) => void;
  fetch?: typeof fetch;
  random?: () => number;
  now?: () => number;
  sleep?: (ms: number, signal?: AbortSignal) => Promise<void>;
}

/** What a Send carries besides the conversation and the message. */
export interface SendOptions {
  documentVersion?: string;
  model?: string;
  context?: string;
  maxOutputTokens?: number;
  /**
   * After a Regenerate, which answer of an earlier message the user kept: those replies' task
   * ids (one per message). Messages not named are sent with their newest reply.
   */
  keptReplies?: string[];
  /** Stored with the press and handed back by `pending()`. */
  meta?: Record<string, string>;
  signal?: AbortSignal;
}

export interface FollowOptions {
  signal?: AbortSignal;
  /** `false`: poll from the start (no streaming). */
  stream?: boolean;
}

/** A new state of the task. A `completed` one carries the saved reply: it replaces the text. */
export interface FollowStatus {
  kind: "status";
  view: ReplyView;
}

/** The running attempt's text grew by `delta`; `text` is all of it so far. */
export interface FollowText {
  kind: "text";
  text: string;
  delta: string;
  /** The attempt whose text this is: another attempt's text starts from empty. */
  assignmentVersion: number;
  /** The piece's number in its attempt, from 1. */
  seq: number;
}

/** The attempt's text will not be saved: clear it (the next attempt's starts from empty). */
export interface FollowWithdrawn {
  kind: "withdrawn";
  assignmentVersion: number;
  /** What the task is now: `superseded` (another attempt runs), `retrying`, `failed`, `cancelled`. */
  reason: WithdrawnData["reason"];
}

/** What `follow(taskId, { text: true })` yields. */
export type FollowUpdate = FollowStatus | FollowText | FollowWithdrawn;

/** The text a follow holds: its attempt, the number of its last piece, the text. */
interface LiveText {
  version: number;
  seq: number;
  text: string;
}

/**
 * The update one event brings, given the text held: `undefined` for a piece already had (or
 * an event that is no update), `gap` for a piece past the next one.
 */
function parseUpdate(event: EventSourceMessage, live: LiveText | undefined): FollowUpdate | "gap" | undefined {
  let data: unknown;
  try {
    data = JSON.parse(event.data);
  } catch {
    return undefined; // not an update: the next read brings one
  }
  switch (event.event) {
    case "status":
      return { kind: "status", view: data as ReplyView };
    case "delta": {
      const delta = data as DeltaData;
      // A piece of another attempt than the one held starts a new text.
      const held = live?.version === delta.assignment_version ? live : undefined;
      const next = (held?.seq ?? 0) + 1;
      if (delta.seq < next) return undefined;
      if (delta.seq > next) return "gap";
      return {
        kind: "text",
        text: (held?.text ?? "") + delta.text,
        delta: delta.text,
        assignmentVersion: delta.assignment_version,
        seq: delta.seq,
      };
    }
    case "withdrawn": {
      const withdrawn = data as WithdrawnData;
      // Another attempt's than the text held: nothing held is void.
      if (live !== undefined && live.version !== withdrawn.assignment_version) return undefined;
      return { kind: "withdrawn", assignmentVersion: withdrawn.assignment_version, reason: withdrawn.reason };
    }
    default:
      return undefined;
  }
}

/** Waits `ms`, or rejects with the signal's reason once it is aborted. */
export function abortableSleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** The stream said nothing: no `text/event-stream` here (a proxy that buffers, a page). */
class StreamUnavailable extends Error {}

/** A stream's connection failed before an event; `retryAfter` if the server said when. */
class StreamFailed extends Error {
  constructor(
    readonly serverWaitMs: number | undefined,
    cause: unknown,
  ) {
    super("the event stream failed", { cause });
  }
}

function defaultPresses(): PressStore {
  try {
    if (typeof sessionStorage !== "undefined") return storagePresses(sessionStorage);
  } catch {
    // Storage can be refused (privacy settings, sandboxed frames): keep presses in memory.
  }
  return memoryPresses();
}

/** A problem from any answer: the body when it is problem+json, else one made from the status. */
async function problemOf(response: Response): Promise<ProblemDetails> {
  const type = response.headers.get("content-type") ?? "";
  const text = await response.text().catch(() => "");
  if (type.startsWith("application/problem+json") || type.startsWith("application/json")) {
    try {
      const body = JSON.parse(text) as Partial<ProblemDetails>;
      if (typeof body.title === "string" && typeof body.detail === "string") {
        return {
          type: typeof body.type === "string" ? body.type : "about:blank",
          title: body.title,
          status: response.status,
          detail: body.detail,
          ...(Array.isArray(body.fields) ? { fields: body.fields } : {}),
        };
      }
    } catch {
      // Not the API's problem: described below.
    }
  }
  return {
    type: "about:blank",
    title: response.statusText || `HTTP ${response.status}`,
    status: response.status,
    detail: `the server answered ${response.status} with ${type || "no content type"}, not a problem`,
  };
}

export class ReplydClient {
  private readonly baseUrl: string;
  private readonly apiKey: () => string;
  private readonly refreshToken: (() => Promise<string>) | undefined;
  /** The token `refreshToken` gave last, used instead of `apiKey` from then on. */
  private refreshed: string | undefined;
  private refreshing: Promise<string> | undefined;
  private readonly presses: PressStore;
  private readonly policy: RetryPolicy;
  private readonly streamIdleMs: number;
  private readonly streamFailuresBeforePolling: number;
  private readonly pollIntervalMs: number;
  private readonly onRequest: (report: RequestReport) => void;
  private readonly fetch: typeof fetch;
  private readonly random: () => number;
  private readonly now: () => number;
  private readonly sleep: (ms: number, signal?: AbortSignal) => Promise<void>;
  /** Calls under way per press (path and body): a second identical call joins the first. */
  private readonly inflight = new Map<string, Promise<Accepted>>();

  constructor(options: ClientOptions) {
    this.baseUrl = (options.baseUrl ?? "").replace(/\/+$/, "");
    const key = options.apiKey;
    this.apiKey = typeof key === "function" ? key : () => key;
    this.refreshToken = options.refreshToken;
    this.presses = options.presses ?? defaultPresses();
    this.policy = { ...DEFAULT_RETRY, ...options.retry };
    this.streamIdleMs = options.streamIdleMs ?? 45_000;
    this.streamFailuresBeforePolling = options.streamFailuresBeforePolling ?? 3;
    this.pollIntervalMs = options.pollIntervalMs ?? 1_000;
    this.onRequest = options.onRequest ?? (() => {});
    // Unbound, `fetch` throws "Illegal invocation" in browsers.
    this.fetch = options.fetch ?? ((input, init) => globalThis.fetch(input, init));
    this.random = options.random ?? Math.random;
    this.now = options.now ?? Date.now;
    this.sleep = options.sleep ?? abortableSleep;
  }

  /**
   * Send a message: a new press, with a new key. Resolves with where to follow the task, once
   * the server has saved it; rejects with a `ProblemError` the server answered, or a
   * `NetworkError` when no answer came within the budget (the press then stays in
   * `pending()`, and `resume` sends it again under the same key).
   *
   * While it runs, the same call again (a double click) joins it: one press, one task.
   */
  send(conversationId: string, message: string, options: SendOptions = {}): Promise<Accepted> {
    const body: CreateReply = { conversation_id: conversationId, message };
    if (options.documentVersion !== undefined) body.document_version = options.documentVersion;
    if (options.model !== undefined) body.model = options.model;
    if (options.context !== undefined) body.context = options.context;
    if (options.maxOutputTokens !== undefined) body.max_output_tokens = options.maxOutputTokens;
    if (options.keptReplies !== undefined && options.keptReplies.length > 0) body.kept_replies = options.keptReplies;
    return this.press("/v1/replies", body, options.meta, options.signal);
  }

  /** Ask for another reply to a task's message: a press of its own, with its own key. */
  regenerate(taskId: string, options: { meta?: Record<string, string>; signal?: AbortSignal } = {}): Promise<Accepted> {
    return this.press(`/v1/replies/${encodeURIComponent(taskId)}/regenerate`, undefined, options.meta, options.signal);
  }

  /**
   * Stop a task (the user pressed Stop): it makes no call, or its running call is cut short,
   * and it ends `cancelled`, uncharged. Safe to send again, and retried as the server's
   * answers allow. Rejects with a `ProblemError` of kind `task_finished` (409) when the reply
   * was saved (or the task failed) first: nothing changed, and `get` shows the reply.
   */
  cancel(taskId: string, options: { signal?: AbortSignal } = {}): Promise<ReplyView> {
    return this.call<ReplyView>("POST", `/v1/replies/${encodeURIComponent(taskId)}/cancel`, {}, options.signal);
  }

  /** Presses not yet settled (e.g. in flight when the page was reloaded), oldest first. */
  pending(): Press[] {
    return this.presses.list();
  }

  /** Send an unsettled press again, under its own key: the server answers with its task. */
  resume(press: Press, options: { signal?: AbortSignal } = {}): Promise<Accepted> {
    return this.join(press, options.signal);
  }

  /** A task's state now. */
  get(taskId: string, options: { signal?: AbortSignal } = {}): Promise<ReplyView> {
    return this.call<ReplyView>("GET", `/v1/replies/${encodeURIComponent(taskId)}`, {}, options.signal);
  }

  /**
   * One page of a conversation's messages, oldest first, each with its replies (the last is
   * the newest). Pass a page's `next_cursor` as `after` for the next; once `has_more` is false,
   * the same cursor later brings what was written since.
   */
  messages(
    conversationId: string,
    options: { after?: string; limit?: number; signal?: AbortSignal } = {},
  ): Promise<MessagePage> {
    const query = new URLSearchParams();
    if (options.after !== undefined) query.set("after", options.after);
    if (options.limit !== undefined) query.set("limit", String(options.limit));
    const search = query.toString();
    return this.call<MessagePage>(
      "GET",
      `/v1/conversations/${encodeURIComponent(conversationId)}/messages${search ? `?${search}` : ""}`,
      {},
      options.signal,
    );
  }

  /**
   * Erase a conversation: its messages, replies and tasks are deleted, a reply still being
   * written is stopped from being saved, and new messages to it are refused (410). Erasing it
   * again deletes nothing and answers the same way.
   */
  eraseConversation(conversationId: string, options: { signal?: AbortSignal } = {}): Promise<ErasedConversation> {
    return this.call<ErasedConversation>("DELETE", `/v1/conversations/${encodeURIComponent(conversationId)}`, {}, options.signal);
  }

  /** The caller's quota now. */
  quota(options: { signal?: AbortSignal } = {}): Promise<QuotaView> {
    return this.call<QuotaView>("GET", "/v1/quota", {}, options.signal);
  }

  /**
   * A task's states as they change, from the current one to a terminal one (`completed`,
   * `failed` or `cancelled`), each once. Streams Server-Sent Events; a cut stream reconnects with
   * `Last-Event-ID`; where streaming is unavailable (no event stream comes back, or several
   * connections in a row bring nothing), it polls `GET /v1/replies/{task_id}` instead. It
   * outlasts outages of any length; it ends early only by throwing a `ProblemError` that is
   * final (e.g. 404: no such task in this workspace) or the abort signal's reason.
   *
   * With `{ text: true }`, it yields `FollowUpdate`s instead: the same states, and between them
   * the running attempt's text as it grows and its withdrawals.
   */
  follow(taskId: string, options: FollowOptions & { text: true }): AsyncGenerator<FollowUpdate, void, undefined>;
  follow(taskId: string, options?: FollowOptions & { text?: false }): AsyncGenerator<ReplyView, void, undefined>;
  follow(taskId: string, options: FollowOptions & { text?: boolean } = {}): AsyncGenerator<FollowUpdate | ReplyView, void, undefined> {
    return options.text === true ? this.updates(taskId, options) : this.states(taskId, options);
  }

  private async *states(taskId: string, options: FollowOptions): AsyncGenerator<ReplyView, void, undefined> {
    for await (const update of this.updates(taskId, options)) if (update.kind === "status") yield update.view;
  }

  /** The transport's updates with repeated states left out, up to a terminal state. */
  private async *updates(taskId: string, options: FollowOptions): AsyncGenerator<FollowUpdate, void, undefined> {
    let last: ReplyView | undefined;
    for await (const update of this.transport(taskId, options)) {
      if (update.kind !== "status") {
        yield update;
        continue;
      }
      const view = update.view;
      if (last === undefined || view.status !== last.status || view.updated_at !== last.updated_at) {
        last = view;
        yield update;
      }
      if (isTerminal(view.status)) return;
    }
  }

  /**
   * The task's updates as the transport brings them, repeated states included: streamed, then
   * polled (states only) once streaming is found unavailable. Pieces of text already had, or
   * past a gap, are left out; `Last-Event-ID` names the last update taken, so a reconnect
   * brings what follows it.
   */
  private async *transport(taskId: string, options: FollowOptions): AsyncGenerator<FollowUpdate, void, undefined> {
    const { signal } = options;
    let streaming = options.stream ?? true;
    let lastEventId: string | undefined;
    let live: LiveText | undefined;
    let silentConnections = 0;
    let retry = 0;

    while (true) {
      if (!streaming) {
        let view: ReplyView;
        try {
          view = await this.get(taskId, signal ? { signal } : {});
        } catch (error) {
          // An outage longer than one call's budget does not end the follow: the task is
          // still there, and the next poll may see it.
          if (signal?.aborted || (error instanceof ProblemError && error.refused)) throw error;
          await this.sleep(waitMs(retry++, undefined, this.policy, this.random), signal);
          continue;
        }
        retry = 0;
        yield { kind: "status", view };
        await this.sleep(this.pollIntervalMs, signal);
        continue;
      }
      let serverWaitMs: number | undefined;
      let events = 0;
      try {
        for await (const event of this.events(taskId, lastEventId, signal)) {
          events++;
          const update = parseUpdate(event, live);
          if (update === "gap") break; // pieces were lost: reconnect after the last one taken
          if (update === undefined) continue; // a piece had already, or not an update
          if (event.id !== undefined) lastEventId = event.id;
          if (update.kind === "text") {
            live = { version: update.assignmentVersion, seq: update.seq, text: update.text };
          } else if (update.kind === "withdrawn") {
            live = undefined;
          }
          silentConnections = 0;
          retry = 0;
          yield update;
        }
      } catch (error) {
        if (signal?.aborted) throw signal.reason;
        if (error instanceof ProblemError) throw error;
        if (error instanceof StreamUnavailable) {
          streaming = false;
          continue;
        }
        if (error instanceof StreamFailed) serverWaitMs = error.serverWaitMs;
      }
      // The stream ended or broke before a terminal state: reconnect after a backoff.
      if (events === 0 && ++silentConnections >= this.streamFailuresBeforePolling) {
        streaming = false;
        continue;
      }
      await this.sleep(waitMs(retry++, serverWaitMs, this.policy, this.random), signal);
    }
  }

  private press(path: string, body: CreateReply | undefined, meta: Record<string, string> | undefined, signal?: AbortSignal): Promise<Accepted> {
    const same = this.inflight.get(identity(path, body));
    if (same) return same;
    const press: Press = { key: newKey(), path, createdAt: this.now() };
    if (body !== undefined) press.body = body;
    if (meta !== undefined) press.meta = meta;
    // Stored before the first request: a reload mid-request finds it and resends it.
    this.presses.put(press);
    return this.join(press, signal);
  }

  private join(press: Press, signal?: AbortSignal): Promise<Accepted> {
    const id = identity(press.path, press.body);
    const same = this.inflight.get(id);
    if (same) return same;
    const settled = this.settle(press, signal).finally(() => this.inflight.delete(id));
    this.inflight.set(id, settled);
    return settled;
  }

  /** Sends a press until the server answers it for good; forgets its key only then. */
  private async settle(press: Press, signal?: AbortSignal): Promise<Accepted> {
    try {
      const init = press.body === undefined ? { key: press.key } : { key: press.key, body: press.body };
      const accepted = await this.call<Accepted>("POST", press.path, init, signal);
      this.presses.delete(press.key);
      return accepted;
    } catch (error) {
      if (error instanceof ProblemError && error.refused) this.presses.delete(press.key);
      throw error;
    }
  }

  private credential(): string {
    return this.refreshed ?? this.apiKey();
  }

  private headers(extra: Record<string, string>, credential: string): Record<string, string> {
    return { authorization: `Bearer ${credential}`, ...extra };
  }

  /**
   * After a 401 to a request sent with `sent`: whether a new credential is there to try, from
   * `refreshToken` (one call at a time), or because another request renewed it meanwhile.
   */
  private async renew(sent: string): Promise<boolean> {
    if (this.refreshToken === undefined) return false;
    if (this.credential() !== sent) return true;
    this.refreshing ??= this.refreshToken().finally(() => {
      this.refreshing = undefined;
    });
    this.refreshed = await this.refreshing;
    return this.refreshed !== sent;
  }

  /** One request, retried while it may yet succeed and the budget allows. */
  private async call<T>(method: string, path: string, init: { key?: string; body?: CreateReply }, signal?: AbortSignal): Promise<T> {
    const started = this.now();
    const headers: Record<string, string> = { accept: "application/json" };
    if (init.key !== undefined) headers["idempotency-key"] = init.key;
    if (init.body !== undefined) headers["content-type"] = "application/json";
    const body = init.body === undefined ? undefined : JSON.stringify(init.body);
    let renewed = false;
    for (let retry = 0, requests = 1; ; retry++, requests++) {
      let failure: ReplydError;
      const credential = this.credential();
      let serverWaitMs: number | undefined;
      const report: RequestReport = { method, path, retry, outcome: "network" };
      if (init.key !== undefined) report.key = init.key;
      const timeout = AbortSignal.timeout(this.policy.attemptTimeoutMs);
      try {
        const response = await this.fetch(this.baseUrl + path, {
          method,
          headers: this.headers(headers, credential),
          ...(body === undefined ? {} : { body }),
          signal: signal ? AbortSignal.any([signal, timeout]) : timeout,
        });
        report.outcome = response.status;
        this.onRequest(report);
        if (verdict(response.status) === "ok") {
          try {
            return (await response.json()) as T;
          } catch (error) {
            // The answer was cut: as lost as no answer (and a retry under the key is safe).
            if (signal?.aborted) throw signal.reason;
            failure = new NetworkError(`the answer to ${method} ${path} was cut off`, requests, error);
          }
        } else {
          serverWaitMs = retryAfterMs(response.headers.get("retry-after"), this.now());
          const retryAt = serverWaitMs === undefined ? undefined : new Date(this.now() + serverWaitMs);
          const problem = new ProblemError(await problemOf(response), requests, retryAt);
          if (response.status === 401 && !renewed && (await this.renew(credential))) {
            // A new token: the same request once more, at once.
            renewed = true;
            continue;
          }
          if (problem.refused) throw problem;
          failure = problem;
        }
      } catch (error) {
        if (error instanceof ProblemError) throw error;
        if (signal?.aborted) throw signal.reason;
        if (report.outcome === "network") this.onRequest(report);
        const why = timeout.aborted ? `no answer within ${this.policy.attemptTimeoutMs} ms` : String(error);
        failure = new NetworkError(`${method} ${path}: ${why}`, requests, error);
      }
      const wait = waitMs(retry, serverWaitMs, this.policy, this.random);
      if (!fitsBudget(started, this.now(), wait, this.policy)) throw failure;
      await this.sleep(wait, signal);
    }
  }

  /** The events of one stream connection; throws how it failed. */
  private async *events(taskId: string, lastEventId: string | undefined, signal?: AbortSignal): AsyncGenerator<EventSourceMessage, void, undefined> {
    // An abort listener never fires for a signal aborted already.
    signal?.throwIfAborted();
    const path = `/v1/replies/${encodeURIComponent(taskId)}/events`;
    const headers: Record<string, string> = { accept: "text/event-stream" };
    if (lastEventId !== undefined) headers["last-event-id"] = lastEventId;
    const connection = new AbortController();
    const onAbort = () => connection.abort(signal?.reason);
    signal?.addEventListener("abort", onAbort, { once: true });
    const connectTimer = setTimeout(() => connection.abort(new Error("no answer")), this.policy.attemptTimeoutMs);
    const report: RequestReport = { method: "GET", path, retry: 0, outcome: "network" };
    let response: Response;
    const credential = this.credential();
    try {
      response = await this.fetch(this.baseUrl + path, { headers: this.headers(headers, credential), signal: connection.signal });
    } catch (error) {
      this.onRequest(report);
      signal?.removeEventListener("abort", onAbort);
      throw new StreamFailed(undefined, error);
    } finally {
      clearTimeout(connectTimer);
    }
    report.outcome = response.status;
    this.onRequest(report);
    try {
      if (response.status !== 200) {
        const serverWaitMs = retryAfterMs(response.headers.get("retry-after"), this.now());
        const problem = new ProblemError(await problemOf(response), 1, undefined);
        // A new token: connect again with it.
        if (response.status === 401 && (await this.renew(credential))) throw new StreamFailed(0, problem);
        if (problem.refused) throw problem;
        throw new StreamFailed(serverWaitMs, problem);
      }
      const type = response.headers.get("content-type") ?? "";
      if (!type.startsWith("text/event-stream") || response.body === null) {
        await response.body?.cancel().catch(() => {});
        throw new StreamUnavailable(`the stream answered ${type || "no content type"}`);
      }
      const queue: EventSourceMessage[] = [];
      const parser = createParser({ onEvent: (event) => queue.push(event) });
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      try {
        while (true) {
          // A connection can die without a word (a sleeping laptop, a dropped NAT entry):
          // silence longer than the keep-alive period ends it.
          let idle: ReturnType<typeof setTimeout> | undefined;
          const silence = new Promise<never>((_, reject) => {
            idle = setTimeout(() => reject(new Error(`no event or keep-alive in ${this.streamIdleMs} ms`)), this.streamIdleMs);
          });
          let chunk: ReadableStreamReadResult<string>;
          try {
            chunk = await Promise.race([reader.read(), silence]);
          } finally {
            clearTimeout(idle);
          }
          if (chunk.done) return;
          parser.feed(chunk.value);
          while (queue.length > 0) yield queue.shift()!;
        }
      } catch (error) {
        if (error instanceof ProblemError) throw error;
        throw new StreamFailed(undefined, error);
      } finally {
        reader.cancel().catch(() => {});
      }
    } finally {
      signal?.removeEventListener("abort", onAbort);
      connection.abort();
    }
  }
}

function identity(path: string, body: CreateReply | undefined): string {
  return `${path} ${JSON.stringify(body ?? null)}`;
}
