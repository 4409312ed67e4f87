// specgen playground: streams answers from this server's own OpenAI API with each round's draft
// pieces ("speculative": {"live": true}) and draws them as `specgen run` does in a terminal.
// Plain JavaScript, no dependencies, nothing fetched from another origin.
"use strict";

const KEY = "specgen-playground-key";
const SVG = "http://www.w3.org/2000/svg";
const METHODS = ["plain", "chain", "lookup", "lookup-chain", "suffix", "rsd-c", "rsd-s", "multi-draft", "eagle"];
const DEFAULT_METHOD = "lookup-chain";  // config.DEFAULT_METHOD, until the server names its own
const METRICS_SECONDS = 3;
const RATE_WINDOW = 8; // rounds in each point of the tokens/s plot

const $ = (id) => document.getElementById(id);
const state = { model: null, controller: null, runs: [], metricsTimer: null, metricsUpdates: 0 };

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = text;
  return node;
}

function svg(tag, attributes) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, String(value));
  return node;
}

function key() { return $("key").value.trim(); }

function authorization() { return { Authorization: "Bearer " + key() }; }

function showError(text) {
  $("error").textContent = text || "";
  $("error").hidden = !text;
}

async function failure(response) {
  // the server's own message: {"error": {"message": ...}}
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
  } catch (ignored) { /* not JSON */ }
  return message;
}

// -- what the server runs -------------------------------------------------------------------
async function connect() {
  if (!key()) return false;
  const response = await fetch("/v1/models", { headers: authorization() });
  if (!response.ok) {
    showError(await failure(response));
    state.model = null;
    return false;
  }
  const models = await response.json();
  state.model = models.data[0].id;
  const health = await fetch("/health", { headers: authorization() });
  const info = health.ok ? await health.json() : {};
  fillMethods(info.methods || METHODS, info.method);
  $("served").textContent = info.models ? `Serving ${info.models}.` : `Serving ${state.model}.`;
  showError("");
  refreshMetrics();
  return true;
}

function fillMethods(methods, preferred) {
  const pick = $("method"), third = $("third");
  const chosen = pick.value || preferred || DEFAULT_METHOD;
  pick.replaceChildren(...methods.filter((m) => m !== "plain").map((m) => new Option(m, m)));
  if (!pick.options.length) pick.append(new Option("plain", "plain"));
  pick.value = [...pick.options].some((o) => o.value === chosen) ? chosen : pick.options[0].value;
  const kept = third.value;
  third.replaceChildren(new Option("none", ""), ...methods.filter((m) => m !== "plain").map((m) => new Option(m, m)));
  third.value = [...third.options].some((o) => o.value === kept) ? kept : "";
}

// -- a request ---------------------------------------------------------------------------------
function settings() {
  const number = (id) => ($(id).value === "" ? null : Number($(id).value));
  return {
    max_tokens: number("max-tokens"), temperature: number("temperature"), top_p: number("top-p"),
    seed: number("seed"), draft_tokens: number("draft-tokens"), deterministic: $("deterministic").checked,
  };
}

function body(method, options) {
  const messages = [];
  if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
  messages.push({ role: "user", content: $("prompt").value });
  const speculative = { method, live: true };
  if (options.draft_tokens !== null && method !== "plain") speculative.draft_tokens = options.draft_tokens;
  if (options.deterministic) speculative.deterministic = true;
  const request = { model: state.model, messages, stream: true, stream_options: { include_usage: true }, speculative };
  for (const name of ["max_tokens", "temperature", "top_p", "seed"]) {
    if (options[name] !== null) request[name] = options[name];
  }
  return request;
}

function methodsToRun() {
  const method = $("method").value || "plain";
  if (!$("race").checked) return [method];
  const chosen = ["plain", method];
  if ($("third").value) chosen.push($("third").value);
  return [...new Set(chosen)];
}

async function generate(event) {
  event.preventDefault();
  showError("");
  $("verdict").hidden = true;
  if (!key()) { showError("Enter the API key first."); $("key").focus(); return; }
  if (!state.model && !(await connect())) return;
  if (!$("prompt").value.trim()) { showError("Write a prompt first."); $("prompt").focus(); return; }
  const options = settings();
  state.controller = new AbortController();
  $("go").disabled = true;
  $("stop").disabled = false;
  state.runs = methodsToRun().map((method) => newRun(method));
  $("columns").replaceChildren(...state.runs.map((run) => run.node));
  try {
    await Promise.all(state.runs.map((run) => stream(run, body(run.method, options), state.controller.signal)));
    compare(state.runs, options);
  } finally {
    $("go").disabled = false;
    $("stop").disabled = true;
    state.controller = null;
    refreshMetrics();
  }
}

async function stream(run, request, signal) {
  run.started = performance.now();
  let response;
  try {
    response = await fetch("/v1/chat/completions", {
      method: "POST", signal, headers: { ...authorization(), "Content-Type": "application/json" },
      body: JSON.stringify(request),
    });
  } catch (error) {
    run.speed.textContent = signal.aborted ? "stopped" : `failed: ${error.message}`;
    return;
  }
  if (!response.ok) {
    const message = await failure(response);
    showError(`${run.method}: ${message}`);
    run.speed.textContent = "refused";
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ") && line !== "data: [DONE]") onChunk(run, JSON.parse(line.slice(6)));
        }
      }
    }
  } catch (error) {
    if (!signal.aborted) showError(`${run.method}: the stream broke (${error.message})`);
  }
  run.done = true;
  if (signal.aborted && !run.summary) run.speed.textContent += " (stopped)";
}

// -- chunks -> rounds --------------------------------------------------------------------------
function onChunk(run, chunk) {
  if (chunk.error) { showError(`${run.method}: ${chunk.error.message}`); return; }
  const live = chunk.speculative;
  if (!live) return;
  if (live.stats && "round" in live) addRound(run, live);
  else if (live.stats && live.replay) addReplay(run, live);
  if (live.stats) showSpeed(run, live.stats);
  // the finish chunk carries the summary (and the text); the usage chunk after it repeats the summary
  if ("acceptance_rate" in live && !("round" in live) && !live.replay && !run.summary) finish(run, live);
}

function newRun(method) {
  const node = $("column").content.firstElementChild.cloneNode(true);
  const run = {
    method, node, answer: node.querySelector(".answer"), speed: node.querySelector(".speed"),
    detail: node.querySelector(".detail"), rounds: [], pending: [], selected: -1, decodeSeconds: 0,
    points: [], emitted: [], summary: null, done: false, text: "",
  };
  node.querySelector(".title").textContent = method;
  node.dataset.method = method;
  run.answer.setAttribute("aria-label", `${method}'s answer`);
  run.answer.addEventListener("keydown", (event) => stepRound(run, event));
  run.answer.addEventListener("focus", () => { if (run.selected < 0 && run.rounds.length) select(run, 0); });
  return run;
}

function addRound(run, live) {
  const stats = live.stats;
  const seconds = Math.max(0, stats.decode_seconds - run.decodeSeconds);
  run.decodeSeconds = stats.decode_seconds;
  const round = el("span", "round");
  const pending = Boolean(live.pending);
  const accepted = live.origin === "memory" ? "acc mem" : "acc"; // drafted from earlier requests' text
  for (const piece of live.accepted) {
    const span = el("span", pending ? `${accepted} pending` : accepted, piece);
    round.append(span);
    if (pending) run.pending.push(span);
  }
  for (const piece of live.rejected) round.append(el("del", "rej", piece));
  if (live.target) {
    const target = el("strong", pending ? "tgt pending" : "tgt", live.target);
    round.append(target);
    if (pending) run.pending.push(target);
  }
  const info = {
    number: live.round, accepted: live.accepted, rejected: live.rejected, target: live.target, seconds,
    origin: live.origin,
    tree: live.tree ? live.tree.texts.length : 0, emitted: live.ids.length,
  };
  round.title = describe(run, info);
  round.addEventListener("mouseenter", () => { run.detail.textContent = describe(run, info); });
  run.rounds.push({ node: round, info });
  run.answer.append(round);
  run.answer.scrollTop = run.answer.scrollHeight;
  run.emitted.push({ time: stats.decode_seconds, tokens: live.ids.length });
  const point = ratePoint(run);
  if (point) run.points.push(point);
}

function addReplay(run, live) {
  // deterministic mode: the replay confirms the pending tokens, or drops the last ones and adds its own
  const dropped = live.replay.dropped || 0;
  const kept = run.pending.length - dropped;
  run.pending.forEach((span, i) => {
    span.classList.remove("pending");
    if (i >= kept) { span.className = "rolled"; span.title = "rolled back by the replay"; }
  });
  run.pending = [];
  if (live.replay.correction !== null && live.replay.correction !== undefined) {
    run.answer.append(el("strong", "tgt", live.replay.correction));
  }
}

function describe(run, info) {
  const quoted = (pieces) => pieces.map((p) => JSON.stringify(p)).join(" ");
  const drafted = info.tree ? `a tree of ${info.tree} nodes` : `${info.accepted.length + info.rejected.length} drafted`;
  const from = info.origin === "memory" ? " from the memory of earlier requests" : "";
  const parts = [`Round ${info.number}: ${drafted}${from}, ${info.accepted.length} accepted`];
  if (info.accepted.length) parts.push(`accepted ${quoted(info.accepted)}`);
  if (info.rejected.length) parts.push(`rejected ${quoted(info.rejected)}`);
  if (info.target) parts.push(`target's token ${JSON.stringify(info.target)}`);
  parts.push(`${(info.seconds * 1000).toFixed(1)} ms`);
  return parts.join(" · ");
}

function stepRound(run, event) {
  if (!run.rounds.length) return;
  const moves = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1, Home: -Infinity, End: Infinity };
  if (!(event.key in moves)) return;
  event.preventDefault();
  const next = Math.min(run.rounds.length - 1, Math.max(0, (run.selected < 0 ? 0 : run.selected) + moves[event.key]));
  select(run, next);
}

function select(run, index) {
  if (run.selected >= 0) run.rounds[run.selected].node.classList.remove("selected");
  run.selected = index;
  const round = run.rounds[index];
  round.node.classList.add("selected");
  round.node.scrollIntoView({ block: "nearest" });
  run.detail.textContent = describe(run, round.info);
}

function ratePoint(run) {
  // tokens/s over the last RATE_WINDOW rounds, measured from the end of the round before them:
  // the first round's token comes with the prefill, in no decode time, so it starts no window
  const rounds = run.emitted, last = rounds.length - 1;
  if (last < 1) return null;
  const start = Math.max(0, last - RATE_WINDOW);
  const seconds = rounds[last].time - rounds[start].time;
  const tokens = rounds.slice(start + 1).reduce((sum, r) => sum + r.tokens, 0);
  return seconds > 0 ? { time: rounds[last].time, rate: tokens / seconds } : null;
}

// a decode too short to time (a one-token answer) has no rate: the server sends null
function speed(stats) {
  return stats.tokens_per_second == null ? "–" : stats.tokens_per_second.toFixed(1);
}

function showSpeed(run, stats) {
  run.speed.textContent = `${stats.new_tokens} tokens · ${speed(stats)} tok/s · ` +
    `acceptance ${(100 * stats.acceptance_rate).toFixed(0)}%`;
}

function finish(run, summary) {
  run.summary = summary;
  if (summary.text !== undefined) run.text = summary.text;
  const rows = [
    ["method", summary.method],
    ["acceptance", `${(100 * summary.acceptance_rate).toFixed(1)}% (${summary.accepted}/${summary.drafted} drafted)`],
    ["tokens per target forward", summary.tokens_per_target_forward.toFixed(2)],
    ["tokens/s", speed(summary)],
    ["time to first token", `${(1000 * summary.time_to_first_token).toFixed(0)} ms`],
    ["target forwards", String(summary.target_forwards)],
  ];
  const list = run.node.querySelector(".summary");
  list.replaceChildren();
  for (const [name, value] of rows) list.append(el("dt", null, name), el("dd", null, value));
  list.dataset.accepted = summary.accepted;
  list.dataset.drafted = summary.drafted;
  run.speed.textContent = `${speed(summary)} tok/s · ` +
    `${summary.tokens_per_target_forward.toFixed(2)} tokens per target forward`;
  drawHistogram(run.node.querySelector(".histogram"), summary.accepted_length_histogram || {});
  drawRate(run.node.querySelector(".rate"), run.points);
}

// -- plots (inline SVG) --------------------------------------------------------------------------
function plotFrame(figure, label) {
  figure.querySelector("svg")?.remove();
  const frame = svg("svg", { viewBox: "0 0 320 120", role: "img", "aria-label": label });
  figure.append(frame);
  frame.append(svg("line", { class: "axis", x1: 36, y1: 100, x2: 315, y2: 100 }));
  return frame;
}

function drawHistogram(figure, counts) {
  const lengths = Object.keys(counts).map(Number);
  const most = Math.max(1, ...Object.values(counts));
  const top = Math.max(0, ...lengths);
  const frame = plotFrame(figure, "accepted draft tokens per round: " +
    (lengths.map((k) => `${k}: ${counts[k]} rounds`).join(", ") || "nothing drafted"));
  if (!lengths.length) {
    const none = svg("text", { x: 172, y: 60, "text-anchor": "middle" });
    none.textContent = "nothing drafted";
    frame.append(none);
    return;
  }
  const width = 279 / (top + 1);
  for (let k = 0; k <= top; k++) {
    const n = counts[String(k)] || 0;
    const height = (88 * n) / most;
    const x = 36 + k * width;
    const bar = svg("rect", { class: "bar", x: x + 2, y: 100 - height, width: Math.max(1, width - 4), height });
    bar.append(svg("title"));
    bar.firstChild.textContent = `${k} accepted: ${n} rounds`;
    frame.append(bar);
    const label = svg("text", { x: x + width / 2, y: 114, "text-anchor": "middle" });
    label.textContent = String(k);
    frame.append(label);
  }
  const peak = svg("text", { x: 32, y: 16, "text-anchor": "end" });
  peak.textContent = String(most);
  frame.append(peak);
}

function drawRate(figure, points) {
  const frame = plotFrame(figure, "tokens per second over the answer's decode time");
  if (!points.length) return;
  const end = Math.max(1e-6, points[points.length - 1].time);
  const high = Math.max(1e-6, ...points.map((p) => p.rate));
  const xy = points.map((p) => `${(36 + (279 * p.time) / end).toFixed(1)},${(100 - (88 * p.rate) / high).toFixed(1)}`);
  frame.append(svg("polyline", { class: "line", points: xy.join(" ") }));
  const peak = svg("text", { x: 32, y: 16, "text-anchor": "end" });
  peak.textContent = high >= 100 ? high.toFixed(0) : high.toFixed(1);
  const span = svg("text", { x: 315, y: 114, "text-anchor": "end" });
  span.textContent = `${end.toFixed(2)} s`;
  frame.append(peak, span);
}

// -- race: the same text under greedy --------------------------------------------------------------
function compare(runs, options) {
  const finished = runs.filter((run) => run.summary);
  if (finished.length < 2) return;
  const plain = finished.find((run) => run.method === "plain") || finished[0];
  const timed = (run) => run.summary.tokens_per_second != null;
  const speeds = finished.map((run) => `${run.method} ${speed(run.summary)} tok/s` +
    (run === plain || !timed(run) || !timed(plain) ? "" :
      ` (${(run.summary.tokens_per_second / plain.summary.tokens_per_second).toFixed(2)}x)`));
  const same = finished.every((run) => run.text === plain.text);
  let verdict = speeds.join(" · ");
  if (options.temperature === 0 || options.temperature === null) {
    verdict += same ? " · the same text in every column" : " · the texts differ";
  }
  // rows share the batch's rounds: the server may hold a row to plain rounds where its drafting
  // would cost the others more than it gains (a lone draft model's row on a small CPU)
  for (const run of finished) {
    if (run.method !== "plain" && run.summary.drafted === 0) {
      verdict += ` · ${run.method} drafted nothing: beside the others its drafting would not pay`;
    }
  }
  $("verdict").textContent = verdict;
  $("verdict").hidden = false;
}

// -- the server panel from /metrics ------------------------------------------------------------------
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    const match = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, name, value] of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[name] = value;
    samples.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return samples;
}

async function refreshMetrics() {
  if (!key()) return;
  let response;
  try {
    response = await fetch("/metrics", { headers: authorization() });
  } catch (error) {
    $("metrics-state").textContent = `the server did not answer (${error.message})`;
    return;
  }
  if (!response.ok) {
    $("metrics-state").textContent = await failure(response);
    return;
  }
  const samples = parseMetrics(await response.text());
  const one = (name) => samples.find((s) => s.name === name)?.value ?? 0;
  const requests = samples.filter((s) => s.name === "specgen_requests_total");
  const byStatus = {};
  for (const s of requests) byStatus[s.labels.status] = (byStatus[s.labels.status] || 0) + s.value;
  const perMethod = {}; // method -> [draft length at 1 row, 2 rows, ...]
  for (const s of samples.filter((s) => s.name === "specgen_draft_length")) {
    (perMethod[s.labels.method] ||= [])[Number(s.labels.width) - 1] = s.value;
  }
  const widths = Object.entries(perMethod)
    .map(([method, lengths]) => `${method}: ${lengths.map((k) => k ?? "-").join(" ")} (1 to ${lengths.length} rows)`);
  const rows = [
    ["requests (by outcome)", `${requests.reduce((sum, s) => sum + s.value, 0)}` +
      (requests.length ? ` (${Object.entries(byStatus).map(([k, v]) => `${k} ${v}`).join(", ")})` : "")],
    ["queue", String(one("specgen_queue_depth"))],
    ["batch width", String(one("specgen_batch_width"))],
    ["draft length per width", widths.join("; ") || "none measured"],
    ["acceptance", `${(100 * one("specgen_acceptance_rate")).toFixed(1)}%`],
    ["tokens per target forward", one("specgen_tokens_per_target_forward").toFixed(2)],
    ["tokens generated", String(one("specgen_generated_tokens_total"))],
  ];
  const list = $("metrics");
  list.replaceChildren();
  for (const [name, value] of rows) list.append(el("dt", null, name), el("dd", null, value));
  state.metricsUpdates += 1;
  list.dataset.updates = String(state.metricsUpdates);
  $("metrics-state").textContent = `Updated ${new Date().toLocaleTimeString()}, every ${METRICS_SECONDS} s.`;
}

// -- wiring -------------------------------------------------------------------------------------------
function start() {
  fillMethods(METHODS, DEFAULT_METHOD);
  const saved = sessionStorage.getItem(KEY);
  if (saved) { $("key").value = saved; connect(); }
  $("key").addEventListener("change", () => {
    sessionStorage.setItem(KEY, key());
    state.model = null;
    connect();
  });
  $("race").addEventListener("change", () => { $("third").disabled = !$("race").checked; });
  $("form").addEventListener("submit", generate);
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("form").requestSubmit();
  });
  document.addEventListener("keydown", (event) => { if (event.key === "Escape") state.controller?.abort(); });
  state.metricsTimer = setInterval(refreshMetrics, METRICS_SECONDS * 1000);
}

start();
