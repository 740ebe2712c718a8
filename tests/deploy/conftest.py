"""Registers the deploy tests' fixtures. They live in deploy_helpers.py, a module name no other
test folder uses, so test files can import its helpers without clashing with another
folder's conftest."""

from deploy_helpers import (  # noqa: F401
    capacity_profile_file,
    helm,
    helm_bin,
    raycluster_schema,
    rendered,
)
