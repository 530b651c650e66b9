"""Redis is data, not authority: what a registration must be for a reader to
use it (the integration test plants these in a real Redis)."""

from __future__ import annotations

import pytest

from services.discovery import InvalidRegistration, check_registration, registration_value

TOKEN = "registration-token"
MODEL = "SmolLM2-135M-Instruct"


def test_check_registration_refuses_what_does_not_check_out() -> None:
    layout = {"model_id": MODEL, "block_size": 16}
    good = registration_value(MODEL, "decode", "d0", "10.0.0.1:5000", layout, TOKEN)
    assert check_registration(good, MODEL, "decode", TOKEN, layout) == "10.0.0.1:5000"
    bad = {
        "unsigned": registration_value(MODEL, "decode", "d0", "10.0.0.1:5000", layout, None),
        "another token": registration_value(MODEL, "decode", "d0", "10.0.0.1:5000", layout, "other"),
        "another model": registration_value("other", "decode", "d0", "10.0.0.1:5000", layout, TOKEN),
        "another role": registration_value(MODEL, "prefill", "d0", "10.0.0.1:5000", layout, TOKEN),
        "another layout": registration_value(MODEL, "decode", "d0", "10.0.0.1:5000", {"block_size": 32},
                                             TOKEN),
        "not an address": registration_value(MODEL, "decode", "d0", "http://x/y", layout, TOKEN),
        "not UTF-8": b"\xff\xfe\x00",
        "not JSON": b"10.0.0.1:5000",  # the old plain-address form
        "not an object": b"[1, 2]",
    }
    for what, value in bad.items():
        with pytest.raises(InvalidRegistration):
            check_registration(value, MODEL, "decode", TOKEN, layout)
            pytest.fail(what)
    # without a cluster token only the MAC goes unchecked
    assert check_registration(bad["unsigned"], MODEL, "decode", None, layout) == "10.0.0.1:5000"
