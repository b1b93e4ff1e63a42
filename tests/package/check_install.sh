#!/usr/bin/env bash
# Installs a build into a scratch prefix, then builds and runs the README's
# embedding snippets against it as an outside engine would: the C++ program
# through find_package(questkv), the C program through pkg-config. Both must
# run and print the same number; libquestkv.so must export the public API and
# nothing of its internals or private dependencies.
# Usage: check_install.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "package.install: FAILED: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$tmp/prefix" >/dev/null || fail "cmake --install"
for f in include/questkv/runtime.h include/questkv/questkv.h lib/libquestkv.so lib/cmake/questkv/questkvConfig.cmake \
         lib/pkgconfig/questkv.pc; do
  [ -e "$tmp/prefix/$f" ] || fail "the install lacks $f"
done

# The README's ```cmake, ```cpp and ```c blocks, as written.
python3 - "$src/README.md" "$tmp" <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
for lang, name in (("cmake", "CMakeLists.txt"), ("cpp", "main.cc"), ("c", "main.c")):
    blocks = re.findall(r"```%s\n(.*?)```" % lang, text, re.S)
    if len(blocks) != 1:
        sys.exit(f"package.install: FAILED: the README has {len(blocks)} ```{lang} blocks, not 1")
    open(f"{sys.argv[2]}/{name}", "w").write(blocks[0])
PY

cmake -S "$tmp" -B "$tmp/cpp" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_BUILD_RPATH="$tmp/prefix/lib" >"$tmp/cmake.log" 2>&1 ||
  { cat "$tmp/cmake.log" >&2; fail "configuring the C++ consumer"; }
cmake --build "$tmp/cpp" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log" >&2; fail "building the C++ consumer"; }
cpp_out=$("$tmp/cpp/my_engine") || fail "the C++ consumer exited non-zero: $cpp_out"

flags=$(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --cflags --libs questkv) || fail "pkg-config questkv"
cc -std=c99 -Wall -o "$tmp/c_engine" "$tmp/main.c" $flags -lm -Wl,-rpath,"$tmp/prefix/lib" ||
  fail "building the C consumer with: $flags"
c_out=$("$tmp/c_engine") || fail "the C consumer exited non-zero: $c_out"
[ "$cpp_out" = "$c_out" ] || fail "the C++ program printed $cpp_out, the C program $c_out"
case "$cpp_out" in *nan*|*inf*|"") fail "the programs printed '$cpp_out'" ;; esac

syms=$(nm -DC --defined-only "$tmp/prefix/lib/libquestkv.so")
grep -q " qkv_create$" <<<"$syms" || fail "qkv_create is not exported"
grep -q "questkv::Runtime::Create(questkv::Config const&)" <<<"$syms" || fail "Runtime::Create is not exported"
leaks=$(grep -E "io_uring_|hwloc_|boost|cuda[A-Z]|__cuda|TierMover|HbmCache|DiskTier|Selector|kernels::|Runtime::Impl" <<<"$syms" || true)
[ -z "$leaks" ] || fail "internal symbols exported: $(head -3 <<<"$leaks")"
needed=$(readelf -d "$tmp/prefix/lib/libquestkv.so" | grep NEEDED || true)
grep -q uring <<<"$needed" && fail "libquestkv.so needs liburing at run time: $needed"
echo "package.install: installed, C++ (find_package) and C (pkg-config) consumers print $cpp_out," \
     "$(wc -l <<<"$syms") symbols exported: passed"
