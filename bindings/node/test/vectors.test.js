"use strict";
// The conformance vectors (conformance/vectors/NAME.json + NAME.msgpack, generated from
// docs/protocol.md by conformance/generate.py) against this client's codec and request builders.

const assert = require("node:assert/strict");
const fs = require("node:fs");
const path = require("node:path");
const { test } = require("node:test");

const ppoz = require("../ppoz.js");

const VECTORS = path.resolve(__dirname, "..", "..", "..", "conformance", "vectors");
const NAMES = fs
  .readdirSync(VECTORS)
  .filter((f) => f.endsWith(".msgpack"))
  .map((f) => f.slice(0, -".msgpack".length))
  .sort();

function vector(name) {
  return {
    json: JSON.parse(fs.readFileSync(path.join(VECTORS, `${name}.json`), "utf8")),
    bytes: fs.readFileSync(path.join(VECTORS, `${name}.msgpack`)),
  };
}

const hex = (b) => Buffer.from(b).toString("hex");

/**
 * A vector's JSON with the protocol's float fields wrapped in Float64, as the client sends them: JSON cannot tell
 * 1.0 from 1 (JSON.parse gives the number 1 for both), and a float field keeps its msgpack type even when integral
 * (the generate examples' temperature 1.0 and 0.0 and top_p 1.0 are float64 on the wire).
 */
function withProtocolFloats(json) {
  const out = { ...json };
  for (const key of ["reward", "logprob"]) if (typeof out[key] === "number") out[key] = new ppoz.Float64(out[key]);
  if (Array.isArray(out.probs)) out.probs = out.probs.map((x) => new ppoz.Float64(x));
  if (out.sampling !== undefined) {
    out.sampling = { ...out.sampling };
    for (const key of ["temperature", "top_p"]) if (typeof out.sampling[key] === "number") out.sampling[key] = new ppoz.Float64(out.sampling[key]);
  }
  return out;
}

test("the vectors are there", () => {
  assert.ok(NAMES.length >= 15, `expected the documented examples in ${VECTORS}, found ${NAMES.length}`);
  for (const name of NAMES) assert.ok(fs.existsSync(path.join(VECTORS, `${name}.json`)), `${name}.json is missing`);
});

for (const name of NAMES) {
  test(`${name}: decoding the bytes gives the JSON, keys in wire order`, () => {
    const { json, bytes } = vector(name);
    const decoded = ppoz.decode(bytes);
    assert.deepStrictEqual(decoded, json);
    assert.deepStrictEqual(Object.keys(decoded), Object.keys(json));
  });

  test(`${name}: encoding the JSON gives the exact bytes`, () => {
    const { json, bytes } = vector(name);
    assert.equal(hex(ppoz.encode(withProtocolFloats(json))), hex(bytes));
  });
}

// The request builders, with the rids and task id of the documented examples.
const OBS = vector("step-request").json.obs;
const GENERATE = {
  prompt: { prompt: "Q: 2 + 3 = ? Answer with a number.\nA:", maxNewTokens: 16, temperature: 1.0, topP: 0.9, stop: ["\n"], seed: 7 },
  messages: {
    messages: [{ role: "system", content: "Be brief." }, { role: "user", content: "Name a colour." }],
    maxNewTokens: 8,
    temperature: 0.0,
    topP: 1.0,
    deadlineMs: 20000,
  },
};
const BUILT = {
  "attach-request": () => ppoz.buildRequest(ppoz.OP.ATTACH, {}, "a1"),
  "attach-request-2": () => ppoz.buildRequest(ppoz.OP.ATTACH, { task_id: "emu-7" }, "a2"),
  "ask-request": () => ppoz.buildRequest(ppoz.OP.ASK, { task_id: "emu-7" }, "k1"),
  "step-request": () => ppoz.buildRequest(ppoz.OP.STEP, ppoz.stepFields("emu-7", OBS), "s1"),
  "generate-request": () => ppoz.buildRequest(ppoz.OP.GENERATE, ppoz.generateFields("qa-3", GENERATE.prompt), "g1"),
  "generate-request-2": () => ppoz.buildRequest(ppoz.OP.GENERATE, ppoz.generateFields("qa-3", GENERATE.messages), "g2"),
  "feedback-request": () => ppoz.buildRequest(ppoz.OP.FEEDBACK, ppoz.feedbackFields("emu-7", 0.8), "f1"),
  "detach-request": () => ppoz.buildRequest(ppoz.OP.DETACH, { task_id: "emu-7" }, "d1"),
  "ping-request": () => ppoz.buildRequest(ppoz.OP.PING, {}, "p1"),
};

test("every request vector has a builder case", () => {
  assert.deepStrictEqual(Object.keys(BUILT).sort(), NAMES.filter((n) => n.includes("-request")));
});

for (const [name, build] of Object.entries(BUILT)) {
  test(`${name}: the client's request builder reproduces the bytes`, () => {
    assert.equal(hex(ppoz.encode(build())), hex(vector(name).bytes));
  });
}

test("the client's own methods send the documented bytes (recorded, no socket)", async () => {
  const client = new ppoz.PPOZClient("tcp://127.0.0.1:1");
  const sent = [];
  const deadlines = [];
  client.request = async (op, fields, { rid, deadlineMs } = {}) => {
    sent.push(ppoz.encode(ppoz.buildRequest(op, fields, rid)));
    deadlines.push(deadlineMs);
    return { task_id: "emu-7", status: "ok" };
  };
  assert.equal(await client.attach(undefined, { rid: "a1" }), "emu-7");
  await client.attach("emu-7", { rid: "a2" });
  await client.ask("emu-7", { rid: "k1" });
  // the observation's keys in another order still go out as prompt, question, action
  await client.step("emu-7", { action: OBS.action, question: OBS.question, prompt: OBS.prompt }, { rid: "s1" });
  await client.generate("qa-3", { ...GENERATE.prompt, rid: "g1" });
  await client.generate("qa-3", { ...GENERATE.messages, rid: "g2" });
  await client.feedback("emu-7", 0.8, { rid: "f1" });
  await client.detach("emu-7", { rid: "d1" });
  await client.ping({ rid: "p1" });
  const names = ["attach-request", "attach-request-2", "ask-request", "step-request", "generate-request", "generate-request-2",
    "feedback-request", "detach-request", "ping-request"];
  assert.deepStrictEqual(sent.map(hex), names.map((n) => hex(vector(n).bytes)));
  // generate's deadlineMs is also the request's own deadline here (as the Python client's `deadline`)
  assert.deepStrictEqual(deadlines.slice(4, 6), [undefined, 20000]);
  client.close();
});

test("reward is float64 even when integral; integer fields stay ints", () => {
  const body = ppoz.buildRequest(ppoz.OP.FEEDBACK, ppoz.feedbackFields("emu-7", 1, { done: true }), "f1");
  const bytes = ppoz.encode(body);
  // the reward: cb + IEEE 754 double 1.0; v stays the positive fixint 01
  assert.ok(hex(bytes).includes(hex(Buffer.from("a6726577617264cb3ff0000000000000", "hex"))), hex(bytes));
  assert.ok(hex(bytes).startsWith("88a570726f746fa470706f7aa17601"), hex(bytes));
  for (const [reward, wire] of [[0, "cb0000000000000000"], [-3, "cbc008000000000000"], [0.8, "cb3fe999999999999a"]]) {
    const fields = ppoz.encode(ppoz.feedbackFields("t", reward));
    assert.ok(hex(fields).includes(`a6726577617264${wire}`), `${reward}: ${hex(fields)}`);
  }
  // a plain integral number is an int, as in Python: action 1, retry_after_ms 1000, policy_version 12
  assert.equal(hex(ppoz.encode({ action: 1 })), "81a6616374696f6e01");
  assert.equal(hex(ppoz.encode({ retry_after_ms: 1000 })), "81ae72657472795f61667465725f6d73cd03e8");
  assert.equal(hex(ppoz.encode({ x: new ppoz.Float64(12) })), "81a178cb4028000000000000");
  assert.throws(() => ppoz.feedbackFields("t", Number.NaN), TypeError);
  assert.throws(() => ppoz.feedbackFields("t", "1"), TypeError);
});

test("generate-reply: the fields a client reads", async () => {
  const { json, bytes } = vector("generate-reply");
  const reply = ppoz.decode(bytes);
  assert.equal(reply.status, "ok");
  assert.equal(reply.task_id, "qa-3");
  assert.equal(reply.text, " 5");
  assert.equal(reply.n_tokens, 2);
  assert.equal(reply.finish_reason, "stop");
  assert.equal(reply.logprob, -1.5);
  assert.equal(reply.policy_version, 12);
  // client.generate resolves to the reply map as it came
  const client = new ppoz.PPOZClient("tcp://127.0.0.1:1");
  client.request = async () => reply;
  assert.deepStrictEqual(await client.generate("qa-3", { prompt: "Q: 2 + 3 = ? Answer with a number.\nA:" }), json);
  client.close();
  const error = ppoz.errorFromReply(vector("generate-error").json);
  assert.ok(error instanceof ppoz.BadRequest);
  assert.match(error.message, /unknown `sampling` keys: n/);
});

test("generate: temperature and top_p are float64 even when integral; stop and seed only when given", () => {
  const fields = ppoz.generateFields("t", { prompt: "p", maxNewTokens: 4, temperature: 1, topP: 1, stop: [] });
  assert.deepStrictEqual(Object.keys(fields), ["task_id", "prompt", "sampling"]);
  assert.deepStrictEqual(Object.keys(fields.sampling), ["max_new_tokens", "temperature", "top_p"]);
  assert.equal(hex(ppoz.encode(fields.sampling)),
    "83ae6d61785f6e65775f746f6b656e7304ab74656d7065726174757265cb3ff0000000000000a5746f705f70cb3ff0000000000000");
  // the Python client's defaults: 256 tokens, temperature 1, top_p 1
  const defaults = ppoz.decode(ppoz.encode(ppoz.generateFields("t", { prompt: "p" })));
  assert.deepStrictEqual(defaults.sampling, { max_new_tokens: 256, temperature: 1, top_p: 1 });
  // message keys go out as role, content whatever the object's order
  const chat = ppoz.generateFields("t", { messages: [{ content: "Hi", role: "user" }], seed: 0 });
  assert.deepStrictEqual(Object.keys(chat.messages[0]), ["role", "content"]);
  assert.deepStrictEqual(Object.keys(chat.sampling), ["max_new_tokens", "temperature", "top_p", "seed"]);
});

test("feedback leaves out an empty next_obs and orders a given one", () => {
  const empty = ppoz.feedbackFields("t", 1, { truncated: true, nextObs: {} });
  assert.deepStrictEqual(Object.keys(empty), ["task_id", "reward", "done", "truncated"]);
  const given = ppoz.feedbackFields("t", 1, { truncated: true, nextObs: { action: ["0: a"], prompt: "p" } });
  assert.deepStrictEqual(Object.keys(given.next_obs), ["prompt", "question", "action"]);
  assert.equal(hex(ppoz.encode(given.next_obs)), hex(ppoz.encode({ prompt: "p", action: ["0: a"] })));
});

test("error replies map to their classes", () => {
  const reply = vector("feedback-error").json;
  const error = ppoz.errorFromReply(reply);
  assert.ok(error instanceof ppoz.FeedbackWithoutStep);
  assert.ok(error instanceof ppoz.PPOZError);
  assert.equal(error.code, "feedback_without_step");
  assert.equal(error.reply, reply);
  assert.ok(ppoz.errorFromReply(vector("ask-error").json) instanceof ppoz.UnsupportedVersion);
  assert.ok(ppoz.errorFromReply({ error: { code: "timeout", message: "m" } }) instanceof ppoz.RequestTimeout);
  const unknown = ppoz.errorFromReply({ error: { code: "new_code", message: "m" } });
  assert.equal(unknown.constructor, ppoz.PPOZError);
  assert.equal(unknown.code, "new_code");
});

test("the retry rule: retried codes wait, others throw, the deadline bounds the waits", () => {
  const rule = new ppoz.RetryRule("ask", "k1", { task_id: "emu-7" }, 5000, 1000);
  assert.equal(hex(rule.data), hex(vector("ask-request").bytes));
  assert.ok(rule.nextAttempt() <= 1000);
  assert.equal(rule.waitBeforeRetry({ status: "ok" }), null);
  assert.equal(rule.waitBeforeRetry({ error: { code: "overloaded", message: "" }, retry_after_ms: 250 }), 250);
  assert.equal(rule.waitBeforeRetry({ error: { code: "internal", message: "" } }), 100);
  assert.equal(rule.waitBeforeRetry({ error: { code: "timeout", message: "" } }), 100);
  assert.throws(() => rule.waitBeforeRetry({ error: { code: "unknown_task", message: "" } }), ppoz.UnknownTask);
  assert.throws(() => rule.waitBeforeRetry({ error: { code: "overloaded", message: "" }, retry_after_ms: 60000 }), ppoz.Overloaded);
  const expired = new ppoz.RetryRule("ping", "p1", {}, 1, 1000);
  const end = performance.now() + 5;
  while (performance.now() < end); // let its 1 ms deadline pass
  assert.throws(() => expired.nextAttempt(), ppoz.RequestTimeout);
  assert.throws(() => new ppoz.PPOZClient("tcp://127.0.0.1:1", { deadlineMs: 0 }), /deadlineMs/);
  assert.throws(() => new ppoz.PPOZClient("tcp://127.0.0.1:1", { attemptTimeoutMs: -1 }), /attemptTimeoutMs/);
  assert.throws(() => ppoz.buildRequest("ask", { rid: "x" }), /header/);
});
