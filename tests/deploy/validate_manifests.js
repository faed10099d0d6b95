#!/usr/bin/env node
// Validates Kubernetes manifests of fp8rt offline (see lib/manifests.js for what is checked):
//   node validate_manifests.js [--flavor cpu|gpu] [--any-image] FILE.yaml...
// The files together form one stack (e.g. `kubectl kustomize deploy/kubernetes/overlays/cpu`
// saved to a file, or `-` for standard input). Exit 0 valid, 1 errors (each printed with the
// object and field), 2 bad usage.
"use strict";

const fs = require("fs");
const m = require("./lib/manifests");

function main(argv) {
  let flavor = null;
  let imageTag = true;
  const files = [];
  for (let i = 0; i < argv.length; ++i) {
    if (argv[i] === "--flavor") flavor = argv[++i];
    else if (argv[i] === "--any-image") imageTag = false;
    else if (argv[i].startsWith("--")) {
      process.stderr.write(`validate_manifests: unknown option ${argv[i]}\n`);
      return 2;
    } else files.push(argv[i]);
  }
  if (files.length === 0 || (flavor !== null && !["cpu", "gpu"].includes(flavor))) {
    process.stderr.write("usage: validate_manifests.js [--flavor cpu|gpu] [--any-image] FILE...\n");
    return 2;
  }
  const objects = [];
  for (const f of files) {
    objects.push(...m.parseManifests(fs.readFileSync(f === "-" ? 0 : f, "utf8"), f));
  }
  const errors = [
    ...m.validateSchemas(objects),
    ...m.typeCheck(objects),
    ...m.checkStack(objects),
    ...(flavor ? m.checkFlavor(objects, flavor, { imageTag }) : []),
  ];
  for (const e of errors) process.stderr.write(`${e}\n`);
  if (errors.length > 0) return 1;
  process.stdout.write(`${objects.length} objects valid: ${objects.map(m.describe).join(", ")}\n`);
  return 0;
}

process.exitCode = main(process.argv.slice(2));
