"use strict";
// The client against a scripted ROUTER on a random port: rid matching, the retry rule, deadlines.

const assert = require("node:assert/strict");
const { test } = require("node:test");
const zmq = require("zeromq");

const ppoz = require("../ppoz.js");

/** A fake broker: hands each request ({id, frames, body, bytes}) to `handler`, which replies or not. */
async function fakeBroker(handler) {
  const router = new zmq.Router({ linger: 0 });
  await router.bind("tcp://127.0.0.1:*");
  const seen = [];
  const loop = (async () => {
    try {
      for (;;) {
        const [id, ...frames] = await router.receive();
        const bytes = frames[frames.length - 1];
        const req = { id: id.toString("hex"), frames: frames.length, body: ppoz.decode(bytes), bytes: bytes.toString("hex") };
        seen.push(req);
        const replies = await handler(req, seen);
        for (const reply of replies || []) await router.send([id, Buffer.alloc(0), ppoz.encode(reply)]);
      }
    } catch {
      // closed
    }
  })();
  return {
    endpoint: router.lastEndpoint,
    seen,
    close: async () => {
      router.close();
      await loop;
    },
  };
}

const ok = (body, extra = {}) => ({ ...ppoz.header(body.op, body.rid), status: "ok", ...extra });
const err = (body, code, extra = {}) => ({ ...ppoz.header(body.op, body.rid), error: { code, message: `${code} on purpose` }, ...extra });

test("a request goes as [empty, body] and its reply comes back; a stale rid is ignored", async () => {
  const broker = await fakeBroker(({ body }) => [ok({ op: body.op, rid: "stale" }, { time_ms: 1 }), ok(body, { time_ms: 2 })]);
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 2000 });
  try {
    const reply = await client.ping({ rid: "p1" });
    assert.equal(reply.time_ms, 2);
    assert.equal(broker.seen.length, 1);
    assert.equal(broker.seen[0].frames, 2); // the empty delimiter and the body
    assert.equal(broker.seen[0].bytes, "84a570726f746fa470706f7aa17601a26f70a470696e67a3726964a27031");
  } finally {
    client.close();
    await broker.close();
  }
});

test("overloaded, timeout and internal: wait retry_after_ms, resend the same bytes", async () => {
  const broker = await fakeBroker(({ body }, seen) => {
    if (seen.length === 1) return [err(body, "overloaded", { retry_after_ms: 150 })];
    if (seen.length === 2) return [err(body, "timeout")];
    if (seen.length === 3) return [err(body, "internal")];
    return [ok(body, { task_id: body.task_id })];
  });
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 2000 });
  try {
    const t0 = performance.now();
    const reply = await client.feedback("emu-7", 1, { done: true });
    assert.equal(reply.status, "ok");
    assert.ok(performance.now() - t0 >= 340, "waited 150 + 100 + 100 ms");
    assert.equal(broker.seen.length, 4);
    assert.equal(new Set(broker.seen.map((r) => r.bytes)).size, 1, "every attempt sends the same bytes (same rid)");
    assert.equal(new Set(broker.seen.map((r) => r.id)).size, 1, "an error reply does not replace the socket");
  } finally {
    client.close();
    await broker.close();
  }
});

test("other errors are not retried", async () => {
  const broker = await fakeBroker(({ body }) => [err(body, "unknown_task")]);
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 2000 });
  try {
    await assert.rejects(client.ask("gone"), (e) => e instanceof ppoz.UnknownTask && e.code === "unknown_task" && e.reply.rid !== undefined);
    assert.equal(broker.seen.length, 1);
  } finally {
    client.close();
    await broker.close();
  }
});

test("generate: the documented fields go out, a `timeout` is resent as a step's, and the reply comes back", async () => {
  const broker = await fakeBroker(({ body }, seen) => {
    if (seen.length === 1) return [err(body, "timeout")];
    return [ok(body, { task_id: body.task_id, text: "Blue.\nÉ bleu", n_tokens: 3, finish_reason: "eos", logprob: new ppoz.Float64(-2),
      policy_version: 12 })];
  });
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 2000 });
  try {
    const messages = [{ role: "system", content: "Be brief." }, { content: "Name a colour.", role: "user" }];
    const reply = await client.generate("qa-3", { messages, maxNewTokens: 8, temperature: 1, topP: 0.95, stop: ["\n", "User:"], seed: 42,
      deadlineMs: 4000 });
    assert.equal(reply.status, "ok");
    assert.equal(reply.text, "Blue.\nÉ bleu");
    assert.equal(reply.n_tokens, 3);
    assert.equal(reply.finish_reason, "eos");
    assert.equal(reply.logprob, -2);
    assert.equal(reply.policy_version, 12);
    assert.equal(broker.seen.length, 2);
    assert.equal(broker.seen[0].bytes, broker.seen[1].bytes, "the same bytes (same rid) again after `timeout`");
    const { body, bytes } = broker.seen[0];
    assert.deepStrictEqual(Object.keys(body), ["proto", "v", "op", "rid", "task_id", "messages", "sampling", "deadline_ms"]);
    assert.equal(body.op, "generate");
    assert.deepStrictEqual(body.messages, [{ role: "system", content: "Be brief." }, { role: "user", content: "Name a colour." }]);
    assert.deepStrictEqual(body.messages.map((m) => Object.keys(m)), [["role", "content"], ["role", "content"]]);
    assert.deepStrictEqual(body.sampling, { max_new_tokens: 8, temperature: 1, top_p: 0.95, stop: ["\n", "User:"], seed: 42 });
    assert.deepStrictEqual(Object.keys(body.sampling), ["max_new_tokens", "temperature", "top_p", "stop", "seed"]);
    assert.equal(body.deadline_ms, 4000);
    // temperature 1 went out as float64 1.0, max_new_tokens and seed as ints
    assert.ok(bytes.includes("ab74656d7065726174757265cb3ff0000000000000"), bytes);
    assert.ok(bytes.includes("ae6d61785f6e65775f746f6b656e7308") && bytes.includes("a4736565642a"), bytes);
  } finally {
    client.close();
    await broker.close();
  }
});

test("generate: a bad argument throws, naming it, before anything is sent", async () => {
  const broker = await fakeBroker(({ body }) => [ok(body)]);
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 2000 });
  const user = [{ role: "user", content: "Name a colour." }];
  try {
    const cases = [
      [{}, TypeError, /exactly one of `prompt` .* and `messages` .*got neither/],
      [{ prompt: "p", messages: user }, TypeError, /exactly one of .*got both/],
      [{ prompt: 3 }, TypeError, /`prompt` must be a string, got number/],
      [{ messages: [] }, TypeError, /`messages` must be a non-empty array/],
      [{ messages: "hi" }, TypeError, /`messages` must be a non-empty array .*got string/],
      [{ messages: [{ role: "user" }] }, TypeError, /`messages\[0\]\.content` must be a string, got undefined/],
      [{ messages: [...user, { content: "x" }] }, TypeError, /`messages\[1\]\.role` must be a non-empty string/],
      [{ messages: [{ role: "user", content: "x", name: "n" }] }, TypeError, /`messages\[0\]` has unknown keys name/],
      [{ prompt: "p", maxNewTokens: 0 }, RangeError, /`maxNewTokens` \(sampling\.max_new_tokens\) must be an integer >= 1, got 0/],
      [{ prompt: "p", maxNewTokens: 2.5 }, RangeError, /`maxNewTokens`/],
      [{ prompt: "p", temperature: -0.5 }, RangeError, /`temperature` \(sampling\.temperature\) must be a finite number >= 0/],
      [{ prompt: "p", temperature: Number.NaN }, RangeError, /`temperature`/],
      [{ prompt: "p", temperature: "1" }, TypeError, /`temperature` .*must be a number, got string/],
      [{ prompt: "p", topP: 0 }, RangeError, /`topP` \(sampling\.top_p\) must be in \(0, 1\], got 0/],
      [{ prompt: "p", topP: 1.5 }, RangeError, /`topP`/],
      [{ prompt: "p", stop: "\n" }, TypeError, /`stop` \(sampling\.stop\) must be an array of non-empty strings, got string/],
      [{ prompt: "p", stop: ["\n", ""] }, TypeError, /`stop\[1\]` .*must be a non-empty string/],
      [{ prompt: "p", seed: -1 }, RangeError, /`seed` \(sampling\.seed\) must be an integer from 0/],
      [{ prompt: "p", deadlineMs: 0 }, RangeError, /`deadlineMs` must be a positive integer/],
      [{ prompt: "p", max_new_tokens: 8 }, TypeError, /unknown generate options max_new_tokens; known: prompt, messages/],
    ];
    for (const [options, Cls, message] of cases) {
      assert.throws(() => client.generate("qa-3", options), (e) => e instanceof Cls && message.test(e.message), JSON.stringify(options));
    }
    await new Promise((resolve) => setTimeout(resolve, 100));
    assert.equal(client.attempts, 0);
    assert.equal(broker.seen.length, 0, "nothing reached the broker");
  } finally {
    client.close();
    await broker.close();
  }
});

test("no reply: a fresh socket and the same bytes again", async () => {
  const broker = await fakeBroker(({ body }, seen) => (seen.length === 1 ? [] : [ok(body, { task_id: "emu-7" })]));
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 300 });
  try {
    assert.equal(await client.attach("emu-7"), "emu-7");
    assert.equal(broker.seen.length, 2);
    assert.equal(broker.seen[0].bytes, broker.seen[1].bytes);
    assert.notEqual(broker.seen[0].id, broker.seen[1].id, "the second attempt came on a new socket");
  } finally {
    client.close();
    await broker.close();
  }
});

test("past the deadline: RequestTimeout", async () => {
  const broker = await fakeBroker(() => []);
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 700, attemptTimeoutMs: 300 });
  try {
    const t0 = performance.now();
    await assert.rejects(client.ping(), (e) => e instanceof ppoz.RequestTimeout && e.code === "timeout" && e.reply === null);
    const elapsed = performance.now() - t0;
    assert.ok(elapsed >= 650 && elapsed < 2000, `${elapsed} ms`);
    assert.ok(client.attempts >= 3, `attempts of 300, 300 and about 100 ms, got ${client.attempts}`);
    assert.ok(broker.seen.length >= 2, `${broker.seen.length} attempts arrived`);
    assert.equal(new Set(broker.seen.map((r) => r.bytes)).size, 1);
  } finally {
    client.close();
    await broker.close();
  }
});

test("many requests in flight on one socket, answered out of order", async () => {
  const held = [];
  const broker = await fakeBroker(({ body }) => {
    held.push(body);
    if (held.length < 8) return [];
    return held.reverse().map((b) => ok(b, { task_id: b.task_id, action: Number(b.task_id.slice(5)) }));
  });
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 3000 });
  try {
    const obs = { prompt: "p", action: ["0: a", "1: b"] };
    const replies = await Promise.all([...Array(8).keys()].map((i) => client.step(`task-${i}`, obs)));
    assert.deepStrictEqual(replies.map((r) => r.action), [0, 1, 2, 3, 4, 5, 6, 7]);
    assert.deepStrictEqual(replies.map((r) => r.task_id), [...Array(8).keys()].map((i) => `task-${i}`));
    assert.equal(new Set(broker.seen.map((r) => r.id)).size, 1, "one socket");
    assert.equal(client.attempts, 8);
  } finally {
    client.close();
    await broker.close();
  }
});

test("a lost attempt resends every request in flight on the new socket", async () => {
  let dropped = 0;
  const broker = await fakeBroker(({ id, body }, seen) => {
    if (id === seen[0].id) {
      dropped += 1;
      return []; // the first socket is a dead connection
    }
    return [ok(body, { task_id: body.task_id })];
  });
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 400 });
  try {
    const first = client.ask("task-a");
    await new Promise((r) => setTimeout(r, 300));
    const second = client.ask("task-b"); // sent later on the same socket: it goes again when the first times out
    const t0 = performance.now();
    const replies = await Promise.all([first, second]);
    assert.deepStrictEqual(replies.map((r) => r.task_id), ["task-a", "task-b"]);
    // ~100 ms (the first's timeout at 400 ms replaces the socket); its own timeout would be 400 ms
    assert.ok(performance.now() - t0 < 300, "the second went again at once, not after its own attempt timeout");
    assert.equal(dropped, 2);
  } finally {
    client.close();
    await broker.close();
  }
});

test("close() fails the requests still waiting", async () => {
  const broker = await fakeBroker(() => []);
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 2000 });
  try {
    const pending = client.ping();
    await new Promise((r) => setTimeout(r, 50));
    client.close();
    await assert.rejects(pending, (e) => e instanceof ppoz.PPOZError && e.code === "closed");
    await assert.rejects(client.ping(), (e) => e.code === "closed");
  } finally {
    await broker.close();
  }
});

test("a reply with rid nil answers the one request in flight: raised at once, never resent", async () => {
  const broker = await fakeBroker(({ body }) => [{ ...ppoz.header(body.op, null), error: { code: "bad_request", message: "`rid` must be a non-empty str or bin, got nil" } }]);
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 2000 });
  try {
    const t0 = performance.now();
    await assert.rejects(client.ping(), (e) => e instanceof ppoz.BadRequest && e.reply.rid === null);
    assert.ok(performance.now() - t0 < 1500, "not after the deadline");
    await new Promise((resolve) => setTimeout(resolve, 200));
    assert.equal(broker.seen.length, 1, "a request the broker cannot read is not sent again");
  } finally {
    client.close();
    await broker.close();
  }
});

test("with several in flight a reply with rid nil matches none: a warning, and each gets its own reply", async () => {
  const held = [];
  const broker = await fakeBroker(({ body }) => {
    held.push(body);
    if (held.length < 2) return [];
    return [{ ...ppoz.header(null, null), error: { code: "bad_request", message: "unreadable" } }, ...held.map((b) => ok(b, { time_ms: 1 }))];
  });
  const warnings = [];
  const onWarning = (w) => warnings.push(w);
  process.on("warning", onWarning);
  const client = new ppoz.PPOZClient(broker.endpoint, { deadlineMs: 5000, attemptTimeoutMs: 2000 });
  try {
    const replies = await Promise.all([client.ping({ rid: "p-0" }), client.ping({ rid: "p-1" })]);
    assert.deepEqual(replies.map((r) => r.rid), ["p-0", "p-1"]);
    await new Promise((resolve) => setImmediate(resolve));
    assert.ok(warnings.some((w) => w.name === "PPOZWarning" && /rid nil .* matches none of 2/.test(w.message)), warnings.map(String).join("; "));
  } finally {
    process.off("warning", onWarning);
    client.close();
    await broker.close();
  }
});

test("a rid the broker could not read is refused before anything is sent, naming it", () => {
  assert.throws(() => ppoz.buildRequest("ping", {}, "x".repeat(65)), /1 to 64 bytes, got 65/);
  assert.throws(() => ppoz.buildRequest("ping", {}, "é".repeat(33)), /1 to 64 bytes, got 66/);
  assert.throws(() => ppoz.buildRequest("ping", {}, "\ud800"), /not valid UTF-8/);
  assert.throws(() => ppoz.buildRequest("ping", {}, 7), /must be a string or a Uint8Array, got number/);
  assert.throws(() => ppoz.buildRequest("ping", {}, new Uint8Array(65)), /got 65/);
  assert.equal(ppoz.buildRequest("ping", {}, "é".repeat(32)).rid, "é".repeat(32));
});

test("a reply with rid nil is final whatever its code: a retried code is not resent", () => {
  const rule = new ppoz.RetryRule("ping", "p1", {}, 5000, 1000);
  assert.throws(() => rule.waitBeforeRetry({ rid: null, error: { code: "internal", message: "no rid" } }), ppoz.InternalError);
  assert.equal(rule.waitBeforeRetry({ rid: "p1", error: { code: "internal", message: "" } }), 100);
});
