"""Schemathesis against the server's own OpenAPI document (``/openapi.json``) on a real server.

Every generated request (valid and invalid: bad headers, odd paths, random JSON bodies) must be
answered without an unexpected server error, with a status code and content type the document
lists for that route, and a body matching the documented schema. 503/504 are statuses this
server gives on purpose (not ready / overloaded, deadline missed) and are documented per route,
so they pass when the document lists them; a 500 never does.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="needs schemathesis (the test extra)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis import checks as st_checks  # noqa: E402

MAX_EXAMPLES = 8
# schemathesis' own pytest plugin (``from_fixture``) does not run on pytest 9, so the cases are
# drawn with plain hypothesis from each operation's strategy
CHECKS = [st_checks.status_code_conformance, st_checks.content_type_conformance,
          st_checks.response_schema_conformance, st_checks.response_headers_conformance]


def no_undocumented_server_error(ctx, response, case) -> bool | None:
    """A 500 is always a bug; another 5xx only passes when the route documents it."""
    status = response.status_code
    if status == 500:
        raise AssertionError(f"500 from {case.method} {case.formatted_path}: {response.text[:300]}")
    if status >= 500:
        documented = case.operation.definition.raw.get("responses", {})
        assert str(status) in documented, (
            f"{status} from {case.method} {case.formatted_path} is not in the document "
            f"(documented: {sorted(documented)}): {response.text[:300]}")
    return None


def _fuzz(operation, mode: GenerationMode, path_parameters: dict | None) -> str | None:
    query = None
    if path_parameters and "{model_version}" not in operation.path:
        # the unversioned routes also list a ``model_version`` query parameter (one handler serves
        # both route shapes); a random value there would only ever give 404
        query = {"model_version": ""}
    strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters, query=query)

    @given(case=strategy)
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        case.call_and_validate(checks=[no_undocumented_server_error, *CHECKS],
                               excluded_checks=[st_checks.not_a_server_error], timeout=30)

    try:
        run()
    except Unsatisfiable:  # nothing in this operation can be made invalid
        return None
    except Exception as exc:  # hypothesis re-raises the shrunk failure
        return f"{operation.method.upper()} {operation.path} ({mode.value}, {path_parameters}): {exc}"
    return None


@pytest.fixture(scope="module")
def docs_server(tiny_repo, tmp_path_factory):
    """The tiny model with its API pages on (--api-docs), on loopback."""
    from conftest import start_server

    s = start_server(tiny_repo, tmp_path_factory.mktemp("fuzz"), "--api-docs")
    yield s
    s.stop()


def test_api_conforms_to_its_openapi_document(docs_server):
    schema = schemathesis.openapi.from_url(docs_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    failures = []
    for operation in operations:
        if "text/event-stream" in operation.definition.raw["responses"].get("200", {}).get(
                "content", {}):
            continue  # a stream that never ends (the live results): tests/integration/test_live.py
        # with the served model's name the cases reach the route's logic; with generated names
        # they exercise the unknown-model paths
        names = [None, {"model_name": "tiny"}] if "{model_name}" in operation.path else [None]
        # invalid data (negative mode) only where there is a body and headers to get wrong: the
        # GET routes' only inputs are path segments, which the positive mode already varies
        modes = [GenerationMode.POSITIVE]
        if operation.method.upper() == "POST":
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            for path_parameters in names:
                failure = _fuzz(operation, mode, path_parameters)
                if failure:
                    failures.append(failure)
    assert not failures, "\n\n".join(failures)


def test_document_has_the_oip_routes(docs_server):
    import httpx

    doc = httpx.get(docs_server.url + "/openapi.json", timeout=10).json()
    paths = doc["paths"]
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/{model_name}",
                 "/v2/models/{model_name}/ready", "/v2/models/{model_name}/config",
                 "/v2/models/{model_name}/stats", "/v2/models/{model_name}/infer",
                 "/v2/models/{model_name}/versions/{model_version}/infer"):
        assert path in paths, path
    infer = paths["/v2/models/{model_name}/infer"]["post"]
    body = infer["requestBody"]["content"]
    assert "application/octet-stream" in body  # the binary tensor extension
    json_schema = body["application/json"]["schema"]
    assert "$ref" not in str(json_schema), "the infer body schema must resolve inside the document"
    assert set(json_schema["required"]) == {"inputs"}
    for status in ("200", "400", "404", "503", "504"):
        assert status in infer["responses"], status
