// The Models page's verdict forms: "Preview" sends the fields that differ from the rules in
// force to POST /v1/models/{m}/verdict/preview and shows which of the last frames would change
// verdict; "Save" is enabled once the values shown were previewed and PUTs the same body to
// /v1/models/{m}/verdict. Both carry the session's CSRF token where the server has sessions;
// the server's answer, or its refusal, is shown as it said it.
"use strict";

(function () {
  const source = document.getElementById("verdict-strings");
  if (!source) return;
  const strings = JSON.parse(source.textContent);
  const {fill, send: sendJson} = window.visionserveConsole;  // console.js, loaded first

  // one field's value as JSON, or throws Error with the message to show
  function valueOf(el) {
    const kind = el.dataset.kind;
    if (kind === "labels") {
      return Array.from(el.querySelectorAll("input[type=checkbox]:checked"), (c) => c.value);
    }
    const text = el.value.trim();
    if (text === "") return null;  // back to the default
    if (kind === "number" || kind === "integer") {
      const n = Number(text);
      return Number.isFinite(n) ? n : text;  // the server names a bad number
    }
    if (kind === "json") {
      try {
        return JSON.parse(text);
      } catch (e) {
        throw new Error(fill(strings.verdict_bad_json, {field: el.dataset.field, error: e.message}));
      }
    }
    return text;
  }

  // the fields whose value differs from the rules in force
  function changes(form) {
    const rules = JSON.parse(form.dataset.rules);
    const body = {};
    for (const el of form.querySelectorAll("[data-field]")) {
      const value = valueOf(el);
      if (JSON.stringify(value) !== JSON.stringify(rules[el.dataset.field])) {
        body[el.dataset.field] = value;
      }
    }
    return body;
  }

  function timeIn(zone, seconds) {
    const options = {timeZone: zone, year: "numeric", month: "2-digit", day: "2-digit",
                     hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23"};
    let format;
    try {
      format = new Intl.DateTimeFormat("en-CA", options);
    } catch (e) {  // a zone the browser lacks: its own
      delete options.timeZone;
      format = new Intl.DateTimeFormat("en-CA", options);
    }
    const p = {};
    for (const part of format.formatToParts(new Date(seconds * 1000))) p[part.type] = part.value;
    return `${p.year}-${p.month}-${p.day} ${p.hour}:${p.minute}:${p.second}`;
  }

  function cell(row, tag, text) {
    const c = document.createElement(tag);
    c.textContent = text;
    row.appendChild(c);
    return c;
  }

  function showPreview(form, answer) {
    const out = form.querySelector("[data-verdict=preview-answer]");
    out.replaceChildren();
    const said = document.createElement("p");
    said.className = "preview-count";
    said.textContent = fill(strings.verdict_previewed, answer);
    out.appendChild(said);
    if (answer.unavailable) {
      const why = document.createElement("p");
      why.className = "note";
      why.textContent = fill(strings.verdict_unavailable,
                             {count: answer.unavailable, why: answer.why || strings.none});
      out.appendChild(why);
    }
    if (!answer.frames_changed.length) return;
    const table = document.createElement("table");
    table.className = "preview-frames";
    cell(table.createCaption(), "span", strings.verdict_changes_caption);
    const head = table.createTHead().insertRow();
    for (const key of ["col_part", "col_request", "col_change", "col_time"]) {
      cell(head, "th", strings[key]).scope = "col";
    }
    const body = table.createTBody();
    for (const f of answer.frames_changed) {
      const row = body.insertRow();
      cell(row, "td", f.part_id || strings.none);
      cell(row, "td", f.request_id || strings.none);
      cell(row, "td", `${f.old} → ${f.new}`);
      cell(row, "td", timeIn(form.dataset.zone, f.timestamp));
    }
    out.appendChild(table);
  }

  // send body to the form's route; the answer's JSON, or null after showing the refusal
  function send(form, method, url, body) {
    return sendJson(form.querySelector("[data-verdict=status]"),
                    form.querySelector("[data-verdict=alert]"), method, url, body);
  }

  function setUp(form) {
    const save = form.querySelector("button[data-verdict=save]");
    const preview = form.querySelector("button[data-verdict=preview]");
    const status = form.querySelector("[data-verdict=status]");
    const alert = form.querySelector("[data-verdict=alert]");
    let previewed = null;  // the body last previewed, as JSON text

    function current() {
      try {
        return changes(form);
      } catch (e) {
        alert.textContent = e.message;
        return null;
      }
    }

    // a value changed since the preview: it must be previewed again
    form.addEventListener("input", () => {
      save.disabled = true;
      previewed = null;
    });

    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const body = current();
      if (body === null) return;
      if (!Object.keys(body).length) {
        alert.textContent = strings.verdict_no_change;
        return;
      }
      preview.disabled = true;
      const answer = await send(form, "POST", form.dataset.url + "/preview", body);
      preview.disabled = false;
      if (answer !== null) {
        showPreview(form, answer);
        previewed = JSON.stringify(body);
        save.disabled = false;
      }
      preview.focus();
    });

    save.addEventListener("click", async () => {
      const body = current();
      if (body === null || JSON.stringify(body) !== previewed) {
        save.disabled = true;
        return;
      }
      save.disabled = true;
      const answer = await send(form, "PUT", form.dataset.url, body);
      if (answer === null) {
        save.disabled = false;
        save.focus();
        return;
      }
      form.dataset.rules = JSON.stringify(answer.verdict);
      previewed = null;
      const rules = Object.entries(answer.verdict)
        .map(([k, v]) => `${k} = ${JSON.stringify(v)}`).join(", ");
      status.textContent = fill(strings.verdict_saved, {model: answer.model, rules: rules});
      const table = form.parentElement.querySelector("table.rules");
      if (table) {
        for (const row of table.tBodies[0].rows) {
          const key = row.cells[0].textContent;
          if (key in answer.verdict) {
            row.cells[1].querySelector("code").textContent = JSON.stringify(answer.verdict[key]);
          }
        }
      }
      preview.focus();
    });
  }

  for (const form of document.querySelectorAll("form.verdict-form")) setUp(form);
})();
