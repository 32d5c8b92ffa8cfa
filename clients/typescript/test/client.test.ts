import assert from "node:assert/strict";
import test from "node:test";

import { ReplydClient, type ClientOptions, type RequestReport } from "../src/client.js";
import { NetworkError, ProblemError } from "../src/errors.js";
import { memoryPresses, storagePresses, type PressStore } from "../src/presses.js";
import type { Accepted } from "../src/types.js";
import { FakeStorage } from "./storage.js";

const BASE = "https://replies.test";
const TASK = "0b9c6a52-7f7e-4c1a-9a43-4f1f6f2d8e11";
const UUID_V4 = /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;

interface Recorded {
  method: string;
  url: string;
  headers: Headers;
  body: string | undefined;
}

/** What the scripted server does with one request: answer, fail on the network, or never answer. */
type Answer = Response | Error | Promise<Response> | "hang";
type Script = (request: Recorded, index: number) => Answer;

/** Answers in order; a request past the end is answered 599 so a count assertion shows it. */
function steps(...answers: Array<(request: Recorded) => Answer>): Script {
  return (request, index) => {
    const answer = answers[index];
    return answer ? answer(request) : new Response("unscripted request", { status: 599 });
  };
}

function accepted(replayed = false): Response {
  const body: Accepted = {
    task_id: TASK,
    status: "pending",
    status_url: `/v1/replies/${TASK}`,
    events_url: `/v1/replies/${TASK}/events`,
    replayed,
  };
  return new Response(JSON.stringify(body), { status: 202, headers: { "content-type": "application/json" } });
}

function problem(status: number, kind: string, extra: { headers?: Record<string, string>; detail?: string; fields?: string[] } = {}): Response {
  const body = {
    type: `https://replyd.dev/problems/${kind}`,
    title: "Problem",
    status,
    detail: extra.detail ?? `a ${kind}`,
    ...(extra.fields ? { fields: extra.fields } : {}),
  };
  return new Response(JSON.stringify(body), {
    status,
    headers: { "content-type": "application/problem+json", ...extra.headers },
  });
}

const lost = () => new TypeError("fetch failed");

/**
 * A client over a scripted fetch, a clock that only moves when the client sleeps, and a
 * fixed random source: every wait and every request is known in advance.
 */
function harness(script: Script, options: Partial<ClientOptions> = {}) {
  const requests: Recorded[] = [];
  const waits: number[] = [];
  const reports: RequestReport[] = [];
  const clock = { now: 1_700_000_000_000 };
  const presses: PressStore = options.presses ?? memoryPresses();
  const fetch: typeof globalThis.fetch = (input, init) => {
    const request: Recorded = {
      method: init?.method ?? "GET",
      url: String(input),
      headers: new Headers(init?.headers),
      body: typeof init?.body === "string" ? init.body : undefined,
    };
    requests.push(request);
    const answer = script(request, requests.length - 1);
    if (answer instanceof Error) return Promise.reject(answer);
    if (answer === "hang") {
      // Like a real fetch: no answer ever, but the request's signal still ends it.
      return new Promise((_, reject) => {
        const signal = init?.signal;
        if (signal?.aborted) return reject(signal.reason);
        signal?.addEventListener("abort", () => reject(signal.reason), { once: true });
      });
    }
    return Promise.resolve(answer);
  };
  const client = new ReplydClient({
    baseUrl: BASE,
    apiKey: "secret",
    fetch,
    random: () => 0.5,
    now: () => clock.now,
    sleep: async (ms, signal) => {
      waits.push(ms);
      clock.now += ms;
      if (signal?.aborted) throw signal.reason;
    },
    onRequest: (report) => reports.push({ ...report }),
    ...options,
    presses,
  });
  const keys = () => requests.map((r) => r.headers.get("idempotency-key"));
  return { client, requests, waits, reports, clock, presses, keys };
}

test("a retry after a lost answer carries the press's key", async () => {
  const h = harness(steps(() => lost(), () => problem(503, "unavailable"), () => accepted()));
  const answer = await h.client.send("conv-1", "hello");
  assert.equal(answer.task_id, TASK);
  assert.equal(h.requests.length, 3);
  const [key] = h.keys();
  assert.match(key ?? "", UUID_V4);
  assert.deepEqual(h.keys(), [key, key, key]);
  for (const request of h.requests) {
    assert.equal(request.method, "POST");
    assert.equal(request.url, `${BASE}/v1/replies`);
    assert.equal(request.headers.get("authorization"), "Bearer secret");
    assert.equal(request.headers.get("content-type"), "application/json");
    assert.deepEqual(JSON.parse(request.body ?? ""), { conversation_id: "conv-1", message: "hello" });
  }
});

test("the replies the user kept go with the message; none kept, the field is left out", async () => {
  const h = harness(steps(() => accepted(), () => accepted()));
  const kept = "6a0d4c52-3f43-4a5e-9d3a-1c3f3e0a7b21";
  await h.client.send("conv-1", "and then?", { keptReplies: [kept] });
  await h.client.send("conv-1", "and then?", { keptReplies: [] });
  assert.deepEqual(JSON.parse(h.requests[0]!.body ?? ""), {
    conversation_id: "conv-1",
    message: "and then?",
    kept_replies: [kept],
  });
  assert.deepEqual(JSON.parse(h.requests[1]!.body ?? ""), { conversation_id: "conv-1", message: "and then?" });
});

test("a 401 asks refreshToken once for a new token and sends the same press again with it", async () => {
  let refreshes = 0;
  const h = harness(steps(() => problem(401, "unauthorized"), () => accepted()), {
    apiKey: "old-token",
    refreshToken: async () => `new-token-${++refreshes}`,
  });
  const answer = await h.client.send("conv-1", "hello");
  assert.equal(answer.task_id, TASK);
  assert.equal(refreshes, 1);
  assert.deepEqual(
    h.requests.map((r) => r.headers.get("authorization")),
    ["Bearer old-token", "Bearer new-token-1"],
  );
  assert.equal(new Set(h.keys()).size, 1, "one press, one key");
  assert.deepEqual(h.waits, [], "no backoff before the renewed request");
  // The new token is kept for what follows.
  await h.client.regenerate(TASK).catch(() => {});
  assert.equal(h.requests[2]?.headers.get("authorization"), "Bearer new-token-1");
});

test("a second 401 after a refresh is final, and without refreshToken the first is", async () => {
  let refreshes = 0;
  const h = harness(steps(() => problem(401, "unauthorized"), () => problem(401, "unauthorized")), {
    apiKey: "old-token",
    refreshToken: async () => `new-token-${++refreshes}`,
  });
  await assert.rejects(h.client.send("conv-1", "hello"), (error: unknown) => error instanceof ProblemError && error.status === 401);
  assert.equal(refreshes, 1);
  assert.equal(h.requests.length, 2);
  const plain = harness(steps(() => problem(401, "unauthorized")));
  await assert.rejects(plain.client.send("conv-1", "hello"), ProblemError);
  assert.equal(plain.requests.length, 1);
});

test("two sends, the second after the first settled, carry different keys", async () => {
  const h = harness(steps(() => accepted(), () => accepted()));
  await h.client.send("conv-1", "hello");
  await h.client.send("conv-1", "hello");
  const [first, second] = h.keys();
  assert.equal(h.requests.length, 2);
  assert.match(first ?? "", UUID_V4);
  assert.match(second ?? "", UUID_V4);
  assert.notEqual(first, second);
});

test("regenerate is a press of its own: its own key, the regenerate path, no body", async () => {
  const h = harness(steps(() => accepted(), () => accepted()));
  await h.client.send("conv-1", "hello");
  await h.client.regenerate(TASK);
  const regen = h.requests[1]!;
  assert.equal(regen.method, "POST");
  assert.equal(regen.url, `${BASE}/v1/replies/${TASK}/regenerate`);
  assert.equal(regen.body, undefined);
  assert.equal(regen.headers.get("content-type"), null);
  assert.match(regen.headers.get("idempotency-key") ?? "", UUID_V4);
  assert.notEqual(regen.headers.get("idempotency-key"), h.requests[0]!.headers.get("idempotency-key"));
  assert.deepEqual(h.client.pending(), []);
});

test("network errors, 5xx, 429 and a cut 2xx body are all retried under the same key", async () => {
  const cut = () => new Response('{"task_id": "0b9c', { status: 202, headers: { "content-type": "application/json" } });
  const h = harness(
    steps(
      () => lost(),
      () => problem(500, "internal"),
      () => problem(502, "bad_gateway"),
      () => problem(429, "rate_limited"),
      () => cut(),
      () => accepted(),
    ),
  );
  const answer = await h.client.send("conv-1", "hello");
  assert.equal(answer.task_id, TASK);
  assert.equal(h.requests.length, 6);
  assert.equal(new Set(h.keys()).size, 1);
  assert.equal(h.waits.length, 5);
  assert.deepEqual(h.client.pending(), []);
});

test("a 503 with Retry-After is retried no sooner than the server said", async () => {
  const h = harness(steps(() => problem(503, "unavailable", { headers: { "retry-after": "3" } }), () => accepted()));
  await h.client.send("conv-1", "hello");
  assert.equal(h.requests.length, 2);
  assert.equal(h.waits.length, 1);
  assert.ok(h.waits[0]! >= 3_000, `waited ${h.waits[0]} ms`);
  // Retry-After replaces the backoff: the jitter on top stays under one base.
  assert.ok(h.waits[0]! < 3_000 + 250, `waited ${h.waits[0]} ms`);
});

test("a 429 with Retry-After as an HTTP date is retried no sooner than that date", async () => {
  const h = harness(
    steps(
      () => problem(429, "rate_limited", { headers: { "retry-after": new Date(h.clock.now + 5_000).toUTCString() } }),
      () => accepted(),
    ),
  );
  // A whole second, so the HTTP date (second precision) is exactly 5 s away.
  h.clock.now = Math.ceil(h.clock.now / 1000) * 1000;
  await h.client.send("conv-1", "hello");
  assert.equal(h.requests.length, 2);
  assert.ok(h.waits[0]! >= 5_000, `waited ${h.waits[0]} ms`);
});

for (const [status, kind] of [
  [400, "invalid_body"],
  [401, "unauthorized"],
  [404, "not_found"],
  [422, "idempotency_key_reused"],
] as const) {
  test(`a ${status} is never retried: one request, a refused ProblemError, the press settled`, async () => {
    const fields = status === 422 ? ["message"] : undefined;
    const h = harness(steps(() => problem(status, kind, fields ? { fields } : {})));
    const error = await h.client.send("conv-1", "hello").then(
      () => assert.fail("the send resolved"),
      (e: unknown) => e,
    );
    assert.ok(error instanceof ProblemError, String(error));
    assert.equal(error.status, status);
    assert.equal(error.kind, kind);
    assert.equal(error.refused, true);
    assert.equal(error.requests, 1);
    if (fields) assert.deepEqual(error.problem.fields, fields);
    assert.equal(h.requests.length, 1);
    assert.deepEqual(h.waits, []);
    assert.deepEqual(h.client.pending(), []);
  });
}

test("a server always answering 503 is given up on when the next wait would pass the budget", async () => {
  let n = 0;
  const h = harness(() => problem(503, "unavailable", { detail: `answer ${++n}` }), {
    retry: { budgetMs: 1_000, baseMs: 100, capMs: 1_000 },
  });
  const error = await h.client.send("conv-1", "hello").then(
    () => assert.fail("the send resolved"),
    (e: unknown) => e,
  );
  // random()=0.5: waits 50, 100, 200, 400 (750 ms in all); the next, 500, would end at 1250.
  assert.deepEqual(h.waits, [50, 100, 200, 400]);
  assert.equal(h.requests.length, 5);
  assert.ok(error instanceof ProblemError, String(error));
  assert.equal(error.status, 503);
  assert.equal(error.problem.detail, "answer 5");
  assert.equal(error.requests, 5);
  assert.equal(error.refused, false);
  // Not refused: the server may still make the task, so the key is kept.
  assert.deepEqual(
    h.client.pending().map((p) => p.key),
    [h.keys()[0]],
  );
});

test("a 429 whose Retry-After is past the budget is not waited for, and says when to retry", async () => {
  const h = harness(steps(() => problem(429, "rate_limited", { headers: { "retry-after": "60" } })), {
    retry: { budgetMs: 10_000 },
  });
  const now = h.clock.now;
  const error = await h.client.send("conv-1", "hello").then(
    () => assert.fail("the send resolved"),
    (e: unknown) => e,
  );
  assert.ok(error instanceof ProblemError, String(error));
  assert.equal(error.status, 429);
  assert.equal(error.kind, "rate_limited");
  assert.equal(h.requests.length, 1);
  assert.deepEqual(h.waits, []);
  assert.equal(error.retryAt?.getTime(), now + 60_000);
});

test("a press given up on after network errors stays pending, and resume sends its key again", async () => {
  let online = false;
  const h = harness(() => (online ? accepted(true) : lost()), {
    retry: { budgetMs: 1_000, baseMs: 100, capMs: 1_000 },
  });
  const error = await h.client.send("conv-1", "hello", { meta: { turn: "3" } }).then(
    () => assert.fail("the send resolved"),
    (e: unknown) => e,
  );
  assert.ok(error instanceof NetworkError, String(error));
  assert.equal(error.requests, 5);
  const key = h.keys()[0];
  const pending = h.client.pending();
  assert.equal(pending.length, 1);
  assert.equal(pending[0]!.key, key);
  assert.equal(pending[0]!.path, "/v1/replies");
  assert.deepEqual(pending[0]!.body, { conversation_id: "conv-1", message: "hello" });
  assert.deepEqual(pending[0]!.meta, { turn: "3" });

  online = true;
  const answer = await h.client.resume(pending[0]!);
  assert.equal(answer.replayed, true);
  assert.equal(h.requests.length, 6);
  assert.equal(h.keys()[5], key);
  assert.deepEqual(h.client.pending(), []);
});

test("a press in flight at a reload is found by the next page and resumed with its key and body", async () => {
  const storage = new FakeStorage();
  storage.setItem("unrelated", "kept");

  // The first page: the request never comes back, and the page goes away (abort).
  const first = harness(steps(() => "hang"), { presses: storagePresses(storage) });
  const leaving = new AbortController();
  const sending = first.client.send("conv-7", "are you there?", { model: "m-1", meta: { turn: "1" }, signal: leaving.signal });
  // A real unload runs no more code: the press must be in storage while its request is out.
  assert.equal(first.requests.length, 1);
  assert.deepEqual(
    storagePresses(storage).list().map((p) => p.key),
    [first.keys()[0]],
  );
  const reason = new Error("page unloaded");
  leaving.abort(reason);
  await assert.rejects(sending, (e) => e === reason);
  assert.equal(first.requests.length, 1);
  const key = first.keys()[0];
  assert.match(key ?? "", UUID_V4);

  // The next page: a new client on the same storage.
  const second = harness(steps(() => accepted(true)), { presses: storagePresses(storage) });
  const pending = second.client.pending();
  assert.equal(pending.length, 1);
  assert.equal(pending[0]!.key, key);
  assert.deepEqual(pending[0]!.meta, { turn: "1" });
  await second.client.resume(pending[0]!);
  assert.equal(second.requests.length, 1);
  assert.equal(second.keys()[0], key);
  assert.equal(second.requests[0]!.url, `${BASE}/v1/replies`);
  assert.equal(second.requests[0]!.body, first.requests[0]!.body);
  assert.deepEqual(JSON.parse(second.requests[0]!.body ?? ""), {
    conversation_id: "conv-7",
    message: "are you there?",
    model: "m-1",
  });
  assert.deepEqual(second.client.pending(), []);
  assert.equal(storage.length, 1);
  assert.equal(storage.getItem("unrelated"), "kept");
});

test("a double click sends one request, and both calls get the same answer", async () => {
  let answer!: (response: Response) => void;
  const held = new Promise<Response>((resolve) => (answer = resolve));
  const h = harness(steps(() => held, () => accepted(), () => accepted()));
  const click1 = h.client.send("conv-1", "hello");
  const click2 = h.client.send("conv-1", "hello");
  // Another message while the first is in flight is a press of its own.
  const other = h.client.send("conv-1", "something else");
  await Promise.resolve();
  assert.equal(h.requests.length, 2);
  assert.equal(h.client.pending().length, 2);
  answer(accepted());
  const [a1, a2] = await Promise.all([click1, click2, other]);
  assert.equal(a1, a2);
  assert.notEqual(h.keys()[0], h.keys()[1]);

  // Settled: the same message again is new work, with a new key.
  await h.client.send("conv-1", "hello");
  assert.equal(h.requests.length, 3);
  assert.equal(new Set(h.keys()).size, 3);
  assert.deepEqual(h.client.pending(), []);
});

test("resuming a press that is still in flight joins it instead of sending it again", async () => {
  let answer!: (response: Response) => void;
  const held = new Promise<Response>((resolve) => (answer = resolve));
  const h = harness(steps(() => held, () => accepted()));
  const sending = h.client.send("conv-1", "hello");
  // E.g. a "retry" button that resumes every pending press while the first request is out.
  const resuming = h.client.resume(h.client.pending()[0]!);
  assert.equal(h.requests.length, 1);
  answer(accepted());
  assert.equal(await sending, await resuming);
  assert.equal(h.requests.length, 1);
  assert.deepEqual(h.client.pending(), []);
});

test("onRequest reports every request with its retry index and outcome", async () => {
  const h = harness(steps(() => lost(), () => problem(503, "unavailable"), () => accepted()));
  await h.client.send("conv-1", "hello");
  const key = h.keys()[0]!;
  assert.deepEqual(h.reports, [
    { method: "POST", path: "/v1/replies", key, retry: 0, outcome: "network" },
    { method: "POST", path: "/v1/replies", key, retry: 1, outcome: 503 },
    { method: "POST", path: "/v1/replies", key, retry: 2, outcome: 202 },
  ]);
});

test("a request with no answer within the attempt timeout is retried under the same key", { timeout: 5_000 }, async () => {
  // Node's AbortSignal.timeout does not keep the process alive, and a pending fake fetch
  // does not either: hold the event loop open (for a bounded time, so a client that never
  // times out fails the test instead of hanging the run).
  const alive = setTimeout(() => {}, 4_000);
  try {
    const h = harness(steps(() => "hang", () => accepted()), { retry: { attemptTimeoutMs: 20 } });
    const started = Date.now();
    const answer = await h.client.send("conv-1", "hello");
    assert.equal(answer.task_id, TASK);
    assert.equal(h.requests.length, 2);
    assert.equal(h.keys()[0], h.keys()[1]);
    assert.deepEqual(
      h.reports.map((r) => r.outcome),
      ["network", 202],
    );
    assert.ok(Date.now() - started >= 15, "the first attempt was given its time");
  } finally {
    clearTimeout(alive);
  }
});

test("a conversation's page is asked for by its cursor and its size, the id escaped", async () => {
  const page = { conversation_id: "team/1", messages: [], next_cursor: "c2VxOjc", has_more: false };
  const h = harness(
    steps(
      () => new Response(JSON.stringify(page), { status: 200, headers: { "content-type": "application/json" } }),
      () => problem(400, "invalid_query"),
    ),
  );
  const listed = await h.client.messages("team/1", { after: "c2VxOjc", limit: 20 });
  assert.deepEqual(listed, page);
  assert.equal(h.requests[0]?.method, "GET");
  assert.equal(h.requests[0]?.url, `${BASE}/v1/conversations/team%2F1/messages?after=c2VxOjc&limit=20`);
  assert.equal(h.requests[0]?.headers.get("authorization"), "Bearer secret");
  await assert.rejects(h.client.messages("team/1", { after: "bad" }), (error: unknown) => {
    assert.ok(error instanceof ProblemError);
    assert.equal(error.status, 400);
    return true;
  });
});

test("a cancel is a POST of the task's path, retried when unanswered, and a late one is a final problem", async () => {
  const view = { task_id: "t/1", status: "cancelled", attempts: 0, max_attempts: 3 };
  const h = harness(
    steps(
      () => problem(503, "unavailable"),
      () => new Response(JSON.stringify(view), { status: 200, headers: { "content-type": "application/json" } }),
      () => problem(409, "task_finished"),
    ),
  );
  assert.deepEqual(await h.client.cancel("t/1"), view);
  assert.equal(h.requests.length, 2);
  for (const request of h.requests) {
    assert.equal(request.method, "POST");
    assert.equal(request.url, `${BASE}/v1/replies/t%2F1/cancel`);
    assert.equal(request.headers.get("idempotency-key"), null);
  }
  await assert.rejects(h.client.cancel("t/1"), (error: unknown) => {
    assert.ok(error instanceof ProblemError);
    assert.equal(error.status, 409);
    assert.equal(error.problem.type.split("/").pop(), "task_finished");
    return true;
  });
  assert.equal(h.requests.length, 3, "a 409 is final: not asked again");
});

test("erasing a conversation is a DELETE of its path, retried as the server's answers allow", async () => {
  const erased = { conversation_id: "c 1", tasks: 2, messages: 2, ended: 0 };
  const h = harness(
    steps(
      () => problem(503, "unavailable"),
      () => new Response(JSON.stringify(erased), { status: 200, headers: { "content-type": "application/json" } }),
    ),
  );
  assert.deepEqual(await h.client.eraseConversation("c 1"), erased);
  assert.equal(h.requests.length, 2);
  for (const request of h.requests) {
    assert.equal(request.method, "DELETE");
    assert.equal(request.url, `${BASE}/v1/conversations/c%201`);
  }
});
