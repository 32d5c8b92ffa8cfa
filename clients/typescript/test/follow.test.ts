import assert from "node:assert/strict";
import http from "node:http";
import type { AddressInfo } from "node:net";
import test, { type TestContext } from "node:test";

import { ReplydClient, type ClientOptions, type FollowUpdate } from "../src/client.js";
import { ProblemError } from "../src/errors.js";
import { memoryPresses } from "../src/presses.js";
import type { ReplyStatus, ReplyView } from "../src/types.js";

const TASK = "5d1f0c7e-2b8a-4e0f-9d3c-6a7b8c9d0e1f";
const EVENTS = `/v1/replies/${TASK}/events`;
const STATUS = `/v1/replies/${TASK}`;

interface Seen {
  method: string;
  path: string;
  headers: http.IncomingHttpHeaders;
}

type Handler = (req: http.IncomingMessage, res: http.ServerResponse, nth: number) => void;

/** A real server on 127.0.0.1, scripted per route; `nth` counts that route's requests from 0. */
async function serve(t: TestContext, routes: Record<string, Handler>, options: Partial<ClientOptions> = {}) {
  const seen: Seen[] = [];
  const server = http.createServer((req, res) => {
    const path = req.url ?? "";
    const nth = seen.filter((s) => s.path === path).length;
    seen.push({ method: req.method ?? "", path, headers: req.headers });
    const handler = routes[path];
    if (handler) return handler(req, res, nth);
    res.writeHead(599).end("unscripted");
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  t.after(async () => {
    // Open streams (and the client's kept-alive sockets) would hold close() forever.
    server.closeAllConnections();
    await new Promise<void>((resolve) => server.close(() => resolve()));
  });
  const { port } = server.address() as AddressInfo;
  const client = new ReplydClient({
    baseUrl: `http://127.0.0.1:${port}`,
    apiKey: "secret",
    presses: memoryPresses(),
    retry: { baseMs: 5, capMs: 20 },
    pollIntervalMs: 10,
    ...options,
  });
  const requests = (path: string) => seen.filter((s) => s.path === path);
  return { client, seen, requests };
}

function view(status: ReplyStatus, updatedAt: string): ReplyView {
  const done = status === "completed" || status === "failed";
  return {
    task_id: TASK,
    status,
    attempts: status === "pending" ? 0 : 1,
    max_attempts: 3,
    created_at: "2025-01-15T12:00:00Z",
    updated_at: updatedAt,
    ...(status === "completed" ? { reply: "hi there" } : {}),
    ...(done ? { finished_at: updatedAt } : {}),
  };
}

const PENDING = view("pending", "2025-01-15T12:00:00Z");
const RUNNING = view("running", "2025-01-15T12:00:01Z");
const COMPLETED = view("completed", "2025-01-15T12:00:02Z");

function openStream(res: http.ServerResponse): void {
  res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
  res.flushHeaders();
}

function sendEvent(res: http.ServerResponse, id: string, state: ReplyView): void {
  res.write(`event: status\nid: ${id}\ndata: ${JSON.stringify(state)}\n\n`);
}

function json(res: http.ServerResponse, status: number, body: unknown, type = "application/json"): void {
  res.writeHead(status, { "content-type": type }).end(JSON.stringify(body));
}

async function collect(iterable: AsyncIterable<ReplyView>, each?: (state: ReplyView, index: number) => void): Promise<ReplyView[]> {
  const states: ReplyView[] = [];
  for await (const state of iterable) {
    states.push(state);
    each?.(state, states.length - 1);
  }
  return states;
}

test("a stream of pending, running, completed is followed to its end, each state once", { timeout: 5_000 }, async (t) => {
  const { client, requests } = await serve(t, {
    [EVENTS]: (_req, res) => {
      openStream(res);
      sendEvent(res, "1", PENDING);
      sendEvent(res, "2", RUNNING);
      sendEvent(res, "3", COMPLETED);
      res.end();
    },
  });
  assert.deepEqual(await collect(client.follow(TASK)), [PENDING, RUNNING, COMPLETED]);
  const [connection] = requests(EVENTS);
  assert.equal(requests(EVENTS).length, 1);
  assert.equal(connection!.headers.accept, "text/event-stream");
  assert.equal(connection!.headers.authorization, "Bearer secret");
  assert.equal(connection!.headers["last-event-id"], undefined);
  assert.equal(requests(STATUS).length, 0);
});

test("a stream cut mid-way reconnects with Last-Event-ID and yields no state twice", { timeout: 5_000 }, async (t) => {
  let first: http.ServerResponse | undefined;
  const { client, requests } = await serve(t, {
    [EVENTS]: (_req, res, nth) => {
      openStream(res);
      if (nth === 0) {
        first = res;
        sendEvent(res, "1", PENDING);
        return; // held open until the test cuts it
      }
      // The server may send the state the client already has once more.
      sendEvent(res, "1", PENDING);
      sendEvent(res, "2", RUNNING);
      sendEvent(res, "3", COMPLETED);
      res.end();
    },
  });
  // The cut comes once the first state is in the client's hands: no race with its delivery.
  const states = await collect(client.follow(TASK), (_state, index) => {
    if (index === 0) first!.socket!.destroy();
  });
  assert.deepEqual(states, [PENDING, RUNNING, COMPLETED]);
  const connections = requests(EVENTS);
  assert.equal(connections.length, 2);
  assert.equal(connections[0]!.headers["last-event-id"], undefined);
  assert.equal(connections[1]!.headers["last-event-id"], "1");
  assert.equal(requests(STATUS).length, 0);
});

test("an events route that is not an event stream falls back to polling the task", { timeout: 5_000 }, async (t) => {
  const { client, requests } = await serve(t, {
    [EVENTS]: (_req, res) => {
      res.writeHead(200, { "content-type": "text/plain" }).end("a proxy's page");
    },
    [STATUS]: (_req, res, nth) => json(res, 200, [RUNNING, RUNNING, COMPLETED][nth] ?? COMPLETED),
  });
  assert.deepEqual(await collect(client.follow(TASK)), [RUNNING, COMPLETED]);
  assert.equal(requests(EVENTS).length, 1);
  assert.equal(requests(STATUS).length, 3);
  assert.ok(requests(STATUS).every((s) => s.method === "GET"));
});

test("three failed stream connections in a row fall back to polling the task", { timeout: 5_000 }, async (t) => {
  const { client, requests } = await serve(t, {
    [EVENTS]: (_req, res) => {
      json(res, 502, { type: "about:blank", title: "Bad Gateway", status: 502, detail: "upstream" }, "application/problem+json");
    },
    [STATUS]: (_req, res, nth) => json(res, 200, nth === 0 ? PENDING : COMPLETED),
  });
  assert.deepEqual(await collect(client.follow(TASK)), [PENDING, COMPLETED]);
  assert.equal(requests(EVENTS).length, 3);
  assert.equal(requests(STATUS).length, 2);
});

test("a 404 on the events route ends the follow with that ProblemError, without polling", { timeout: 5_000 }, async (t) => {
  const { client, requests } = await serve(t, {
    [EVENTS]: (_req, res) => {
      json(
        res,
        404,
        { type: "https://replyd.dev/problems/not_found", title: "Not found", status: 404, detail: "no such task" },
        "application/problem+json",
      );
    },
  });
  await assert.rejects(collect(client.follow(TASK)), (error) => {
    assert.ok(error instanceof ProblemError, String(error));
    assert.equal(error.status, 404);
    assert.equal(error.kind, "not_found");
    return true;
  });
  assert.equal(requests(EVENTS).length, 1);
  assert.equal(requests(STATUS).length, 0);
});

test("aborting a follow ends it with the signal's reason and closes the stream", { timeout: 5_000 }, async (t) => {
  let closed!: Promise<void>;
  const { client } = await serve(t, {
    [EVENTS]: (_req, res) => {
      closed = new Promise((resolve) => res.on("close", () => resolve()));
      openStream(res);
      sendEvent(res, "1", PENDING);
      // Never ends: only the abort can stop the follow.
    },
  });
  const controller = new AbortController();
  const follow = client.follow(TASK, { signal: controller.signal });
  assert.deepEqual(await follow.next(), { value: PENDING, done: false });
  const waiting = follow.next();
  const reason = new Error("the user left the page");
  controller.abort(reason);
  await assert.rejects(waiting, (error) => error === reason);
  assert.deepEqual(await follow.next(), { value: undefined, done: true });
  await closed;
});

test("a follow whose signal is already aborted throws its reason without a request", { timeout: 5_000 }, async (t) => {
  const { client, seen } = await serve(t, {
    [EVENTS]: (_req, res) => {
      openStream(res);
      sendEvent(res, "1", PENDING);
      sendEvent(res, "2", COMPLETED);
      res.end();
    },
  });
  const reason = new Error("already gone");
  const signal = AbortSignal.abort(reason);
  await assert.rejects(collect(client.follow(TASK, { signal })), (error) => error === reason);
  assert.equal(seen.length, 0);
});

test("events repeating a state (same status and updated_at) yield it once", { timeout: 5_000 }, async (t) => {
  const { client } = await serve(t, {
    [EVENTS]: (_req, res) => {
      openStream(res);
      sendEvent(res, "1", PENDING);
      sendEvent(res, "2", { ...PENDING, attempts: 0 });
      sendEvent(res, "3", RUNNING);
      sendEvent(res, "4", RUNNING);
      // Same status, a later updated_at: a new state (e.g. another attempt).
      const retried = { ...RUNNING, attempts: 2, updated_at: "2025-01-15T12:00:01.500Z" };
      sendEvent(res, "5", retried);
      sendEvent(res, "6", COMPLETED);
      res.end();
    },
  });
  const states = await collect(client.follow(TASK));
  assert.deepEqual(
    states.map((s) => `${s.status}@${s.updated_at}`),
    [
      "pending@2025-01-15T12:00:00Z",
      "running@2025-01-15T12:00:01Z",
      "running@2025-01-15T12:00:01.500Z",
      "completed@2025-01-15T12:00:02Z",
    ],
  );
});

test("polling outlasts an outage longer than one call's budget", { timeout: 5_000 }, async (t) => {
  const { client, requests } = await serve(
    t,
    {
      [EVENTS]: (_req, res) => res.writeHead(200, { "content-type": "text/plain" }).end("no stream here"),
      // Eight 503s in a row: each poll gives up within its 30 ms budget, the follow does not.
      [STATUS]: (_req, res, nth) =>
        nth < 8
          ? json(res, 503, { type: "about:blank", title: "Service Unavailable", status: 503, detail: "database away" }, "application/problem+json")
          : json(res, 200, COMPLETED),
    },
    { retry: { baseMs: 5, capMs: 20, budgetMs: 30 } },
  );
  assert.deepEqual(await collect(client.follow(TASK)), [COMPLETED]);
  assert.equal(requests(STATUS).length, 9);
});

function sendDelta(res: http.ServerResponse, version: number, seq: number, text: string): void {
  const data = { task_id: TASK, assignment_version: version, seq, text };
  res.write(`event: delta\nid: live-${version}-${seq}\ndata: ${JSON.stringify(data)}\n\n`);
}

function sendWithdrawn(res: http.ServerResponse, version: number, reason: string): void {
  const data = { task_id: TASK, assignment_version: version, reason };
  res.write(`event: withdrawn\nid: withdrawn-${version}\ndata: ${JSON.stringify(data)}\n\n`);
}

/** The updates of a follow with text, each as one line: a state, a text so far, a withdrawal. */
async function updates(iterable: AsyncIterable<FollowUpdate>, each?: (update: FollowUpdate, index: number) => void): Promise<string[]> {
  const lines: string[] = [];
  for await (const update of iterable) {
    each?.(update, lines.length);
    switch (update.kind) {
      case "status":
        lines.push(`status ${update.view.status}${update.view.reply === undefined ? "" : ` ${JSON.stringify(update.view.reply)}`}`);
        break;
      case "text":
        lines.push(`text v${update.assignmentVersion}#${update.seq} ${JSON.stringify(update.text)} (+${JSON.stringify(update.delta)})`);
        break;
      case "withdrawn":
        lines.push(`withdrawn v${update.assignmentVersion} ${update.reason}`);
        break;
    }
  }
  return lines;
}

const saved = (reply: string): ReplyView => ({ ...COMPLETED, reply });

test("with text, the running attempt's text grows piece by piece, and completed ends it with the saved reply", { timeout: 5_000 }, async (t) => {
  const { client, requests } = await serve(t, {
    [EVENTS]: (_req, res) => {
      openStream(res);
      sendEvent(res, "0-pending", PENDING);
      sendEvent(res, "1-running", RUNNING);
      sendDelta(res, 7, 1, "Hel");
      sendDelta(res, 7, 2, "lo, ");
      sendDelta(res, 7, 3, "world");
      sendEvent(res, "1-completed", saved("Hello, world"));
      res.end();
    },
  });
  assert.deepEqual(await updates(client.follow(TASK, { text: true })), [
    "status pending",
    "status running",
    'text v7#1 "Hel" (+"Hel")',
    'text v7#2 "Hello, " (+"lo, ")',
    'text v7#3 "Hello, world" (+"world")',
    'status completed "Hello, world"',
  ]);
  assert.equal(requests(EVENTS).length, 1);
});

test("a withdrawn attempt's text is void, and the next attempt's text starts from empty", { timeout: 5_000 }, async (t) => {
  const { client } = await serve(t, {
    [EVENTS]: (_req, res) => {
      openStream(res);
      sendEvent(res, "1-running", RUNNING);
      sendDelta(res, 7, 1, "first ");
      sendDelta(res, 7, 2, "try");
      sendWithdrawn(res, 7, "retrying");
      sendEvent(res, "1-pending", { ...PENDING, attempts: 1, updated_at: "2025-01-15T12:00:01.200Z" });
      sendEvent(res, "2-running", { ...RUNNING, attempts: 2, updated_at: "2025-01-15T12:00:01.500Z" });
      sendDelta(res, 8, 1, "second");
      sendDelta(res, 8, 2, " try");
      sendEvent(res, "2-completed", saved("second try"));
      res.end();
    },
  });
  assert.deepEqual(await updates(client.follow(TASK, { text: true })), [
    "status running",
    'text v7#1 "first " (+"first ")',
    'text v7#2 "first try" (+"try")',
    "withdrawn v7 retrying",
    "status pending",
    "status running",
    'text v8#1 "second" (+"second")',
    'text v8#2 "second try" (+" try")',
    'status completed "second try"',
  ]);
});

test("a piece of another attempt starts a new text even without a withdrawal", { timeout: 5_000 }, async (t) => {
  const { client } = await serve(t, {
    [EVENTS]: (_req, res) => {
      openStream(res);
      sendEvent(res, "1-running", RUNNING);
      sendDelta(res, 7, 1, "old");
      sendDelta(res, 8, 1, "new");
      sendEvent(res, "2-completed", saved("new"));
      res.end();
    },
  });
  assert.deepEqual(await updates(client.follow(TASK, { text: true })), [
    "status running",
    'text v7#1 "old" (+"old")',
    'text v8#1 "new" (+"new")',
    'status completed "new"',
  ]);
});

test("a stream cut mid-text reconnects with Last-Event-ID live-V-S and goes on from the next piece, repeats ignored", { timeout: 5_000 }, async (t) => {
  let first: http.ServerResponse | undefined;
  const { client, requests } = await serve(t, {
    [EVENTS]: (_req, res, nth) => {
      openStream(res);
      if (nth === 0) {
        first = res;
        sendEvent(res, "1-running", RUNNING);
        sendDelta(res, 7, 1, "a");
        sendDelta(res, 7, 2, "b");
        return; // held open until the test cuts it
      }
      // A piece the client has, sent again, is not appended twice.
      sendDelta(res, 7, 2, "b");
      sendDelta(res, 7, 3, "c");
      sendEvent(res, "1-completed", saved("abc"));
      res.end();
    },
  });
  const seen = await updates(client.follow(TASK, { text: true }), (update) => {
    if (update.kind === "text" && update.seq === 2) first!.socket!.destroy();
  });
  assert.deepEqual(seen, ["status running", 'text v7#1 "a" (+"a")', 'text v7#2 "ab" (+"b")', 'text v7#3 "abc" (+"c")', 'status completed "abc"']);
  const connections = requests(EVENTS);
  assert.equal(connections.length, 2);
  assert.equal(connections[1]!.headers["last-event-id"], "live-7-2");
});

test("a piece past a gap is not appended: the follow reconnects after the last piece it has", { timeout: 5_000 }, async (t) => {
  const { client, requests } = await serve(t, {
    [EVENTS]: (_req, res, nth) => {
      openStream(res);
      if (nth === 0) {
        sendEvent(res, "1-running", RUNNING);
        sendDelta(res, 7, 1, "a");
        sendDelta(res, 7, 3, "c"); // piece 2 lost
        return; // held open: only the client's reconnect moves on
      }
      sendDelta(res, 7, 2, "b");
      sendDelta(res, 7, 3, "c");
      sendEvent(res, "1-completed", saved("abc"));
      res.end();
    },
  });
  assert.deepEqual(await updates(client.follow(TASK, { text: true })), [
    "status running",
    'text v7#1 "a" (+"a")',
    'text v7#2 "ab" (+"b")',
    'text v7#3 "abc" (+"c")',
    'status completed "abc"',
  ]);
  assert.equal(requests(EVENTS)[1]!.headers["last-event-id"], "live-7-1");
});

test("a reconnect after a piece of an attempt that no longer runs gets its withdrawal, then the current state", { timeout: 5_000 }, async (t) => {
  let first: http.ServerResponse | undefined;
  const { client, requests } = await serve(t, {
    [EVENTS]: (_req, res, nth) => {
      openStream(res);
      if (nth === 0) {
        first = res;
        sendEvent(res, "1-running", RUNNING);
        sendDelta(res, 7, 1, "lost");
        return;
      }
      sendWithdrawn(res, 7, "superseded");
      sendEvent(res, "2-running", { ...RUNNING, attempts: 2, updated_at: "2025-01-15T12:00:01.500Z" });
      sendDelta(res, 8, 1, "kept");
      sendEvent(res, "2-completed", saved("kept"));
      res.end();
    },
  });
  const seen = await updates(client.follow(TASK, { text: true }), (update) => {
    if (update.kind === "text" && update.assignmentVersion === 7) first!.socket!.destroy();
  });
  assert.deepEqual(seen, [
    "status running",
    'text v7#1 "lost" (+"lost")',
    "withdrawn v7 superseded",
    "status running",
    'text v8#1 "kept" (+"kept")',
    'status completed "kept"',
  ]);
  assert.equal(requests(EVENTS)[1]!.headers["last-event-id"], "live-7-1");
});

test("the saved reply of completed is what the follow ends with, even when the streamed text differs", { timeout: 5_000 }, async (t) => {
  const { client } = await serve(t, {
    [EVENTS]: (_req, res) => {
      openStream(res);
      sendEvent(res, "1-running", RUNNING);
      sendDelta(res, 7, 1, "draft");
      sendEvent(res, "1-completed", saved("the saved reply"));
      // Nothing after a terminal state is taken.
      sendDelta(res, 7, 2, " more");
      res.end();
    },
  });
  const seen = await updates(client.follow(TASK, { text: true }));
  assert.deepEqual(seen, ["status running", 'text v7#1 "draft" (+"draft")', 'status completed "the saved reply"']);
});

test("without text, a follow yields only its states, and its reconnect names the last piece", { timeout: 5_000 }, async (t) => {
  const { client, requests } = await serve(t, {
    [EVENTS]: (_req, res, nth) => {
      openStream(res);
      if (nth === 0) {
        sendEvent(res, "1-running", RUNNING);
        sendDelta(res, 7, 1, "a");
        // Ended after the piece, so the client has read it when it reconnects.
        res.end();
        return;
      }
      sendDelta(res, 7, 2, "b");
      sendEvent(res, "1-completed", COMPLETED);
      res.end();
    },
  });
  assert.deepEqual(await collect(client.follow(TASK)), [RUNNING, COMPLETED]);
  assert.equal(requests(EVENTS)[1]!.headers["last-event-id"], "live-7-1");
});

test("a follow with text that polls yields states only", { timeout: 5_000 }, async (t) => {
  const { client } = await serve(t, {
    [EVENTS]: (_req, res) => {
      res.writeHead(200, { "content-type": "text/plain" }).end("a proxy's page");
    },
    [STATUS]: (_req, res, nth) => json(res, 200, [RUNNING, COMPLETED][nth] ?? COMPLETED),
  });
  assert.deepEqual(await updates(client.follow(TASK, { text: true })), ["status running", 'status completed "hi there"']);
});
