// The Line live page's script: the answers as they happen, read from the server's Server-Sent
// Events (GET /v1/live, filtered by the page's model and station), newest on top in a bounded
// list; and each model's answers and latency of the last minutes (GET /v1/live/summary, read
// every few seconds) drawn as small inline SVG plots. The browser's EventSource reconnects by
// itself and sends the last event id, so the server resumes after it; the page also skips an
// event whose id it has shown already, so a reconnect never shows a row twice.
"use strict";

(function () {
  const root = document.querySelector(".live");
  if (!root) return;
  const strings = JSON.parse(document.getElementById("live-strings").textContent);
  const rows = document.getElementById("live-rows");
  const empty = document.getElementById("live-empty");
  const state = document.getElementById("live-state");
  const notice = document.getElementById("live-notice");
  const maxRows = parseInt(root.dataset.rows, 10);
  const minutes = parseInt(root.dataset.minutes, 10);
  const withStation = rows.dataset.stations === "yes";
  const SUMMARY_EVERY_MS = 3000;
  const REOPEN_MS = 5000;  // after a refused stream (the browser does not retry those itself)
  const SVG = (() => {  // the SVG namespace, as the HTML parser gives it (no address written)
    const holder = document.createElement("div");
    holder.innerHTML = "<svg></svg>";
    return holder.firstChild.namespaceURI;
  })();
  const KINDS = [["ok", strings.live_ok], ["ng", strings.live_ng], ["late", strings.live_late],
                 ["refused", strings.live_refused]];
  const newest = new Map();  // the engine run's id -> the highest event number shown of it

  const {fill} = window.visionserveConsole;  // console.js, loaded first

  // times as the other pages show them: in the server's zone, YYYY-MM-DD HH:MM:SS
  const clock = new Intl.DateTimeFormat("en-US", {
    timeZone: root.dataset.zone || undefined, hourCycle: "h23", year: "numeric",
    month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit"});

  function when(epochS) {
    const p = {};
    for (const part of clock.formatToParts(new Date(epochS * 1000))) p[part.type] = part.value;
    return `${p.year}-${p.month}-${p.day} ${p.hour}:${p.minute}:${p.second}`;
  }

  function cell(text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    return td;
  }

  function isNew(id) {
    const cut = id.lastIndexOf("-");
    const boot = id.slice(0, cut);
    const seq = parseInt(id.slice(cut + 1), 10);
    if (newest.has(boot) && newest.get(boot) >= seq) return false;
    newest.set(boot, seq);
    return true;
  }

  function show(event) {
    if (!isNew(event.id)) return;
    const tr = document.createElement("tr");
    tr.dataset.id = event.id;
    tr.appendChild(cell(when(event.time)));
    tr.appendChild(cell(`${event.model} ${event.version}`));
    if (withStation) tr.appendChild(cell(event.station || strings.none));
    tr.appendChild(cell(event.part_id || strings.none, "part"));
    const verdict = document.createElement("span");
    verdict.className = `verdict verdict-${event.verdict.toLowerCase()}`;
    verdict.textContent = event.verdict;
    const td = cell("");
    td.appendChild(verdict);
    tr.appendChild(td);
    tr.appendChild(cell([event.label, ...event.reasons].filter(Boolean).join("; ")));
    tr.appendChild(cell(event.latency_ms.toFixed(1), "num"));
    rows.insertBefore(tr, rows.firstChild);
    while (rows.children.length > maxRows) rows.removeChild(rows.lastChild);
    empty.hidden = true;
    if (event.verdict === "NG") lastNgSoon(event.part_id);
  }

  // The last NG part's captured frame with the model's answer drawn on it (with --records and
  // --capture): read from the records listing when an NG answer comes, at most once every
  // LAST_NG_EVERY_MS whatever the rate of NG answers; the record is written just after the
  // answer, so a read that finds an older one reads again once.
  const lastNg = document.getElementById("last-ng");
  const LAST_NG_EVERY_MS = 2000;
  const LAST_NG_AGAIN_MS = 1000;
  let lastNgShown = null;   // the record id on show
  let lastNgTimer = null;   // a read is planned
  let lastNgAt = 0;         // when the last read started
  let lastNgWanted = null;  // the part id of the newest NG answer seen

  function lastNgSoon(part) {
    if (!lastNg) return;
    lastNgWanted = part;
    if (lastNgTimer !== null) return;
    const wait = Math.max(0, lastNgAt + LAST_NG_EVERY_MS - Date.now());
    lastNgTimer = setTimeout(() => readLastNg(true), wait);
  }

  async function readLastNg(retry) {
    lastNgTimer = null;
    lastNgAt = Date.now();
    const query = new URLSearchParams({verdict: "NG", captured: "true", limit: "1"});
    if (root.dataset.model) query.set("model", root.dataset.model);
    let record = null;
    try {
      const r = await fetch(`/v1/records?${query}`, {
        headers: {"Accept": "application/json"}, credentials: "same-origin"});
      if (r.ok) record = (await r.json()).records[0] || null;
    } catch (e) {
      return;  // the next NG answer reads again
    }
    if (record && record.id !== lastNgShown) {
      lastNgShown = record.id;
      const part = record.part_id || strings.none;
      const image = document.getElementById("last-ng-image");
      image.src = `/v1/records/${record.id}/overlay?size=640`;
      image.alt = fill(strings.live_last_ng_alt, {part: part});
      document.getElementById("last-ng-link").href = record.part_id
        ? `/ui/parts/${encodeURIComponent(record.part_id)}` : "/ui/parts";
      document.getElementById("last-ng-caption").textContent = fill(
        strings.live_last_ng_caption, {part: part, model: record.model,
          version: record.version, time: when(record.timestamp), label: record.label || ""});
      lastNg.hidden = false;
      document.getElementById("last-ng-empty").hidden = true;
    }
    if (retry && lastNgWanted !== null && (!record || record.part_id !== lastNgWanted)) {
      lastNgTimer = setTimeout(() => readLastNg(false), LAST_NG_AGAIN_MS);
    }
  }

  let source = null;
  let reopen = null;

  function listen() {
    const query = new URLSearchParams();
    if (root.dataset.model) query.set("model", root.dataset.model);
    if (root.dataset.station) query.set("station", root.dataset.station);
    reopen = null;
    source = new EventSource(`/v1/live?${query}`);
    source.onopen = () => { state.textContent = strings.live_connected; };
    source.onmessage = (m) => show(JSON.parse(m.data));
    source.addEventListener("dropped", (m) => {
      notice.textContent = fill(strings.live_dropped, JSON.parse(m.data));
    });
    source.addEventListener("shutdown", () => { notice.textContent = strings.live_shutdown; });
    source.onerror = () => {
      state.textContent = strings.live_reconnecting;
      if (source.readyState === EventSource.CLOSED && reopen === null) {
        reopen = setTimeout(listen, REOPEN_MS);
      }
    };
  }

  // leaving the page gives its stream back at once (the server keeps a limited number open);
  // a page the browser brings back from its cache listens again
  window.addEventListener("pagehide", () => {
    clearTimeout(reopen);
    reopen = null;
    if (source) source.close();
  });
  window.addEventListener("pageshow", (e) => { if (e.persisted) listen(); });

  // --- the plots ------------------------------------------------------------------------------

  function svg(name, attrs, parent) {
    const el = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (parent) parent.appendChild(el);
    return el;
  }

  function plot(label) {
    const box = svg("svg", {viewBox: "0 0 320 130", role: "img", class: "plot"});
    svg("title", {}, box).textContent = label;
    svg("line", {x1: 30, y1: 110, x2: 318, y2: 110, class: "axis"}, box);
    return box;
  }

  function scaleText(box, top) {
    svg("text", {x: 26, y: 14, class: "scale", "text-anchor": "end"}, box).textContent = top;
    svg("text", {x: 26, y: 110, class: "scale", "text-anchor": "end"}, box).textContent = "0";
  }

  function legend(items) {
    const ul = document.createElement("ul");
    ul.className = "legend";
    for (const [kind, text] of items) {
      const li = document.createElement("li");
      const swatch = document.createElement("span");
      swatch.className = `swatch swatch-${kind}`;
      li.appendChild(swatch);
      li.appendChild(document.createTextNode(text));
      ul.appendChild(li);
    }
    return ul;
  }

  function countsPlot(data, totals) {
    const box = plot(fill(strings.live_counts_chart, {model: data.model, minutes, ...totals}));
    const n = data.minutes.length;
    const top = Math.max(1, ...data.minutes.map((m) => m.ok + m.ng + m.late + m.refused));
    const step = 288 / n;
    data.minutes.forEach((m, i) => {
      let y = 110;
      for (const [kind] of KINDS) {
        const h = (m[kind] / top) * 100;
        if (h > 0) {
          y -= h;
          svg("rect", {x: 30 + i * step + 2, y: y, width: step - 4, height: h,
                       class: `bar-${kind}`}, box);
        }
      }
    });
    scaleText(box, String(top));
    return box;
  }

  function latencyPlot(data, now) {
    const box = plot(fill(strings.live_latency_chart, {model: data.model, minutes,
                                                       takt: data.takt_ms, ...now}));
    const n = data.minutes.length;
    const values = data.minutes.flatMap((m) => [m.p50_ms, m.p99_ms]).filter((v) => v !== null);
    const top = Math.max(data.takt_ms * 1.25, ...values) || 1;
    const step = 288 / n;
    const y = (v) => 110 - (v / top) * 100;
    const ty = y(data.takt_ms);
    svg("line", {x1: 30, y1: ty, x2: 318, y2: ty, class: "takt"}, box);
    for (const [key, kind] of [["p50_ms", "p50"], ["p99_ms", "p99"]]) {
      const points = [];
      data.minutes.forEach((m, i) => {
        if (m[key] === null) return;
        const x = 30 + i * step + step / 2;
        points.push(`${x.toFixed(1)},${y(m[key]).toFixed(1)}`);
        svg("circle", {cx: x.toFixed(1), cy: y(m[key]).toFixed(1), r: 2.5,
                       class: `dot-${kind}`}, box);
      });
      if (points.length > 1) svg("polyline", {points: points.join(" "), class: `line-${kind}`},
                                 box);
    }
    scaleText(box, String(Math.round(top)));
    return box;
  }

  function draw(section, data) {
    const totals = {};
    for (const [kind] of KINDS) totals[kind] = data.minutes.reduce((a, m) => a + m[kind], 0);
    const last = data.minutes[data.minutes.length - 1];
    const ms = (v) => (v === null ? strings.live_no_latency : String(v));
    const now = {p50: ms(last.p50_ms), p99: ms(last.p99_ms), takt: data.takt_ms};
    section.querySelector("[data-part=totals]").textContent = fill(strings.live_totals, totals);
    section.querySelector("[data-part=latency-now]").textContent =
        fill(strings.live_latency_now, now);
    section.querySelector("[data-part=since]").textContent = data.since === null
        ? strings.live_not_kept : fill(strings.live_since, {time: when(data.since)});
    const counts = section.querySelector("[data-part=counts]");
    counts.replaceChildren(countsPlot(data, totals), legend(KINDS));
    const latency = section.querySelector("[data-part=latency]");
    latency.replaceChildren(latencyPlot(data, now),
                            legend([["p50", strings.live_p50], ["p99", strings.live_p99],
                                    ["takt", strings.live_takt]]));
  }

  async function summaries() {
    for (const section of document.querySelectorAll("[data-summary]")) {
      const query = new URLSearchParams({model: section.dataset.summary, minutes: minutes});
      try {
        const r = await fetch(`/v1/live/summary?${query}`, {
          headers: {"Accept": "application/json"}, credentials: "same-origin"});
        const body = await r.json();
        if (!r.ok) throw new Error(body.error || r.statusText);
        draw(section, body);
      } catch (e) {
        section.querySelector("[data-part=totals]").textContent =
            fill(strings.live_summary_error, {error: e.message});
      }
    }
  }

  listen();
  if (lastNg) readLastNg(false);
  summaries();
  setInterval(summaries, SUMMARY_EVERY_MS);
})();
