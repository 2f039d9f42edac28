// The console's script on every page: the buttons that change something. Each asks for confirmation in
// a dialog, then sends its request as JSON to the server's own route, with the CSRF token of
// the signed-in session where the server has sessions (GET /ui/session; without it no token
// is sent and the route's access rule decides). The server's answer is shown as it said it.
"use strict";

(function () {
  const strings = JSON.parse(document.getElementById("strings").textContent);
  const status = document.getElementById("status");
  const alert = document.getElementById("alert");
  const dialog = document.getElementById("confirm");
  const DONE_KEY = "visionserve-console-done";
  let csrf = null;  // null: not asked yet; "": the server has no sessions

  function fill(text, values) {
    return text.replace(/\{(\w+)\}/g, (all, name) => (name in values ? values[name] : all));
  }

  async function csrfToken() {
    if (csrf === null) {
      try {
        const r = await fetch("/ui/session", {headers: {"Accept": "application/json"},
                                              credentials: "same-origin"});
        csrf = r.ok ? ((await r.json()).csrf_token || "") : "";
      } catch (e) {
        csrf = "";
      }
    }
    return csrf;
  }

  // send body as JSON to url with the session's CSRF token, saying so in the status element;
  // the answer's JSON, or null after showing the server's refusal in the alert element
  async function send(statusEl, alertEl, method, url, body) {
    alertEl.textContent = "";
    statusEl.textContent = strings.working;
    const headers = {"Content-Type": "application/json", "Accept": "application/json"};
    const token = await csrfToken();
    if (token) headers["X-CSRF-Token"] = token;
    try {
      const r = await fetch(url, {method: method, headers: headers, body: JSON.stringify(body),
                                  credentials: "same-origin"});
      statusEl.textContent = "";
      if (r.ok) return await r.json();
      let error = r.statusText;
      try {
        error = (await r.json()).error || error;
      } catch (e) { /* not JSON: the status line says it */ }
      alertEl.textContent = fill(strings.refused, {error: error, status: r.status});
    } catch (e) {
      statusEl.textContent = "";
      alertEl.textContent = fill(strings.network_error, {error: e.message});
    }
    return null;
  }

  // for the pages' own scripts (loaded after this one): one place for these
  window.visionserveConsole = {fill, csrfToken, send};

  function confirmWith(text) {
    return new Promise((resolve) => {
      document.getElementById("confirm-text").textContent = text;
      const ok = document.getElementById("confirm-ok");
      const cancel = document.getElementById("confirm-cancel");
      function finish(answer) {
        ok.removeEventListener("click", yes);
        cancel.removeEventListener("click", no);
        dialog.removeEventListener("cancel", no);
        if (dialog.open) dialog.close();
        resolve(answer);
      }
      function yes() { finish(true); }
      function no() { finish(false); }
      ok.addEventListener("click", yes);
      cancel.addEventListener("click", no);
      dialog.addEventListener("cancel", no);  // Escape
      dialog.showModal();
    });
  }

  async function act(button) {
    const values = {};
    let body = {};
    if (button.dataset.recipeFrom) {
      values.recipe = document.getElementById(button.dataset.recipeFrom).value;
      body = {recipe: values.recipe};
    }
    if (!(await confirmWith(fill(button.dataset.confirm, values)))) {
      button.focus();
      return;
    }
    alert.textContent = "";
    status.textContent = strings.working;
    button.disabled = true;
    const headers = {"Content-Type": "application/json", "Accept": "application/json"};
    const token = await csrfToken();
    if (token) headers["X-CSRF-Token"] = token;
    try {
      const r = await fetch(button.dataset.url, {method: "POST", headers: headers,
                                                 body: JSON.stringify(body),
                                                 credentials: "same-origin"});
      if (r.ok) {
        // 202: kept, waiting for more (a promotion's first approval)
        const what = r.status === 202 && button.dataset.waiting ? button.dataset.waiting
          : button.dataset.done;
        sessionStorage.setItem(DONE_KEY, fill(strings.done, {what: fill(what, values)}));
        window.location.reload();
        return;
      }
      let error = r.statusText;
      try {
        error = (await r.json()).error || error;
      } catch (e) { /* not JSON: the status line says it */ }
      status.textContent = "";
      alert.textContent = fill(strings.refused, {error: error, status: r.status});
    } catch (e) {
      status.textContent = "";
      alert.textContent = fill(strings.network_error, {error: e.message});
    }
    button.disabled = false;
    button.focus();
  }

  const done = sessionStorage.getItem(DONE_KEY);
  if (done) {
    sessionStorage.removeItem(DONE_KEY);
    status.textContent = done;
  }
  for (const button of document.querySelectorAll("button[data-action]")) {
    button.addEventListener("click", () => act(button));
  }

  // signing out ends the session on the server (POST /ui/logout, a change: with the CSRF
  // token), then shows the sign-in form
  const signOut = document.getElementById("sign-out");
  if (signOut) {
    signOut.addEventListener("click", async () => {
      const headers = {"Accept": "application/json"};
      const token = await csrfToken();
      if (token) headers["X-CSRF-Token"] = token;
      try {
        const r = await fetch("/ui/logout", {method: "POST", headers: headers,
                                             credentials: "same-origin"});
        if (!r.ok) {
          let error = r.statusText;
          try { error = (await r.json()).error || error; } catch (e) { /* the status says it */ }
          alert.textContent = fill(strings.refused, {error: error, status: r.status});
          return;
        }
      } catch (e) {
        alert.textContent = fill(strings.network_error, {error: e.message});
        return;
      }
      window.location.assign("/ui/login");
    });
  }
})();
