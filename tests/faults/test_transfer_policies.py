"""KV hand-off faults under both `--on-transfer-failure` policies: injected NIXL READ errors,
the prefill worker killed during the READ, and a receiver that never reads. "recompute" turns
each into a correct answer (the decode worker prefills the prompt itself); "error" into a clear
error naming the request. Never wrong text, never a leaked block (the sender's leases expire
or are released; the receiver frees what it allocated)."""

from __future__ import annotations

import pytest
from fault_helpers import check, live_server, run

from bench import fault_cases as fc


@pytest.fixture(scope="module")
def error_server(fault_model, tmp_path_factory):
    faults = {"decode": {"step_delay_s": 0.01, "read_delay_s": 1.5, "fail_reads": 2}}
    flags = ("--lease-seconds", "4", "--on-transfer-failure", "error")
    with live_server(fault_model, tmp_path_factory.mktemp("err"), *flags, faults=faults) as s:
        yield s


def test_injected_read_errors_fail_clearly_under_error_policy(error_server):
    status, body = error_server.post(
        "/v1/completions", {"prompt": fc.PROMPTS[0], "max_tokens": 4, "temperature": 0}
    )
    assert status == 500 and "injected" in body["error"]["message"], body
    assert "cmpl-" in body["error"]["message"]  # the error names the request
    status, body = error_server.post(
        "/v1/completions", {"prompt": fc.PROMPTS[0], "max_tokens": 4, "temperature": 0}
    )
    assert status == 500, body
    tally = run(fc.plain_load(error_server, "injected READ errors (2)", "error", 4, 24))
    check(tally, correct=4, errors=0)  # the third READ on succeed


def test_prefill_killed_during_read_under_error_policy(error_server):
    tally = run(fc.kill_worker(error_server, "prefill-0", "error", 4, 40, after_s=0.7))
    check(tally, correct=0, errors=4)


@pytest.fixture(scope="module")
def never_read_server(fault_model, tmp_path_factory):
    faults = {"decode": {"never_read": True}}
    flags = ("--lease-seconds", "2", "--kv-read-timeout-s", "3")
    with live_server(fault_model, tmp_path_factory.mktemp("nr"), *flags, faults=faults) as s:
        yield s


def test_receiver_that_never_reads(never_read_server):
    """The decode worker accepts every hand-off and never reads it: the prefill worker's
    leases expire (its blocks come back), the decode worker's own deadline fails each READ,
    and it recomputes."""
    server = never_read_server
    tally = run(fc.plain_load(server, "receiver never reads", "recompute", 3, 12))
    check(tally, correct=3, errors=0)
    expired = sum(
        v
        for k, v in server.metrics().items()
        if k.startswith("tandem_kv_expired_leases") and 'role="prefill"' in k
    )
    assert expired >= 3
