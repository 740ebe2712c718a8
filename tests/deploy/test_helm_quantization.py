"""The chart's quantization values (model.quantized, model.prefillQuantization,
model.decodeQuantization) reach `tandem serve` as flags the real parser takes, and the settings
they build are the ones `tandem serve` would run with. In a file of its own: test_helm_chart.py
is past the 600-line limit."""

from __future__ import annotations

import json

import pytest
import yaml
from deploy_helpers import CHART, Helm, given_flags, head_serve_argv, parse_serve_args

from cluster.serve import ServeSettings, settings_from_args
from engine.quantization import QUANTIZATIONS


def _settings(helm: Helm, *sets: str) -> tuple[list[str], ServeSettings]:
    """(the head's `tandem serve` argv, the ServeSettings it builds) for `--set` values."""
    args = [a for s in sets for a in ("--set", s)]
    argv = head_serve_argv(helm.render(*args))
    return argv, settings_from_args(parse_serve_args(argv))


def _quantization(s: ServeSettings) -> tuple[str, str, str]:
    return s.prefill_quantization, s.decode_quantization, s.engine["kv_dtype"]


def test_values_and_schema_name_the_quantizations_tandem_takes() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["model"]
    assert (values["quantized"], values["prefillQuantization"], values["decodeQuantization"]) == (
        False,
        "auto",
        "auto",
    )
    schema = json.loads((CHART / "values.schema.json").read_text())
    model = schema["properties"]["model"]["properties"]
    assert model["quantized"] == {"type": "boolean"}
    for key in ("prefillQuantization", "decodeQuantization"):
        ref = model[key]["$ref"].rsplit("/", 1)[-1]
        assert tuple(schema["definitions"][ref]["enum"]) == QUANTIZATIONS, key


def test_defaults_keep_the_checkpoints_weights(helm: Helm) -> None:
    argv, s = _settings(helm)
    assert "--quantized" not in given_flags(argv)
    assert {"--prefill-quantization", "--decode-quantization"} <= given_flags(argv)
    assert (s.quantized, _quantization(s)) == (False, ("auto", "auto", "auto"))


def test_quantized_renders_the_switch_and_the_quantized_profile(helm: Helm) -> None:
    argv, s = _settings(helm, "model.quantized=true")
    assert "--quantized" in given_flags(argv)
    assert s.quantized and _quantization(s) == ("fp8", "weight-only", "fp8_e4m3")


@pytest.mark.parametrize(
    ("sets", "want"),
    [
        (
            ["model.prefillQuantization=fp8", "model.decodeQuantization=int8"],
            ("fp8", "int8", "auto"),
        ),
        (["model.decodeQuantization=fp8-weight-only"], ("auto", "fp8-weight-only", "auto")),
        # A pool set explicitly wins over model.quantized; the rest follow the switch.
        (["model.quantized=true", "model.decodeQuantization=int8"], ("fp8", "int8", "fp8_e4m3")),
        (
            ["model.quantized=true", "model.prefillQuantization=none", "model.kvDtype=fp8_e4m3"],
            ("none", "weight-only", "fp8_e4m3"),
        ),
    ],
    ids=["per-pool", "decode-only", "quantized-decode-int8", "quantized-prefill-none"],
)
def test_per_pool_values_render(helm: Helm, sets: list[str], want: tuple[str, str, str]) -> None:
    _, s = _settings(helm, *sets)
    assert _quantization(s) == want


_ONE_OF = "value must be one of " + ", ".join(f"'{q}'" for q in QUANTIZATIONS)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("model.prefillQuantization=int4", f"at '/model/prefillQuantization': {_ONE_OF}"),
        ("model.decodeQuantization=bogus", f"at '/model/decodeQuantization': {_ONE_OF}"),
        ("model.quantized=maybe", "at '/model/quantized': got string, want boolean"),
    ],
)
def test_schema_rejects_an_unknown_quantization(helm: Helm, value: str, message: str) -> None:
    proc = helm.template("--set", value)
    assert proc.returncode != 0, f"helm template --set {value} rendered"
    assert message in proc.stderr, proc.stderr
