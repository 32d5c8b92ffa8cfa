/** How a client retries: backoff with full jitter, under a total time budget. */
export interface RetryPolicy {
    /** The longest a call keeps trying, first request to last answer, in ms. */
    budgetMs: number;
    /** The first backoff's ceiling, in ms; it doubles with each retry. */
    baseMs: number;
    /** The largest backoff ceiling, in ms. */
    capMs: number;
    /** How long one request may take before it counts as lost and is retried, in ms. */
    attemptTimeoutMs: number;
}
export declare const DEFAULT_RETRY: RetryPolicy;
/**
 * What an answer's status means for a retry.
 *
 * - `ok`: the server took the request.
 * - `retry`: the same request may succeed later: a timeout (408), a concurrent request with
 *   the same key (409), too early (425), over a rate or quota (429), or a server fault (5xx).
 * - `refused`: the request itself is wrong (400, 401, 404, 413, 415, 422, ...); sending it
 *   again cannot change the answer, so it is never retried.
 */
export type Verdict = "ok" | "retry" | "refused";
export declare function verdict(status: number): Verdict;
/**
 * A `Retry-After` header in ms: delay-seconds or an HTTP date (RFC 9110 §10.2.3). Absent,
 * malformed or in the past: `undefined`.
 */
export declare function retryAfterMs(header: string | null | undefined, nowMs: number): number | undefined;
/** Full jitter: a uniform wait between 0 and `min(cap, base * 2^retry)`. */
export declare function backoffMs(retry: number, policy: RetryPolicy, random: () => number): number;
/**
 * The wait before retry number `retry` (0 for the first): the server's `Retry-After` when it
 * gave one (never sooner; the jitter only spreads clients that were told the same instant),
 * otherwise the backoff.
 */
export declare function waitMs(retry: number, serverWaitMs: number | undefined, policy: RetryPolicy, random: () => number): number;
/** Whether a wait still fits the budget: a retry that would land after it is not made. */
export declare function fitsBudget(startedMs: number, nowMs: number, wait: number, policy: RetryPolicy): boolean;
