"""Build the folder that carries Ray (and what else pt-ray needs) to a GPU machine without Ray.

A GPU machine lent for a check has torch (CUDA), timm and transformers but no Ray, and accepts
at most 64 MiB of files beside the repository. Ray's wheel alone is about 80 MB; without the
parts a pt-ray run never imports (``ray/jars``, ``ray/rllib``, ``ray/serve``, the dashboard's
prebuilt web front end, byte code) it compresses with xz to about a third of that. This script,
run on any machine with pip and a route to PyPI, writes one folder holding:

- ``ray.tar.xz``: the pruned Ray package (with its ``dist-info``) for the target Python and
  platform;
- ``wheels/``: the small dependencies the GPU image lacks (jsonschema and its own, tensorboardX,
  pydantic), pinned to the versions installed here so that pydantic and pydantic-core match;
- ``install.sh``: unpacks both into a site folder given to it, offline;
- ``manifest.json``: versions, sizes (``bytes``: the folder without this file) and what was
  pruned.

It fails, naming the size, when the folder exceeds ``--limit-mb`` (60 by default, under the 64
MiB that travels). ``bench/gpu_check.sh --ray`` installs the folder into a temporary site
directory when Ray is not importable. For another Ray version: ``--ray-version 2.61.0`` (the
pruned paths are checked to exist, so a layout change fails here, not on the GPU machine).

    python bench/gpu_bundle.py --out bench/out/gpu_bundle            # Python 3.12, x86_64
    python bench/gpu_bundle.py --python-version 3.11 --out /tmp/b311
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

# Never imported by a pt-ray run; together about two thirds of the unpacked wheel.
PRUNED = ("ray/jars", "ray/rllib", "ray/serve", "ray/dashboard/client/build")
# What the GPU image lacks among Ray's and pt-ray's dependencies (the image has click, filelock,
# msgpack, protobuf, pyyaml, requests, aiohttp, pandas, pyarrow, fsspec, numpy and packaging).
MISSING = ("jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "attrs",
           "tensorboardX", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")
INSTALL_SH = """#!/usr/bin/env bash
# Unpack this bundle into a site folder, offline: bundle/install.sh SITE_DIR
# then: export PYTHONPATH=SITE_DIR:$PYTHONPATH
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
site=${1:?usage: install.sh SITE_DIR}
mkdir -p "$site"
tar -xJf "$here/ray.tar.xz" -C "$site"
for whl in "$here"/wheels/*.whl; do
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \\
    "$whl" "$site"
done
# Ray's console scripts are not needed: pt-ray starts an embedded cluster with ray.init.
echo "$site"
"""


def pip_download(spec: list[str], dest: Path, python_version: str, platform: str) -> None:
    """Binary wheels of ``spec`` for the target interpreter, without resolving dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--platform", platform,
           "--platform", "manylinux_2_17_x86_64" if "x86_64" in platform else platform,
           "--platform", "any", "-d", str(dest), *spec]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pip download {' '.join(spec)} failed: {done.stderr.strip()[-400:]}")


def local_pins(names: tuple[str, ...]) -> list[str]:
    """``name==version`` as installed here, so the carried pydantic matches its pydantic-core."""
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    return pins


def extract_with_modes(wheel: Path, root: Path) -> None:
    """Unzip ``wheel`` keeping each file's mode: ``zipfile`` drops it, and Ray's GCS server and
    raylet must stay executable."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = Path(archive.extract(info, root))
            mode = info.external_attr >> 16
            if mode and not info.is_dir():
                path.chmod(mode & 0o777)


def prune_and_pack(wheel: Path, dest: Path) -> dict[str, int]:
    """Unpack Ray's wheel, drop what a run never imports, write ``dest`` (tar, xz -9e)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        extract_with_modes(wheel, root)
        pruned = {}
        for rel in PRUNED:
            path = root / rel
            if not path.exists():
                raise SystemExit(f"{wheel.name} has no {rel}: Ray's layout changed; update PRUNED "
                                 f"in {Path(__file__).name}")
            pruned[rel] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path)
        for cache in list(root.rglob("__pycache__")):
            shutil.rmtree(cache, ignore_errors=True)
        with lzma.open(dest, "wb", preset=9 | lzma.PRESET_EXTREME) as raw, \
                tarfile.open(fileobj=raw, mode="w") as tar:
            for child in sorted(root.iterdir()):
                tar.add(child, arcname=child.name)
    return pruned


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build(out: Path, ray_version: str, python_version: str, platform: str, limit_mb: float) -> dict:
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading ray=={ray_version} for Python {python_version} ({platform})",
              flush=True)
        pip_download([f"ray=={ray_version}"], Path(tmp), python_version, platform)
        wheel = next(Path(tmp).glob("ray-*.whl"))
        print(f"pruning and compressing {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)",
              flush=True)
        pruned = prune_and_pack(wheel, out / "ray.tar.xz")
    print(f"downloading {len(MISSING)} small wheels", flush=True)
    pip_download(local_pins(MISSING), out / "wheels", python_version, platform)
    (out / "install.sh").write_text(INSTALL_SH)
    (out / "install.sh").chmod(0o755)
    size = folder_bytes(out)
    manifest = {"ray": ray_version, "python": python_version, "platform": platform,
                "bytes": size, "limit_bytes": int(limit_mb * 2**20),
                "ray_tar_xz_bytes": (out / "ray.tar.xz").stat().st_size,
                "wheels": sorted(p.name for p in (out / "wheels").glob("*.whl")),
                "pruned_bytes": pruned}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_bundle"))
    parser.add_argument("--ray-version", default=metadata.version("ray"),
                        help="Ray to carry (default: the one installed here)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--platform", default="manylinux2014_x86_64")
    parser.add_argument("--limit-mb", type=float, default=60.0,
                        help="fail when the folder is larger (MiB)")
    args = parser.parse_args(argv)
    manifest = build(args.out, args.ray_version, args.python_version, args.platform,
                     args.limit_mb)
    mib = manifest["bytes"] / 2**20
    print(f"{args.out}: {mib:.1f} MiB (ray.tar.xz {manifest['ray_tar_xz_bytes'] / 2**20:.1f} "
          f"MiB, {len(manifest['wheels'])} wheels), limit {args.limit_mb:g} MiB")
    if manifest["bytes"] > manifest["limit_bytes"]:
        print(f"error: the bundle is {mib:.1f} MiB, over --limit-mb {args.limit_mb:g}: prune more "
              f"of Ray (PRUNED in {Path(__file__).name}) or carry fewer wheels", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
