// Copies the one runtime dependency's ES modules next to the demo page, which loads them
// through its import map (replyd embeds demo/dist in its binary, so the page needs nothing
// from npm at run time).
import { copyFileSync, mkdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const out = process.argv[2] ?? join(root, "demo/dist");
const from = join(root, "node_modules/eventsource-parser/dist");
const to = join(out, "vendor/eventsource-parser");
rmSync(to, { recursive: true, force: true });
mkdirSync(to, { recursive: true });
// The package's ES build is one self-contained module.
copyFileSync(join(from, "index.js"), join(to, "index.js"));
