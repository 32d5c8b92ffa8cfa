// The answer as it is written, in the demo page served by replyd (signed in with an API key),
// in Debian's Chromium driven by playwright-core: a long reply, streamed slowly by the mock,
// grows in its bubble, marked as still being written; a reload mid-answer shows the same text
// again and it goes on growing; at the end the bubble holds the saved reply, no longer marked.
// A second answer, stopped mid-way, shows the stopped state and none of its text.
// Prints one JSON report for the caller (tests/it/browser.rs), which compares the text shown
// with the reply the server saved.
//
// Environment: REPLYD_URL (the API, with its demo page on), REPLYD_KEY, REPLYD_PROMPT (a prompt
// whose reply is long and slow), CHROMIUM.

import assert from "node:assert/strict";

import { chromium, type Browser, type Page } from "playwright-core";

const env = (name: string): string => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};

const TIMEOUT = 60_000;

/** A reply bubble, as the page shows it. */
interface Bubble {
  task: string;
  status: string;
  badge: string;
  streaming: boolean;
  busy: string;
  text: string;
}

/** The `index`th reply bubble of the page, if it shows one. */
async function bubble(page: Page, index = 0): Promise<Bubble | undefined> {
  return page.evaluate((index) => {
    const node = document.querySelectorAll<HTMLElement>(".reply")[index];
    if (node === undefined) return undefined;
    return {
      task: node.dataset.taskId ?? "",
      status: node.dataset.status ?? "",
      badge: node.querySelector(".status")?.textContent ?? "",
      streaming: node.hasAttribute("data-streaming"),
      busy: node.getAttribute("aria-busy") ?? "",
      text: node.querySelector(".text")?.textContent ?? "",
    };
  }, index);
}

/**
 * Watches the `index`th bubble until its text, marked as being written, was seen at `lengths` distinct
 * lengths longer than `since`, each the one before with more at its end; fails if the reply
 * completes first. Every text seen is `since` cut or continued (after a reload, the same
 * attempt's text is sent again from its start), and a text never shrinks between two looks.
 */
async function growing(page: Page, lengths: number, since = "", index = 0): Promise<string[]> {
  const texts: string[] = [];
  let previous = "";
  const deadline = Date.now() + TIMEOUT;
  while (texts.length < lengths) {
    assert.ok(Date.now() < deadline, `the text grew to ${texts.length} lengths in ${TIMEOUT} ms`);
    const now = await bubble(page, index);
    assert.notEqual(now?.status, "completed", `the reply was written before ${lengths} lengths were seen (${texts.length})`);
    if (now?.streaming && now.text.length > 0) {
      assert.equal(now.status, "running", "a text is written only while its attempt runs");
      assert.equal(now.badge, "still processing");
      assert.equal(now.busy, "true");
      assert.ok(now.text.startsWith(since) || since.startsWith(now.text), "the same attempt's text");
      assert.ok(now.text.startsWith(previous), `the text grows at its end: ${JSON.stringify(previous)} then ${JSON.stringify(now.text)}`);
      previous = now.text;
      if (now.text.length > Math.max(since.length, texts.at(-1)?.length ?? 0)) texts.push(now.text);
    }
    await new Promise((resolve) => setTimeout(resolve, 15));
  }
  return texts;
}

async function main(): Promise<void> {
  const base = env("REPLYD_URL");
  let browser: Browser | undefined;
  try {
    browser = await chromium.launch({
      executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
      args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    });
    const context = await browser.newContext({ viewport: { width: 1000, height: 720 } });
    const page = await context.newPage();
    const errors: string[] = [];
    page.on("pageerror", (error) => errors.push(String(error)));
    page.on("console", (message) => console.error(`[live] ${message.text()}`));
    await page.goto(`${base}/demo#key=${encodeURIComponent(env("REPLYD_KEY"))}`);
    await page.waitForSelector("body[data-ready=true]", { timeout: TIMEOUT });

    await page.fill("#message", env("REPLYD_PROMPT"));
    await page.click("#send");
    const before = await growing(page, 3);
    const task = (await bubble(page))!.task;

    // A reload mid-answer: the page reads the conversation back and follows the task again,
    // whose stream sends the text written so far, then the rest as it comes.
    await page.reload();
    await page.waitForSelector("body[data-ready=true]", { timeout: TIMEOUT });
    const after = await growing(page, 3, before.at(-1));
    const restored = await bubble(page);
    assert.equal(restored!.task, task, "the same task after the reload");

    await page.waitForSelector(".reply[data-status=completed]", { timeout: TIMEOUT });
    const end = (await bubble(page))!;
    assert.equal(end.badge, "completed");
    assert.equal(end.streaming, false, "the saved reply is no longer marked as being written");
    assert.equal(end.busy, "false");
    assert.ok(end.text.startsWith(after.at(-1)!), "the text written was the start of the saved reply");
    assert.equal(await page.$$eval(".reply", (nodes) => nodes.length), 1, "one reply");

    // Stop mid-answer: the bubble shows the stopped state, and no piece comes back after it.
    await page.fill("#message", env("REPLYD_PROMPT"));
    await page.click("#send");
    await growing(page, 2, "", 1);
    const stoppedTask = (await bubble(page, 1))!.task;
    await page.click(".reply[data-streaming] button.stop");
    await page.waitForSelector(".reply[data-status=cancelled]", { timeout: TIMEOUT });
    await new Promise((resolve) => setTimeout(resolve, 1_000));
    const stopped = (await bubble(page, 1))!;
    assert.equal(stopped.badge, "stopped");
    assert.equal(stopped.text, "", "a stopped reply shows none of its text");
    assert.equal(stopped.streaming, false, "nor is it marked as being written");
    assert.equal((await bubble(page, 0))!.text, end.text, "the first reply stays");
    assert.deepEqual(errors, [], "no page error");

    const conversation = await page.evaluate(
      () => (window as unknown as { replydDemo: { conversation(): { id: string } } }).replydDemo.conversation().id,
    );
    console.log(
      JSON.stringify({
        conversation_id: conversation,
        task_id: task,
        stopped_task_id: stoppedTask,
        lengths_before_reload: before.map((t) => t.length),
        lengths_after_reload: after.map((t) => t.length),
        text: end.text,
      }),
    );
  } finally {
    await browser?.close();
  }
}

await main();
