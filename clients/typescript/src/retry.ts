// When to try a request again, and how long to wait first. Pure: the clock and the random
// source are the caller's, so every decision here is tested without waiting.

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

export const DEFAULT_RETRY: RetryPolicy = {
  budgetMs: 30_000,
  baseMs: 250,
  capMs: 8_000,
  attemptTimeoutMs: 15_000,
};

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

export function verdict(status: number): Verdict {
  if (status >= 200 && status < 300) return "ok";
  if (status === 408 || status === 409 || status === 425 || status === 429) return "retry";
  if (status >= 500) return "retry";
  return "refused";
}

/**
 * A `Retry-After` header in ms: delay-seconds or an HTTP date (RFC 9110 §10.2.3). Absent,
 * malformed or in the past: `undefined`.
 */
export function retryAfterMs(header: string | null | undefined, nowMs: number): number | undefined {
  if (header == null) return undefined;
  const text = header.trim();
  if (/^\d+$/.test(text)) return Number(text) * 1000;
  const at = Date.parse(text);
  if (Number.isNaN(at)) return undefined;
  const wait = at - nowMs;
  return wait > 0 ? wait : undefined;
}

/** Full jitter: a uniform wait between 0 and `min(cap, base * 2^retry)`. */
export function backoffMs(retry: number, policy: RetryPolicy, random: () => number): number {
  const ceiling = Math.min(policy.capMs, policy.baseMs * 2 ** Math.min(retry, 30));
  return Math.floor(random() * ceiling);
}

/**
 * The wait before retry number `retry` (0 for the first): the server's `Retry-After` when it
 * gave one (never sooner; the jitter only spreads clients that were told the same instant),
 * otherwise the backoff.
 */
export function waitMs(
  retry: number,
  serverWaitMs: number | undefined,
  policy: RetryPolicy,
  random: () => number,
): number {
  const jitter = backoffMs(retry, policy, random);
  if (serverWaitMs === undefined) return jitter;
  return serverWaitMs + Math.floor(random() * Math.min(policy.baseMs, serverWaitMs + 1));
}

/** Whether a wait still fits the budget: a retry that would land after it is not made. */
export function fitsBudget(startedMs: number, nowMs: number, wait: number, policy: RetryPolicy): boolean {
  return nowMs + wait - startedMs <= policy.budgetMs;
}
