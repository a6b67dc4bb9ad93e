#!/usr/bin/env node
// A Node.js host for specdeploy bundles: greedy speculative decoding on onnxruntime-node.
//
//   node examples/node/host.mjs BUNDLE PROMPT_FILE MAX_NEW_TOKENS
//
// It reads nothing but the bundle's contract: specdeploy.json names every tensor each model takes
// and returns, says how its KV cache is laid out and shared, and points at the tokenizer and at
// the accept graph, which decides how many draft tokens to keep. The completion goes to stdout,
// statistics to stderr; bad input is one `error: ...` line and exit code 2.

import fs from "node:fs";
import path from "node:path";
import { performance } from "node:perf_hooks";

import { Tokenizer } from "@huggingface/tokenizers";
import * as ort from "onnxruntime-node";

// 1: a target and a draft; 2: the draft may be null (the target alone).
const FORMAT_VERSIONS = [1, 2];
const NUM_DRAFT_TOKENS = 4; // k: tokens the draft proposes per round, as `specdeploy run`'s default
const PREFILL_CHUNK = 64; // prompt tokens per pass: the graphs return logits at every position

class UsageError extends Error {}

function parseArguments(argv) {
  if (argv.length !== 3) throw new UsageError("usage: node host.mjs BUNDLE PROMPT_FILE MAX_NEW_TOKENS");
  const [bundle, promptFile, maxNew] = argv;
  if (!/^\d+$/.test(maxNew)) throw new UsageError(`MAX_NEW_TOKENS must be a whole number >= 0 (got '${maxNew}')`);
  if (!fs.existsSync(promptFile)) throw new UsageError(`prompt file not found: ${promptFile}`);
  return { bundle, prompt: fs.readFileSync(promptFile, "utf8"), maxNewTokens: Number(maxNew) };
}

function readManifest(bundle) {
  const file = path.join(bundle, "specdeploy.json");
  if (!fs.existsSync(file)) throw new UsageError(`not a specdeploy bundle: ${file} is missing`);
  let manifest;
  try {
    manifest = JSON.parse(fs.readFileSync(file, "utf8"));
  } catch (error) {
    throw new UsageError(`manifest ${file} is not valid JSON: ${error.message}`);
  }
  if (!FORMAT_VERSIONS.includes(manifest.format_version)) {
    throw new UsageError(`manifest format_version ${manifest.format_version} is not supported (this host reads ${FORMAT_VERSIONS.join(" and ")})`);
  }
  if (!manifest.accept) throw new UsageError("the bundle has no accept graphs; re-export it with this specdeploy");
  for (const entry of [manifest.target, manifest.draft, manifest.tokenizer, manifest.accept].filter(Boolean).flatMap((s) => s.files)) {
    const file = path.join(bundle, entry.path);
    if (!fs.existsSync(file)) throw new UsageError(`bundle is incomplete: ${entry.path} is listed in the manifest but missing`);
    const size = fs.statSync(file).size;
    if (size !== entry.size) throw new UsageError(`bundle is corrupt: ${entry.path} has ${size} bytes, manifest says ${entry.size}`);
  }
  const names = manifest.accept.greedy.inputs.map((t) => t.name).join(",");
  if (names !== "target_logits,draft_tokens") throw new UsageError(`the greedy accept graph takes ${names}; this host knows target_logits,draft_tokens`);
  return manifest;
}

// numpy dtype names (the manifest's) -> onnxruntime-node tensor types and their storage.
const TENSOR_TYPES = {
  float32: ["float32", Float32Array],
  float16: ["float16", Uint16Array],
  int64: ["int64", BigInt64Array],
};

function tensorType(dtype) {
  if (!(dtype in TENSOR_TYPES)) throw new UsageError(`this host cannot hold ${dtype} tensors`);
  return TENSOR_TYPES[dtype];
}

function float16ToNumber(bits) {
  const exponent = (bits >> 10) & 0x1f;
  const fraction = bits & 0x3ff;
  const sign = bits & 0x8000 ? -1 : 1;
  if (exponent === 0) return sign * fraction * 2 ** -24;
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
}

// logits [rows, vocab] (a tensor's data) -> the index of the first maximum of one row, as NumPy's argmax.
function argmax(data, row, vocab) {
  const decode = data instanceof Uint16Array ? float16ToNumber : (x) => x;
  let best = 0;
  let bestValue = -Infinity;
  for (let i = 0, offset = row * vocab; i < vocab; i++) {
    const value = decode(data[offset + i]);
    if (value > bestValue) [best, bestValue] = [i, value];
  }
  return best;
}

const ids = (values) => BigInt64Array.from(values, (v) => BigInt(v));

// One bundle model, its KV cache and the tokens the cache holds, so rollback is "keep this many".
class CachedModel {
  static async load(bundle, spec, maxContext, sessionOptions) {
    const session = await ort.InferenceSession.create(path.join(bundle, spec.onnx_path), sessionOptions);
    return new CachedModel(session, spec, maxContext);
  }

  constructor(session, spec, maxContext) {
    this.session = session;
    this.spec = spec;
    this.shared = spec.kv_cache.shared_buffer;
    this.tokens = [];
    this.ms = 0; // time in session.run
    this.vocab = spec.vocab_size;
    this.logitsType = spec.outputs.find((t) => t.name === "logits").dtype;
    const [kvType, KvArray] = tensorType(spec.kv_cache.dtype);
    const format = (template, layer) => template.replace("%d", String(layer));
    this.layers = [];
    for (let layer = 0; layer < spec.num_layers; layer++) {
      const names = ["past_key", "past_value", "present_key", "present_value"].map((t) => format(spec.kv_cache[t], layer));
      this.layers.push({ past: names.slice(0, 2), present: names.slice(2) });
    }
    const known = new Set(["input_ids", "attention_mask", "position_ids", ...this.layers.flatMap((l) => l.past)]);
    const unknown = spec.inputs.find((t) => !known.has(t.name));
    if (unknown) throw new UsageError(`the ${spec.role} model takes an input '${unknown.name}' this host does not know`);
    this.inputNames = new Set(spec.inputs.map((t) => t.name));
    if (spec.kv_cache.layout !== "batch,kv_heads,sequence,head_dim") {
      throw new UsageError(`the ${spec.role} model's KV layout ${spec.kv_cache.layout} is not one this host knows`);
    }
    this.kvType = kvType;
    this.KvArray = KvArray;
    // Shared buffers: [1, kv_heads, max_context, head_dim] each, bound as both the past input and
    // the present output, so the graph writes new positions in place; the valid length is the
    // attention mask's. Otherwise pasts grow: present = past + the new positions, a new tensor each pass.
    this.past = this.layers.map(() => [0, 1].map(() => this.kvTensor(this.shared ? maxContext : 0)));
    this.ones = new BigInt64Array(maxContext).fill(1n); // attention_mask views: ones over past + new
  }

  kvTensor(length, data) {
    const dims = [1, this.spec.num_kv_heads, length, this.spec.head_dim];
    return new ort.Tensor(this.kvType, data ?? new this.KvArray(dims.reduce((a, b) => a * b)), dims);
  }

  truncate(length) {
    this.tokens.length = Math.min(this.tokens.length, length);
    if (this.shared) return; // the buffers stay; the next mask is shorter
    const { num_kv_heads: heads, head_dim: headDim } = this.spec;
    this.past = this.past.map((pair) =>
      pair.map((tensor) => {
        const old = tensor.dims[2];
        if (old <= length) return tensor;
        const data = new this.KvArray(heads * length * headDim);
        for (let h = 0; h < heads; h++) data.set(tensor.data.subarray(h * old * headDim, (h * old + length) * headDim), h * length * headDim);
        return this.kvTensor(length, data);
      }),
    );
  }

  // The tokens of context not yet in the cache, after truncating it to the prefix it shares with
  // context; at least `keep` tokens are left to run.
  uncached(context, keep = 1) {
    let shared = 0;
    const limit = Math.min(this.tokens.length, context.length - keep);
    while (shared < limit && this.tokens[shared] === context[shared]) shared++;
    this.truncate(shared);
    return context.slice(shared);
  }

  // Appends tokens to the cache; returns the logits tensor [n, vocab]. Each pass runs the tokens it is
  // given, one for a target-only step, as `specdeploy run` does without --exact.
  async extend(tokens) {
    const count = tokens.length;
    const past = this.tokens.length;
    const feeds = { input_ids: new ort.Tensor("int64", ids(tokens), [1, count]) };
    if (this.inputNames.has("attention_mask")) feeds.attention_mask = new ort.Tensor("int64", this.ones.subarray(0, past + count), [1, past + count]);
    if (this.inputNames.has("position_ids")) feeds.position_ids = new ort.Tensor("int64", ids(tokens.map((_, i) => past + i)), [1, count]);
    const fetches = { logits: null };
    this.layers.forEach((layer, i) => {
      layer.past.forEach((name, j) => (feeds[name] = this.past[i][j]));
      layer.present.forEach((name, j) => (fetches[name] = this.shared ? this.past[i][j] : null));
    });
    const start = performance.now();
    const outputs = await this.session.run(feeds, fetches);
    this.ms += performance.now() - start;
    if (!this.shared) this.past = this.layers.map((layer) => layer.present.map((name) => outputs[name]));
    this.tokens.push(...tokens);
    return new ort.Tensor(outputs.logits.type, outputs.logits.data, [count, this.vocab]);
  }

  // The logits [vocab] after context, as the index of their maximum (prefills in chunks).
  async nextAfter(context) {
    let rest = this.uncached(context);
    while (rest.length > PREFILL_CHUNK) {
      await this.extend(rest.slice(0, PREFILL_CHUNK));
      rest = rest.slice(PREFILL_CHUNK);
    }
    const logits = await this.extend(rest);
    return argmax(logits.data, logits.dims[0] - 1, this.vocab);
  }

  async prefill(context) {
    const rest = this.uncached(context, 0);
    for (let start = 0; start < rest.length; start += PREFILL_CHUNK) await this.extend(rest.slice(start, start + PREFILL_CHUNK));
  }
}

// The draft proposes count tokens greedily; the target verifies them in one pass of count + 1
// tokens; the accept graph says how many to keep and which token follows them.
async function speculativeRound(target, draft, accept, context, count) {
  const drafts = [await draft.nextAfter(context)];
  while (drafts.length < count) {
    const logits = await draft.extend([drafts[drafts.length - 1]]);
    drafts.push(argmax(logits.data, 0, draft.vocab));
  }
  const logits = await target.extend([...target.uncached(context), ...drafts]);
  const rows = logits.dims[0];
  const verify = new ort.Tensor(logits.type, logits.data.subarray((rows - count - 1) * target.vocab), [count + 1, target.vocab]);
  const result = await accept.run({ target_logits: verify, draft_tokens: new ort.Tensor("int64", ids(drafts), [count]) });
  const accepted = Number(result.num_accepted.data[0]);
  return { tokens: [...drafts.slice(0, accepted), Number(result.next_token.data[0])], accepted, drafted: count };
}

async function generate(models, promptIds, maxNewTokens, maxContext, eosIds) {
  const { target, draft, accept } = models;
  const context = [...promptIds];
  const budget = Math.min(maxNewTokens, maxContext - promptIds.length);
  const stats = { rounds: 0, drafted: 0, accepted: 0, prefillMs: 0, decodeMs: 0 };
  let start = performance.now();
  await target.prefill(context.slice(0, -1));
  if (draft) await draft.prefill(context.slice(0, -1));
  stats.prefillMs = performance.now() - start;
  start = performance.now();
  const output = [];
  let generated = 0;
  rounds: while (generated < budget) {
    const count = draft ? Math.min(NUM_DRAFT_TOKENS, budget - generated - 1, maxContext - context.length) : 0;
    const round = count > 0
      ? await speculativeRound(target, draft, accept, context, count)
      : { tokens: [await target.nextAfter(context)], accepted: 0, drafted: 0 };
    stats.rounds += 1;
    stats.drafted += round.drafted;
    stats.accepted += round.accepted;
    context.push(...round.tokens);
    generated += round.tokens.length;
    for (const token of round.tokens) {
      output.push(token);
      if (eosIds.has(token)) break rounds;
    }
  }
  stats.decodeMs = performance.now() - start;
  return { tokens: output, stats };
}

function loadTokenizer(bundle, spec) {
  const read = (name) => JSON.parse(fs.readFileSync(path.join(bundle, spec.path, name), "utf8"));
  const configFile = path.join(bundle, spec.path, "tokenizer_config.json");
  return new Tokenizer(read("tokenizer.json"), fs.existsSync(configFile) ? read("tokenizer_config.json") : {});
}

function encode(tokenizer, spec, text, maxContext) {
  // As the Python runtime: the tokenizer's own special tokens; an empty prompt is just BOS.
  let promptIds = text ? tokenizer.encode(text, { add_special_tokens: true }).ids.map(Number) : [];
  // Text that starts with the BOS token's string (a rendered template) keeps that BOS only: the
  // tokenizer's post-processor would put a second one in front of it.
  const bos = spec.bos_token_id;
  if (bos !== null && promptIds[0] === bos && promptIds[1] === bos) {
    const bosText = tokenizer.id_to_token(bos);
    if (bosText && text.startsWith(bosText)) promptIds = promptIds.slice(1);
  }
  if (promptIds.length === 0) {
    if (spec.bos_token_id === null) throw new UsageError("the prompt is empty and the tokenizer has no BOS token to start from");
    promptIds = [spec.bos_token_id];
  }
  if (promptIds.length >= maxContext) {
    throw new UsageError(`the prompt has ${promptIds.length} tokens; the bundle's max context is ${maxContext} (including new tokens)`);
  }
  return promptIds;
}

async function main() {
  const { bundle, prompt, maxNewTokens } = parseArguments(process.argv.slice(2));
  const manifest = readManifest(bundle);
  const maxContext = manifest.max_context;
  // Spinning threads of two sessions that alternate fight over the same cores (as in the Python runtime).
  const options = { executionProviders: ["cpu"], graphOptimizationLevel: "all", extra: { session: { intra_op: { allow_spinning: "0" } } } };
  // An eagle head reads the target's features, and a vocabulary-subset draft needs its logits widened:
  // this host runs neither, so such a bundle decodes with the target alone (the same output, slower), as
  // does a bundle without a draft model.
  const draft = manifest.draft;
  const draftless = !draft || draft.kind === "eagle" || draft.vocab_ids;
  if (!draft) {
    process.stderr.write("note: the bundle has no draft model; decoding with the target alone\n");
  } else if (draftless) {
    process.stderr.write(`note: the draft is ${draft.kind === "eagle" ? "an eagle head" : "over a vocabulary subset"}, which this host does not run; decoding with the target alone\n`);
  }
  const models = {
    target: await CachedModel.load(bundle, manifest.target, maxContext, options),
    draft: draftless ? null : await CachedModel.load(bundle, draft, maxContext, options),
    accept: await ort.InferenceSession.create(path.join(bundle, manifest.accept.greedy.path), options),
  };
  const tokenizer = loadTokenizer(bundle, manifest.tokenizer);
  const promptIds = encode(tokenizer, manifest.tokenizer, prompt, maxContext);
  const { tokens, stats } = await generate(models, promptIds, maxNewTokens, maxContext, new Set(manifest.target.eos_token_ids));
  // As Python's tokenizers: no clean-up of spaces before punctuation (" ," stays), whatever the config says.
  const text = tokens.length ? tokenizer.decode(tokens, { skip_special_tokens: true, clean_up_tokenization_spaces: false }) : "";
  process.stdout.write(text);
  const perSecond = stats.decodeMs > 0 ? (tokens.length / stats.decodeMs) * 1000 : 0;
  const acceptance = stats.drafted ? stats.accepted / stats.drafted : 0;
  process.stderr.write(
    `\n${tokens.length} tokens in ${stats.decodeMs.toFixed(1)} ms (${perSecond.toFixed(1)} tok/s), prefill ${stats.prefillMs.toFixed(1)} ms, ` +
      `${stats.rounds} rounds, acceptance ${acceptance.toFixed(2)}, target ${models.target.ms.toFixed(1)} ms, draft ${models.draft ? models.draft.ms.toFixed(1) : "-"} ms (in session.run)\n`,
  );
}

main().catch((error) => {
  const message = error instanceof UsageError ? error.message : `${error?.message ?? error}`.split("\n")[0];
  process.stderr.write(`error: ${message}\n`);
  process.exit(2);
});
