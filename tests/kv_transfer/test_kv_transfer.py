"""Real NIXL transfers between two OS processes: byte-exact blocks, FP8 with scales, and
handshake refusal. The sender is a peer process; the receiver is this test process."""

from __future__ import annotations

import hashlib
import itertools
import time

import pytest
import torch
from kvx_helpers import LocalWorker, PeerProcess, spec

from engine.kv_cache import KVCache
from kv_transfer.errors import HandshakeError, TransferError
from kv_transfer.messages import ReadDone

NUM_BLOCKS = 2100  # room for 1000 non-contiguous blocks on each side


def local_hashes(cache: KVCache, blocks: list[int]) -> list[str]:
    out = []
    for b in blocks:
        h = hashlib.sha256(cache.data[b].contiguous().view(torch.uint8).numpy().tobytes())
        if cache.scales is not None:
            h.update(cache.scales[b].contiguous().view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return out


@pytest.fixture(scope="module", params=["auto", "fp8_e4m3"])
def pair(request):
    kv_dtype = request.param
    sender = PeerProcess(f"snd-{kv_dtype}", NUM_BLOCKS, kv_dtype=kv_dtype)
    receiver = LocalWorker(f"rcv-{kv_dtype}", NUM_BLOCKS, kv_dtype=kv_dtype)
    try:
        assert sender.call("fill", seed=7)["ok"]
        receiver.agent.connect(sender.metadata)
        yield kv_dtype, sender, receiver
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_blocks_arrive_byte_exact(pair, n):
    kv_dtype, sender, receiver = pair
    baseline = sender.call("free_count")["free"]
    served = sender.call("stats")
    remote = sender.call("alloc", n=n)["blocks"]
    local = receiver.alloc(n)
    assert n == 1 or (
        remote != sorted(remote) or any(b - a != 1 for a, b in itertools.pairwise(remote))
    )
    rid = f"req-{kv_dtype}-{n}"
    deadline = sender.call("hold", rid=rid, blocks=remote, peer=receiver.agent.name)["deadline"]
    receiver.agent.start_read(rid, sender.name, remote, local, deadline)
    ev = receiver.wait_for(rid, timeout=30)
    assert isinstance(ev, ReadDone), ev
    assert list(ev.local_block_ids) == local
    # ReadDone says when the sender's lease confirmation came, and it came (a read is DONE
    # only after both); the GPU run splits a READ's wall clock with it.
    assert 0 < ev.confirmed_s < 30 and 0 < ev.seconds < 30
    assert local_hashes(receiver.cache, local) == sender.call("hashes", blocks=remote)["hashes"]
    # The sender got the NIXL notification and released exactly those blocks.
    (rel,) = sender.wait_events(1, timeout=10)
    assert rel == {"kind": "released", "rid": rid, "blocks": remote, "reason": "read_done"}
    assert sender.call("free_count")["free"] == baseline
    # The sender accounts what it served: the bytes the receiver read, and the reading time.
    after = sender.call("stats")
    assert after["bytes_served"] - served["bytes_served"] == ev.num_bytes
    assert after["serve_seconds"] > served["serve_seconds"]
    receiver.free.extend(local)


def test_fp8_halves_the_wire_bytes_and_scales_travel(pair):
    kv_dtype, sender, receiver = pair
    s = spec(kv_dtype=kv_dtype)
    per_block = KVCache.bytes_per_block(s)
    bf16 = KVCache.bytes_per_block(spec())
    if kv_dtype == "fp8_e4m3":
        # Data halves; one float32 scale per (token, head) rides along: +4 bytes per head_dim.
        assert per_block == bf16 // 2 + bf16 * 2 // s.head_dim
        assert per_block < 0.55 * bf16
    before = receiver.agent.stats().bytes_read
    # Real engine writes: FP8 quantization with per-token scales, then the attention's read
    # path (gather, dequantize) on the receiver must equal the sender's.
    remote = sender.call("alloc", n=3)["blocks"]
    slots = [b * s.block_size + o for b in remote for o in range(s.block_size)]
    assert sender.call("write_kv", slots=slots, seed=3)["ok"]
    local = receiver.alloc(3)
    deadline = sender.call("hold", rid=f"w-{kv_dtype}", blocks=remote, peer=receiver.agent.name)[
        "deadline"
    ]
    receiver.agent.start_read(f"w-{kv_dtype}", sender.name, remote, local, deadline)
    assert isinstance(receiver.wait_for(f"w-{kv_dtype}", timeout=20), ReadDone)
    assert receiver.agent.stats().bytes_read - before == 3 * per_block
    h = hashlib.sha256()
    table = torch.tensor(local, dtype=torch.int64)
    for layer in range(s.num_layers):
        k, v = receiver.cache.gather(layer, table, torch.float32)
        h.update(k.numpy().tobytes())
        h.update(v.numpy().tobytes())
    assert h.hexdigest() == sender.call("gather_hash", blocks=remote)["hash"]
    if kv_dtype == "fp8_e4m3":
        assert receiver.cache.scales[local].ne(1.0).all()  # real scales arrived, not defaults
    sender.wait_events(1, timeout=10)
    receiver.free.extend(local)


def test_connect_is_idempotent(pair):
    _, sender, receiver = pair
    before = receiver.agent.stats().handshakes
    t = time.monotonic()
    receiver.agent.connect(sender.metadata)
    assert time.monotonic() - t < 0.05
    assert receiver.agent.stats().handshakes == before


@pytest.fixture(scope="module")
def sender16():
    sender = PeerProcess("snd-b16", 64)
    yield sender
    sender.close()


def test_mismatched_block_size_is_refused_locally(sender16):
    receiver = LocalWorker("rcv-b32", 64, block_size=32)
    try:
        with pytest.raises(HandshakeError) as info:
            receiver.agent.connect(sender16.metadata)
        assert info.value.fields == ("block_size",)
        assert "block_size: 32 here, 16 on peer" in str(info.value)
        with pytest.raises(TransferError, match="not connected"):
            receiver.agent.start_read("r", sender16.name, [0], [0], time.time() + 5)
        assert receiver.agent.stats().bytes_read == 0
    finally:
        receiver.close()


def test_sender_refuses_a_hello_that_differs(sender16):
    """Registry metadata can be stale or wrong; the sender checks the Hello itself."""
    receiver = LocalWorker("rcv-b32-liar", 64, block_size=32, num_layers=3)
    try:
        md = dict(sender16.metadata)
        md["compat_fields"] = receiver.agent.metadata()["compat_fields"]
        md["compat_hash"] = receiver.agent.metadata()["compat_hash"]
        with pytest.raises(HandshakeError) as info:
            receiver.agent.connect(md)
        assert info.value.fields == ("block_size", "num_layers")
        assert "refused" in str(info.value) and "block_size" in str(info.value)
        assert receiver.agent.stats().bytes_read == 0
        assert sender16.call("stats")["bytes_served"] == 0
    finally:
        receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_vram_blocks_arrive_byte_exact(kv_dtype):
    """The same pull between two processes with both caches in GPU memory (VRAM)."""
    sender = PeerProcess(f"gpu-snd-{kv_dtype}", 512, kv_dtype=kv_dtype, device="cuda")
    receiver = LocalWorker(f"gpu-rcv-{kv_dtype}", 512, kv_dtype=kv_dtype, device="cuda")
    try:
        assert receiver.agent.metadata()["mem_type"] == "VRAM"
        sender.call("fill", seed=11)
        receiver.agent.connect(sender.metadata)
        remote = sender.call("alloc", n=200)["blocks"]
        local = receiver.alloc(200)
        dl = sender.call("hold", rid="g", blocks=remote, peer=receiver.agent.name)["deadline"]
        receiver.agent.start_read("g", sender.name, remote, local, dl)
        assert isinstance(receiver.wait_for("g", timeout=30), ReadDone)
        torch.cuda.synchronize()
        got = []
        for b in local:
            h = hashlib.sha256(receiver.cache.data[b].cpu().view(torch.uint8).numpy().tobytes())
            if receiver.cache.scales is not None:
                h.update(receiver.cache.scales[b].cpu().view(torch.uint8).numpy().tobytes())
            got.append(h.hexdigest())
        assert got == sender.call("hashes", blocks=remote)["hashes"]
    finally:
        receiver.close()
        sender.close()
