"""The error shape and limits of velocity_fast/http/errors.py and velocity_fast/server/limits.py."""

from __future__ import annotations

import orjson

from velocity_fast.http.errors import error_body
from velocity_fast.server.limits import ServerLimits


def test_error_body_has_the_one_shape_with_code_equal_to_the_status():
    err = orjson.loads(error_body(404, "The model `x` does not exist.", param="model"))["error"]
    assert err == {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}


def test_error_body_type_defaults_by_status_and_can_be_given():
    assert orjson.loads(error_body(413, "big"))["error"]["type"] == "RequestTooLargeError"
    assert orjson.loads(error_body(418, "teapot"))["error"]["type"] == "Error"
    assert orjson.loads(error_body(400, "m", type="invalid_request_error"))["error"]["type"] == "invalid_request_error"


def test_limits_keep_their_defaults_and_take_overrides():
    lim = ServerLimits(max_body_bytes=10, linger_timeout=0.5)
    assert (lim.max_body_bytes, lim.linger_timeout) == (10, 0.5)
    d = ServerLimits()
    assert d.max_body_bytes == 16 * 1024 * 1024 and d.max_header_bytes == 64 * 1024
    assert d.keepalive_timeout > d.header_timeout > 0 and d.linger_timeout > 0
