"""The operator console: HTML pages at ``/ui`` on the server's own port (docs/console.md).

A front end for people: it reads the engine through the same :class:`~visionserve.dataplane.
DataPlane` the HTTP and gRPC front ends call (so it works in a ``--frontends`` process too), and
the pages' buttons call the server's existing JSON routes (load, unload, recipe switch) from the
browser, under the same access rules as any other client. The pages are rendered on the server
(Jinja2 templates in ``templates/``); ``static/`` holds the style sheets and the plain scripts
(``console.js`` for every page's actions, ``verdict.js`` for the Models page's verdict form,
``live.css`` and ``live.js`` for the Line live page, which reads the live results,
:mod:`visionserve.http.live`), served from the package: nothing is fetched from the internet.

- :mod:`.strings`: every text the pages show, in one place;
- :mod:`.verdictform`: the Models page's form for a model's ``[verdict]``;
- :mod:`.system`: the System page's figures, read from the server's own Prometheus series;
- :mod:`.parts`: the NG parts pages' reads of the record store (``parts.css`` and ``parts.js``
  beside them; their pictures come from the records' image routes);
- :mod:`.pages`: the routes (``make_router``).
"""
