#!/usr/bin/env bash
# The PyTorch ops with CUDA tensors, on the GPU machine. Its PyTorch (with
# CUDA) has no questkv build of its own there (no nvcc, no liburing), so
# python/ops.cc is compiled there against it and linked with questkv's
# static libraries built here for sm_90; then tests/python/test_ops.py runs,
# whose DeviceTensors tests need the GPU. The extension uses torch's own CUDA
# runtime (QKV_CUDART=static: the static one packed here).
#   here:   bash bench/gpu/torch_ops.sh pack [build_dir] [libs.tar.xz]
#   device: bash bench/gpu/torch_ops.sh run [libs.tar.xz]
set -euo pipefail
cd "$(dirname "$0")/../.."
case ${1:-} in
  pack)
    build=${2:-build}
    out=${3:-.device/torch/libs.tar.xz}
    mkdir -p "$(dirname "$out")"
    libs=()
    for d in runtime prefetch selector kernels tiers topology core; do libs+=("$build"/$d/*.a); done
    uring=$(grep -m1 '^pkgcfg_lib_URING_uring' "$build/CMakeCache.txt" | cut -d= -f2)
    [ "${uring##*.}" = a ] || { echo "torch_ops: $build links liburing dynamically ($uring); configure it with liburing.a" >&2; exit 1; }
    cudart=$(grep -m1 '^QUESTKV_CUDART_STATIC' "$build/CMakeCache.txt" | cut -d= -f2)
    tmp=$(mktemp -d)
    cp "${libs[@]}" "$uring" "$cudart" "$tmp/"
    strip --strip-debug "$tmp"/*.a
    tar -cJf "$out" -C "$tmp" .
    rm -rf "$tmp"
    ls -la "$out" ;;
  run)
    tarball=${2:-.device/torch/libs.tar.xz}
    OUT=${OUT:-/tmp/questkv-gpu-out}
    work=$(mktemp -d)
    mkdir -p "$work/libs" "$work/pkg/questkv" "$OUT"
    tar -xJf "$tarball" -C "$work/libs"
    cp python/questkv/*.py "$work/pkg/questkv/"
    QKV_LIBS=$work/libs QKV_PKG=$work/pkg/questkv python3 - <<'EOF'
import glob, os, shutil
from torch.utils.cpp_extension import load
libs = os.environ["QKV_LIBS"]
order = ["runtime", "prefetch", "selector", "kernels_cuda", "kernels", "tiers", "topology", "core"]
archives = [f"{libs}/libquestkv_{n}.a" for n in order]
archives += [a for a in sorted(glob.glob(f"{libs}/*.a")) if a not in archives and "cudart" not in a]
# The CUDA runtime torch itself loads, not a second (static) one in the
# extension: one runtime in the process.
import torch
site = os.path.dirname(os.path.dirname(torch.__file__))
cudart = sorted(glob.glob(f"{site}/nvidia/**/libcudart.so*", recursive=True))
if cudart and os.environ.get("QKV_CUDART", "torch") == "torch":
    d = os.path.dirname(cudart[0])
    runtime = [f"-L{d}", f"-l:{os.path.basename(cudart[0])}", f"-Wl,-rpath,{d}"]
else:
    runtime = glob.glob(f"{libs}/*cudart*.a")
print("questkv ops: CUDA runtime", runtime, flush=True)
load(name="questkv_ops", sources=["python/ops.cc"], extra_include_paths=[os.getcwd(), os.getcwd() + "/include"],
     extra_cflags=["-std=c++20", "-O2"],
     extra_ldflags=["-Wl,--start-group", *archives, *runtime, "-Wl,--end-group", "-lhwloc", "-ldl", "-lrt",
                    "-lpthread"],
     is_python_module=False, build_directory=libs, verbose=False)
shutil.copy(f"{libs}/questkv_ops.so", os.environ["QKV_PKG"] + "/libquestkv_ops.so")
EOF
    PYTHONPATH=$work/pkg python3 -X faulthandler -m unittest -v tests/python/test_ops.py 2>&1 | tee "$OUT/torch-ops.log" | tail -25 ;;
  *) echo "usage: $0 pack [build_dir] [libs.tar.xz] | run [libs.tar.xz]" >&2; exit 2 ;;
esac
