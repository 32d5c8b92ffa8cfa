import assert from "node:assert/strict";
import test from "node:test";

import { memoryPresses, newKey, storagePresses, type Press } from "../src/presses.js";
import { FakeStorage } from "./storage.js";

const press = (key: string, createdAt: number): Press => ({
  key,
  path: "/v1/replies",
  body: { conversation_id: "c", message: key },
  createdAt,
});

test("storagePresses round-trips presses, oldest first, and ignores other entries", () => {
  const storage = new FakeStorage();
  storage.setItem("theme", "dark");
  const store = storagePresses(storage);
  store.put(press("b", 2));
  store.put(press("a", 1));
  assert.deepEqual(storagePresses(storage).list(), [press("a", 1), press("b", 2)]);
  store.delete("a");
  assert.deepEqual(storagePresses(storage).list(), [press("b", 2)]);
  assert.equal(storage.getItem("theme"), "dark");
});

test("an unreadable stored press is dropped without hiding the press stored after it", () => {
  const storage = new FakeStorage();
  storage.setItem("replyd.press.broken", "{not json");
  const store = storagePresses(storage);
  store.put(press("good", 1));
  assert.deepEqual(store.list(), [press("good", 1)]);
  assert.equal(storage.getItem("replyd.press.broken"), null);
});

test("memoryPresses lists presses oldest first and forgets a deleted one", () => {
  const store = memoryPresses();
  store.put(press("late", 5));
  store.put(press("early", 1));
  assert.deepEqual(
    store.list().map((p) => p.key),
    ["early", "late"],
  );
  store.delete("early");
  assert.deepEqual(
    store.list().map((p) => p.key),
    ["late"],
  );
});

test("newKey makes distinct UUID v4 keys", () => {
  const keys = new Set(Array.from({ length: 100 }, newKey));
  assert.equal(keys.size, 100);
  for (const key of keys) assert.match(key, /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
});
