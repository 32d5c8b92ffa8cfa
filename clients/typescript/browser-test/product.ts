// The demo page as a product serves it: on the product's own origin (`replyd-lab product`),
// calling replyd on another origin, signed in as an end user with a short-lived token the
// product's server asks replyd for. Debian's Chromium, driven by playwright-core. The token
// expires mid-conversation and is refreshed; Stop cuts a slow reply short; a reload, and
// another tab, read the conversation back from the server's listing; another user sees none
// of it; the workspace's key is never in the browser. Prints one JSON report for the caller
// (tests/it/browser.rs), which checks the server's durable state.
//
// Environment: REPLYD_PRODUCT_URL (the product's origin), REPLYD_KEY (the workspace's key, to
// look for in the browser), CHROMIUM.

import assert from "node:assert/strict";

import { chromium, type Browser, type BrowserContext, type Page } from "playwright-core";

const env = (name: string): string => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};

const TIMEOUT = 60_000;

interface Shown {
  task: string;
  status: string;
  text: string;
}

interface PageStats {
  tokens: number;
  reports: { method: string; path: string; outcome: number | "network" }[];
}

async function open(page: Page, url: string): Promise<void> {
  await page.goto(url);
  await page.waitForSelector("body[data-ready=true]", { timeout: TIMEOUT });
}

async function signIn(page: Page, user: string): Promise<void> {
  await page.fill("#api-key", user);
  await page.click("#use-key");
  await page.waitForFunction((u) => document.getElementById("user")?.textContent === `signed in as ${u}`, user, {
    timeout: TIMEOUT,
  });
}

async function ask(page: Page, text: string): Promise<void> {
  await page.fill("#message", text);
  await page.click("#send");
}

async function shown(page: Page): Promise<Shown[]> {
  return page.$$eval(".reply", (nodes) =>
    nodes.map((node) => ({
      task: (node as HTMLElement).dataset.taskId ?? "",
      status: (node as HTMLElement).dataset.status ?? "",
      text: node.querySelector(".text")?.textContent ?? "",
    })),
  );
}

/** Waits until the page shows exactly `statuses`, in order. */
async function showing(page: Page, statuses: string[]): Promise<Shown[]> {
  await page.waitForFunction(
    (want) => {
      const replies = [...document.querySelectorAll<HTMLElement>(".reply")];
      return replies.length === want.length && replies.every((r, i) => r.dataset.status === want[i]);
    },
    statuses,
    { timeout: TIMEOUT },
  );
  return shown(page);
}

async function stats(page: Page): Promise<PageStats> {
  return page.evaluate(() => {
    const s = (window as unknown as { replydDemo: { stats: PageStats } }).replydDemo.stats;
    return { tokens: s.tokens, reports: s.reports };
  });
}

async function conversationOf(page: Page): Promise<string> {
  return page.evaluate(() => (window as unknown as { replydDemo: { conversation(): { id: string } } }).replydDemo.conversation().id);
}

/** Waits until the token the page holds has expired (its `exp`, by this machine's clock). */
async function expired(page: Page): Promise<void> {
  const exp = await page.evaluate(() => {
    const token = sessionStorage.getItem("replyd.demo.token") ?? "";
    const payload = token.split(".")[1] ?? "";
    return (JSON.parse(atob(payload.replace(/-/g, "+").replace(/_/g, "/"))) as { exp: number }).exp;
  });
  await page.waitForFunction((at) => Date.now() / 1000 >= at, exp, { timeout: TIMEOUT, polling: 100 });
}

/** Everything the page keeps, to look for the workspace's key in. */
async function storage(page: Page): Promise<string> {
  return page.evaluate(() => JSON.stringify({ session: { ...sessionStorage }, local: { ...localStorage }, cookies: document.cookie }));
}

async function main(): Promise<void> {
  const product = env("REPLYD_PRODUCT_URL");
  const key = env("REPLYD_KEY");
  let browser: Browser | undefined;
  try {
    browser = await chromium.launch({
      executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
      args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    });
    const alice: BrowserContext = await browser.newContext();
    const page = await alice.newPage();
    const errors: string[] = [];
    page.on("pageerror", (error) => errors.push(String(error)));
    await open(page, `${product}/demo`);
    await signIn(page, "alice");

    // A first turn, then the token runs out, then a second: the client asks the product for a
    // new token on the 401 and sends the same press again.
    await ask(page, "What are the key decisions in this document?");
    await showing(page, ["completed"]);
    await expired(page);
    await ask(page, "Which one is the riskiest?");
    const two = await showing(page, ["completed", "completed"]);
    const afterRefresh = await stats(page);
    assert.ok(afterRefresh.tokens >= 2, `a sign-in and a refresh: ${afterRefresh.tokens} tokens`);
    const refused = afterRefresh.reports.filter((r) => r.outcome === 401);
    assert.ok(refused.length >= 1, "the expired token was refused once");
    assert.ok(
      afterRefresh.reports.some((r) => r.method === "POST" && r.path === "/v1/replies" && r.outcome === 202),
      "and the press went through with the new one",
    );

    // Stop during a slow reply.
    await ask(page, "[mock:latency_ms=8000] Take your time over this one.");
    await page.waitForSelector(".reply[data-status=running] button.stop", { timeout: TIMEOUT });
    await page.click(".reply[data-status=running] button.stop");
    const three = await showing(page, ["completed", "completed", "cancelled"]);
    const conversation = await conversationOf(page);

    // A reload reads the conversation back from the listing: the same replies, texts and states.
    await open(page, `${product}/demo`);
    const reloaded = await showing(page, ["completed", "completed", "cancelled"]);
    assert.deepEqual(reloaded, three);
    assert.deepEqual(reloaded.slice(0, 2), two);

    // Another tab of alice's, opened on the conversation, shows it once signed in.
    const tab = await alice.newPage();
    await open(tab, `${product}/demo?conversation=${encodeURIComponent(conversation)}`);
    await signIn(tab, "alice");
    assert.deepEqual(await showing(tab, ["completed", "completed", "cancelled"]), three);

    // Bob, on the same conversation's address, sees nothing of it.
    const bobContext = await browser.newContext();
    const bob = await bobContext.newPage();
    await open(bob, `${product}/demo?conversation=${encodeURIComponent(conversation)}`);
    await signIn(bob, "bob");
    await bob.waitForFunction(
      () =>
        (window as unknown as { replydDemo: { stats: PageStats } }).replydDemo.stats.reports.some(
          (r) => r.path.includes("/messages") && r.outcome === 404,
        ),
      undefined,
      { timeout: TIMEOUT },
    );
    assert.deepEqual(await shown(bob), [], "another user's conversation is not shown");

    // The workspace's key is nowhere in any browser.
    for (const p of [page, tab, bob]) {
      const kept = await storage(p);
      assert.ok(!kept.includes(key), "the workspace's key is not in the browser");
      assert.ok(kept.includes("replyd.demo.token"), "the page holds an end user's token");
    }
    assert.deepEqual(errors, [], "no page error");
    console.log(
      JSON.stringify({
        conversation_id: conversation,
        tokens: afterRefresh.tokens,
        refused: refused.length,
        tasks_shown: three.map((r) => r.task),
        statuses: three.map((r) => r.status),
      }),
    );
  } finally {
    await browser?.close();
  }
}

await main();
