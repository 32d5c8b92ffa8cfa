// The API's types, by name. `openapi.ts` is generated from docs/openapi.json (`npm run
// generate`), and `npm run check` fails when it is not what the document gives, so these are
// the server's own schemas.
/** The states after which a task never changes. */
export const TERMINAL = new Set(["completed", "failed", "cancelled"]);
export function isTerminal(status) {
    return TERMINAL.has(status);
}
