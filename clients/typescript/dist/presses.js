// Where a press's idempotency key lives until the press is settled. A press is one user
// action (Send, Regenerate); its key is made once and reused for every retry, also after a
// page reload, so the server can tell a retry from new work. It is forgotten only once the
// server has answered for good: accepted (202) or refused (a 4xx that says the request is
// wrong). A press that ran out of time keeps its key.
/** Presses in memory only: they do not survive a reload. */
export function memoryPresses() {
    const presses = new Map();
    return {
        list: () => [...presses.values()].sort((a, b) => a.createdAt - b.createdAt),
        put: (press) => void presses.set(press.key, press),
        delete: (key) => void presses.delete(key),
    };
}
/**
 * Presses in a Web Storage (`sessionStorage` by default: one tab's presses survive its
 * reloads, and another tab does not resend them). An entry that cannot be read is dropped.
 */
export function storagePresses(storage, prefix = "replyd.press.") {
    return {
        list() {
            const presses = [];
            // The names first: removing an entry while walking the indices would skip the next one.
            const names = [];
            for (let i = 0; i < storage.length; i++)
                names.push(storage.key(i) ?? "");
            for (const name of names) {
                if (!name.startsWith(prefix))
                    continue;
                try {
                    const press = JSON.parse(storage.getItem(name) ?? "");
                    if (typeof press.key === "string" && typeof press.path === "string")
                        presses.push(press);
                }
                catch {
                    storage.removeItem(name);
                }
            }
            return presses.sort((a, b) => a.createdAt - b.createdAt);
        },
        put: (press) => storage.setItem(prefix + press.key, JSON.stringify(press)),
        delete: (key) => storage.removeItem(prefix + key),
    };
}
/**
 * A new key: a random UUID (v4). `crypto.getRandomValues` is used rather than
 * `crypto.randomUUID`, which browsers offer only on secure origins.
 */
export function newKey() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    const hex = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
    return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}
