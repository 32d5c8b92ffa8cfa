import type { CreateReply } from "./types.js";
/** One unsettled press, as stored. */
export interface Press {
    /** The `Idempotency-Key`. */
    key: string;
    /** The request path: `/v1/replies` or `/v1/replies/{task_id}/regenerate`. */
    path: string;
    /** The body, for a Send (a Regenerate has none). */
    body?: CreateReply;
    /** When the press was made (ms since the epoch). */
    createdAt: number;
    /** The caller's own data, handed back by `pending()` (e.g. which turn of a chat it is). */
    meta?: Record<string, string>;
}
/** A store of unsettled presses. */
export interface PressStore {
    list(): Press[];
    put(press: Press): void;
    delete(key: string): void;
}
/** Presses in memory only: they do not survive a reload. */
export declare function memoryPresses(): PressStore;
/**
 * Presses in a Web Storage (`sessionStorage` by default: one tab's presses survive its
 * reloads, and another tab does not resend them). An entry that cannot be read is dropped.
 */
export declare function storagePresses(storage: Storage, prefix?: string): PressStore;
/**
 * A new key: a random UUID (v4). `crypto.getRandomValues` is used rather than
 * `crypto.randomUUID`, which browsers offer only on secure origins.
 */
export declare function newKey(): string;
