#!/usr/bin/env bash
# `make gpu-wheels`: Keras and the pure-Python and small binary packages it needs beyond what
# JAX brings, as wheels for the GPU machine (CPython 3.12, manylinux x86_64), into an ignored
# folder that travels with the repository (at most 64 MiB may): benchmarks/gpu_check.py installs
# them into a temporary folder where Keras is not importable (that machine has JAX, its CUDA
# plugin, PyTorch with CUDA, numpy and pytest, and no Keras, no TensorFlow and no network).
# Keras under PyTorch needs no more than under JAX: its requirements are the same wheels (its
# torch backend imports torch, numpy and ml_dtypes, which is among them).
#
#   benchmarks/gpu_wheels.sh [DIR]    # DIR defaults to build/gpu_wheels/
#
# GPU_WHEELS_PYTHON_VERSION (default 3.12) picks the CPython the wheels are for. Needs the
# network (PyPI) and a Python with pip (PYTHON, default .venv/bin/python, else python3). Fails
# if a wheel's requirement is neither downloaded nor in PRESENT, or the folder is over LIMIT_MIB.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/build/gpu_wheels}"
version="${GPU_WHEELS_PYTHON_VERSION:-3.12}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
LIMIT_MIB=40
# Keras 3.15's requirements and theirs (rich: markdown-it-py, mdurl, pygments; optree:
# typing-extensions). Keras is pinned to the version the stack is tested with (pyproject.toml).
PACKAGES=(
    "keras==3.15.1"
    "absl-py" "namex" "h5py" "optree" "ml-dtypes" "packaging" "typing-extensions"
    "rich>=13.7,<16" "markdown-it-py" "mdurl" "pygments"
)
# What JAX brings on that machine (numpy's wheel alone is 16 MiB), so not downloaded.
PRESENT=("numpy")

abi="cp${version/./}"
echo "gpu_wheels: downloading Keras and its dependencies for CPython $version (manylinux x86_64) into $out ..."
rm -rf "$out"
mkdir -p "$out"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$version" --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    --dest "$out" "${PACKAGES[@]}"

# Every requirement of every wheel (markers evaluated for that Python on Linux) is downloaded
# or PRESENT; the folder fits the limit.
"$PYTHON" - "$out" "$version" "$LIMIT_MIB" "${PRESENT[@]}" <<'EOF'
import email.parser
import pathlib
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

folder, version, limit = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
present = {canonicalize_name(name) for name in sys.argv[4:]}
wheels = sorted(folder.glob("*.whl"))
names = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in wheels}
environment = {
    "python_version": version,
    "python_full_version": version + ".0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.parser.Parser().parsestr(archive.read(metadata).decode())
    for text in message.get_all("Requires-Dist") or []:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate(environment):
            continue
        name = canonicalize_name(requirement.name)
        if name in present:
            continue
        if name not in names:
            missing.append(f"{wheel.name} needs {text}")
        elif parse_wheel_filename(names[name].name)[1] not in requirement.specifier:
            missing.append(f"{wheel.name} needs {text}, got {names[name].name}")
if missing:
    sys.exit("gpu_wheels: FAILED: " + "; ".join(missing))
total = sum(w.stat().st_size for w in wheels) / 2**20
for wheel in wheels:
    print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
print(f"gpu_wheels: {len(wheels)} wheels, {total:.1f} MiB in {folder}")
if total > limit:
    sys.exit(f"gpu_wheels: FAILED: {total:.1f} MiB is over {limit:g} MiB")
EOF
