import assert from "node:assert/strict";
import test from "node:test";

import { ProblemError } from "../src/errors.js";
import { backoffMs, fitsBudget, retryAfterMs, verdict, waitMs, type RetryPolicy } from "../src/retry.js";

const policy: RetryPolicy = { budgetMs: 1_000, baseMs: 100, capMs: 1_000, attemptTimeoutMs: 5_000 };

// A whole second, so an HTTP date (second precision) lands exactly on it.
const NOW = Date.UTC(2025, 0, 15, 12, 0, 0);

test("verdict: 2xx is ok, transient statuses are retried, a wrong request is refused", () => {
  const expected: Record<number, string> = {
    200: "ok",
    202: "ok",
    400: "refused",
    401: "refused",
    404: "refused",
    408: "retry",
    409: "retry",
    413: "refused",
    415: "refused",
    422: "refused",
    425: "retry",
    429: "retry",
    500: "retry",
    502: "retry",
    503: "retry",
  };
  const actual = Object.fromEntries(Object.keys(expected).map((s) => [s, verdict(Number(s))]));
  assert.deepEqual(actual, expected);
});

test("a ProblemError is refused exactly when verdict refuses its status", () => {
  // errors.ts keeps its own list of retryable 4xx; the two must never disagree.
  for (let status = 400; status < 600; status++) {
    const error = new ProblemError({ type: "about:blank", title: "t", status, detail: "d" }, 1, undefined);
    assert.equal(error.refused, verdict(status) === "refused", `status ${status}`);
  }
});

test("Retry-After as delta-seconds is that many seconds", () => {
  assert.equal(retryAfterMs("120", NOW), 120_000);
  assert.equal(retryAfterMs("0", NOW), 0);
  assert.equal(retryAfterMs(" 7 ", NOW), 7_000);
});

test("Retry-After as a future HTTP date is the time until it", () => {
  assert.equal(retryAfterMs(new Date(NOW + 30_000).toUTCString(), NOW), 30_000);
});

test("Retry-After as a past or present HTTP date means no server wait", () => {
  assert.equal(retryAfterMs(new Date(NOW - 30_000).toUTCString(), NOW), undefined);
  assert.equal(retryAfterMs(new Date(NOW).toUTCString(), NOW), undefined);
});

test("a garbage or absent Retry-After means no server wait", () => {
  for (const header of ["soon", "", "1.5", "-5", "12s"]) {
    assert.equal(retryAfterMs(header, NOW), undefined, JSON.stringify(header));
  }
  assert.equal(retryAfterMs(null, NOW), undefined);
  assert.equal(retryAfterMs(undefined, NOW), undefined);
});

test("full jitter: random()=0 waits nothing", () => {
  for (let retry = 0; retry < 8; retry++) assert.equal(backoffMs(retry, policy, () => 0), 0);
});

test("full jitter: random() just under 1 waits just under min(cap, base*2^retry)", () => {
  const almostOne = () => 0.999;
  assert.deepEqual(
    [0, 1, 2, 3, 4, 5, 10].map((retry) => backoffMs(retry, policy, almostOne)),
    [99, 199, 399, 799, 999, 999, 999],
  );
  // The largest value random() can give still stays under the ceiling.
  assert.equal(backoffMs(3, policy, () => 1 - Number.EPSILON), 799);
});

test("the backoff ceiling stops at the cap, also for absurd retry counts", () => {
  assert.equal(backoffMs(2, policy, () => 0.5), 200);
  assert.equal(backoffMs(50, policy, () => 0.5), 500);
  assert.equal(backoffMs(10_000, policy, () => 0.5), 500);
});

test("without a server wait, waitMs is the backoff", () => {
  for (let retry = 0; retry < 6; retry++) {
    assert.equal(waitMs(retry, undefined, policy, () => 0.5), backoffMs(retry, policy, () => 0.5));
  }
});

test("waitMs is never below the server's Retry-After", () => {
  for (const server of [0, 1, 10, 250, 5_000, 60_000]) {
    for (const r of [0, 0.25, 0.5, 0.999]) {
      for (let retry = 0; retry < 6; retry++) {
        const wait = waitMs(retry, server, policy, () => r);
        assert.ok(wait >= server, `server ${server}, random ${r}, retry ${retry}: ${wait}`);
        // The jitter on top only spreads clients told the same instant: below one base.
        assert.ok(wait < server + policy.baseMs, `server ${server}, random ${r}, retry ${retry}: ${wait}`);
      }
    }
  }
  assert.equal(waitMs(0, 5_000, policy, () => 0), 5_000);
  assert.equal(waitMs(0, 0, policy, () => 0.999), 0);
  // A short server wait replaces a long backoff rather than adding to it.
  assert.equal(waitMs(5, 10, policy, () => 0.999), 20);
});

test("fitsBudget allows a retry landing exactly at the budget and none after it", () => {
  assert.equal(fitsBudget(1_000, 1_600, 400, policy), true);
  assert.equal(fitsBudget(1_000, 1_600, 401, policy), false);
  assert.equal(fitsBudget(1_000, 1_000, 0, policy), true);
  assert.equal(fitsBudget(1_000, 2_001, 0, policy), false);
});
