// tokenmill's page: a chat playground and a live engine dashboard.
// Every piece of data is put on the page as text (textContent / attributes), never as
// HTML, and the server's Content-Security-Policy allows no inline script.
"use strict";

(() => {
  const POLL_MS = 1000; // the engine history has one sample per second
  const TIMELINE_LIMIT = 40;
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";

  // ------------------------------------------------------------------ API access
  const auth = {
    key: sessionStorage.getItem("tokenmill.apiKey") || "",
    waiters: [],
  };

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (auth.key) h.Authorization = "Bearer " + auth.key;
    return h;
  }

  class Unauthorized extends Error {}

  async function api(path, options) {
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.headers);
    const response = await fetch(path, opts);
    if (response.status === 401) {
      askForKey(Boolean(auth.key));
      throw new Unauthorized("API key required");
    }
    return response;
  }

  function askForKey(refused) {
    $("key-error").hidden = !refused;
    $("key-overlay").hidden = false;
    $("api-key").focus();
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    auth.key = $("api-key").value.trim();
    sessionStorage.setItem("tokenmill.apiKey", auth.key);
    $("key-overlay").hidden = true;
    $("change-key").hidden = false;
    loadModel();
  });
  $("change-key").addEventListener("click", () => askForKey(false));
  $("change-key").hidden = !auth.key;

  let model = null;
  async function loadModel() {
    try {
      const body = await (await api("/v1/models")).json();
      model = body.data[0].id;
      $("model-name").textContent = model;
      $("send").disabled = chat.streaming;
      schedulePoll(0);
    } catch (error) {
      if (!(error instanceof Unauthorized)) $("model-name").textContent = "server unreachable";
    }
  }

  // ----------------------------------------------------------------------- views
  function showView(name) {
    for (const view of ["chat", "dashboard"]) {
      $("view-" + view).hidden = view !== name;
      $("tab-" + view).setAttribute("aria-selected", String(view === name));
    }
    if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
    schedulePoll(0);
  }
  window.addEventListener("hashchange", () => {
    showView(location.hash === "#dashboard" ? "dashboard" : "chat");
  });
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => showView(tab.dataset.view));
  }

  // ------------------------------------------------------------------------ chat
  const chat = { history: [], streaming: false, controller: null };

  function newRequestId() {
    const bytes = crypto.getRandomValues(new Uint8Array(8));
    return "ui-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function addMessage(role, text) {
    $("empty-chat").hidden = true;
    const item = document.createElement("div");
    item.className = "message " + role;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role === "user" ? "You" : "Assistant";
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    const meta = document.createElement("div");
    meta.className = "meta";
    item.append(who, body, meta);
    $("messages").append(item);
    item.scrollIntoView({ block: "end" });
    return { item, body, meta };
  }

  function setStreaming(on) {
    chat.streaming = on;
    $("send").disabled = on || !model;
    $("stop").disabled = !on;
  }

  function showCount(tokens, seconds) {
    const count = $("token-count");
    count.dataset.tokens = String(tokens);
    const rate = seconds > 0 && tokens > 1 ? ` · ${(tokens / seconds).toFixed(1)} tok/s` : "";
    count.textContent = `${tokens} token${tokens === 1 ? "" : "s"}${rate}`;
  }

  // Parse a server-sent-events body, calling onEvent with each data payload.
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          onEvent(JSON.parse(data));
        }
      }
    }
  }

  async function send() {
    const text = $("prompt").value.trim();
    if (!text || chat.streaming || !model) return;
    $("prompt").value = "";
    chat.history.push({ role: "user", content: text });
    addMessage("user", text);
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...chat.history);

    const requestId = newRequestId();
    const reply = addMessage("assistant", "");
    reply.item.dataset.requestId = requestId;
    reply.item.classList.add("streaming");
    const started = performance.now();
    let content = "";
    let tokens = 0;
    let outcome = "";
    chat.controller = new AbortController();
    setStreaming(true);
    $("chat-status").textContent = "waiting for the first token…";
    showCount(0, 0);
    try {
      const response = await api("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", "x-request-id": requestId },
        body: JSON.stringify({
          model,
          messages,
          temperature: Number($("temperature").value),
          max_tokens: Number($("max-tokens").value) || undefined,
          stream: true,
          stream_options: { include_usage: true, continuous_usage_stats: true },
        }),
        signal: chat.controller.signal,
      });
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        throw new Error((body.error && body.error.message) || `HTTP ${response.status}`);
      }
      await readEvents(response, (event) => {
        if (event.error) throw new Error(event.error.message);
        if (event.usage) tokens = event.usage.completion_tokens;
        for (const choice of event.choices || []) {
          content += (choice.delta && choice.delta.content) || "";
          if (choice.finish_reason) outcome = choice.finish_reason;
        }
        reply.body.textContent = content;
        $("chat-status").textContent = "streaming…";
        showCount(tokens, (performance.now() - started) / 1000);
        reply.item.scrollIntoView({ block: "end" });
      });
    } catch (error) {
      if (error.name === "AbortError") outcome = "stopped";
      else outcome = "error: " + error.message;
    } finally {
      setStreaming(false);
      chat.controller = null;
      reply.item.classList.remove("streaming");
      reply.item.dataset.outcome = outcome;
      reply.meta.textContent = `${tokens} tokens · ${outcome || "done"} · ${requestId}`;
      $("chat-status").textContent = outcome === "stopped" ? "stopped" : "";
      showCount(tokens, (performance.now() - started) / 1000);
      if (content) chat.history.push({ role: "assistant", content });
    }
  }

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.history = [];
    for (const item of $("messages").querySelectorAll(".message")) item.remove();
    $("empty-chat").hidden = false;
    showCount(0, 0);
    $("token-count").textContent = "";
  });
  $("temperature").addEventListener("input", () => {
    $("temperature-value").textContent = $("temperature").value;
  });

  // ------------------------------------------------------------------- dashboard
  const dash = { samples: [], fields: [], timer: null, lastT: null, window: 300 };

  function schedulePoll(delay) {
    clearTimeout(dash.timer);
    dash.timer = null;
    if (!model || $("view-dashboard").hidden || document.hidden) return;
    dash.timer = setTimeout(poll, delay);
  }
  document.addEventListener("visibilitychange", () => schedulePoll(0));

  async function poll() {
    let delay = POLL_MS;
    try {
      const since = dash.lastT === null ? "" : `?since=${dash.lastT}`;
      const [state, recent] = await Promise.all([
        api("/v1/engine/state" + since).then((r) => r.json()),
        api(`/v1/requests/recent?limit=${TIMELINE_LIMIT}`).then((r) => r.json()),
      ]);
      renderState(state);
      renderTimeline(recent);
    } catch (error) {
      if (error instanceof Unauthorized) return; // resumes once a key is entered
      delay = 5 * POLL_MS;
    }
    schedulePoll(delay);
  }

  const fmtSeconds = (s) =>
    s === null || s === undefined ? "–" : s < 1 ? `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms` : `${s.toFixed(2)} s`;
  const fmtInt = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en"));

  function renderState(state) {
    $("stats-off").hidden = state.stats_enabled;
    if (!state.stats_enabled) return;
    dash.fields = state.fields;
    dash.window = state.window_s;
    for (const row of state.samples) {
      if (dash.lastT === null || row[0] > dash.lastT) dash.samples.push(row);
    }
    if (dash.samples.length) dash.lastT = dash.samples[dash.samples.length - 1][0];
    const horizon = state.time - dash.window;
    while (dash.samples.length && dash.samples[0][0] <= horizon) dash.samples.shift();

    const col = (name) => dash.fields.indexOf(name);
    const cur = state.current;
    const cfg = state.config;
    $("card-running").textContent = fmtInt(cur.running);
    $("card-running-sub").textContent = `of ${cfg.max_num_seqs} slots`;
    $("card-waiting").textContent = fmtInt(cur.waiting);
    $("card-waiting-sub").textContent = `${fmtInt(cur.tokens_waiting)} tokens waiting`;
    $("card-kv").textContent = `${(cur.kv_cache_usage * 100).toFixed(1)}%`;
    $("card-kv-sub").textContent =
      `${fmtInt(cur.kv_cache_tokens_used)} / ${fmtInt(cfg.kv_cache_tokens_total)} tokens`;
    const last10 = dash.samples.slice(-10);
    const gen = last10.reduce((sum, row) => sum + row[col("generation_tokens")], 0);
    $("card-tps").textContent = last10.length ? (gen / last10.length).toFixed(1) : "–";
    $("card-tps-sub").textContent = "last 10 s";
    const lat = state.latency;
    const minutes = Math.round(dash.window / 60);
    $("card-ttft").textContent = `p50 ${fmtSeconds(lat.ttft.p50)}`;
    $("card-ttft-sub").textContent =
      `p90 ${fmtSeconds(lat.ttft.p90)} · p99 ${fmtSeconds(lat.ttft.p99)} · ${lat.ttft.count} req, ${minutes} min`;
    $("card-itl").textContent = `p50 ${fmtSeconds(lat.itl.p50)}`;
    $("card-itl-sub").textContent =
      `p90 ${fmtSeconds(lat.itl.p90)} · p99 ${fmtSeconds(lat.itl.p99)} · TPOT p50 ${fmtSeconds(lat.tpot.p50)}`;
    const recentPreemptions = dash.samples.reduce((s, row) => s + row[col("preemptions")], 0);
    $("card-preemptions").textContent = fmtInt(state.totals.preemptions);
    $("card-preemptions-sub").textContent = `${recentPreemptions} in the last ${minutes} min`;
    const fin = state.totals.finished;
    $("card-finished").textContent = fmtInt(fin.stop + fin.length);
    $("card-finished-sub").textContent = `${fin.abort} aborted · ${fin.error} failed`;

    // the last window_s seconds, or since the first sample when the server is younger
    const t1 = state.time;
    const first = dash.samples.length ? dash.samples[0][0] : t1;
    const t0 = Math.min(t1 - 30, Math.max(t1 - dash.window, first));
    const series = (name, scale) => dash.samples.map((r) => [r[0], r[col(name)] * (scale || 1)]);
    drawChart($("chart-requests"), t0, t1, [
      { points: series("running"), cls: "l-running" },
      { points: series("waiting"), cls: "l-waiting" },
    ], fmtInt, series("preemptions"));
    drawChart($("chart-tokens"), t0, t1, [
      { points: series("kv_cache_tokens_used"), cls: "l-kvtok" },
      { points: series("tokens_waiting"), cls: "l-twait" },
    ], fmtInt);
    drawChart($("chart-kv"), t0, t1, [{ points: series("kv_cache_usage", 100), cls: "l-kv" }],
      (v) => `${Math.round(v)}%`, null, 100);
    drawChart($("chart-throughput"), t0, t1, [
      { points: series("generation_tokens"), cls: "l-gen" },
      { points: series("prompt_tokens"), cls: "l-prompt" },
    ], fmtInt);
  }

  function svg(tag, attrs, parent) {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
    if (parent) parent.append(el);
    return el;
  }

  // A line chart over [t0, t1] seconds; `marks` (optional) draws [t, count] ticks.
  function drawChart(el, t0, t1, lines, fmt, marks, fixedMax) {
    const W = 400, H = 120, L = 44, B = 18, T = 8, R = 8;
    el.setAttribute("viewBox", `0 0 ${W} ${H}`);
    el.replaceChildren();
    let max = fixedMax || 0;
    if (!fixedMax) for (const line of lines) for (const [, v] of line.points) max = Math.max(max, v);
    max = max > 0 ? niceCeil(max) : 1;
    const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
    const y = (v) => H - B - (v / max) * (H - B - T);
    for (const v of [0, max]) {
      svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }, el);
      svg("text", { x: L - 4, y: y(v) + 4, class: "tick", "text-anchor": "end" }, el).textContent = fmt(v);
    }
    for (const [label, t] of [[`-${Math.round(t1 - t0)} s`, t0], ["now", t1]]) {
      const anchor = t === t0 ? "start" : "end";
      svg("text", { x: x(t), y: H - 4, class: "tick", "text-anchor": anchor }, el).textContent = label;
    }
    if (marks) {
      for (const [t, n] of marks) {
        if (n > 0) svg("rect", { x: x(t) - 1, y: T, width: 2, height: H - B - T, class: "mark" }, el)
          .append(Object.assign(document.createElementNS(SVG, "title"), { textContent: `${n} preemption(s)` }));
      }
    }
    for (const line of lines) {
      if (!line.points.length) continue;
      const d = line.points.map(([t, v], i) => `${i ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`).join("");
      svg("path", { d, class: "line " + line.cls }, el);
    }
  }

  function niceCeil(v) {
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  // ---------------------------------------------------------------- timeline
  const timeline = { byId: new Map() };

  function renderTimeline(recent) {
    const box = $("timeline");
    const rows = recent.data;
    if (!rows.length) return;
    const now = recent.time;
    const earliest = Math.min(...rows.map((r) => r.arrival_time || now));
    const span = Math.min(600, Math.max(10, now - earliest));
    const t0 = now - span;
    const pct = (t) => `${(Math.max(0, (t - t0) / span) * 100).toFixed(3)}%`;
    timeline.byId.clear();
    const fragment = document.createDocumentFragment();
    for (const req of rows) {
      const key = `${req.id}#${req.choice}`;
      timeline.byId.set(key, req);
      const row = document.createElement("div");
      row.className = `tl-row status-${req.status}`;
      row.tabIndex = 0;
      row.dataset.key = key;
      row.dataset.requestId = req.id;
      row.dataset.status = req.status;
      const label = document.createElement("div");
      label.className = "tl-label";
      const name = document.createElement("span");
      name.className = "tl-id";
      name.textContent = req.choice ? `${req.id} #${req.choice}` : req.id;
      const status = document.createElement("span");
      status.className = "tl-status";
      status.textContent = req.status;
      label.append(name, status);
      const track = document.createElement("div");
      track.className = "tl-track";
      for (const seg of req.segments) {
        const end = seg.end === null ? now : seg.end;
        if (end < t0) continue;
        const bar = document.createElement("div");
        bar.className = `tl-seg seg-${seg.state}`;
        bar.style.left = pct(seg.start);
        bar.style.width = `calc(${pct(end)} - ${pct(seg.start)} + 1px)`;
        track.append(bar);
      }
      if (req.end_time !== null) {
        const end = document.createElement("div");
        end.className = `tl-end end-${req.status}`;
        end.style.left = pct(req.end_time);
        track.append(end);
      }
      row.append(label, track);
      fragment.append(row);
    }
    box.replaceChildren(fragment);
    $("timeline-axis").textContent = `${Math.round(span)} s ago … now`;
    refreshTooltip();
  }

  const tip = { key: null, x: 0, y: 0 };

  function describe(req) {
    const lines = [
      ["request", req.choice ? `${req.id} (choice ${req.choice})` : req.id],
      ["status", req.status + (req.finish_reason ? ` (${req.finish_reason})` : "")],
      ["prompt tokens", `${req.prompt_tokens} (${req.cached_tokens} cached)`],
      ["output tokens", String(req.output_tokens)],
      ["TTFT", fmtSeconds(req.ttft)],
      ["TPOT", fmtSeconds(req.tpot)],
      ["end to end", fmtSeconds(req.e2e)],
      ["preemptions", String(req.preemptions)],
    ];
    for (const seg of req.segments) {
      const end = seg.end === null ? null : seg.end - seg.start;
      lines.push([`  ${seg.state}`, end === null ? "ongoing" : fmtSeconds(end)]);
    }
    return lines;
  }

  function refreshTooltip() {
    const box = $("tooltip");
    const req = tip.key && timeline.byId.get(tip.key);
    if (!req) {
      box.hidden = true;
      return;
    }
    const table = document.createElement("dl");
    for (const [k, v] of describe(req)) {
      const dt = document.createElement("dt");
      dt.textContent = k;
      const dd = document.createElement("dd");
      dd.textContent = v;
      table.append(dt, dd);
    }
    const parts = [table];
    for (const field of ["prompt", "output"]) {
      if (typeof req[field] !== "string") continue;
      const head = document.createElement("div");
      head.className = "tip-head";
      head.textContent = field;
      const text = document.createElement("pre");
      text.className = "tip-text tip-" + field;
      text.textContent = req[field];
      parts.push(head, text);
    }
    box.replaceChildren(...parts);
    box.hidden = false;
    const left = Math.min(tip.x + 14, window.innerWidth - box.offsetWidth - 8);
    box.style.left = `${Math.max(8, left)}px`;
    box.style.top = `${tip.y + 14}px`;
  }

  function pointAt(event) {
    const row = event.target.closest && event.target.closest(".tl-row");
    tip.key = row ? row.dataset.key : null;
    if (row && event.type === "focusin") {
      const rect = row.getBoundingClientRect();
      tip.x = rect.left + 120;
      tip.y = rect.bottom + window.scrollY - 14;
    } else {
      tip.x = event.clientX;
      tip.y = event.pageY;
    }
    refreshTooltip();
  }
  $("timeline").addEventListener("mousemove", pointAt);
  $("timeline").addEventListener("focusin", pointAt);
  $("timeline").addEventListener("mouseleave", () => { tip.key = null; refreshTooltip(); });
  $("timeline").addEventListener("focusout", () => { tip.key = null; refreshTooltip(); });

  // ------------------------------------------------------------------------ start
  showView(location.hash === "#dashboard" ? "dashboard" : "chat");
  setStreaming(false);
  loadModel();
})();
