"""`tandem serve --decode-quantization int8`: the decode pool loads int8 weights, the prefill
pool keeps full ones, and disaggregated requests (prefill there, KV over NIXL, int8 decode
here) complete with exact lengths and give every KV block back."""

from __future__ import annotations

import re

import openai


def test_int8_decode_pool_serves_disaggregated_requests(start_serve, e2e_model):
    with start_serve(
        e2e_model,
        "--dtype",
        "float32",
        "--disagg-threshold",
        "0",
        "--decode-quantization",
        "int8",
    ) as server:
        weights = dict(
            re.findall(r"tandem:\s+(\S+)\s+\S+\s+requests .* weights (\S+)",
                       server.log_path.read_text())
        )
        assert weights == {"prefill-0": "float32", "decode-0": "int8"}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for n in (5, 17):
            raw = client.completions.with_raw_response.create(
                model=client.models.list().data[0].id,
                prompt="the quick brown fox jumps over the lazy dog " * 3,
                max_tokens=n,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            out = raw.parse()
            assert out.usage.completion_tokens == n
            assert raw.headers["X-Tandem-Path"] == "remote"  # prefilled on the prefill pool
            assert raw.headers["X-Tandem-Decode-Worker"] == "decode-0"
        server.wait_all_blocks_free()
