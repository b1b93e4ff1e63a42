#!/usr/bin/env bash
# The PyTorch ops with CUDA tensors, on the GPU machine. Its PyTorch (with
# CUDA) has no questkv build of its own there (no nvcc, no liburing), so
# python/ops.cc is compiled there against it and linked with questkv's
# static libraries built here for sm_90; then tests/python/test_ops.py runs,
# whose DeviceTensors tests need the GPU. The extension uses torch's own CUDA
# runtime (QKV_CUDART=static: the static one packed here).
# `tinylm` builds the same package, then decodes the trained model of
# shared/models/tinylm (copied to MODEL_DIR) on the GPU with the CUDA backend
# and on the CPU backend, over the same held-out headers (the machine's
# /usr/include), and writes both tables to $OUT.
#   here:   bash bench/gpu/torch_ops.sh pack [build_dir] [libs.tar.xz]
#           cp -r ../shared/models/tinylm .device/tinylm
#   device: bash bench/gpu/torch_ops.sh run [libs.tar.xz]
#           bash bench/gpu/torch_ops.sh tinylm [libs.tar.xz] [model_dir] [eval flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
# Builds the extension against this machine's PyTorch into $work/pkg/questkv.
build_pkg() {
  local tarball=$1
  OUT=${OUT:-/tmp/questkv-gpu-out}
  work=$(mktemp -d)
  mkdir -p "$work/libs" "$work/pkg/questkv" "$OUT"
  tar -xJf "$tarball" -C "$work/libs"
  cp python/questkv/*.py "$work/pkg/questkv/"
  # The system g++: a toolchain that links its own static libstdc++ into the
  # extension (the GPU machine's /opt/gcc does) gives it a second C++
  # runtime beside torch's, and the first stream it formats crashes.
  [ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++
  QKV_LIBS=$work/libs QKV_PKG=$work/pkg/questkv python3 - <<'EOF' || exit 1
import glob, os, shutil, sys
import torch
from torch.utils.cpp_extension import load
libs = os.environ["QKV_LIBS"]
packed = open(f"{libs}/cxx11_abi").read().strip() if os.path.exists(f"{libs}/cxx11_abi") else "?"
print(f"questkv ops: torch {torch.__version__}, C++11 ABI torch {int(torch.compiled_with_cxx11_abi())}, "
      f"libraries {packed}", flush=True)
if packed in ("0", "1") and int(packed) != int(torch.compiled_with_cxx11_abi()):
    sys.exit("questkv ops: the libraries' C++ ABI differs from torch's: pack a build configured with "
             f"CMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}")
order = ["runtime", "prefetch", "selector", "kernels_cuda", "kernels", "tiers", "topology", "core"]
archives = [f"{libs}/libquestkv_{n}.a" for n in order]
archives += [a for a in sorted(glob.glob(f"{libs}/*.a")) if a not in archives and "cudart" not in a]
# The CUDA runtime torch itself loads, not a second (static) one in the
# extension: one runtime in the process.
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
     is_python_module=False, build_directory=libs, verbose=os.environ.get("QKV_VERBOSE") == "1")
import subprocess
needed = subprocess.run(["readelf", "-d", f"{libs}/questkv_ops.so"], capture_output=True, text=True).stdout
if "libstdc++.so" not in needed:
    sys.exit("questkv ops: the extension does not load libstdc++.so (a static C++ runtime of its own): "
             "build it with a compiler that links the shared one (CXX)")
shutil.copy(f"{libs}/questkv_ops.so", os.environ["QKV_PKG"] + "/libquestkv_ops.so")
EOF
}
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
    # The libraries' C++ ABI (std::string, std::list): the extension must be
    # compiled with the same (torch.compiled_with_cxx11_abi()). grep reads all
    # of nm's output: with -q it would stop early, and pipefail would count
    # nm's broken pipe as no match.
    if nm "$tmp/libquestkv_core.a" 2>/dev/null | grep __cxx11 >/dev/null; then echo 1 >"$tmp/cxx11_abi"; else echo 0 >"$tmp/cxx11_abi"; fi
    tar -cJf "$out" -C "$tmp" .
    rm -rf "$tmp"
    ls -la "$out" ;;
  run)
    build_pkg "${2:-.device/torch/libs.tar.xz}"
    # The CPU-backend tests first: a crash in the CUDA ones then says which.
    tests="tests.python.test_ops.EngineOwnedOps tests.python.test_ops.OwnedCache tests.python.test_ops.DeviceTensors tests.python.test_ops.EngineOwnedOpsOnCuda"
    status=0
    PYTHONPATH=$work/pkg python3 -X faulthandler -m unittest -v $tests >"$OUT/torch-ops.log" 2>&1 || status=$?
    tail -25 "$OUT/torch-ops.log"
    if [ $status -gt 128 ]; then
      # Killed by a signal: the same tests again with a handler preloaded
      # that prints the native frames of the fault.
      cat >"$work/backtrace.c" <<'C'
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>
static void on_fault(int sig) {
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
__attribute__((constructor)) static void install(void) {
  signal(SIGSEGV, on_fault);
  signal(SIGABRT, on_fault);
  signal(SIGBUS, on_fault);
}
C
      cc -shared -fPIC -O1 -o "$work/backtrace.so" "$work/backtrace.c"
      PYTHONPATH=$work/pkg LD_PRELOAD=$work/backtrace.so python3 -m unittest -v $tests 2>&1 | c++filt |
        tee "$OUT/torch-ops-backtrace.log" | grep -v '^test_.* ok$' | tail -60 || true
    fi
    exit $status ;;
  tinylm)
    build_pkg "${2:-.device/torch/libs.tar.xz}"
    model=${3:-.device/tinylm}
    shift $(($# < 3 ? $# : 3))
    # The same windows for both backends; the CPU backend's table is the reference
    # the GPU's is compared with (f16 K/V against f32).
    for backend in cuda cpu; do
      echo "== tinylm, questkv $backend backend" >&2
      python3 bench/tinylm_eval.py --pythonpath "$work/pkg" --model-dir "$model" --backend $backend \
        --json "$OUT/tinylm-$backend.json" "$@" 2>"$OUT/tinylm-$backend.err" | tee "$OUT/tinylm-$backend.txt" ||
        { tail -20 "$OUT/tinylm-$backend.err"; exit 1; }
    done ;;
  *) echo "usage: $0 pack [build_dir] [libs.tar.xz] | run [libs.tar.xz] | tinylm [libs.tar.xz] [model_dir] [flags]" >&2
     exit 2 ;;
esac
