"""`tandem serve --mode colocated --tp 2` live on CPU: one replica that is a TP-2 group (its
rank-0 actor in a Ray placement group, the second rank a subprocess of it) answers a greedy
request with the text of the same model on one process, and exits cleanly.

Colocated, because the engine runs TP > 1 only without a KV hand-off today: `--prefill-tp 2`
is refused at start until the hand-off across TP sizes lands (issue 23, item 3; the refusal
is tested in test_serve_flags.py)."""

from __future__ import annotations

from pathlib import Path

from bench.live_server import LiveServer

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def _children(pid: int) -> list[str]:
    """Command lines of `pid`'s child processes (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            out.append(cmdline.decode(errors="replace"))
    return out


def test_a_colocated_tp2_replica_serves_what_one_process_computes(make_tiny_model, tmp_path):
    from engine.llm import LLM
    from engine.protocol import SamplingParams

    model = make_tiny_model("llama", "tiny", 0)
    flags = ("--mode", "colocated", "--replicas", "1", "--tp", "2", "--dtype", "float32")
    server = LiveServer(model, tmp_path / "serve", *flags).start()
    try:
        code, body = server.post(
            "/v1/completions",
            {"model": model.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        )
        assert code == 200, body
        # The replica really is a group: its second rank runs beside it.
        ranks = [c for c in _children(server.pids()["replica-0"]) if "engine.distributed" in c]
        assert len(ranks) == 1, ranks
    finally:
        rc = server.stop()
    assert rc == 0, server.log_text()[-3000:]
    assert server.leftovers() == []
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    want = LLM(str(model), dtype="float32").generate([PROMPT], sp)[0]
    assert body["usage"]["completion_tokens"] == len(want.token_ids) == 8
    assert body["choices"][0]["text"] == want.text
