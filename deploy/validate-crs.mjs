// Validate Prometheus Operator custom resources offline against the CRD schemas that
// @kubernetes-models/prometheus-operator ships (the core kinds go through
// kubernetes-validate instead).
//
//   node deploy/validate-crs.mjs NODE_MODULES_DIR FILE.yaml...   (multi-document YAML)
//
// Prints "OK Kind/name" per custom resource and "FAIL Kind/name: reason" for each invalid
// one; documents of other API groups are skipped and listed. Exit status 1 on any failure
// or on a monitoring.coreos.com kind this script does not know.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [nodeModules, ...files] = process.argv.slice(2);
if (!nodeModules || files.length === 0) {
  console.error("usage: node validate-crs.mjs NODE_MODULES_DIR FILE.yaml...");
  process.exit(2);
}
const load = (rel) => import(pathToFileURL(join(nodeModules, rel)).href);
const yaml = await load("js-yaml/dist/js-yaml.mjs");
const models = {
  "monitoring.coreos.com/v1": await load(
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/index.js",
  ),
  "monitoring.coreos.com/v1alpha1": await load(
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1alpha1/index.js",
  ),
};

let failed = 0;
let checked = 0;
for (const file of files) {
  for (const doc of yaml.loadAll(readFileSync(file, "utf8"))) {
    if (!doc) continue;
    const id = `${doc.kind}/${doc.metadata?.name ?? "?"}`;
    if (!String(doc.apiVersion).startsWith("monitoring.coreos.com/")) {
      console.log(`SKIP ${id} (${doc.apiVersion})`);
      continue;
    }
    const Model = models[doc.apiVersion]?.[doc.kind];
    if (!Model) {
      console.log(`FAIL ${id}: no model for ${doc.apiVersion} ${doc.kind}`);
      failed += 1;
      continue;
    }
    try {
      new Model(doc).validate();
      console.log(`OK ${id}`);
      checked += 1;
    } catch (err) {
      console.log(`FAIL ${id}: ${err.message}`);
      failed += 1;
    }
  }
}
console.log(`${checked} valid, ${failed} invalid`);
process.exit(failed ? 1 : 0);
