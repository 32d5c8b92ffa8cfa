// The browser tests of the demo page: Debian's Chromium, driven by playwright-core, against a
// live `replyd serve` (with the mock provider) behind a fault proxy. Each scenario runs in a
// fresh browser context (its own sessionStorage) and asserts what the page shows; it prints
// one JSON report with, per scenario, what was sent and shown and the conversation it used,
// so the caller (tests/browser.rs) asserts the server's durable state for each.
//
// Environment: REPLYD_URL (the API), REPLYD_KEY (a key of an unlimited workspace),
// REPLYD_QUOTA_KEY (a key of a workspace whose quota admits one generation), REPLYD_MOCK_URL
// (the mock provider, whose faults a scenario sets), REPLYD_OUT (a directory for screenshots),
// CHROMIUM (the browser; default /usr/bin/chromium).

import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { join } from "node:path";

import { chromium, type Browser, type Page } from "playwright-core";

import { FaultProxy, type Seen } from "./proxy.js";

const env = (name: string): string => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};

interface Shown {
  task: string;
  status: string;
  badge: string;
  text: string;
}

interface Report {
  scenario: string;
  conversation_id: string;
  posts: number;
  post_keys: number;
  streams: number;
  polls: number;
  retries: number;
  requests_by_page: number;
  tasks_shown: string[];
  replies_shown: number;
  notice?: string;
  faults: Record<string, number>;
}

const TIMEOUT = 60_000;

async function open(page: Page, base: string, key: string): Promise<void> {
  await page.goto(`${base}/demo#key=${encodeURIComponent(key)}`);
  await page.waitForSelector("body[data-ready=true]", { timeout: TIMEOUT });
}

async function ask(page: Page, text: string, click: "click" | "dblclick" = "click"): Promise<void> {
  await page.fill("#message", text);
  if (click === "dblclick") await page.dblclick("#send");
  else await page.click("#send");
}

async function shown(page: Page): Promise<Shown[]> {
  return page.$$eval(".reply", (nodes) =>
    nodes.map((node) => ({
      task: (node as HTMLElement).dataset.taskId ?? "",
      status: (node as HTMLElement).dataset.status ?? "",
      badge: node.querySelector(".status")?.textContent ?? "",
      text: node.querySelector(".text")?.textContent ?? "",
    })),
  );
}

/** Waits until `count` replies are shown, all completed. */
async function completed(page: Page, count: number): Promise<Shown[]> {
  await page.waitForFunction(
    (n) => {
      const replies = [...document.querySelectorAll<HTMLElement>(".reply")];
      return replies.length === n && replies.every((r) => r.dataset.status === "completed");
    },
    count,
    { timeout: TIMEOUT },
  );
  const replies = await shown(page);
  for (const reply of replies) {
    assert.equal(reply.badge, "completed");
    assert.ok(reply.text.length > 0, `reply ${reply.task} shows its text`);
  }
  return replies;
}

async function conversationOf(page: Page): Promise<string> {
  return page.evaluate(() => (window as unknown as { replydDemo: { conversation(): { id: string } } }).replydDemo.conversation().id);
}

async function pageStats(page: Page): Promise<{ requests: number; retries: number }> {
  return page.evaluate(() => {
    const stats = (window as unknown as { replydDemo: { stats: { requests: number; retries: number } } }).replydDemo.stats;
    return { requests: stats.requests, retries: stats.retries };
  });
}

function count(seen: Seen[], test: (s: Seen) => boolean): number {
  return seen.filter(test).length;
}

/** Presses: POSTs but cancels (a Stop carries no key and makes no task). */
const posts = (seen: Seen[]) => seen.filter((s) => s.method === "POST" && !s.path.endsWith("/cancel"));
const cancels = (seen: Seen[]) => seen.filter((s) => s.method === "POST" && s.path.endsWith("/cancel"));
const streams = (seen: Seen[]) => seen.filter((s) => s.method === "GET" && s.path.endsWith("/events"));
const polls = (seen: Seen[]) => seen.filter((s) => s.method === "GET" && /^\/v1\/replies\/[^/]+$/.test(s.path));

async function report(scenario: string, page: Page, proxy: FaultProxy, extra: Partial<Report> = {}): Promise<Report> {
  const replies = await shown(page);
  const stats = await pageStats(page);
  const faults: Record<string, number> = {};
  for (const seen of proxy.seen) if (seen.fault !== "none") faults[seen.fault] = (faults[seen.fault] ?? 0) + 1;
  return {
    scenario,
    conversation_id: await conversationOf(page),
    posts: posts(proxy.seen).length,
    post_keys: new Set(posts(proxy.seen).map((s) => s.key)).size,
    streams: streams(proxy.seen).length,
    polls: polls(proxy.seen).length,
    retries: stats.retries,
    requests_by_page: stats.requests,
    tasks_shown: replies.map((r) => r.task),
    replies_shown: replies.filter((r) => r.status === "completed").length,
    faults,
    ...extra,
  };
}

type Scenario = (page: Page, base: string, proxy: FaultProxy) => Promise<Report>;

const key = () => env("REPLYD_KEY");

const scenarios: Record<string, Scenario> = {
  // Send twice fast: one press, one request, one task.
  async double_click(page, base, proxy) {
    await open(page, base, key());
    await ask(page, "What does a double click cost?", "dblclick");
    const replies = await completed(page, 1);
    assert.equal(posts(proxy.seen).length, 1, "one POST for a double click");
    return report("double_click", page, proxy, { tasks_shown: replies.map((r) => r.task) });
  },

  // The answer to the POST is cut off after replyd saved the task: the client retries with
  // the same key and is answered with the same task.
  async lost_answer(page, base, proxy) {
    proxy.faults.dropPostAnswers = 1;
    await open(page, base, key());
    await ask(page, "Is this answer lost?");
    await completed(page, 1);
    const sent = posts(proxy.seen);
    assert.ok(sent.length >= 2, `the POST was retried (${sent.length} sent)`);
    assert.equal(new Set(sent.map((s) => s.key)).size, 1, "every retry carries the press's key");
    assert.equal(sent[0]!.fault, "answer_dropped");
    assert.equal(sent[0]!.status, 202, "replyd took the first request");
    assert.ok((await pageStats(page)).retries >= 1, "the page counted the retry");
    return report("lost_answer", page, proxy);
  },

  // Reload while the POST is unanswered: the press (its key) survives in sessionStorage and
  // is sent again after the reload; replyd answers with the task it already saved.
  async reload_mid_post(page, base, proxy) {
    proxy.faults.holdPostAnswers = 1;
    proxy.faults.holdMs = 3_000;
    await open(page, base, key());
    await ask(page, "What survives a reload?");
    await waitFor(() => posts(proxy.seen).some((s) => s.status === 202), "replyd answered the held POST");
    await page.reload();
    await page.waitForSelector("body[data-ready=true]", { timeout: TIMEOUT });
    await completed(page, 1);
    const sent = posts(proxy.seen);
    assert.equal(sent.length, 2, "the press was sent once before the reload and once after");
    assert.equal(new Set(sent.map((s) => s.key)).size, 1, "with the same key");
    return report("reload_mid_post", page, proxy);
  },

  // Reload while the reply is pending: the page follows the same task to completion.
  async reload_mid_reply(page, base, proxy) {
    await open(page, base, key());
    // Slow enough (the mock reads the tag) that the reload comes before the reply.
    await ask(page, "Will the reply wait for me? [mock:latency_ms=4000]");
    await page.waitForSelector(".reply[data-status=pending], .reply[data-status=running]", { timeout: TIMEOUT });
    const before = (await shown(page))[0]!;
    assert.equal(before.badge, "still processing");
    await page.reload();
    await page.waitForSelector("body[data-ready=true]", { timeout: TIMEOUT });
    const after = await completed(page, 1);
    assert.equal(after[0]!.task, before.task, "the same task is followed after the reload");
    assert.equal(posts(proxy.seen).length, 1, "the reload sent nothing new");
    return report("reload_mid_reply", page, proxy);
  },

  // Regenerate: a second press with its own key; both replies are shown side by side.
  async regenerate(page, base, proxy) {
    await open(page, base, key());
    await ask(page, "Say it another way.");
    const [first] = await completed(page, 1);
    await page.click(".reply .regenerate");
    const replies = await completed(page, 2);
    assert.equal(replies[0]!.task, first!.task, "the first reply stays");
    assert.notEqual(replies[1]!.task, first!.task, "the second reply is another task");
    const sent = posts(proxy.seen);
    assert.equal(new Set(sent.map((s) => s.key)).size, 2, "Regenerate is a press of its own");
    assert.ok(sent[1]!.path.endsWith(`/v1/replies/${first!.task}/regenerate`));
    await page.screenshot({ path: join(env("REPLYD_OUT"), "demo-page.png"), fullPage: true });
    return report("regenerate", page, proxy);
  },

  // The event stream is cut after its first event: the client reconnects with Last-Event-ID
  // and the page still reaches completed.
  async stream_cut(page, base, proxy) {
    proxy.faults.cutStreams = 1;
    await open(page, base, key());
    // Slow enough that the cut comes before the terminal state.
    await ask(page, "Can a stream break? [mock:latency_ms=3000]");
    await completed(page, 1);
    const opened = streams(proxy.seen);
    assert.ok(opened.length >= 2, `the stream was reopened (${opened.length})`);
    assert.equal(opened[0]!.fault, "stream_cut");
    assert.ok(opened[0]!.lastRelayedId, "the cut stream delivered an event first");
    assert.equal(opened[1]!.lastEventId, opened[0]!.lastRelayedId, "the reconnect names the last event seen");
    return report("stream_cut", page, proxy);
  },

  // A gateway that cannot stream (every stream answered 502): the client polls instead.
  async no_streaming(page, base, proxy) {
    proxy.faults.noStreaming = true;
    await open(page, base, key());
    await ask(page, "What if nothing streams?");
    await completed(page, 1);
    assert.ok(polls(proxy.seen).length >= 1, "the task was polled");
    assert.equal(count(proxy.seen, (s) => s.fault === "no_streaming"), 3, "three streams were tried first");
    return report("no_streaming", page, proxy);
  },

  // A workspace whose quota admits one generation: the second Send gets 429 quota_exceeded,
  // and the page says when to try again (from Retry-After), without waiting hours for it.
  async quota(page, base, proxy) {
    await open(page, base, env("REPLYD_QUOTA_KEY"));
    await ask(page, "The one generation this workspace may have.");
    await completed(page, 1);
    await ask(page, "One more, over the quota?");
    await page.waitForSelector("#notice[data-kind=quota_exceeded]", { timeout: TIMEOUT });
    const notice = (await page.textContent("#notice")) ?? "";
    assert.match(notice, /try again in \d+ s/);
    const refused = posts(proxy.seen).filter((s) => s.status === 429);
    assert.equal(refused.length, 1, "a wait longer than the budget is not waited for");
    const retryAt = Date.parse((await page.getAttribute("#notice", "data-retry-at")) ?? "");
    const told = Number(refused[0]!.retryAfter) * 1000;
    assert.ok(Math.abs(retryAt - (Date.now() + told)) < 10_000, "the page shows the server's Retry-After");
    assert.equal((await page.textContent(".turn:last-child .turn-state"))?.trim().startsWith("not sent yet"), true);
    return report("quota", page, proxy, { notice });
  },

  // The provider refuses the work (a fatal 400): the task ends failed, and the page shows the
  // server's reason rather than a guess.
  async failed(page, base, proxy) {
    await setMockFaults({ error_rate: 1.0, error_status: 400 });
    try {
      await open(page, base, key());
      await ask(page, "What if the provider says no?");
      await page.waitForSelector(".reply[data-status=failed]", { timeout: TIMEOUT });
    } finally {
      await setMockFaults({});
    }
    const [reply] = await shown(page);
    assert.equal(reply!.badge, "failed");
    assert.ok(reply!.text.length > 0, "the failure's reason is shown");
    assert.equal(posts(proxy.seen).length, 1);
    return report("failed", page, proxy);
  },

  // Stop during a slow reply: one cancel, the task ends cancelled with no reply, and the page
  // offers Regenerate where it offered Stop.
  async stop(page, base, proxy) {
    await open(page, base, key());
    await ask(page, "[mock:latency_ms=8000] Take your time over this one.");
    await page.waitForSelector(".reply[data-status=running] button.stop", { timeout: TIMEOUT });
    await page.click(".reply button.stop");
    await page.waitForSelector(".reply[data-status=cancelled]", { timeout: TIMEOUT });
    const [reply] = await shown(page);
    assert.equal(reply!.badge, "stopped");
    assert.equal(reply!.text, "", "a stopped reply shows no text");
    assert.equal(await page.$$eval(".reply button.stop", (nodes) => nodes.length), 0, "no Stop once stopped");
    assert.equal(await page.$$eval(".reply button.regenerate", (nodes) => nodes.length), 1);
    assert.equal(cancels(proxy.seen).length, 1, "one cancel per press of Stop");
    assert.equal(cancels(proxy.seen)[0]!.status, 200);
    return report("stop", page, proxy);
  },

  // A request that is wrong (a message over worker.max_prompt_bytes): 422, sent once, its key
  // forgotten, nothing written; the page shows the server's detail.
  async refused(page, base, proxy) {
    await open(page, base, key());
    await ask(page, "x".repeat(300 * 1024));
    await page.waitForSelector("#notice[data-status='422']", { timeout: TIMEOUT });
    const notice = (await page.textContent("#notice")) ?? "";
    assert.match(notice, /worker\.max_prompt_bytes/);
    assert.equal(posts(proxy.seen).length, 1, "a 422 is not retried");
    assert.equal((await page.textContent(".turn:last-child .turn-state"))?.trim(), "not sent");
    const kept = await page.evaluate(() => Object.keys(sessionStorage).filter((name) => name.startsWith("replyd.press.")).length);
    assert.equal(kept, 0, "the refused press's key is forgotten");
    return report("refused", page, proxy, { notice });
  },
};

/** Replaces the mock provider's faults (`PUT /faults`; `{}`: none). */
async function setMockFaults(faults: Record<string, unknown>): Promise<void> {
  const answer = await fetch(`${env("REPLYD_MOCK_URL")}/faults`, {
    method: "PUT",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(faults),
  });
  assert.equal(answer.status, 200, `the mock took the faults: ${await answer.text()}`);
}

async function waitFor(condition: () => boolean, what: string): Promise<void> {
  const deadline = Date.now() + TIMEOUT;
  while (!condition()) {
    if (Date.now() > deadline) throw new Error(`timed out: ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

async function main(): Promise<void> {
  const proxy = new FaultProxy(new URL(env("REPLYD_URL")));
  const base = await proxy.listen();
  let browser: Browser | undefined;
  const reports: Report[] = [];
  const failures: string[] = [];
  try {
    browser = await chromium.launch({
      executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
      // No sandbox (tests run as root); no calls home (the network here is closed).
      args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    });
    const only = process.env.REPLYD_SCENARIOS?.split(",");
    for (const [name, scenario] of Object.entries(scenarios)) {
      if (only && !only.includes(name)) continue;
      proxy.reset();
      const context = await browser.newContext({ viewport: { width: 1000, height: 720 } });
      const page = await context.newPage();
      const errors: string[] = [];
      page.on("pageerror", (error) => errors.push(String(error)));
      // The page's console goes to the report's stderr, which the Rust side prints on failure.
      page.on("console", (message) => console.error(`[${name}] ${message.text()}`));
      try {
        const result = await scenario(page, base, proxy);
        assert.deepEqual(errors, [], "no script error on the page");
        reports.push(result);
      } catch (error) {
        failures.push(`${name}: ${error instanceof Error ? error.stack ?? error.message : String(error)}\nproxy saw: ${JSON.stringify(proxy.seen)}`);
      } finally {
        await context.close();
      }
    }
  } finally {
    await browser?.close();
    await proxy.close();
  }
  writeFileSync(join(env("REPLYD_OUT"), "report.json"), JSON.stringify(reports, null, 2));
  console.log(JSON.stringify(reports));
  if (failures.length > 0) {
    console.error(failures.join("\n\n"));
    process.exit(1);
  }
}

await main();
