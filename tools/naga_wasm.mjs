#!/usr/bin/env node
// WGSL -> SPIR-V with naga compiled to WebAssembly (npm `naga-wasm`, pinned to
// 30.1.0 in package.json; it bundles naga 30.0.1). Used when the `naga` CLI is
// not on PATH. Run `npm ci` in the repo root first.
//
//   node tools/naga_wasm.mjs IN.wgsl OUT.spv [--override NAME=VALUE ...]
//                            [--debug] [--spirv 1.0|1.1|1.2|1.3]
//   node tools/naga_wasm.mjs --serve      # build_shaders.py's translator
//
// --serve reads one JSON request a line from stdin, {"in": IN.wgsl, "out": OUT.spv}, and answers each with one
// line, {"ok": true} or {"ok": false, "error": naga's report}: one process translates a whole build's modules.
// A process per module paid Node's start and naga's unoptimized first run each time (0.6 s a module, against
// 0.05-0.1 s once the wasm is warm: 80 s of a 2-core build of 103 modules).
//
// naga-wasm API used (dist/index.d.ts; the "node" export loads the .wasm
// synchronously on import):
//   parseWgsl(source) -> Module              throws NagaError kind "parse"
//   validate(module)  -> ModuleInfo          throws NagaError kind "validation"
//   writeSpirv(module, info, { flags?: { debug?, adjustCoordinateSpace?,
//     labelVaryings?, clampFragDepth?, forcePointSize? } }) -> Uint32Array
//                                            throws NagaError kind "write"
//   NagaError.formatted = naga's full report with file:line:col and a caret.
// writeSpirv has no other options: unknown keys (langVersion, ...) are silently
// ignored, so the module header always says SPIR-V 1.0, and there is no
// pipeline-constants option. flags.debug only adds OpName.
//
// What this script adds on top:
// * WGSL `override`s: naga's SPIR-V writer rejects them ("overrides should not
//   be present at this stage"); it never emits OpSpecConstant/SpecId. So every
//   `override` declaration is rewritten to a `const`, with the --override
//   value, or else its default. Line numbers are kept. A NAME given with
//   --override needs an explicit type (`override WG: u32 = 64;`).
// * SPIR-V version: naga emits GroupNonUniform* capabilities (for subgroup
//   builtins) while the header still says 1.0, which spirv-val rejects. If those
//   capabilities are present, or if --spirv asks for it, the header word is set
//   to 1.3 (or the version given). That is safe because naga's 1.0 output is
//   also valid 1.1-1.3 (checked with spirv-val --target-env vulkan1.1/1.2).
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { dirname } from "node:path";
import { createInterface } from "node:readline";
import { NagaError, parseWgsl, validate, writeSpirv } from "naga-wasm";

const die = (msg, code = 2) => { process.stderr.write(`naga_wasm: ${msg}\n`); process.exit(code); };

// ---- command line ---------------------------------------------------------
const args = process.argv.slice(2);
const files = [], overrides = new Map();
let debug = false, spirv = null, serve = false;
for (let i = 0; i < args.length; i++) {
  const a = args[i];
  if (a === "--override" || a === "--spirv") {
    const v = args[++i] ?? die(`${a} needs a value`);
    if (a === "--spirv") {
      if (!/^1\.[0-3]$/.test(v)) die(`--spirv must be 1.0 to 1.3, got ${v}`);
      spirv = v;
      continue;
    }
    const m = /^([A-Za-z_]\w*)=(true|false|[-+]?[0-9.][0-9a-fA-FxX.eE+-]*[iuhf]?)$/.exec(v);
    if (!m) die(`bad --override ${v} (want NAME=number or NAME=true/false)`);
    overrides.set(m[1], m[2]);
  } else if (a === "--debug") debug = true;
  else if (a === "--serve") serve = true;
  else if (a.startsWith("-")) die(`unknown option ${a}`);
  else files.push(a);
}

// One translation: null, or the error to report (naga's, with the file's path where it names the source).
function translate(inPath, outPath) {
  // ---- resolve `override` declarations to `const` ----------------------------
  // Matches `[@id(N)] override NAME[: TYPE][= INIT];`, at the start of a line.
  const OVERRIDE_RE = /^([ \t]*)(?:@id\s*\([^)]*\)\s*)?override\s+([A-Za-z_]\w*)\s*(?::\s*([^=;]+?))?\s*(?:=\s*([^;]+?))?\s*;/gm;
  const unused = new Set(overrides.keys());
  let text;
  try { text = readFileSync(inPath, "utf8"); } catch (e) { return e.message; }
  let problem = null;
  const source = text.replace(OVERRIDE_RE, (decl, indent, name, type, init) => {
    unused.delete(name);
    const value = overrides.get(name) ?? init;
    if (value === undefined) problem ??= `override ${name} has no default; pass --override ${name}=VALUE`;
    if (overrides.has(name) && !type) problem ??= `override ${name} needs an explicit type to be overridden`;
    const pad = "\n".repeat(decl.split("\n").length - 1); // keep line numbers
    return `${indent}const ${name}${type ? `: ${type}` : ""} = ${value};${pad}`;
  });
  if (problem) return problem;
  if (unused.size) return `no override named ${[...unused].join(", ")} in ${inPath}`;

  // ---- translate ------------------------------------------------------------
  let words;
  try {
    const module = parseWgsl(source);
    try {
      const info = validate(module);
      try { words = writeSpirv(module, info, { flags: { debug } }); } finally { info.free(); }
    } finally { module.free(); }
  } catch (e) {
    if (!(e instanceof NagaError)) throw e;
    // naga names the source "wgsl"; put the real path there so editors can jump to it.
    return e.formatted.replaceAll("┌─ wgsl:", `┌─ ${inPath}:`).trimEnd();
  }

  // ---- SPIR-V version word ----------------------------------------------------
  // Capabilities come right after the 5-word header; OpCapability is opcode 17,
  // GroupNonUniform* capabilities are 61..68 and need SPIR-V 1.3.
  let needsSubgroups = false;
  for (let i = 5; i < words.length && (words[i] & 0xffff) === 17; i += words[i] >>> 16)
    if (words[i + 1] >= 61 && words[i + 1] <= 68) needsSubgroups = true;
  const minor = spirv ? Number(spirv.split(".")[1]) : 0;
  if (needsSubgroups && minor < 3) {
    if (spirv) return `${inPath} uses subgroup operations, which need --spirv 1.3`;
    words[1] = 0x00010300;
  } else if (minor) words[1] = 0x00010000 | (minor << 8);

  mkdirSync(dirname(outPath), { recursive: true });
  writeFileSync(outPath, new Uint8Array(words.buffer, words.byteOffset, words.byteLength));
  return null;
}

if (serve) {
  if (files.length || overrides.size) die("--serve takes its files from stdin, and no overrides");
  const lines = createInterface({ input: process.stdin, crlfDelay: Infinity });
  for await (const line of lines) {
    if (!line.trim()) continue;
    let error;
    try {
      const request = JSON.parse(line);
      error = translate(request.in, request.out);
    } catch (e) { error = String(e?.stack ?? e); }
    process.stdout.write(JSON.stringify(error === null ? { ok: true } : { ok: false, error }) + "\n");
  }
} else {
  if (files.length !== 2) die("usage: node tools/naga_wasm.mjs IN.wgsl OUT.spv [--override NAME=VALUE ...] [--debug] [--spirv 1.3]");
  const error = translate(files[0], files[1]);
  if (error !== null) { process.stderr.write(error + "\n"); process.exit(1); }
}
