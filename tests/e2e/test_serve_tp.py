"""`tandem serve --prefill-tp 2 --decode-tp 2` on CPU: 1 prefill worker and 1 decode worker,
each a tensor-parallel group of two ranks (its rank-0 actor in a Ray placement group, the
second rank a subprocess of it, each rank with its own NIXL agent over its own half of the KV
heads).

Long prompts are prefilled by the prefill group, and each decode rank READs its own KV head
from the prefill rank that holds it (the second decode rank on rank 0's order,
kv_transfer/tp_read.py); short ones stay on the decode worker. Every answer is transformers'
greedy fp32 text, the remote ones from transferred KV (0 recomputes, bytes read equal to the
prompts' blocks of every head), every block comes back and the server exits cleanly.

A decode rank SIGKILLed mid-stream is tests/kv_transfer/test_tp_decode.py's (a clear error
naming the rank, every lease released, the loop's `on_group_down` called once: the worker
actor then exits and Ray replaces the whole group as it replaces any dead worker; measured
through `tandem serve` at 13-45 s on the 2-core box when this test still did it, before the
suite's time budget moved it out).

(P1, D1) is what the rest of tests/e2e serves; (P1, D2), (P2, D1), (P4, D1) and (P1, D4) with
replicated KV heads, and FP8 KV at (P2, D1), are proved at the worker level
(tests/kv_transfer/test_tp_handoff.py, test_tp_decode.py) and through `tandem serve` by
benchmarks/tp_serve_matrix.py (too slow for this suite)."""

from __future__ import annotations

from pathlib import Path

import openai
from e2e_helpers import TransferCheck, hf_greedy_ids

THRESHOLD = 16
REMOTE = [list(range(3, 3 + n)) for n in (20, 37, 64)]
LOCAL = [[5, 9, 11, 2]]
MAX_TOKENS = 8


def _children(pid: int) -> list[str]:
    """Command lines of `pid`'s child processes (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            out.append(cmdline.decode(errors="replace"))
    return out


def test_a_tp2_prefill_worker_hands_its_kv_to_a_tp2_decode_worker(start_serve, e2e_model):
    flags = ("--dtype", "float32", "--prefill", "1", "--decode", "1", "--prefill-tp", "2",
             "--decode-tp", "2", "--disagg-threshold", str(THRESHOLD),
             "--routing", "affinity")  # fmt: skip
    with start_serve(e2e_model, *flags) as server:
        for pool in ("prefill", "decode"):  # each worker really is a group of two
            worker = next(w for w in server.pids() if w.startswith(pool))
            ranks = [c for c in _children(server.pids()[worker]) if "engine.distributed" in c]
            assert len(ranks) == 1, (pool, ranks)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        check = TransferCheck(server, e2e_model)
        got, paths = [], []
        for prompt in REMOTE + LOCAL:
            raw = client.completions.with_raw_response.create(
                model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            paths.append(raw.headers["X-Tandem-Path"])
            choice = raw.parse().choices[0]
            assert choice.finish_reason == "length"
            got.append(choice.text)
        assert paths == ["remote"] * len(REMOTE) + ["local"] * len(LOCAL)
        check.verify([len(p) for p in REMOTE])
        server.wait_all_blocks_free()
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(e2e_model)
        want = [tok.decode(hf_greedy_ids(e2e_model, p, MAX_TOKENS)) for p in REMOTE + LOCAL]
        assert got == want
