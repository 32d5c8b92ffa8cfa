import { type Press, type PressStore } from "./presses.js";
import { type RetryPolicy } from "./retry.js";
import { type Accepted, type ErasedConversation, type MessagePage, type QuotaView, type ReplyView, type WithdrawnData } from "./types.js";
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
/** Waits `ms`, or rejects with the signal's reason once it is aborted. */
export declare function abortableSleep(ms: number, signal?: AbortSignal): Promise<void>;
export declare class ReplydClient {
    private readonly baseUrl;
    private readonly apiKey;
    private readonly refreshToken;
    /** The token `refreshToken` gave last, used instead of `apiKey` from then on. */
    private refreshed;
    private refreshing;
    private readonly presses;
    private readonly policy;
    private readonly streamIdleMs;
    private readonly streamFailuresBeforePolling;
    private readonly pollIntervalMs;
    private readonly onRequest;
    private readonly fetch;
    private readonly random;
    private readonly now;
    private readonly sleep;
    /** Calls under way per press (path and body): a second identical call joins the first. */
    private readonly inflight;
    constructor(options: ClientOptions);
    /**
     * Send a message: a new press, with a new key. Resolves with where to follow the task, once
     * the server has saved it; rejects with a `ProblemError` the server answered, or a
     * `NetworkError` when no answer came within the budget (the press then stays in
     * `pending()`, and `resume` sends it again under the same key).
     *
     * While it runs, the same call again (a double click) joins it: one press, one task.
     */
    send(conversationId: string, message: string, options?: SendOptions): Promise<Accepted>;
    /** Ask for another reply to a task's message: a press of its own, with its own key. */
    regenerate(taskId: string, options?: {
        meta?: Record<string, string>;
        signal?: AbortSignal;
    }): Promise<Accepted>;
    /**
     * Stop a task (the user pressed Stop): it makes no call, or its running call is cut short,
     * and it ends `cancelled`, uncharged. Safe to send again, and retried as the server's
     * answers allow. Rejects with a `ProblemError` of kind `task_finished` (409) when the reply
     * was saved (or the task failed) first: nothing changed, and `get` shows the reply.
     */
    cancel(taskId: string, options?: {
        signal?: AbortSignal;
    }): Promise<ReplyView>;
    /** Presses not yet settled (e.g. in flight when the page was reloaded), oldest first. */
    pending(): Press[];
    /** Send an unsettled press again, under its own key: the server answers with its task. */
    resume(press: Press, options?: {
        signal?: AbortSignal;
    }): Promise<Accepted>;
    /** A task's state now. */
    get(taskId: string, options?: {
        signal?: AbortSignal;
    }): Promise<ReplyView>;
    /**
     * One page of a conversation's messages, oldest first, each with its replies (the last is
     * the newest). Pass a page's `next_cursor` as `after` for the next; once `has_more` is false,
     * the same cursor later brings what was written since.
     */
    messages(conversationId: string, options?: {
        after?: string;
        limit?: number;
        signal?: AbortSignal;
    }): Promise<MessagePage>;
    /**
     * Erase a conversation: its messages, replies and tasks are deleted, a reply still being
     * written is stopped from being saved, and new messages to it are refused (410). Erasing it
     * again deletes nothing and answers the same way.
     */
    eraseConversation(conversationId: string, options?: {
        signal?: AbortSignal;
    }): Promise<ErasedConversation>;
    /** The caller's quota now. */
    quota(options?: {
        signal?: AbortSignal;
    }): Promise<QuotaView>;
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
    follow(taskId: string, options: FollowOptions & {
        text: true;
    }): AsyncGenerator<FollowUpdate, void, undefined>;
    follow(taskId: string, options?: FollowOptions & {
        text?: false;
    }): AsyncGenerator<ReplyView, void, undefined>;
    private states;
    /** The transport's updates with repeated states left out, up to a terminal state. */
    private updates;
    /**
     * The task's updates as the transport brings them, repeated states included: streamed, then
     * polled (states only) once streaming is found unavailable. Pieces of text already had, or
     * past a gap, are left out; `Last-Event-ID` names the last update taken, so a reconnect
     * brings what follows it.
     */
    private transport;
    private press;
    private join;
    /** Sends a press until the server answers it for good; forgets its key only then. */
    private settle;
    private credential;
    private headers;
    /**
     * After a 401 to a request sent with `sent`: whether a new credential is there to try, from
     * `refreshToken` (one call at a time), or because another request renewed it meanwhile.
     */
    private renew;
    /** One request, retried while it may yet succeed and the budget allows. */
    private call;
    /** The events of one stream connection; throws how it failed. */
    private events;
}
