"""Property-based fuzzing of the OpenAPI schema against the real server: no 5xx.

Drives schemathesis' per-operation hypothesis strategies directly (its pytest plugin
does not support the pytest version in use here).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = 20
# Generation length is not what is being fuzzed; keeping it short keeps the run fast.
_CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2}


def _cap(body: object) -> None:
    if not isinstance(body, dict):
        return
    for key, cap in _CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if "messages" in body and body.get("max_tokens") is None:
        body["max_tokens"] = 8


def test_fuzzed_requests_never_get_a_server_error(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                               "/tokenize", "/detokenize"}
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            _cap(case.body)
            response = case.call(base_url=server.url, headers=server.auth_headers, timeout=30)
            assert response.status_code < 500, (case.method, case.path, case.body,
                                                response.text)

        check()
