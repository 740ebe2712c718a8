"""`tandem profile` end to end on the tiny llama: one command writes the JSON and both plots,
and the numbers it reports are real measurements (positive, prefill cost grows with length)."""

from __future__ import annotations

import json

import pytest

from bench.profile import ProfileConfig, profile_model
from cluster import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_profile_command_writes_json_and_both_plots(make_tiny_model, tmp_path, capsys):
    model = make_tiny_model("llama", "tiny", 0)
    out = tmp_path / "profile"
    rc = cli.main(
        [
            "profile",
            "--model",
            str(model),
            "--lengths",
            "16,128,512",
            "--max-position",
            "96",
            "--positions",
            "20,50,90",
            "--repeats",
            "3",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    for name in ("prefill_latency.png", "decode_latency.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    doc = json.loads((out / "profile.json").read_text())
    prefill = {p["prompt_len"]: p for p in doc["prefill"]}
    assert sorted(prefill) == [16, 128, 512]
    assert all(p["median_ms"] > 0 and len(p["samples_ms"]) == 3 for p in prefill.values())
    # 32x the tokens must cost more, however noisy a shared machine is.
    assert prefill[512]["median_ms"] > prefill[16]["median_ms"]
    assert [d["position"] for d in doc["decode"]] == [20, 50, 90]
    assert all(d["median_ms"] > 0 for d in doc["decode"])
    # One timed step per generated token after the first: prompt 16 grows to 96 tokens.
    raw = doc["decode_raw"]
    assert raw["first_position"] == 17 and len(raw["step_ms"]) == 96 - 17
    assert "prefill" in capsys.readouterr().out


def test_profile_rejects_lengths_beyond_the_context_window(make_tiny_model):
    model = make_tiny_model("llama", "tiny", 0)
    with pytest.raises(ValueError, match="context window"):
        profile_model(ProfileConfig(model=str(model), lengths=(4096,), max_position=32))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lengths": ()},
        {"lengths": (0, 16)},
        {"repeats": 0},
        {"positions": (0,)},
        {"max_position": 1},
    ],
)
def test_profile_config_validates(kwargs):
    with pytest.raises(ValueError):
        ProfileConfig(model="m", **kwargs)
