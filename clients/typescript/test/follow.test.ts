import assert from "node:assert/strict";
import http from "node:http";
import type { AddressInfo } from "node:net";
import test, { type TestContext } from "node:test";

import { ReplydClient, type ClientOptions } from "../src/client.js";
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
