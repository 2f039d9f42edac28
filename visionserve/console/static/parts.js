// The NG parts pages: the gallery and a part's answers are rendered by the server, so their
// first data is on screen once the document is parsed; this marks that moment for the
// Performance API ("visionserve:first-data"), which the console's benchmark reads.
"use strict";

(function () {
  function firstData() {
    if (document.getElementById("gallery") || document.getElementById("answers")) {
      performance.mark("visionserve:first-data");
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", firstData);
  } else {
    firstData();
  }
})();
