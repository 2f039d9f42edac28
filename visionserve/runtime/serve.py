"""Start the HTTP (and gRPC) server on a model repository.

Every option is also an environment variable VISIONSERVE_<OPTION> (--http-port is
VISIONSERVE_HTTP_PORT; switches take true/false there); the command line wins. docs/settings.md
lists them with their variables and limits.

On SIGTERM/SIGINT readiness goes false, new requests get 503, queued ones finish within
--drain-timeout-s, then the process exits 0.

Exit codes: 0 clean shutdown, 2 bad settings or model repository, 3 a model failed to load.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from pathlib import Path

from pydantic import ValidationError

from ..config import SETTING_GROUPS, ServerSettings, grouped_setting_docs, unknown_variables
from ..errors import VisionServeError, describe_validation
from ..logs import configure_logging
from ..process import run_loop
from ..security import with_admin_token
from .assembly import assemble, serve
from .startup import hold

log = logging.getLogger("visionserve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per ServerSettings field, in the field's group, so the CLI, env and docs
    (docs/settings.md, from the same :func:`~visionserve.config.grouped_setting_docs`) never drift
    apart."""
    parser.usage = "%(prog)s [options]"  # the groups below list them; all at once is a page
    for title, docs in grouped_setting_docs():
        group = parser.add_argument_group(title, SETTING_GROUPS[title])
        for doc in docs:
            # argparse %-formats help texts: a literal "%" (as in "80% of it") must be doubled
            help_text = f"{doc.help} [default: {doc.default}]".replace("%", "%%")
            ann = ServerSettings.model_fields[doc.name].annotation
            if ann is bool:
                group.add_argument(doc.flags[0], dest=doc.name,
                                   action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
                continue
            if typing.get_origin(ann) is list:  # repeatable: each use adds one
                group.add_argument(doc.flags[0], dest=doc.name, action="append", default=None,
                                   help=help_text, metavar=doc.name.upper())
                continue
            group.add_argument(doc.flags[0], dest=doc.name, type=_scalar(ann),
                               choices=doc.choices or None, default=None, help=help_text,
                               metavar=None if doc.choices else doc.name.upper())


def _scalar(ann) -> type:
    for t in (int, float, Path):
        if ann is t or t in typing.get_args(ann):
            return str if t is Path else t
    return str


def settings_from(args: argparse.Namespace) -> ServerSettings:
    given = {k: getattr(args, k) for k in ServerSettings.model_fields
             if getattr(args, k, None) is not None}
    return ServerSettings(**given)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        # a refused --camera may hold a password: its value is not repeated
        secret = any(err["loc"][:1] == ("camera",) for err in exc.errors())
        for line in describe_validation(exc, flag=True, got=not secret):
            print(f"visionserve serve: {line}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_json)
    for warning in unknown_variables(os.environ):
        log.warning("%s", warning)
    try:
        settings = with_admin_token(settings)
        settings, engine, guard = assemble(settings)
    except VisionServeError as exc:
        if not settings.hold_on_error:
            print(f"visionserve serve: {exc.message}", file=sys.stderr)
            return 2
        print(f"visionserve serve: {exc.message} -- not serving; fix it, then restart "
              f"(hold_on_error: waiting for SIGTERM)", file=sys.stderr)
        return hold(2)
    code = run_loop(serve(engine, settings, guard))
    if code == 3 and settings.hold_on_error:   # start-up failed; the reason is logged
        log.error("not serving; fix it, then restart (hold_on_error: waiting for SIGTERM)")
        return hold(code)
    return code
