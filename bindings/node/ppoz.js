"use strict";
/**
 * A Node.js client for the PPOZ broker: one ZeroMQ DEALER socket, msgpack bodies,
 * deadlines and the protocol's retry rule (docs/protocol.md is the reference;
 * client/aio.py is the Python client this one mirrors).
 *
 * CommonJS module:  const { PPOZClient } = require("./ppoz.js");
 *
 * Many requests may be in flight on one client at once: one receive loop per
 * socket hands each reply to the request waiting for its rid (section 1 of the
 * protocol), and sends are queued because a zeromq.js socket takes one send at
 * a time.
 *
 * Numbers. JavaScript has one number type; msgpack (and the Python side) has int
 * and float. This module sends an integral number as a msgpack int and any other
 * number as float64, like Python does for int and float values. A field that the
 * protocol defines as a float even when integral (the `reward` of `feedback`, the
 * `temperature` and `top_p` of generate's `sampling`) is wrapped in `Float64`, which
 * the encoder writes as float64 (0xcb) always: reward 1 goes out as 1.0, exactly as
 * Python's `float(1)` would.
 */

const crypto = require("node:crypto");
const zmq = require("zeromq");
const { Encoder, Decoder } = require("@msgpack/msgpack");

// --- Protocol constants (docs/protocol.md) --------------------------------------------------
const PROTOCOL_ID = "ppoz";
const PROTOCOL_VERSION = 1;

const OP = Object.freeze({
  ATTACH: "attach",
  DETACH: "detach",
  ASK: "ask",
  STEP: "step",
  RAG_STEP: "rag_step",
  GENERATE: "generate",
  FEEDBACK: "feedback",
  STATUS: "status",
  PING: "ping",
});

const E = Object.freeze({
  BAD_REQUEST: "bad_request",
  UNKNOWN_OP: "unknown_op",
  UNKNOWN_TASK: "unknown_task",
  FEEDBACK_WITHOUT_STEP: "feedback_without_step",
  TOO_LARGE: "too_large",
  UNSUPPORTED_VERSION: "unsupported_version",
  OVERLOADED: "overloaded",
  TIMEOUT: "timeout",
  INTERNAL: "internal",
});

// Error codes that mean "nothing was applied, send the same request again" (rule 4).
const RETRIED_CODES = new Set([E.OVERLOADED, E.TIMEOUT, E.INTERNAL]);
// The wait before a retry when the error reply suggests none (rule 4).
const DEFAULT_RETRY_AFTER_MS = 100;
const HEADER_KEYS = new Set(["proto", "v", "op", "rid"]);
// A rid is 1 to 64 bytes (a string counted in UTF-8); the broker answers any other with `rid: nil` (section 4).
const MAX_RID_BYTES = 64;

// --- Errors: one class per protocol error code ----------------------------------------------
/** An error reply from the broker (`.code`, `.message`, `.reply`), or no reply within the deadline. */
class PPOZError extends Error {
  constructor(code, message, reply = null) {
    super(message);
    this.name = this.constructor.name;
    this.code = code;
    this.reply = reply;
  }
}

class BadRequest extends PPOZError {}
class UnknownOp extends PPOZError {}
class UnknownTask extends PPOZError {}
class FeedbackWithoutStep extends PPOZError {}
class TooLarge extends PPOZError {}
class UnsupportedVersion extends PPOZError {}
class Overloaded extends PPOZError {}
/** The broker's `timeout` reply, or no usable reply before the client's own deadline (`.reply` is then null). */
class RequestTimeout extends PPOZError {}
class InternalError extends PPOZError {}

const ERROR_CLASSES = Object.freeze({
  [E.BAD_REQUEST]: BadRequest,
  [E.UNKNOWN_OP]: UnknownOp,
  [E.UNKNOWN_TASK]: UnknownTask,
  [E.FEEDBACK_WITHOUT_STEP]: FeedbackWithoutStep,
  [E.TOO_LARGE]: TooLarge,
  [E.UNSUPPORTED_VERSION]: UnsupportedVersion,
  [E.OVERLOADED]: Overloaded,
  [E.TIMEOUT]: RequestTimeout,
  [E.INTERNAL]: InternalError,
});

/** The exception for an error reply: its code's class (PPOZError for a code this client does not know). */
function errorFromReply(reply) {
  const error = reply.error !== null && typeof reply.error === "object" ? reply.error : {};
  const code = typeof error.code === "string" ? error.code : String(error.code);
  const Cls = ERROR_CLASSES[code] || PPOZError;
  return new Cls(code, String(error.message), reply);
}

// --- Encoding ---------------------------------------------------------------------------------
/** A number that must go out as msgpack float64 even when it is integral (a protocol float such as `reward`). */
class Float64 {
  constructor(value) {
    if (typeof value !== "number") throw new TypeError(`Float64 needs a number, got ${typeof value}`);
    this.value = value;
  }
}

const scalarEncoder = new Encoder(); // integral numbers -> smallest int, other numbers -> float64, as msgpack-python

function mapHeader(n) {
  if (n < 16) return Buffer.from([0x80 | n]);
  const b = Buffer.alloc(n < 0x10000 ? 3 : 5);
  if (n < 0x10000) {
    b[0] = 0xde;
    b.writeUInt16BE(n, 1);
  } else {
    b[0] = 0xdf;
    b.writeUInt32BE(n, 1);
  }
  return b;
}

function arrayHeader(n) {
  if (n < 16) return Buffer.from([0x90 | n]);
  const b = Buffer.alloc(n < 0x10000 ? 3 : 5);
  if (n < 0x10000) {
    b[0] = 0xdc;
    b.writeUInt16BE(n, 1);
  } else {
    b[0] = 0xdd;
    b.writeUInt32BE(n, 1);
  }
  return b;
}

function isPlainObject(value) {
  if (value === null || typeof value !== "object") return false;
  const proto = Object.getPrototypeOf(value);
  return proto === Object.prototype || proto === null;
}

function encodeInto(value, chunks) {
  if (value instanceof Float64) {
    const b = Buffer.alloc(9);
    b[0] = 0xcb;
    b.writeDoubleBE(value.value, 1);
    chunks.push(b);
  } else if (Array.isArray(value)) {
    chunks.push(arrayHeader(value.length));
    for (const item of value) encodeInto(item === undefined ? null : item, chunks);
  } else if (value instanceof Map || isPlainObject(value)) {
    // Maps are walked here (not by @msgpack/msgpack) so that Float64 values may sit at any depth;
    // the key order is the insertion order, which is the wire order. Undefined values are left out.
    const entries = (value instanceof Map ? [...value.entries()] : Object.entries(value)).filter(([, v]) => v !== undefined);
    chunks.push(mapHeader(entries.length));
    for (const [k, v] of entries) {
      encodeInto(k, chunks);
      encodeInto(v, chunks);
    }
  } else if (typeof value === "bigint" || value === undefined || typeof value === "function" || typeof value === "symbol") {
    throw new TypeError(`cannot encode a ${typeof value} in a PPOZ message`);
  } else if (value !== null && typeof value === "object" && !ArrayBuffer.isView(value) && !(value instanceof ArrayBuffer)) {
    throw new TypeError(`cannot encode a ${value.constructor?.name || "object"} in a PPOZ message (plain objects, Maps, arrays, strings, numbers, booleans, null, bytes)`);
  } else {
    chunks.push(scalarEncoder.encode(value)); // str, number, bool, nil, bin (Buffer/Uint8Array)
  }
}

/**
 * Pack one message body. Keys go in insertion order; an integral number is an int, any other
 * number float64, a Float64 always float64; strings are msgpack str, Buffers/Uint8Arrays bin.
 */
function encode(body) {
  const chunks = [];
  encodeInto(body, chunks);
  return Buffer.concat(chunks);
}

const decoder = new Decoder();

/** Unpack one message body; throw TypeError unless it is a msgpack map. Floats and ints both become numbers. */
function decode(frame) {
  const body = decoder.decode(frame);
  if (!isPlainObject(body)) throw new TypeError(`a PPOZ body must be a msgpack map, got ${Array.isArray(body) ? "array" : typeof body}`);
  return body;
}

// --- Building requests --------------------------------------------------------------------------
/** A request id unique across clients and restarts (32 hex characters, as client/retry.py's). */
function newRid() {
  return crypto.randomUUID().replace(/-/g, "");
}

/** The header every message starts with, in wire order. */
function header(op, rid) {
  return { proto: PROTOCOL_ID, v: PROTOCOL_VERSION, op, rid };
}

/**
 * Throw unless `rid` is one the broker can read and echo: a string (well-formed UTF-16, so its UTF-8 is the
 * same text) or a Uint8Array of 1 to 64 bytes. A reply with `rid: nil` could not be matched to it.
 */
function checkRid(rid) {
  if (typeof rid === "string") {
    const bytes = Buffer.byteLength(rid, "utf8");
    if (Buffer.from(rid, "utf8").toString("utf8") !== rid) throw new RangeError(`\`rid\` ${JSON.stringify(rid.slice(0, 16))} is not valid UTF-8 (a lone surrogate)`);
    if (bytes < 1 || bytes > MAX_RID_BYTES) throw new RangeError(`\`rid\` must be 1 to ${MAX_RID_BYTES} bytes, got ${bytes}: ${JSON.stringify(rid.slice(0, 16))}`);
  } else if (rid instanceof Uint8Array) {
    if (rid.length < 1 || rid.length > MAX_RID_BYTES) throw new RangeError(`\`rid\` must be 1 to ${MAX_RID_BYTES} bytes, got ${rid.length}`);
  } else {
    throw new TypeError(`\`rid\` must be a string or a Uint8Array, got ${rid === null ? "null" : typeof rid}`);
  }
  return rid;
}

/** The body of one request: the header (a fresh rid unless one is given, checked), then `fields` in their order. */
function buildRequest(op, fields = {}, rid = undefined) {
  const body = header(op, rid === undefined || rid === null || rid === "" ? newRid() : checkRid(rid));
  for (const [key, value] of Object.entries(fields)) {
    if (HEADER_KEYS.has(key)) throw new TypeError(`\`${key}\` is part of the header; pass it as an option, not a field`);
    if (value !== undefined) body[key] = value;
  }
  return body;
}

/** An observation in the documented key order (prompt, question, action), so equal observations encode equally. */
function obsFields(obs) {
  if (!isPlainObject(obs)) throw new TypeError(`\`obs\` must be an object {prompt, question, action}, got ${obs === null ? "null" : typeof obs}`);
  const { prompt, question, action, ...rest } = obs;
  return { prompt, question, action, ...rest };
}

/** The fields of a `feedback` request; `reward` always float64, `next_obs` only when it is a non-empty observation. */
function feedbackFields(taskId, reward, { done = false, truncated = false, nextObs = undefined } = {}) {
  if (typeof reward !== "number" || !Number.isFinite(reward)) throw new TypeError(`\`reward\` must be a finite number, got ${reward}`);
  const fields = { task_id: taskId, reward: new Float64(reward), done: Boolean(done), truncated: Boolean(truncated) };
  // Older Kea clients send next_obs: {}, which means "none"; leaving it out says the same in fewer bytes.
  if (nextObs && Object.keys(nextObs).length > 0) fields.next_obs = obsFields(nextObs);
  return fields;
}

// --- generate's fields (docs/protocol.md, "generate") ---
const GENERATE_OPTIONS = Object.freeze(["prompt", "messages", "maxNewTokens", "temperature", "topP", "stop", "seed", "deadlineMs"]);

function typeName(value) {
  if (value === null) return "null";
  if (Array.isArray(value)) return "array";
  return typeof value;
}

/** `messages` as the protocol has them: a non-empty array of {role, content} (that key order), strings both. */
function messagesFields(messages) {
  if (!Array.isArray(messages) || messages.length === 0) {
    throw new TypeError(`\`messages\` must be a non-empty array of {role, content}, got ${Array.isArray(messages) ? "an empty array" : typeName(messages)}`);
  }
  return messages.map((message, i) => {
    if (!isPlainObject(message)) throw new TypeError(`\`messages[${i}]\` must be an object {role, content}, got ${typeName(message)}`);
    const { role, content, ...rest } = message;
    const unknown = Object.keys(rest);
    if (unknown.length > 0) throw new TypeError(`\`messages[${i}]\` has unknown keys ${unknown.join(", ")}; known: role, content`);
    if (typeof role !== "string" || role === "") throw new TypeError(`\`messages[${i}].role\` must be a non-empty string (system, user, assistant or tool), got ${typeName(role)}`);
    if (typeof content !== "string") throw new TypeError(`\`messages[${i}].content\` must be a string, got ${typeName(content)}`);
    return { role, content };
  });
}

/** A number option of `sampling`: a TypeError unless a number, a RangeError unless `inRange`. */
function checkSamplingNumber(name, wire, value, inRange, range) {
  if (typeof value !== "number") throw new TypeError(`\`${name}\` (sampling.${wire}) must be a number, got ${typeName(value)}`);
  if (!inRange(value)) throw new RangeError(`\`${name}\` (sampling.${wire}) must be ${range}, got ${value}`);
}

/** The `sampling` map in the documented key order; temperature and top_p always float64, stop and seed only when given. */
function samplingFields({ maxNewTokens, temperature, topP, stop, seed }) {
  checkSamplingNumber("maxNewTokens", "max_new_tokens", maxNewTokens, (v) => Number.isSafeInteger(v) && v >= 1, "an integer >= 1");
  checkSamplingNumber("temperature", "temperature", temperature, (v) => Number.isFinite(v) && v >= 0, "a finite number >= 0 (0 is greedy)");
  checkSamplingNumber("topP", "top_p", topP, (v) => v > 0 && v <= 1, "in (0, 1]");
  const sampling = { max_new_tokens: maxNewTokens, temperature: new Float64(temperature), top_p: new Float64(topP) };
  if (stop !== undefined && stop !== null) {
    if (!Array.isArray(stop)) throw new TypeError(`\`stop\` (sampling.stop) must be an array of non-empty strings, got ${typeName(stop)}`);
    stop.forEach((s, i) => {
      if (typeof s !== "string" || s === "") throw new TypeError(`\`stop[${i}]\` (sampling.stop) must be a non-empty string, got ${typeof s === "string" ? '""' : typeName(s)}`);
    });
    if (stop.length > 0) sampling.stop = [...stop];
  }
  if (seed !== undefined && seed !== null) {
    checkSamplingNumber("seed", "seed", seed, (v) => Number.isSafeInteger(v) && v >= 0, "an integer from 0 to 2^53 - 1 (a safe integer)");
    sampling.seed = seed;
  }
  return sampling;
}

/**
 * The fields of a `generate` request, in the documented order: `task_id`, exactly one of `prompt` (a string) and
 * `messages` (an array of {role, content}), `sampling` {max_new_tokens, temperature, top_p, stop, seed}, then
 * `deadline_ms` when `deadlineMs` is given. Defaults as the Python client's: maxNewTokens 256, temperature 1,
 * topP 1, no stop strings, no seed (the broker picks one). A bad or unknown option throws a TypeError or
 * RangeError naming it.
 */
function generateFields(taskId, options = {}) {
  if (!isPlainObject(options)) throw new TypeError(`generate's options must be an object {prompt | messages, maxNewTokens, ...}, got ${typeName(options)}`);
  const unknown = Object.keys(options).filter((k) => !GENERATE_OPTIONS.includes(k));
  if (unknown.length > 0) throw new TypeError(`unknown generate options ${unknown.join(", ")}; known: ${GENERATE_OPTIONS.join(", ")}`);
  const { prompt, messages, maxNewTokens = 256, temperature = 1.0, topP = 1.0, stop, seed, deadlineMs } = options;
  const hasPrompt = prompt !== undefined && prompt !== null;
  if (hasPrompt === (messages !== undefined && messages !== null)) {
    throw new TypeError(`generate needs exactly one of \`prompt\` (a string) and \`messages\` (an array of {role, content}), got ${hasPrompt ? "both" : "neither"}`);
  }
  if (hasPrompt && typeof prompt !== "string") throw new TypeError(`\`prompt\` must be a string, got ${typeName(prompt)}`);
  const fields = { task_id: taskId };
  if (hasPrompt) fields.prompt = prompt;
  else fields.messages = messagesFields(messages);
  fields.sampling = samplingFields({ maxNewTokens, temperature, topP, stop, seed });
  if (deadlineMs !== undefined) {
    if (!Number.isSafeInteger(deadlineMs) || deadlineMs <= 0) {
      throw new RangeError(`\`deadlineMs\` must be a positive integer of milliseconds, got ${deadlineMs}`);
    }
    fields.deadline_ms = deadlineMs;
  }
  return fields;
}

function stepFields(taskId, obs, brokerDeadlineMs) {
  const fields = { task_id: taskId, obs: obsFields(obs) };
  if (brokerDeadlineMs !== undefined) {
    if (!Number.isSafeInteger(brokerDeadlineMs) || brokerDeadlineMs <= 0) {
      throw new RangeError(`\`brokerDeadlineMs\` must be a positive integer of milliseconds, got ${brokerDeadlineMs}`);
    }
    fields.deadline_ms = brokerDeadlineMs;
  }
  return fields;
}

// --- The retry rule (docs/protocol.md, section 5; client/retry.py) -----------------------------------
function checkPositiveMs(name, value) {
  if (typeof value !== "number" || !Number.isFinite(value) || value <= 0) {
    throw new RangeError(`\`${name}\` must be a positive number of milliseconds, got ${value}`);
  }
}

/** Milliseconds to wait before resending after a retried error: the reply's `retry_after_ms`, else 100. */
function retryAfterMs(reply) {
  const ms = reply.retry_after_ms;
  return typeof ms === "number" && Number.isFinite(ms) && ms >= 0 ? ms : DEFAULT_RETRY_AFTER_MS;
}

/** The attempts of one request: its bytes (the same for every attempt), its deadline, and what each reply means. */
class RetryRule {
  constructor(op, rid, fields, deadlineMs, attemptTimeoutMs) {
    checkPositiveMs("deadlineMs", deadlineMs);
    this.op = op;
    this.body = buildRequest(op, fields, rid);
    this.rid = this.body.rid;
    this.data = encode(this.body);
    this.deadlineMs = deadlineMs;
    this.attemptTimeoutMs = attemptTimeoutMs;
    this.end = performance.now() + deadlineMs;
    this.attempts = 0;
  }

  remainingMs() {
    return this.end - performance.now();
  }

  expired() {
    const s = (this.deadlineMs / 1000).toFixed(1);
    return new RequestTimeout(E.TIMEOUT, `no reply to ${this.op} within ${s} s (${this.attempts} attempt(s), rid ${ridText(this.rid)})`);
  }

  /** Milliseconds the next attempt may wait for its reply; throw RequestTimeout once the deadline has passed. */
  nextAttempt() {
    const remaining = this.remainingMs();
    if (remaining <= 0) throw this.expired();
    this.attempts += 1;
    return Math.min(remaining, this.attemptTimeoutMs);
  }

  /**
   * null when `reply` is the answer; else the milliseconds to wait before sending the same bytes again.
   * Throw the reply's error when its code is not retried, or when waiting would end past the deadline
   * (the caller then learns why the broker refused, say `overloaded`, rather than a bare timeout).
   */
  waitBeforeRetry(reply) {
    if (!("error" in reply)) return null;
    const error = errorFromReply(reply);
    // rid nil: the broker could not read the request's rid, so resending the same bytes cannot help (section 4).
    if (!RETRIED_CODES.has(error.code) || reply.rid === null) throw error;
    const wait = retryAfterMs(reply);
    if (wait >= this.remainingMs()) throw error;
    return wait;
  }
}

function ridKey(rid) {
  if (typeof rid === "string") return `s:${rid}`;
  if (rid instanceof Uint8Array) return `b:${Buffer.from(rid.buffer, rid.byteOffset, rid.byteLength).toString("hex")}`;
  return null;
}

function ridText(rid) {
  return typeof rid === "string" ? rid : `0x${Buffer.from(rid).toString("hex")}`;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// --- The client -------------------------------------------------------------------------------------
/**
 * PPOZ client with many requests in flight on one DEALER socket, matched to replies by rid.
 *
 * `deadlineMs`: default overall time per request (attempts, retry waits); `attemptTimeoutMs`:
 * longest wait for one attempt's reply. An attempt that gets no reply replaces the socket (linger 0);
 * every other request in flight on the old socket is then sent again at once, with its own rid, on
 * the new one (the broker answers a repeated rid with its first reply and applies it once).
 * `close()` is final: requests still waiting fail with a PPOZError of code "closed".
 */
class PPOZClient {
  constructor(endpoint, { deadlineMs = 60000, attemptTimeoutMs = 10000 } = {}) {
    if (typeof endpoint !== "string" || endpoint === "") throw new TypeError(`\`endpoint\` must be a ZeroMQ endpoint string, got ${endpoint}`);
    checkPositiveMs("deadlineMs", deadlineMs);
    checkPositiveMs("attemptTimeoutMs", attemptTimeoutMs);
    this.endpoint = endpoint;
    this.deadlineMs = deadlineMs;
    this.attemptTimeoutMs = attemptTimeoutMs;
    this.attempts = 0; // sends, retries and resends included (for tests and diagnostics)
    this._conn = null; // {sock, sending}: the current socket and the tail of its send queue
    this._waiters = new Map(); // ridKey -> Set of {settle}
    this._closed = false;
  }

  // --- the socket and its receive loop ---
  _open() {
    if (this._closed) throw new PPOZError("closed", `this PPOZClient (${this.endpoint}) is closed`);
    if (this._conn === null) {
      const sock = new zmq.Dealer({ linger: 0 });
      sock.connect(this.endpoint);
      const conn = { sock, sending: Promise.resolve() };
      this._conn = conn;
      this._read(conn);
    }
    return this._conn;
  }

  /** Close `conn` if it is still the current socket; its waiters send again (or fail with `error`). */
  _drop(conn, error = null) {
    if (conn !== this._conn) return; // another request has already replaced it
    this._conn = null;
    conn.sock.close();
    for (const waiters of this._waiters.values()) {
      for (const waiter of [...waiters]) waiter.settle(error === null ? { reply: null } : { error });
    }
  }

  async _read(conn) {
    try {
      for (;;) {
        const frames = await conn.sock.receive();
        this._dispatch(frames);
      }
    } catch (e) {
      // Closing the socket ends a pending receive; only a failure of the current socket matters.
      if (conn === this._conn) this._drop(conn, new PPOZError("socket", `reading replies from ${this.endpoint} failed: ${e.message}`));
    }
  }

  _dispatch(frames) {
    let reply;
    try {
      reply = decode(frames[frames.length - 1]);
    } catch {
      return; // not a PPOZ body: nothing can be matched to it
    }
    let key = ridKey(reply.rid);
    if (reply.rid === null) {
      // The broker could not read a rid (section 4): the answer of the one request in flight, if only one is.
      // Every rid this client sends is checked first (checkRid), so with several it matches none of them.
      if (this._waiters.size === 1 && "error" in reply) {
        key = this._waiters.keys().next().value;
      } else {
        process.emitWarning(`a reply with rid nil from ${this.endpoint} matches none of ${this._waiters.size} requests in flight: ${JSON.stringify(reply.error)}`, "PPOZWarning");
        return;
      }
    }
    const waiters = this._waiters.get(key);
    if (!waiters) return; // a late answer to an attempt given up on, or to a request already answered
    for (const waiter of [...waiters]) waiter.settle({ reply });
  }

  _send(conn, data) {
    // zeromq.js takes one send at a time per socket (else EBUSY): queue them.
    const sent = conn.sending.then(() => conn.sock.send([Buffer.alloc(0), data]));
    conn.sending = sent.catch(() => {});
    return sent;
  }

  /** Send once and wait up to `timeoutMs` for the reply; null if none came (the socket is then replaced). */
  _attempt(rule, timeoutMs) {
    const conn = this._open();
    const key = ridKey(rule.rid);
    return new Promise((resolve, reject) => {
      let timer = null;
      const waiter = {
        settle: (outcome) => {
          const waiters = this._waiters.get(key);
          if (!waiters || !waiters.delete(waiter)) return; // already settled
          if (waiters.size === 0) this._waiters.delete(key);
          clearTimeout(timer);
          if ("error" in outcome) reject(outcome.error);
          else resolve(outcome.reply);
        },
      };
      if (!this._waiters.has(key)) this._waiters.set(key, new Set());
      this._waiters.get(key).add(waiter); // before sending: the reply may come at once
      timer = setTimeout(() => {
        waiter.settle({ reply: null });
        this._drop(conn); // a lost connection: this and every request in flight on it go again on a fresh socket
      }, timeoutMs);
      this.attempts += 1;
      this._send(conn, rule.data).catch((e) => {
        // A send cut short by the socket's replacement is simply sent again on the new one.
        waiter.settle(conn === this._conn ? { error: new PPOZError("socket", `sending to ${this.endpoint} failed: ${e.message}`) } : { reply: null });
      });
    });
  }

  /**
   * Send one request and return its reply map (keys as on the wire); throw the error's class.
   *
   * `fields` follow the header in their insertion order. `rid` (default: a fresh one) is kept for
   * every attempt; `deadlineMs` (default the client's) bounds the whole request.
   */
  async request(op, fields = {}, { rid = undefined, deadlineMs = undefined } = {}) {
    const rule = new RetryRule(op, rid, fields, deadlineMs === undefined ? this.deadlineMs : deadlineMs, this.attemptTimeoutMs);
    for (;;) {
      const reply = await this._attempt(rule, rule.nextAttempt());
      if (reply === null) continue; // no reply, or the socket was replaced under it: nextAttempt() says if time is left
      const wait = rule.waitBeforeRetry(reply);
      if (wait === null) return reply;
      await sleep(wait);
    }
  }

  // --- the operations ---
  /** Create a session (or resume `taskId`); return its task id. */
  async attach(taskId = undefined, opts = {}) {
    const reply = await this.request(OP.ATTACH, taskId ? { task_id: taskId } : {}, opts);
    return reply.task_id;
  }

  /** Close the task's open segment and forget the session. */
  detach(taskId, opts = {}) {
    return this.request(OP.DETACH, { task_id: taskId }, opts);
  }

  /** `{status: "ok"}` or `{status: "wait", retry_after_ms, reason}`; both carry `retryAfterMs` (0 when ok). */
  async ask(taskId, opts = {}) {
    const reply = await this.request(OP.ASK, { task_id: taskId }, opts);
    reply.retryAfterMs = reply.status === "wait" ? retryAfterMs(reply) : 0;
    return reply;
  }

  /** The reply map: action, logprob, probs, policy_version. `brokerDeadlineMs` sends `deadline_ms`. */
  step(taskId, obs, { brokerDeadlineMs = undefined, ...opts } = {}) {
    return this.request(OP.STEP, stepFields(taskId, obs, brokerDeadlineMs), opts);
  }

  /** As step, for retrieval-augmented observations. */
  ragStep(taskId, obs, { brokerDeadlineMs = undefined, ...opts } = {}) {
    return this.request(OP.RAG_STEP, stepFields(taskId, obs, brokerDeadlineMs), opts);
  }

  /**
   * A response written by the policy to `prompt` (a string) or chat `messages` ([{role, content}]); the reply map:
   * text, n_tokens, finish_reason (eos, stop or length), logprob, policy_version. Options: those of generateFields
   * (maxNewTokens, temperature, topP, stop, seed), `rid`, and `deadlineMs`, which bounds the request here and is
   * sent as `deadline_ms` (the broker's limit for writing the response). Its reward goes in with feedback.
   */
  generate(taskId, { rid = undefined, ...options } = {}) {
    return this.request(OP.GENERATE, generateFields(taskId, options), { rid, deadlineMs: options.deadlineMs });
  }

  /** The reward of the pending step (always sent as float64); `nextObs` (with `truncated`) is the state to bootstrap from. */
  feedback(taskId, reward, { done = false, truncated = false, nextObs = undefined, ...opts } = {}) {
    return this.request(OP.FEEDBACK, feedbackFields(taskId, reward, { done, truncated, nextObs }), opts);
  }

  /** The broker's figures (sessions, queue, actors, latency, counters); `windowS` picks the latency window. */
  status({ windowS = undefined, ...opts } = {}) {
    return this.request(OP.STATUS, windowS === undefined ? {} : { window_s: windowS }, opts);
  }

  /** `{status: "ok", time_ms}`: the broker is there and answering. */
  ping(opts = {}) {
    return this.request(OP.PING, {}, opts);
  }

  /** Close the socket; requests still waiting fail with a PPOZError of code "closed". Idempotent. */
  close() {
    if (this._closed) return;
    this._closed = true;
    if (this._conn !== null) {
      this._drop(this._conn, new PPOZError("closed", `this PPOZClient (${this.endpoint}) was closed while the request waited`));
    }
  }
}

module.exports = {
  PPOZClient,
  PPOZError,
  BadRequest,
  UnknownOp,
  UnknownTask,
  FeedbackWithoutStep,
  TooLarge,
  UnsupportedVersion,
  Overloaded,
  RequestTimeout,
  InternalError,
  ERROR_CLASSES,
  errorFromReply,
  Float64,
  encode,
  decode,
  header,
  buildRequest,
  checkRid,
  MAX_RID_BYTES,
  feedbackFields,
  stepFields,
  generateFields,
  obsFields,
  newRid,
  RetryRule,
  RETRIED_CODES,
  PROTOCOL_ID,
  PROTOCOL_VERSION,
  OP,
  E,
};
