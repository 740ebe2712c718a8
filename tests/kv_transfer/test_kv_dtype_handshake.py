"""Pools may quantize their weights differently; their KV must match. The layout a transfer
handshake compares comes from the engine's KV settings alone: an fp8 (W8A8) prefill engine and
an int8 decode engine with the same `kv_dtype` advertise the same compatibility hash, while a
`kv_dtype` mismatch (FP8 KV on one side, model-dtype KV on the other) is refused at the
handshake, by the reader before it asks and by the sender when a Hello differs, and no byte
moves. The served hand-off between differently quantized pools with FP8 KV:
tests/e2e/test_serve_quantized.py."""

from __future__ import annotations

import pytest
from kvx_helpers import PeerProcess

from engine.kv_cache import KVCacheSpec
from engine.llm_engine import EngineConfig, LLMEngine
from kv_transfer.agent import KVTransferAgent
from kv_transfer.errors import HandshakeError, differing_fields


def _engine(model, role: str, quantization: str, kv_dtype: str) -> LLMEngine:
    # bfloat16: the model dtype of the peer process's cache (kvx_helpers / peer_proc.py).
    config = EngineConfig(
        model=str(model),
        dtype="bfloat16",
        num_kv_blocks=8,
        role=role,
        quantization=quantization,
        kv_dtype=kv_dtype,
    )
    return LLMEngine(config)


def _peer_kwargs(spec: KVCacheSpec) -> dict:
    """A peer process whose cache has `spec`'s layout."""
    names = ("model", "num_layers", "num_kv_heads", "head_dim", "block_size", "kv_dtype")
    return {n: getattr(spec, n) for n in names}


@pytest.fixture(scope="module")
def engines(make_tiny_model):
    model = make_tiny_model("llama")
    return {
        "prefill-fp8-kv": _engine(model, "prefill", "fp8", "fp8_e4m3"),
        "prefill-model-kv": _engine(model, "prefill", "fp8", "auto"),
        "decode-fp8-kv": _engine(model, "decode", "int8", "fp8_e4m3"),
    }


def test_weight_quantization_is_not_part_of_the_kv_layout(engines):
    p, d = engines["prefill-fp8-kv"], engines["decode-fp8-kv"]
    assert (p.quantization, d.quantization) == ("fp8", "int8")
    assert p.kv_spec.compat_fields() == d.kv_spec.compat_fields()
    assert p.kv_spec.compat_hash() == d.kv_spec.compat_hash()
    other = engines["prefill-model-kv"].kv_spec
    assert differing_fields(d.kv_spec.compat_fields(), other.compat_fields()) == ["kv_dtype"]
    assert other.compat_hash() != d.kv_spec.compat_hash()


def test_kv_dtype_mismatch_is_refused_at_the_handshake(engines):
    """The decode engine (int8 weights, FP8 KV) reads from a prefill peer whose KV is in the
    model dtype: refused locally from the peer's metadata, and by the peer itself when the
    metadata lies (stale registry), with no byte read or served."""
    sender = PeerProcess("snd-model-kv", 8, **_peer_kwargs(engines["prefill-model-kv"].kv_spec))
    receiver = KVTransferAgent("rcv-fp8-kv", engines["decode-fp8-kv"].cache)
    try:
        with pytest.raises(HandshakeError) as info:
            receiver.connect(sender.metadata)
        assert info.value.fields == ("kv_dtype",)
        assert "kv_dtype: fp8_e4m3 here, auto on peer" in str(info.value)
        md = dict(sender.metadata)
        md["compat_fields"] = receiver.metadata()["compat_fields"]
        md["compat_hash"] = receiver.metadata()["compat_hash"]
        with pytest.raises(HandshakeError) as info:
            receiver.connect(md)
        assert info.value.fields == ("kv_dtype",)
        assert "refused" in str(info.value)
        assert receiver.stats().bytes_read == 0
        assert sender.call("stats")["bytes_served"] == 0
    finally:
        receiver.close()
        sender.close()
