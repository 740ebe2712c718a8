"""FP8 checkpoints in the layouts users download (tests/fp8_checkpoints.py writes them from the
tiny full-precision models): compressed-tensors `float-quantized` (FP8_DYNAMIC, FP8 with
static input scales, FP8_BLOCK, weight-only) and the block-wise `quant_method: fp8`.

The engine keeps their FP8 weights byte for byte (in fused qkv / gate_up layers too, where
128-row blocks do not align to the parts), serves them, and computes what Hugging Face
transformers computes on the same weights dequantized: exactly (up to summation order) with
weight-only FP8, closely with W8A8. Malformed checkpoints fail at load naming the field or
tensor."""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

import fp8_checkpoints as fc
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.linear import Linear
from engine.scoring import teacher_forced_logits

E4M3 = torch.float8_e4m3fn
WRITERS = {
    "ct-channel-dynamic": lambda s, d: fc.write_compressed_tensors(s, d, "channel", "dynamic"),
    "ct-tensor-static": lambda s, d: fc.write_compressed_tensors(s, d, "tensor", "static"),
    "ct-block-group": lambda s, d: fc.write_compressed_tensors(s, d, "block", "dynamic"),
    "ct-channel-weight-only": lambda s, d: fc.write_compressed_tensors(s, d, "channel", None),
    "block-fp8": lambda s, d: fc.write_block_fp8(s, d),
}
CASES = [(w, a) for w in WRITERS if w != "block-fp8" for a in ("llama", "qwen2")]
CASES += [("block-fp8", a) for a in ("llama", "mistral", "qwen2", "qwen3", "gemma3")]
TOKENS = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def fp8_checkpoint(make_tiny_model, tmp_path_factory):
    """`get(writer, arch) -> (fp8 dir, dequantized reference dir)`, each written once."""
    root = tmp_path_factory.mktemp("fp8-checkpoints")

    @functools.cache
    def get(writer: str, arch: str) -> tuple[Path, Path]:
        fp8_dir = WRITERS[writer](make_tiny_model(arch), root / f"{arch}-{writer}")
        return fp8_dir, fc.write_dequantized(fp8_dir, root / f"{arch}-{writer}-dequantized")

    return get


@functools.cache
def _hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float()


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, **kw))


def _decoder_linears(engine: LLMEngine) -> dict[str, Linear]:
    layers = engine.model.model.layers
    return {n: m for n, m in layers.named_modules(prefix="model.layers") if isinstance(m, Linear)}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _row_scales(tensors: dict, part: str, block_rows: int) -> torch.Tensor:
    """The checkpoint scale of layer `part` per weight row: [N], or [N, K blocks] for
    block-wise scales (`block_rows` > 0)."""
    s = tensors.get(f"{part}.weight_scale", tensors.get(f"{part}.weight_scale_inv")).float()
    n = tensors[f"{part}.weight"].shape[0]
    if block_rows:
        return s.repeat_interleave(block_rows, dim=0)[:n]
    return s.reshape(1).expand(n) if s.numel() == 1 else s.reshape(n)


def _check_fused_bytes(engine: LLMEngine, fp8_dir: Path) -> None:
    """Every decoder projection holds the checkpoint's e4m3 bytes (fused layers: their parts'
    rows in order) and its scales per row, a ragged part's rows keeping their own block's
    scale; static input scales: the largest of the parts'."""
    tensors = fc.read_tensors(fp8_dir)
    block_rows = (fc._block_of(fc.read_config(fp8_dir)["quantization_config"]) or (0, 0))[0]
    packed = engine.model.packed_modules
    for name, mod in _decoder_linears(engine).items():
        fused = next((f for f in packed if name.endswith("." + f)), None)
        parts = [name.replace(fused, p) for p in packed[fused]] if fused else [name]
        want = torch.cat([tensors[f"{p}.weight"] for p in parts])
        assert mod.qweight.dtype == E4M3, name
        assert torch.equal(_bytes(mod.qweight), _bytes(want)), name
        scales = torch.cat([_row_scales(tensors, p, block_rows) for p in parts])
        assert torch.equal(mod.wscale, scales), name
        if f"{parts[0]}.input_scale" in tensors:
            scales = [tensors[f"{p}.input_scale"].float().reshape(()) for p in parts]
            assert mod.input_scale is not None
            assert float(mod.input_scale) == max(float(s) for s in scales), name


@pytest.mark.parametrize(("writer", "arch"), CASES)
def test_fp8_checkpoint_keeps_its_fp8_weights(fp8_checkpoint, writer, arch):
    fp8_dir, ref_dir = fp8_checkpoint(writer, arch)
    engine = _engine(fp8_dir)  # quantization auto: W8A8 on a device with FP8 GEMMs
    assert engine.quantization == "fp8"
    linears = _decoder_linears(engine)
    assert len(linears) == 4 * engine.model_config.num_layers
    for name, mod in linears.items():
        assert mod.scheme == "fp8" and mod.fp8_activations, name
        assert mod.weight is None and mod.qweight.dtype == E4M3, name
    assert not engine.model.lm_head.quantized
    _check_fused_bytes(engine, fp8_dir)
    got = teacher_forced_logits(engine, TOKENS)
    ref = _hf_logits(ref_dir)
    cos = float(F.cosine_similarity(got.flatten(), ref.flatten(), dim=0))
    assert cos > 0.99, cos


@pytest.mark.parametrize(("writer", "arch"), CASES)
def test_fp8_weight_only_equals_hf_on_the_dequantized_weights(fp8_checkpoint, writer, arch):
    fp8_dir, ref_dir = fp8_checkpoint(writer, arch)
    engine = _engine(fp8_dir, quantization="fp8-weight-only")
    assert engine.quantization == "fp8-weight-only"
    assert all(
        m.qweight.dtype == E4M3 and not m.fp8_activations for m in _decoder_linears(engine).values()
    )
    got = teacher_forced_logits(engine, TOKENS)
    torch.testing.assert_close(got, _hf_logits(ref_dir), rtol=0, atol=1e-4)


@pytest.mark.parametrize("writer", ["ct-channel-dynamic", "block-fp8"])
def test_fp8_checkpoints_serve(fp8_checkpoint, writer):
    fp8_dir, _ = fp8_checkpoint(writer, "llama")
    llm = LLM(str(fp8_dir), dtype="float32", num_kv_blocks=32)
    assert llm.engine.quantization == "fp8"
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate([TOKENS[:5], TOKENS[:23]], sp)
    assert [len(o.token_ids) for o in outs] == [16, 16]
    assert all(0 <= t < 1024 for o in outs for t in o.token_ids)


@pytest.mark.parametrize("writer", ["ct-channel-dynamic", "block-fp8"])
def test_decode_role_weight_only_keeps_the_fp8_weights(fp8_checkpoint, writer):
    fp8_dir, _ = fp8_checkpoint(writer, "qwen2")
    engine = _engine(fp8_dir, role="decode", quantization="weight-only")
    assert engine.quantization == "fp8-weight-only"
    _check_fused_bytes(engine, fp8_dir)
    assert all(not m.fp8_activations for m in _decoder_linears(engine).values())


# --- malformed checkpoints ---------------------------------------------------------------


@pytest.fixture
def broken(fp8_checkpoint, tmp_path):
    """`copy(writer) -> Path`: a private copy of a llama FP8 checkpoint to break."""

    def copy(writer: str) -> Path:
        src, _ = fp8_checkpoint(writer, "llama")
        return Path(shutil.copytree(src, tmp_path / writer))

    return copy


def _ct_group(cfg: dict) -> dict:
    return cfg["quantization_config"]["config_groups"]["group_0"]


MISSING = [
    ("ct-channel-dynamic", "model.layers.1.self_attn.q_proj.weight_scale"),
    ("block-fp8", "model.layers.0.mlp.up_proj.weight_scale_inv"),
    ("ct-tensor-static", "model.layers.1.mlp.down_proj.input_scale"),
]


@pytest.mark.parametrize(("writer", "tensor"), MISSING)
def test_missing_scale_tensor_is_named(broken, writer, tensor):
    path = fc.rewrite(broken(writer), drop=[tensor])
    with pytest.raises(ValueError, match=rf"lacks {re.escape(tensor)}\b"):
        _engine(path)  # W8A8: the static input scale is needed


def _set(*keys, value):
    def edit(cfg):
        target = cfg["quantization_config"]
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


GROUP = ("config_groups", "group_0")
UNSUPPORTED = {
    "weights-type-int": (
        "ct-channel-dynamic",
        _set(*GROUP, "weights", "type", value="int"),
        r"weights\.type: 'int'",
    ),
    "weights-4-bit": (
        "ct-channel-dynamic",
        _set(*GROUP, "weights", "num_bits", value=4),
        r"weights\.num_bits: 4",
    ),
    "weights-group": (
        "ct-channel-dynamic",
        _set(*GROUP, "weights", "strategy", value="group"),
        r"weights\.strategy: 'group'",
    ),
    "inputs-dynamic-tensor": (
        "ct-channel-dynamic",
        _set(*GROUP, "input_activations", "strategy", value="tensor"),
        r"input_activations\.strategy: 'tensor \(dynamic=True\)'",
    ),
    "inputs-group-size": (
        "ct-block-group",
        _set(*GROUP, "input_activations", "group_size", value=64),
        r"input_activations\.group_size: 64",
    ),
    "format": (
        "ct-channel-dynamic",
        _set(*GROUP, "format", value="pack-quantized"),
        r"group_0\.format: 'pack-quantized'",
    ),
    "quant-method-awq": ("block-fp8", _set("quant_method", value="awq"), r"quant_method: 'awq'"),
    "fmt-e5m2": ("block-fp8", _set("fmt", value="e5m2"), r"fmt: 'e5m2'"),
    "block-size-one-number": (
        "block-fp8",
        _set("weight_block_size", value=[128]),
        r"weight_block_size: \[128\]",
    ),
    "block-size-zero": (
        "block-fp8",
        _set("weight_block_size", value=[0, 128]),
        r"weight_block_size: \[0, 128\]",
    ),
    "ct-block-structure": (
        "ct-block-group",
        _set(*GROUP, "weights", "block_structure", value=[128, -1]),
        r"weights\.block_structure: \[128, -1\]",
    ),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_unsupported_quantization_config_names_the_field(broken, case):
    writer, edit, message = UNSUPPORTED[case]
    path = fc.rewrite(broken(writer), config=edit)
    with pytest.raises(ValueError, match=r"quantization_config\.\S*" + message):
        ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=message):
        _engine(path)


@pytest.mark.parametrize("writer", ["block-fp8", "ct-block-group"])
def test_scales_for_another_block_size_name_the_tensor_and_shape(broken, writer):
    def edit(cfg: dict) -> None:
        if writer == "block-fp8":
            cfg["quantization_config"]["weight_block_size"] = [64, 64]
        else:  # the block and the input groups agree, as a consistent config would
            _ct_group(cfg)["weights"]["block_structure"] = [64, 64]
            _ct_group(cfg)["input_activations"]["group_size"] = 64

    path = fc.rewrite(broken(writer), config=edit)
    tensors = fc.read_tensors(path)
    with pytest.raises(ValueError, match=r"checkpoint tensor \S+\.weight_scale(_inv)?: shape") as e:
        _engine(path)
    m = re.search(
        r"tensor (\S+)\.(weight_scale(?:_inv)?): shape (\[.*?\]), expected (\[.*?\])", str(e.value)
    )
    assert m, str(e.value)
    n, k = tensors[f"{m[1]}.weight"].shape
    assert m[3] == str(list(tensors[f"{m[1]}.{m[2]}"].shape))
    assert m[4] == str([-(-n // 64), -(-k // 64)])
    assert "64x64 blocks" in str(e.value)


@pytest.mark.parametrize("writer", ["ct-channel-dynamic", "block-fp8"])
def test_full_precision_weight_in_an_fp8_checkpoint_names_the_tensor(broken, writer):
    path = broken(writer)
    name = "model.layers.0.self_attn.k_proj.weight"
    w = fc.read_tensors(path)[name].float().to(torch.bfloat16)
    fc.rewrite(path, replace={name: w})
    with pytest.raises(
        ValueError, match=rf"{re.escape(name)}: dtype torch\.bfloat16, expected e4m3"
    ):
        _engine(path)


@pytest.mark.parametrize("method", ["int8", "none"])
def test_full_precision_quantization_of_an_fp8_checkpoint_is_refused(fp8_checkpoint, method):
    fp8_dir, _ = fp8_checkpoint("ct-channel-dynamic", "llama")
    with pytest.raises(ValueError, match=rf"'{method}'.*checkpoint is FP8.*fp8 or fp8-weight-only"):
        _engine(fp8_dir, quantization=method)


def test_compressed_tensors_config_is_what_llm_compressor_writes():
    """The writer's config against the published FP8_DYNAMIC / FP8_BLOCK layouts (the
    compressed-tensors package is not installed here: the shape is checked by hand)."""
    dyn = fc.compressed_tensors_config("channel", "dynamic")
    group = dyn["config_groups"]["group_0"]
    assert dyn["quant_method"] == "compressed-tensors" and dyn["format"] == "float-quantized"
    assert dyn["quantization_status"] == "compressed" and dyn["ignore"] == ["lm_head"]
    assert dyn["kv_cache_scheme"] is None and group["targets"] == ["Linear"]
    assert group["weights"] | {"observer": None} == {
        **fc._ARGS_DEFAULTS,
        "strategy": "channel",
        "observer": None,
    }
    inputs = group["input_activations"]
    assert (inputs["strategy"], inputs["dynamic"], inputs["type"], inputs["num_bits"]) == (
        "token",
        True,
        "float",
        8,
    )
    block = fc.compressed_tensors_config("block", "dynamic")["config_groups"]["group_0"]
    assert block["weights"]["block_structure"] == [128, 128]
    assert (block["input_activations"]["strategy"], block["input_activations"]["group_size"]) == (
        "group",
        128,
    )
    static = fc.compressed_tensors_config("tensor", "static")["config_groups"]["group_0"]
    assert (static["input_activations"]["strategy"], static["input_activations"]["dynamic"]) == (
        "tensor",
        False,
    )
    assert (
        fc.compressed_tensors_config("channel", None)["config_groups"]["group_0"][
            "input_activations"
        ]
        is None
    )


@pytest.mark.parametrize("writer", ["ct-tensor-static", "ct-channel-dynamic", "block-fp8"])
def test_writers_round_trip_to_the_original_weights(make_tiny_model, fp8_checkpoint, writer):
    """The helper itself: the dequantized reference is the original within half an e4m3 step
    (2**-4 relative for normal values, half the subnormal spacing below)."""
    _, ref_dir = fp8_checkpoint(writer, "qwen3")
    original, fp8 = fc.read_tensors(make_tiny_model("qwen3")), fc.read_tensors(ref_dir)
    assert set(original) == set(fp8)
    for name, w in original.items():
        if not fc.is_projection(name):
            assert torch.equal(fp8[name], w), name
            continue
        step = float(w.abs().max()) / 448 * 2**-10
        torch.testing.assert_close(fp8[name], w, rtol=2**-4, atol=step, msg=name)


@pytest.mark.parametrize(
    "args", [("channel", "dynamic"), ("tensor", "static"), ("block", "dynamic"), ("channel", None)]
)
def test_compressed_tensors_package_parses_the_config(args):
    """Cross-check with the compressed-tensors package (a test dependency: the library
    llm-compressor writes these configs with) that it reads our configs as we meant them."""
    import compressed_tensors.quantization as ct

    cfg = ct.QuantizationConfig.model_validate(fc.compressed_tensors_config(*args))
    scheme = cfg.config_groups["group_0"]
    assert cfg.format == "float-quantized" and scheme.weights.strategy == args[0]
    assert (scheme.input_activations is None) == (args[1] is None)


def test_layers_the_checkpoint_ignores_stay_full_precision(broken):
    """compressed-tensors `ignore` (a "re:" pattern here) keeps a decoder projection in full
    precision in the file; the engine loads it full and does not quantize it on its own."""
    path = broken("ct-channel-dynamic")
    layer = "model.layers.0.mlp.down_proj"
    tensors = fc.read_tensors(path)
    full = tensors[f"{layer}.weight"].float() * tensors[f"{layer}.weight_scale"].float()

    def ignore_layer(cfg: dict) -> None:
        cfg["quantization_config"]["ignore"].append(r"re:.*layers\.0\.mlp\.down_proj$")

    fc.rewrite(
        path,
        config=ignore_layer,
        drop=[f"{layer}.weight_scale"],
        replace={f"{layer}.weight": full},
    )
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16))
    assert engine.quantization == "fp8"
    down = engine.model.model.layers[0].mlp.down_proj
    assert not down.quantized and torch.equal(down.weight, full)
    other = engine.model.model.layers[1].mlp.down_proj
    assert other.scheme == "fp8" and other.qweight.dtype == torch.float8_e4m3fn
