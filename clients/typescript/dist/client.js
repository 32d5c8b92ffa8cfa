// The client of `/v1/replies`: one idempotency key per press, kept until the server has
// answered that press for good; retries that reuse it; and a follow of a task's state (and, if
// asked, of its text as it is written) that reconnects, falls back to polling, and ends at a
// terminal state.
import { createParser } from "eventsource-parser";
import { NetworkError, ProblemError } from "./errors.js";
import { memoryPresses, newKey, storagePresses } from "./presses.js";
import { DEFAULT_RETRY, fitsBudget, retryAfterMs, verdict, waitMs } from "./retry.js";
import { isTerminal, } from "./types.js";
/**
 * The update one event brings, given the text held: `undefined` for a piece already had (or
 * an event that is no update), `gap` for a piece past the next one.
 */
function parseUpdate(event, live) {
    let data;
    try {
        data = JSON.parse(event.data);
    }
    catch {
        return undefined; // not an update: the next read brings one
    }
    switch (event.event) {
        case "status":
            return { kind: "status", view: data };
        case "delta": {
            const delta = data;
            // A piece of another attempt than the one held starts a new text.
            const held = live?.version === delta.assignment_version ? live : undefined;
            const next = (held?.seq ?? 0) + 1;
            if (delta.seq < next)
                return undefined;
            if (delta.seq > next)
                return "gap";
            return {
                kind: "text",
                text: (held?.text ?? "") + delta.text,
                delta: delta.text,
                assignmentVersion: delta.assignment_version,
                seq: delta.seq,
            };
        }
        case "withdrawn": {
            const withdrawn = data;
            // Another attempt's than the text held: nothing held is void.
            if (live !== undefined && live.version !== withdrawn.assignment_version)
                return undefined;
            return { kind: "withdrawn", assignmentVersion: withdrawn.assignment_version, reason: withdrawn.reason };
        }
        default:
            return undefined;
    }
}
/** Waits `ms`, or rejects with the signal's reason once it is aborted. */
export function abortableSleep(ms, signal) {
    return new Promise((resolve, reject) => {
        if (signal?.aborted)
            return reject(signal.reason);
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
class StreamUnavailable extends Error {
}
/** A stream's connection failed before an event; `retryAfter` if the server said when. */
class StreamFailed extends Error {
    serverWaitMs;
    constructor(serverWaitMs, cause) {
        super("the event stream failed", { cause });
        this.serverWaitMs = serverWaitMs;
    }
}
function defaultPresses() {
    try {
        if (typeof sessionStorage !== "undefined")
            return storagePresses(sessionStorage);
    }
    catch {
        // Storage can be refused (privacy settings, sandboxed frames): keep presses in memory.
    }
    return memoryPresses();
}
/** A problem from any answer: the body when it is problem+json, else one made from the status. */
async function problemOf(response) {
    const type = response.headers.get("content-type") ?? "";
    const text = await response.text().catch(() => "");
    if (type.startsWith("application/problem+json") || type.startsWith("application/json")) {
        try {
            const body = JSON.parse(text);
            if (typeof body.title === "string" && typeof body.detail === "string") {
                return {
                    type: typeof body.type === "string" ? body.type : "about:blank",
                    title: body.title,
                    status: response.status,
                    detail: body.detail,
                    ...(Array.isArray(body.fields) ? { fields: body.fields } : {}),
                };
            }
        }
        catch {
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
    baseUrl;
    apiKey;
    refreshToken;
    /** The token `refreshToken` gave last, used instead of `apiKey` from then on. */
    refreshed;
    refreshing;
    presses;
    policy;
    streamIdleMs;
    streamFailuresBeforePolling;
    pollIntervalMs;
    onRequest;
    fetch;
    random;
    now;
    sleep;
    /** Calls under way per press (path and body): a second identical call joins the first. */
    inflight = new Map();
    constructor(options) {
        this.baseUrl = (options.baseUrl ?? "").replace(/\/+$/, "");
        const key = options.apiKey;
        this.apiKey = typeof key === "function" ? key : () => key;
        this.refreshToken = options.refreshToken;
        this.presses = options.presses ?? defaultPresses();
        this.policy = { ...DEFAULT_RETRY, ...options.retry };
        this.streamIdleMs = options.streamIdleMs ?? 45_000;
        this.streamFailuresBeforePolling = options.streamFailuresBeforePolling ?? 3;
        this.pollIntervalMs = options.pollIntervalMs ?? 1_000;
        this.onRequest = options.onRequest ?? (() => { });
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
    send(conversationId, message, options = {}) {
        const body = { conversation_id: conversationId, message };
        if (options.documentVersion !== undefined)
            body.document_version = options.documentVersion;
        if (options.model !== undefined)
            body.model = options.model;
        if (options.context !== undefined)
            body.context = options.context;
        if (options.maxOutputTokens !== undefined)
            body.max_output_tokens = options.maxOutputTokens;
        if (options.keptReplies !== undefined && options.keptReplies.length > 0)
            body.kept_replies = options.keptReplies;
        return this.press("/v1/replies", body, options.meta, options.signal);
    }
    /** Ask for another reply to a task's message: a press of its own, with its own key. */
    regenerate(taskId, options = {}) {
        return this.press(`/v1/replies/${encodeURIComponent(taskId)}/regenerate`, undefined, options.meta, options.signal);
    }
    /**
     * Stop a task (the user pressed Stop): it makes no call, or its running call is cut short,
     * and it ends `cancelled`, uncharged. Safe to send again, and retried as the server's
     * answers allow. Rejects with a `ProblemError` of kind `task_finished` (409) when the reply
     * was saved (or the task failed) first: nothing changed, and `get` shows the reply.
     */
    cancel(taskId, options = {}) {
        return this.call("POST", `/v1/replies/${encodeURIComponent(taskId)}/cancel`, {}, options.signal);
    }
    /** Presses not yet settled (e.g. in flight when the page was reloaded), oldest first. */
    pending() {
        return this.presses.list();
    }
    /** Send an unsettled press again, under its own key: the server answers with its task. */
    resume(press, options = {}) {
        return this.join(press, options.signal);
    }
    /** A task's state now. */
    get(taskId, options = {}) {
        return this.call("GET", `/v1/replies/${encodeURIComponent(taskId)}`, {}, options.signal);
    }
    /**
     * One page of a conversation's messages, oldest first, each with its replies (the last is
     * the newest). Pass a page's `next_cursor` as `after` for the next; once `has_more` is false,
     * the same cursor later brings what was written since.
     */
    messages(conversationId, options = {}) {
        const query = new URLSearchParams();
        if (options.after !== undefined)
            query.set("after", options.after);
        if (options.limit !== undefined)
            query.set("limit", String(options.limit));
        const search = query.toString();
        return this.call("GET", `/v1/conversations/${encodeURIComponent(conversationId)}/messages${search ? `?${search}` : ""}`, {}, options.signal);
    }
    /**
     * Erase a conversation: its messages, replies and tasks are deleted, a reply still being
     * written is stopped from being saved, and new messages to it are refused (410). Erasing it
     * again deletes nothing and answers the same way.
     */
    eraseConversation(conversationId, options = {}) {
        return this.call("DELETE", `/v1/conversations/${encodeURIComponent(conversationId)}`, {}, options.signal);
    }
    /** The caller's quota now. */
    quota(options = {}) {
        return this.call("GET", "/v1/quota", {}, options.signal);
    }
    follow(taskId, options = {}) {
        return options.text === true ? this.updates(taskId, options) : this.states(taskId, options);
    }
    async *states(taskId, options) {
        for await (const update of this.updates(taskId, options))
            if (update.kind === "status")
                yield update.view;
    }
    /** The transport's updates with repeated states left out, up to a terminal state. */
    async *updates(taskId, options) {
        let last;
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
            if (isTerminal(view.status))
                return;
        }
    }
    /**
     * The task's updates as the transport brings them, repeated states included: streamed, then
     * polled (states only) once streaming is found unavailable. Pieces of text already had, or
     * past a gap, are left out; `Last-Event-ID` names the last update taken, so a reconnect
     * brings what follows it.
     */
    async *transport(taskId, options) {
        const { signal } = options;
        let streaming = options.stream ?? true;
        let lastEventId;
        let live;
        let silentConnections = 0;
        let retry = 0;
        while (true) {
            if (!streaming) {
                let view;
                try {
                    view = await this.get(taskId, signal ? { signal } : {});
                }
                catch (error) {
                    // An outage longer than one call's budget does not end the follow: the task is
                    // still there, and the next poll may see it.
                    if (signal?.aborted || (error instanceof ProblemError && error.refused))
                        throw error;
                    await this.sleep(waitMs(retry++, undefined, this.policy, this.random), signal);
                    continue;
                }
                retry = 0;
                yield { kind: "status", view };
                await this.sleep(this.pollIntervalMs, signal);
                continue;
            }
            let serverWaitMs;
            let events = 0;
            try {
                for await (const event of this.events(taskId, lastEventId, signal)) {
                    events++;
                    const update = parseUpdate(event, live);
                    if (update === "gap")
                        break; // pieces were lost: reconnect after the last one taken
                    if (update === undefined)
                        continue; // a piece had already, or not an update
                    if (event.id !== undefined)
                        lastEventId = event.id;
                    if (update.kind === "text") {
                        live = { version: update.assignmentVersion, seq: update.seq, text: update.text };
                    }
                    else if (update.kind === "withdrawn") {
                        live = undefined;
                    }
                    silentConnections = 0;
                    retry = 0;
                    yield update;
                }
            }
            catch (error) {
                if (signal?.aborted)
                    throw signal.reason;
                if (error instanceof ProblemError)
                    throw error;
                if (error instanceof StreamUnavailable) {
                    streaming = false;
                    continue;
                }
                if (error instanceof StreamFailed)
                    serverWaitMs = error.serverWaitMs;
            }
            // The stream ended or broke before a terminal state: reconnect after a backoff.
            if (events === 0 && ++silentConnections >= this.streamFailuresBeforePolling) {
                streaming = false;
                continue;
            }
            await this.sleep(waitMs(retry++, serverWaitMs, this.policy, this.random), signal);
        }
    }
    press(path, body, meta, signal) {
        const same = this.inflight.get(identity(path, body));
        if (same)
            return same;
        const press = { key: newKey(), path, createdAt: this.now() };
        if (body !== undefined)
            press.body = body;
        if (meta !== undefined)
            press.meta = meta;
        // Stored before the first request: a reload mid-request finds it and resends it.
        this.presses.put(press);
        return this.join(press, signal);
    }
    join(press, signal) {
        const id = identity(press.path, press.body);
        const same = this.inflight.get(id);
        if (same)
            return same;
        const settled = this.settle(press, signal).finally(() => this.inflight.delete(id));
        this.inflight.set(id, settled);
        return settled;
    }
    /** Sends a press until the server answers it for good; forgets its key only then. */
    async settle(press, signal) {
        try {
            const init = press.body === undefined ? { key: press.key } : { key: press.key, body: press.body };
            const accepted = await this.call("POST", press.path, init, signal);
            this.presses.delete(press.key);
            return accepted;
        }
        catch (error) {
            if (error instanceof ProblemError && error.refused)
                this.presses.delete(press.key);
            throw error;
        }
    }
    credential() {
        return this.refreshed ?? this.apiKey();
    }
    headers(extra, credential) {
        return { authorization: `Bearer ${credential}`, ...extra };
    }
    /**
     * After a 401 to a request sent with `sent`: whether a new credential is there to try, from
     * `refreshToken` (one call at a time), or because another request renewed it meanwhile.
     */
    async renew(sent) {
        if (this.refreshToken === undefined)
            return false;
        if (this.credential() !== sent)
            return true;
        this.refreshing ??= this.refreshToken().finally(() => {
            this.refreshing = undefined;
        });
        this.refreshed = await this.refreshing;
        return this.refreshed !== sent;
    }
    /** One request, retried while it may yet succeed and the budget allows. */
    async call(method, path, init, signal) {
        const started = this.now();
        const headers = { accept: "application/json" };
        if (init.key !== undefined)
            headers["idempotency-key"] = init.key;
        if (init.body !== undefined)
            headers["content-type"] = "application/json";
        const body = init.body === undefined ? undefined : JSON.stringify(init.body);
        let renewed = false;
        for (let retry = 0, requests = 1;; retry++, requests++) {
            let failure;
            const credential = this.credential();
            let serverWaitMs;
            const report = { method, path, retry, outcome: "network" };
            if (init.key !== undefined)
                report.key = init.key;
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
                        return (await response.json());
                    }
                    catch (error) {
                        // The answer was cut: as lost as no answer (and a retry under the key is safe).
                        if (signal?.aborted)
                            throw signal.reason;
                        failure = new NetworkError(`the answer to ${method} ${path} was cut off`, requests, error);
                    }
                }
                else {
                    serverWaitMs = retryAfterMs(response.headers.get("retry-after"), this.now());
                    const retryAt = serverWaitMs === undefined ? undefined : new Date(this.now() + serverWaitMs);
                    const problem = new ProblemError(await problemOf(response), requests, retryAt);
                    if (response.status === 401 && !renewed && (await this.renew(credential))) {
                        // A new token: the same request once more, at once.
                        renewed = true;
                        continue;
                    }
                    if (problem.refused)
                        throw problem;
                    failure = problem;
                }
            }
            catch (error) {
                if (error instanceof ProblemError)
                    throw error;
                if (signal?.aborted)
                    throw signal.reason;
                if (report.outcome === "network")
                    this.onRequest(report);
                const why = timeout.aborted ? `no answer within ${this.policy.attemptTimeoutMs} ms` : String(error);
                failure = new NetworkError(`${method} ${path}: ${why}`, requests, error);
            }
            const wait = waitMs(retry, serverWaitMs, this.policy, this.random);
            if (!fitsBudget(started, this.now(), wait, this.policy))
                throw failure;
            await this.sleep(wait, signal);
        }
    }
    /** The events of one stream connection; throws how it failed. */
    async *events(taskId, lastEventId, signal) {
        // An abort listener never fires for a signal aborted already.
        signal?.throwIfAborted();
        const path = `/v1/replies/${encodeURIComponent(taskId)}/events`;
        const headers = { accept: "text/event-stream" };
        if (lastEventId !== undefined)
            headers["last-event-id"] = lastEventId;
        const connection = new AbortController();
        const onAbort = () => connection.abort(signal?.reason);
        signal?.addEventListener("abort", onAbort, { once: true });
        const connectTimer = setTimeout(() => connection.abort(new Error("no answer")), this.policy.attemptTimeoutMs);
        const report = { method: "GET", path, retry: 0, outcome: "network" };
        let response;
        const credential = this.credential();
        try {
            response = await this.fetch(this.baseUrl + path, { headers: this.headers(headers, credential), signal: connection.signal });
        }
        catch (error) {
            this.onRequest(report);
            signal?.removeEventListener("abort", onAbort);
            throw new StreamFailed(undefined, error);
        }
        finally {
            clearTimeout(connectTimer);
        }
        report.outcome = response.status;
        this.onRequest(report);
        try {
            if (response.status !== 200) {
                const serverWaitMs = retryAfterMs(response.headers.get("retry-after"), this.now());
                const problem = new ProblemError(await problemOf(response), 1, undefined);
                // A new token: connect again with it.
                if (response.status === 401 && (await this.renew(credential)))
                    throw new StreamFailed(0, problem);
                if (problem.refused)
                    throw problem;
                throw new StreamFailed(serverWaitMs, problem);
            }
            const type = response.headers.get("content-type") ?? "";
            if (!type.startsWith("text/event-stream") || response.body === null) {
                await response.body?.cancel().catch(() => { });
                throw new StreamUnavailable(`the stream answered ${type || "no content type"}`);
            }
            const queue = [];
            const parser = createParser({ onEvent: (event) => queue.push(event) });
            const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
            try {
                while (true) {
                    // A connection can die without a word (a sleeping laptop, a dropped NAT entry):
                    // silence longer than the keep-alive period ends it.
                    let idle;
                    const silence = new Promise((_, reject) => {
                        idle = setTimeout(() => reject(new Error(`no event or keep-alive in ${this.streamIdleMs} ms`)), this.streamIdleMs);
                    });
                    let chunk;
                    try {
                        chunk = await Promise.race([reader.read(), silence]);
                    }
                    finally {
                        clearTimeout(idle);
                    }
                    if (chunk.done)
                        return;
                    parser.feed(chunk.value);
                    while (queue.length > 0)
                        yield queue.shift();
                }
            }
            catch (error) {
                if (error instanceof ProblemError)
                    throw error;
                throw new StreamFailed(undefined, error);
            }
            finally {
                reader.cancel().catch(() => { });
            }
        }
        finally {
            signal?.removeEventListener("abort", onAbort);
            connection.abort();
        }
    }
}
function identity(path, body) {
    return `${path} ${JSON.stringify(body ?? null)}`;
}
