#!/usr/bin/env node
"use strict";
/**
 * A Kea-like environment driving the PPOZ broker from Node.js.
 *
 *   node example.js ENDPOINT [EPISODES=3] [STEPS=4] [DEADLINE_MS=60000]
 *
 * Attach, then per episode and step: ask (sleeping `retry_after_ms` while the broker says wait),
 * step on a screen with three candidate actions, and send the reward (1.0 for "Search", else 0.0),
 * done on the episode's last step; detach at the end. Prints a line per episode and
 * `episodes N steps M`; exits 0. On an error prints its code and message to stderr and exits 1.
 */

const { PPOZClient, PPOZError } = require("./ppoz.js");

const QUESTION = "Which action should I choose next? I shall choose No. ";
const ACTIONS = ["0: TouchEvent(view=Cart)", "1: TouchEvent(view=Search)", "2: KeyEvent(name=BACK)"];
const MAX_WAITS = 50; // asks answered `wait` in a row before stepping anyway (ask is advisory)

function usage(message) {
  process.stderr.write(`${message}\nusage: node example.js ENDPOINT [EPISODES] [STEPS] [DEADLINE_MS]\n`);
  process.exit(2);
}

function positiveInt(text, name, fallback) {
  if (text === undefined) return fallback;
  const n = Number(text);
  if (!Number.isSafeInteger(n) || n <= 0) usage(`${name} must be a positive integer, got ${JSON.stringify(text)}`);
  return n;
}

function prompt(episode, step, history) {
  return (
    `You are testing the app Shop (episode ${episode}). Task: find the search page.\n` +
    `Current screen: MainActivity, step ${step}. Views: [0] Cart button [1] Search box [2] Back.\n` +
    `History: ${history.length ? history.join(", ") : "none"}.\n`
  );
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function waitForTurn(client, taskId) {
  for (let i = 0; i < MAX_WAITS; i++) {
    const reply = await client.ask(taskId);
    if (reply.status !== "wait") return;
    await sleep(Math.min(reply.retryAfterMs, 1000));
  }
}

async function main(argv) {
  const [endpoint, episodesText, stepsText, deadlineText] = argv;
  if (!endpoint) usage("ENDPOINT is missing (for example tcp://127.0.0.1:5555)");
  const episodes = positiveInt(episodesText, "EPISODES", 3);
  const steps = positiveInt(stepsText, "STEPS", 4);
  const deadlineMs = positiveInt(deadlineText, "DEADLINE_MS", 60000);
  const client = new PPOZClient(endpoint, { deadlineMs, attemptTimeoutMs: Math.min(10000, deadlineMs) });
  let total = 0;
  try {
    const taskId = await client.attach();
    for (let episode = 1; episode <= episodes; episode++) {
      const history = [];
      let reward = 0;
      let version = null;
      for (let step = 1; step <= steps; step++) {
        await waitForTurn(client, taskId);
        const obs = { prompt: prompt(episode, step, history), question: QUESTION, action: ACTIONS };
        const reply = await client.step(taskId, obs);
        const r = reply.action === 1 ? 1.0 : 0.0;
        await client.feedback(taskId, r, { done: step === steps });
        history.push(ACTIONS[reply.action] ?? String(reply.action));
        reward += r;
        version = reply.policy_version;
        total += 1;
      }
      console.log(`episode ${episode}: task ${taskId} steps ${steps} reward ${reward.toFixed(1)} policy_version ${version}`);
    }
    await client.detach(taskId);
    console.log(`episodes ${episodes} steps ${total}`);
    return 0;
  } catch (e) {
    if (!(e instanceof PPOZError)) throw e;
    process.stderr.write(`ppoz error ${e.code}: ${e.message}\n`);
    return 1;
  } finally {
    client.close();
  }
}

main(process.argv.slice(2)).then(
  (code) => {
    process.exitCode = code;
  },
  (e) => {
    process.stderr.write(`error ${e.code || e.name}: ${e.message}\n`);
    process.exitCode = 1;
  },
);
