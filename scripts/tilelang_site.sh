#!/usr/bin/env bash
# Packs TileLang 0.1.15 and its dependencies for a GPU machine without internet access into one xz tarball of a
# site-packages folder (docs/kernels.md §7): unpack it there, put the folder on PYTHONPATH and set CUDA_HOME
# (scripts/gpu_proof.sh does both from $TILELANG_SITE_TARBALL).
#
#   bash scripts/tilelang_site.sh OUT.tar.xz [PYTHON_VERSION]     # default 3.12 (the lent H200's Python)
#
# The wheels are unpacked before packing: they are zip files already and would not compress (81 MB against about
# 38 MB). z3-solver's .data folder (headers and a second copy of its library) is left out.
set -euo pipefail
out=$(realpath -m "${1:?usage: tilelang_site.sh OUT.tar.xz [PYTHON_VERSION]}")
py=${2:-3.12}
mkdir -p "$(dirname "$out")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/whl" \
    tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext z3-solver==4.15.4 cloudpickle psutil
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do
    python3 -m zipfile -e "$w" "$work/site"
done
rm -rf "$work"/site/*.data
XZ_OPT=${XZ_OPT:--9} tar -C "$work/site" -cJf "$out" .
ls -l "$out"
