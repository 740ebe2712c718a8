"""Fetch the wheels the GPU machine lacks into `.whl/` (git-ignored; carried with the working
tree, 64 MiB in all), with nixl-cu13 cut down to what the UCX backend loads.

The GPU image has torch, triton, transformers, numpy and msgpack but not pyzmq, msgspec,
pydantic, nixl or gguf. nixl-cu13 is 59 MB, mostly the expert-parallel extension for three
torch versions, object-store and other plugins, and their libraries; tandem uses only the UCX
plugin. What stays is the closure (by ELF DT_NEEDED) of the Python bindings, the UCX plugin and
the UCX transport modules UCX dlopens (cuda, cuda_ipc lives in uct_cuda, cma, ib).

    python benchmarks/gpu/pack_wheels.py          # writes .whl/*.whl, prints the total size
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PLATFORM = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_26_x86_64",
]
PACKAGES = [  # pinned to what tandem is tested with here
    "nixl==1.5.1",
    "nixl-cu13==1.5.1",
    "pyzmq==27.3.0",
    "msgspec==0.22.0",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "typing-inspection==0.4.5",
    "annotated-types==0.8.0",
    "gguf==0.19.0",
    # The tests section in parallel (run.py): cold, its Triton compiles alone outran 200 s.
    "pytest-xdist==3.8.0",
    "execnet==2.1.2",
]
ROOTS = (
    r"nixl_cu13/[^/]*\.so$",
    r"libplugin_UCX\.so$",
    r"ucx/libuct_(cuda|cma|ib)\.so",
    r"ucx/libucm_cuda\.so",
)
BUDGET_MB = 64


def download(dest: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    for p in PLATFORM:
        cmd += ["--platform", p]
    subprocess.run(cmd + PACKAGES, check=True)


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def closure(root: Path) -> set[Path]:
    files = [p for p in root.rglob("*.so*") if p.is_file()]
    by_name: dict[str, list[Path]] = {}
    for p in files:
        by_name.setdefault(p.name, []).append(p)
    todo = [p for p in files if any(re.search(r, str(p)) for r in ROOTS)]
    keep: set[Path] = set()
    while todo:
        p = todo.pop()
        if p in keep:
            continue
        keep.add(p)
        for n in needed(p):
            todo += by_name.get(n, [])
    return keep


def strip_nixl(wheel: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
        keep = closure(root)
        for p in list(root.rglob("*")):
            in_libs = any(part.endswith(".libs") for part in p.parts)
            drop = p.is_file() and (
                (in_libs and ".so" in p.name and p not in keep)
                or p.suffix == ".la"
                or "nixl_cu13.scripts" in p.parts
                or "nixl_ep_cu13" in p.parts
            )
            if drop:
                p.unlink()
        write_wheel(root, wheel)


def write_wheel(root: Path, wheel: Path) -> None:
    """Re-zip with a RECORD that lists exactly what is left (pip checks it)."""
    record = next(root.glob("*.dist-info/RECORD"))
    rows = []
    files = sorted(p for p in root.rglob("*") if p.is_file() and p != record)
    for p in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(p.read_bytes()).digest()).rstrip(b"=")
        rows.append(f"{p.relative_to(root)},sha256={digest.decode()},{p.stat().st_size}")
    rows.append(f"{record.relative_to(root)},,")
    record.write_text("\n".join(rows) + "\n")
    wheel.unlink()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for p in files + [record]:
            z.write(p, p.relative_to(root))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=".whl")
    dest = Path(ap.parse_args().dest)
    dest.mkdir(exist_ok=True)
    download(dest)
    for w in dest.glob("nixl_cu13-*.whl"):
        strip_nixl(w)
    total = sum(w.stat().st_size for w in dest.glob("*.whl")) / 2**20
    print(
        f"{len(list(dest.glob('*.whl')))} wheels, {total:.1f} MiB (budget {BUDGET_MB} MiB "
        "with the working tree)"
    )


if __name__ == "__main__":
    main()
