// The label forms (templates/label_form.html): the Review page's send PUT
// /v1/records/{id}/label, a Part page's flags POST /v1/records/{id}/flag with
// "verdict_was_wrong" (console.js's send: the session's CSRF token where the server has
// sessions), with the label the form holds: a classifier's label, an anomaly model's good or
// defective, or a detector's boxes with the one typed in added ("Nothing to find": no boxes).
// The card then shows the label in force (a flagged answer: its frame, now kept); a refusal is
// shown as the server said it.
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
      form.querySelector("[name=label]").focus();
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
    const flag = form.dataset.flag === "true";
    if (flag) body.verdict_was_wrong = true;
    const buttons = form.querySelectorAll("button");
    for (const b of buttons) b.disabled = true;
    const answer = await send(form.querySelector("[data-review=status]"),
                              form.querySelector("[data-review=alert]"),
                              form.dataset.method || "PUT", form.dataset.url, body);
    for (const b of buttons) b.disabled = false;
    if (answer === null) return;
    const label = answer.labelled;
    const card = form.closest(".card");
    const current = card.querySelector("[data-review=current]");
    if (current) current.textContent = shown(label);
    card.dataset.labelled = "true";
    if (flag) showFrame(card);
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
      fill(flag ? strings.part_flagged : strings.review_saved, {id: answer.id, label: shown(label)});
  }

  // a Part page's answer whose frame the flag has just captured: its picture
  function showFrame(card) {
    const none = card.querySelector("[data-review=no-image]");
    if (!none) return;
    const figure = none.closest("figure");
    const link = Object.assign(document.createElement("a"), {href: figure.dataset.overlay});
    link.append(Object.assign(document.createElement("img"), {
      src: `${figure.dataset.overlay}?size=${figure.dataset.size}`, alt: figure.dataset.alt}));
    figure.replaceChildren(link);
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
