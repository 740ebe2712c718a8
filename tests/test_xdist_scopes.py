"""The units `make test` hands to its xdist workers (tests/xdist_scopes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist_scopes import LONGEST_FIRST, WHOLE_PACKAGES, longest_first, unit_of

REPO = Path(__file__).resolve().parents[1]


def test_a_unit_is_a_file_or_a_package_with_a_shared_server():
    assert unit_of("tests/engine/test_rope.py::test_x[llama-yarn]") == "tests/engine/test_rope.py"
    assert unit_of("tests/fuzz/test_http_fuzz.py::test_y") == "tests/fuzz/"
    assert unit_of("tests/interop/test_lm_eval.py::test_z") == "tests/interop/"


@pytest.mark.parametrize("package", WHOLE_PACKAGES)
def test_whole_packages_share_a_package_scoped_server(package):
    """A package is kept whole because its conftest shares one server across its modules; a
    package that no longer does so should be split into files again."""
    conftest = (REPO / package / "conftest.py").read_text()
    assert '@pytest.fixture(scope="package")' in conftest


def test_the_longest_units_exist_and_start_first():
    for unit in LONGEST_FIRST:
        assert (REPO / unit).exists(), f"{unit} is gone: update LONGEST_FIRST"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    short = ["tests/router/test_a.py", "tests/engine/test_b.py"]
    ordered = longest_first([*short, *reversed(LONGEST_FIRST)])
    assert ordered == [*LONGEST_FIRST, *short]
