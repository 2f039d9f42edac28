// The Review page's label forms: each sends PUT /v1/records/{id}/label (console.js's send: the
// session's CSRF token where the server has sessions) with the label the form holds: a
// classifier's label, an anomaly model's good or defective, or a detector's boxes with the one
// typed in added ("Nothing to find": no boxes). The card then shows the label in force; a
// refusal is shown as the server said it.
"use strict";

(function () {
  const source = document.getElementById("review-strings");
  if (!source) return;
  const strings = JSON.parse(source.textContent);
  const {fill, send} = window.visionserveConsole;  // console.js, loaded first

  // the body the form holds, or null when a field is missing (the browser says which)
  function bodyOf(form, nothing) {
    const task = form.dataset.task;
    if (task === "detection") {
      if (nothing) return {boxes: []};
      for (const name of ["x1", "y1", "x2", "y2"]) {
        if (!form.elements[name].reportValidity()) return null;
      }
      const box = ["x1", "y1", "x2", "y2"].map((k) => Number(form.elements[k].value));
      const boxes = JSON.parse(form.dataset.boxes);
      return {boxes: boxes.concat([{label: form.elements.box_label.value, box: box}])};
    }
    const label = task === "anomaly"
      ? (form.querySelector("input[name=label]:checked") || {}).value
      : form.elements.label.value;
    if (!label) {
      form.querySelector("input[name=label]").focus();
      return null;
    }
    return {label: label};
  }

  function shown(label) {
    return "boxes" in label ? fill(strings.review_boxes_label, {n: label.boxes.length})
      : label.label;
  }

  async function submit(form, nothing) {
    const body = bodyOf(form, nothing);
    if (body === null) return;
    const buttons = form.querySelectorAll("button");
    for (const b of buttons) b.disabled = true;
    const answer = await send(form.querySelector("[data-review=status]"),
                              form.querySelector("[data-review=alert]"), "PUT",
                              form.dataset.url, body);
    for (const b of buttons) b.disabled = false;
    if (answer === null) return;
    const label = answer.labelled;
    const card = form.closest("li.card");
    card.querySelector("[data-review=current]").textContent = shown(label);
    card.dataset.labelled = "true";
    if ("boxes" in label) {
      form.dataset.boxes = JSON.stringify(label.boxes);
      const list = form.querySelector("[data-review=boxes]");
      list.replaceChildren(...(label.boxes.length ? label.boxes.map((b) => {
        const li = document.createElement("li");
        li.textContent = `${b.label} [${b.box.join(", ")}]`;
        return li;
      }) : [Object.assign(document.createElement("li"),
                          {textContent: strings.review_no_boxes_yet})]));
      for (const k of ["x1", "y1", "x2", "y2"]) form.elements[k].value = "";
    }
    form.querySelector("[data-review=status]").textContent =
      fill(strings.review_saved, {id: answer.id, label: shown(label)});
  }

  for (const form of document.querySelectorAll("form.review-form")) {
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      submit(form, false);
    });
    const nothing = form.querySelector("[data-review=nothing]");
    if (nothing) nothing.addEventListener("click", () => submit(form, true));
  }
})();
