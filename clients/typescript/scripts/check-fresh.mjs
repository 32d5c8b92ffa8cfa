// Fails when a committed build output is not what its source gives: src/openapi.ts against
// docs/openapi.json, dist/ against src/, demo/dist/ against demo/ (replyd embeds dist/ and
// demo/dist/ in its binary, and cargo cannot run tsc). Builds into a temporary directory and
// compares file by file, so it reads the working tree, not git.
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, readdirSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, relative } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const bin = (name) => join(root, "node_modules/.bin", name);
const scratch = mkdtempSync(join(tmpdir(), "replyd-client-"));
const run = (cmd, args) => execFileSync(cmd, args, { cwd: root, stdio: ["ignore", "ignore", "inherit"] });

function files(dir) {
  const walk = (at) =>
    readdirSync(at).flatMap((name) => (statSync(join(at, name)).isDirectory() ? walk(join(at, name)) : [join(at, name)]));
  return walk(dir)
    .map((path) => relative(dir, path))
    .sort();
}

const stale = [];
function compare(committed, built) {
  const have = files(join(root, committed));
  const want = files(built);
  for (const name of new Set([...have, ...want])) {
    const a = have.includes(name) ? readFileSync(join(root, committed, name), "utf8") : undefined;
    const b = want.includes(name) ? readFileSync(join(built, name), "utf8") : undefined;
    if (a !== b) stale.push(join(committed, name) + (a === undefined ? " (missing)" : b === undefined ? " (not built from source)" : ""));
  }
}

try {
  run(bin("openapi-typescript"), ["../../docs/openapi.json", "-o", join(scratch, "openapi.ts")]);
  if (readFileSync(join(scratch, "openapi.ts"), "utf8") !== readFileSync(join(root, "src/openapi.ts"), "utf8")) {
    stale.push("src/openapi.ts (docs/openapi.json changed: npm run generate)");
  }
  run(bin("tsc"), ["-p", "tsconfig.json", "--outDir", join(scratch, "dist")]);
  compare("dist", join(scratch, "dist"));
  run(bin("tsc"), ["-p", "tsconfig.demo.json", "--outDir", join(scratch, "demo")]);
  run(process.execPath, [join(root, "scripts/vendor.mjs"), join(scratch, "demo")]);
  compare("demo/dist", join(scratch, "demo"));
} finally {
  rmSync(scratch, { recursive: true, force: true });
}
if (stale.length > 0) {
  console.error(`stale build output (run npm run build):\n  ${stale.join("\n  ")}`);
  process.exit(1);
}
console.log("dist/, demo/dist/ and src/openapi.ts are what their sources give");
