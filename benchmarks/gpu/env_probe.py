"""The machine and its measured ceilings: nvidia-smi, versions, device-to-device copy
bandwidth, bf16 and FP8 GEMM peaks. Every later ratio is against these numbers, measured on the
same card in the same run.

    python -m benchmarks.gpu.env_probe --device cuda --out DIR     # writes DIR/env.json
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess

import torch

from benchmarks.gpu.common import (
    copy_bandwidth,
    gemm_peak,
    log,
    section_args,
    write_json,
)


def nvidia_smi() -> str | None:
    try:
        query = "name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,power.limit"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        return out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("triton", "transformers", "nixl", "nixl-cu13", "pyzmq", "msgspec"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def ucx_cuda_libraries() -> dict:
    """What the loader cannot find for UCX's CUDA transports (an empty list: all found)."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("nixl_cu13") or importlib.util.find_spec("nixl_cu12")
    if spec is None or not spec.submodule_search_locations:
        return {"error": "no nixl_cu* package"}
    root = list(spec.submodule_search_locations)[0]
    out = {}
    for lib in glob.glob(f"{root}.libs/ucx/lib*cuda*.so*"):
        try:
            text = subprocess.run(["ldd", lib], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            text = f"ldd failed: {e} => not found"
        out[lib.rsplit("/", 1)[-1]] = [ln.strip() for ln in text.splitlines() if "not found" in ln]
    return out


def probe(device: torch.device, quick: bool) -> dict:
    info = {"device": str(device), "versions": versions(), "nvidia_smi": nvidia_smi()}
    info["ucx_cuda_missing"] = ucx_cuda_libraries()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info["gpu"] = {"name": p.name, "sms": p.multi_processor_count,
                       "memory_gib": round(p.total_memory / 2**30, 1),
                       "capability": list(torch.cuda.get_device_capability(device))}  # fmt: skip
    else:
        info["cpu"] = platform.processor() or platform.machine()
    n = 256 if quick else 8192
    info["copy"] = copy_bandwidth(device, (64 if quick else 2048) * 2**20)
    info["gemm_bf16"] = gemm_peak(device, n)
    try:
        info["gemm_fp8"] = gemm_peak(device, n, fp8=True)
    except (RuntimeError, NotImplementedError) as e:  # no FP8 GEMM on this device
        info["gemm_fp8"] = {"error": str(e)[:300]}
    log(f"copy {info['copy']['rw_gb_per_s']:.0f} GB/s (r+w), bf16 GEMM "
        f"{info['gemm_bf16']['tflops']:.0f} TFLOP/s")  # fmt: skip
    return info


def main(argv=None) -> None:
    args, device = section_args(__doc__, argv)
    write_json(args.out, "env.json", probe(device, args.quick))


if __name__ == "__main__":
    main()
