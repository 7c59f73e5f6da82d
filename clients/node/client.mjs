#!/usr/bin/env node
// Node interop client for sessionrouter. Loads protos/ at run time (@grpc/proto-loader) and
// runs the cross-language scenario against the server at argv[2] (HOST:PORT):
//
//  1. register 4 workers (capacity 4);
//  2. start one group of 4 through 4 concurrent StartSession calls, and check the members
//     share the group and sit on 4 distinct workers;
//  3. check that a conflicting group_size on the same group is INVALID_ARGUMENT;
//  4. submit rewards [1, 0, 0, 1] on one SubmitRewards stream, with a bad entry (unknown
//     session) and a NaN reward along the way, check every entry's status, and check the
//     group_result's advantages against GRPO computed here (ddof 1, eps 1e-6);
//  5. deregister the workers.
//
// Exit status 0 on success, 1 with a message otherwise.
import { randomBytes } from "node:crypto";
import path from "node:path";
import { fileURLToPath } from "node:url";

import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const GROUP_SIZE = 4;
const EPS = 1e-6;
const TOLERANCE = 1e-9;
const REWARDS = [1, 0, 0, 1];
const CALL_TIMEOUT_MS = 30_000;

const here = path.dirname(fileURLToPath(import.meta.url));
const protoRoot = path.resolve(here, "..", "..", "protos");

function loadServices() {
  const definition = protoLoader.loadSync(
    ["sessionrouter/v1/session_service.proto", "sessionrouter/v1/worker_service.proto"],
    {
      includeDirs: [protoRoot],
      keepCase: true, // field names as in the .proto files
      longs: String, // uint64 (sequence, cursor) as decimal strings
      enums: String, // enum values by name
      defaults: true,
    },
  );
  const v1 = grpc.loadPackageDefinition(definition).sessionrouter.v1;
  return { SessionService: v1.SessionService, WorkerService: v1.WorkerService };
}

class ScenarioError extends Error {}

function check(condition, message) {
  if (!condition) {
    throw new ScenarioError(message);
  }
}

function deadline() {
  return { deadline: Date.now() + CALL_TIMEOUT_MS };
}

/** Calls a unary method and resolves with its reply. */
function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, deadline(), (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

async function startGroup(sessions, groupId, taskId) {
  const replies = await Promise.all(
    Array.from({ length: GROUP_SIZE }, (_, i) =>
      unary(sessions, "StartSession", {
        task_id: taskId,
        group_id: groupId,
        group_size: GROUP_SIZE,
        request_id: `${groupId}-req-${i}`,
        metadata: { client: "node" },
      }),
    ),
  );
  const members = new Array(GROUP_SIZE).fill(null);
  const onWorker = new Map();
  let created = 0;
  for (const reply of replies) {
    const s = reply.session;
    check(s.group_id === groupId, `session ${s.name} is in group ${s.group_id}, want ${groupId}`);
    check(reply.group_size === GROUP_SIZE, `session ${s.name}: group_size ${reply.group_size}`);
    check(
      s.index < GROUP_SIZE && members[s.index] === null,
      `session ${s.name}: index ${s.index} is out of range or taken twice`,
    );
    check(
      s.worker_id !== "" && !onWorker.has(s.worker_id),
      `sessions ${onWorker.get(s.worker_id)} and ${s.name} share worker "${s.worker_id}"`,
    );
    check(!reply.shared_worker, `session ${s.name}: shared_worker set although 4 workers are free`);
    members[s.index] = s;
    onWorker.set(s.worker_id, s.name);
    created += reply.group_created ? 1 : 0;
  }
  check(created === 1, `${created} of the ${GROUP_SIZE} calls report group_created, want exactly 1`);
  for (const s of members) {
    console.log(`session ${s.name} on worker ${s.worker_id}`);
  }
  return members;
}

async function checkSizeConflict(sessions, groupId, taskId) {
  try {
    await unary(sessions, "StartSession", {
      task_id: taskId,
      group_id: groupId,
      group_size: GROUP_SIZE + 1,
      request_id: `${groupId}-req-conflict`,
    });
  } catch (err) {
    check(
      err.code === grpc.status.INVALID_ARGUMENT,
      `StartSession with a conflicting group_size: got code ${err.code} (${err.details}), want INVALID_ARGUMENT`,
    );
    console.log(`conflicting group_size refused: ${err.details}`);
    return;
  }
  throw new ScenarioError("StartSession with a conflicting group_size succeeded");
}

/** Sends all requests on one SubmitRewards stream and collects every event until it ends. */
function exchangeRewards(sessions, requests) {
  return new Promise((resolve, reject) => {
    const events = [];
    const call = sessions.SubmitRewards(deadline());
    call.on("data", (event) => events.push(event));
    call.on("error", reject);
    call.on("end", () => resolve(events));
    requests.forEach((req, i) => call.write({ entries: req.entries, sequence: String(i + 1) }));
    call.end();
  });
}

function checkResult(result, groupId, members) {
  check(
    result.group_id === groupId && result.outcome === "GROUP_OUTCOME_COMPLETE",
    `group_result for ${result.group_id} with outcome ${result.outcome}, want ${groupId} COMPLETE`,
  );
  const sent = new Map(members.map((s, i) => [s.name, REWARDS[i]]));
  const names = result.sessions;
  const got = result.advantages;
  check(
    names.length === GROUP_SIZE && got.length === GROUP_SIZE && result.rewards.length === GROUP_SIZE,
    `group_result has ${names.length} sessions, ${result.rewards.length} rewards, ${got.length} advantages`,
  );
  // GRPO, computed here: A_i = (r_i - mean) / (sample std + eps), aligned with `sessions`.
  const aligned = names.map((name, i) => {
    check(sent.has(name), `group_result names session ${name}, not one of ours`);
    check(
      result.rewards[i] === sent.get(name),
      `reward of ${name} is ${result.rewards[i]}, we sent ${sent.get(name)}`,
    );
    return sent.get(name);
  });
  const mean = aligned.reduce((a, b) => a + b, 0) / GROUP_SIZE;
  const std = Math.sqrt(aligned.reduce((a, r) => a + (r - mean) ** 2, 0) / (GROUP_SIZE - 1));
  aligned.forEach((r, i) => {
    const want = (r - mean) / (std + EPS);
    check(Math.abs(got[i] - want) <= TOLERANCE, `advantage of ${names[i]} is ${got[i]}, want ${want}`);
  });
  console.log(
    `group_result ${result.group_id}: sessions ${names.join(",")} rewards ${result.rewards} ` +
      `advantages ${got} (mean ${result.mean}, std ${result.std})`,
  );
}

async function submitRewards(sessions, groupId, members) {
  const entry = (i) => ({ session: members[i].name, reward: REWARDS[i] });
  const unknown = { session: "groups/nope/sessions/0", reward: 0.5 };
  const nan = { session: members[2].name, reward: Number.NaN };
  const ok = "REWARD_STATUS_ACCEPTED";
  const requests = [
    { entries: [entry(0), unknown, entry(1)], want: [ok, "REWARD_STATUS_UNKNOWN_SESSION", ok] },
    { entries: [nan], want: ["REWARD_STATUS_NOT_FINITE"] },
    { entries: [entry(2), entry(3)], want: [ok, ok] },
  ];
  const events = await exchangeRewards(sessions, requests);

  // `ack` is null in a message that only carries group results.
  const acks = [];
  const results = [];
  for (const event of events) {
    if (event.ack !== null) {
      acks.push(event.ack);
    }
    check(
      event.group_results.length === 0 || acks.length === requests.length,
      "a group result arrived before the ack of the request that completed its group",
    );
    results.push(...event.group_results);
  }
  check(acks.length === requests.length, `got ${acks.length} acks for ${requests.length} requests`);
  acks.forEach((ack, i) => {
    check(ack.sequence === String(i + 1), `ack ${i + 1} has sequence ${ack.sequence}: out of order`);
    const want = requests[i].want;
    check(ack.results.length === want.length, `ack ${i + 1} has ${ack.results.length} results`);
    ack.results.forEach((r, j) => {
      check(
        r.status === want[j],
        `ack ${i + 1} entry ${j} (${requests[i].entries[j].session}): ${r.status} (${r.detail}), want ${want[j]}`,
      );
    });
    console.log(`ack ${ack.sequence}: ${ack.results.map((r) => r.status).join(", ")}`);
  });
  check(results.length === 1, `got ${results.length} group results, want 1`);
  checkResult(results[0], groupId, members);
}

async function run(address) {
  const { SessionService, WorkerService } = loadServices();
  const credentials = grpc.credentials.createInsecure();
  const workers = new WorkerService(address, credentials);
  const sessions = new SessionService(address, credentials);
  const runId = randomBytes(6).toString("hex");
  const workerIds = Array.from({ length: GROUP_SIZE }, (_, i) => `node-${runId}-w${i}`);
  try {
    for (const [i, id] of workerIds.entries()) {
      await unary(workers, "RegisterWorker", {
        worker_id: id,
        address: `127.0.0.1:${30000 + i}`,
        capacity: 4,
        labels: { client: "node" },
      });
    }
    console.log(`registered workers ${workerIds.join(", ")}`);
    const groupId = `node-${runId}`;
    const taskId = `node-task-${runId}`;
    const members = await startGroup(sessions, groupId, taskId);
    await checkSizeConflict(sessions, groupId, taskId);
    await submitRewards(sessions, groupId, members);
  } finally {
    const results = await Promise.allSettled(
      workerIds.map((id) => unary(workers, "DeregisterWorker", { worker_id: id })),
    );
    workers.close();
    sessions.close();
    const failed = results.filter((r) => r.status === "rejected" && r.reason.code !== grpc.status.NOT_FOUND);
    if (failed.length > 0) {
      throw new ScenarioError(`DeregisterWorker failed: ${failed.map((r) => r.reason.message).join("; ")}`);
    }
  }
}

const address = process.argv[2];
if (process.argv.length !== 3) {
  console.error("usage: client.mjs HOST:PORT");
  process.exit(2);
}
try {
  await run(address);
  console.log("node interop client: OK");
} catch (err) {
  console.error(`node interop client: FAILED: ${err instanceof ScenarioError ? err.message : err.stack}`);
  process.exit(1);
}
