"""CORS through the real router (aiohttp, real HTTP): a browser's preflight is answered before
the key check, every answer to an allowed origin (whole, streamed, an error) carries the allow
headers and exposes tandem's own, a listed origin is echoed with `Vary: Origin`, another origin
gets a 403 preflight and no allow header, and `--allowed-origins ''` turns it all off."""

from __future__ import annotations

import pytest
import requests

from router.config import RouterConfig
from router.cors import parse_origins

PAGE = "https://chat.example.com"
PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
BODY = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}


def test_any_origin_by_default_preflight_before_the_key(make_router):
    h = make_router(api_key="sekret")
    url = h.base_url + "/v1/completions"
    pre = requests.options(url, headers=PREFLIGHT, timeout=20)
    assert pre.status_code == 204
    assert pre.headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    auth = {"Origin": PAGE, "Authorization": "Bearer sekret"}
    whole = requests.post(url, json=BODY, headers=auth, timeout=20)
    assert whole.status_code == 200 and whole.headers["Access-Control-Allow-Origin"] == "*"
    assert "X-Request-Id" in whole.headers["Access-Control-Expose-Headers"]
    stream = requests.post(url, json=BODY | {"stream": True}, headers=auth, timeout=20)
    assert stream.status_code == 200 and stream.headers["Access-Control-Allow-Origin"] == "*"
    assert stream.text.rstrip().endswith("data: [DONE]")
    refused = requests.post(url, json=BODY, headers={"Origin": PAGE}, timeout=20)  # no key
    assert refused.status_code == 401 and refused.headers["Access-Control-Allow-Origin"] == "*"


def test_listed_origins_only(make_router):
    h = make_router(allowed_origins=f"{PAGE}, http://localhost:3000")
    url = h.base_url + "/v1/completions"
    ok = requests.post(url, json=BODY, headers={"Origin": PAGE}, timeout=20)
    assert ok.headers["Access-Control-Allow-Origin"] == PAGE
    assert "Origin" in ok.headers["Vary"]
    other = {"Origin": "https://evil.example"}
    answer = requests.post(url, json=BODY, headers=other, timeout=20)
    assert answer.status_code == 200 and "Access-Control-Allow-Origin" not in answer.headers
    pre = requests.options(url, headers=PREFLIGHT | other, timeout=20)
    assert pre.status_code == 403 and pre.json()["error"]["message"].startswith("origin")


def test_none_when_turned_off(make_router):
    h = make_router(allowed_origins="")
    url = h.base_url + "/v1/completions"
    assert requests.options(url, headers=PREFLIGHT, timeout=20).status_code == 405
    answer = requests.post(url, json=BODY, headers={"Origin": PAGE}, timeout=20)
    assert answer.status_code == 200 and "Access-Control-Allow-Origin" not in answer.headers


def test_an_origin_must_be_a_scheme_and_host():
    assert parse_origins(" https://a.example/ ,http://b:8080") == (
        "https://a.example",
        "http://b:8080",
    )
    with pytest.raises(ValueError, match="scheme://host"):
        RouterConfig(model_path="m", allowed_origins="a.example")
