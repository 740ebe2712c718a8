"""The e2e fixtures (a real `tandem serve` subprocess, the tiny model), shared with tests/e2e."""

from e2e.conftest import e2e_model, start_serve  # noqa: F401 - the fixtures
