#!/usr/bin/env bash
# Installs a build into a scratch prefix and uses it as an outside engine
# would: tests/package/cpp_consumer through find_package(questkv), and
# tests/package/c_consumer.c through pkg-config, each checked against dense
# attention; then the README's embedding snippets, built the same two ways.
# Each pair of C++ and C programs must print the same number. libquestkv.so
# must export the public API and nothing of its internals or private
# dependencies, and a consumer must need no library but libquestkv.so.
# Usage: check_install.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
lib=$prefix/lib/libquestkv.so
fail() { echo "package.install: FAILED: $*" >&2; exit 1; }

install_prefix() {
  cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log" >&2; fail "cmake --install"; }
  local f
  for f in include/questkv/runtime.h include/questkv/questkv.h lib/libquestkv.so \
           lib/cmake/questkv/questkvConfig.cmake lib/cmake/questkv/questkvConfigVersion.cmake \
           lib/cmake/questkv/questkvTargets.cmake lib/pkgconfig/questkv.pc; do
    [ -e "$prefix/$f" ] || fail "the install lacks $f"
  done
  readelf -d "$lib" | grep -q "SONAME.*\[libquestkv\.so\.[0-9]" || fail "libquestkv.so has no versioned SONAME"
}

# build_cpp NAME SOURCE_DIR: configures and builds a find_package(questkv) project.
build_cpp() {
  cmake -S "$2" -B "$tmp/$1" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >"$tmp/$1.log" 2>&1 &&
    cmake --build "$tmp/$1" >>"$tmp/$1.log" 2>&1 || { cat "$tmp/$1.log" >&2; fail "building the C++ consumer $1"; }
}

# build_c OUT SOURCE: compiles a C program with pkg-config's flags only.
build_c() {
  local flags
  flags=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs questkv) || fail "pkg-config questkv"
  cc -std=c99 -Wall -Wextra -pedantic -o "$1" "$2" $flags -lm -Wl,-rpath,"$prefix/lib" ||
    fail "building the C consumer $2 with: $flags"
}

# run_same CPP_EXE C_EXE: both must exit 0 and print the same finite number.
run_same() {
  local cpp_out c_out
  cpp_out=$("$1") || fail "$1 exited non-zero: $cpp_out"
  c_out=$("$2") || fail "$2 exited non-zero: $c_out"
  [ "$cpp_out" = "$c_out" ] || fail "the C++ program printed $cpp_out, the C program $c_out"
  case "$cpp_out" in *nan*|*inf*|"") fail "the programs printed '$cpp_out'" ;; esac
  echo "$cpp_out"
}

# The README's ```cmake, ```cpp and ```c blocks, as written, into $tmp/readme.
readme_snippets() {
  mkdir "$tmp/readme"
  python3 - "$src/README.md" "$tmp/readme" <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
for lang, name in (("cmake", "CMakeLists.txt"), ("cpp", "main.cc"), ("c", "main.c")):
    blocks = re.findall(r"```%s\n(.*?)```" % lang, text, re.S)
    if len(blocks) != 1:
        sys.exit(f"package.install: FAILED: the README has {len(blocks)} ```{lang} blocks, not 1")
    open(f"{sys.argv[2]}/{name}", "w").write(blocks[0])
PY
}

check_symbols() {
  local mangled demangled leaks
  mangled=$(nm -D --defined-only "$lib")
  demangled=$(nm -DC --defined-only "$lib")
  grep -q " qkv_create$" <<<"$demangled" || fail "qkv_create is not exported"
  grep -q " questkv::Runtime::Create(questkv::Config const&)$" <<<"$demangled" || fail "Runtime::Create is not exported"
  leaks=$(grep -iE "io_uring_|hwloc_|boost|TierMover|HbmCache|DiskTier|kernels|cuda[A-Z_]|Runtime::Impl|Selector" \
          <<<"$mangled"$'\n'"$demangled" | grep -vE "(qkv_cuda_stream|Runtime11cuda_streamEv|Runtime::cuda_stream\(\) const)$" || true)
  [ -z "$leaks" ] || fail "internal symbols exported: $(head -3 <<<"$leaks")"
  grep -vE " (qkv_|_ZN7questkv|_ZNK7questkv)" <<<"$mangled" | grep -q . &&
    fail "symbols outside qkv_ and questkv:: exported: $(grep -vE " (qkv_|_ZNK?7questkv)" <<<"$mangled" | head -3)"
  ! readelf -d "$lib" | grep NEEDED | grep -qiE "uring|cudart|boost" || fail "libquestkv.so needs a private dependency at run time"
  wc -l <<<"$mangled"
}

# A consumer's own NEEDED entries: libquestkv and the C/C++ runtime, nothing private.
check_needed() {
  local needed
  needed=$(readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  grep -q "^libquestkv\.so\." <<<"$needed" || fail "$1 does not need libquestkv.so"
  grep -vqE "^(libquestkv\.so\.|libstdc\+\+|libm\.|libgcc_s|libc\.|ld-linux)" <<<"$needed" &&
    fail "$1 needs more than libquestkv.so: $(tr '\n' ' ' <<<"$needed")"
  return 0
}

install_prefix
build_cpp cpp "$src/tests/package/cpp_consumer"
build_c "$tmp/c_consumer" "$src/tests/package/c_consumer.c"
check_needed "$tmp/cpp/cpp_consumer"
check_needed "$tmp/c_consumer"
sum=$(run_same "$tmp/cpp/cpp_consumer" "$tmp/c_consumer")
readme_snippets
build_cpp readme_cpp "$tmp/readme"
build_c "$tmp/readme_c" "$tmp/readme/main.c"
readme_sum=$(run_same "$tmp/readme_cpp/my_engine" "$tmp/readme_c")
symbols=$(check_symbols)
echo "package.install: consumers (find_package and pkg-config) equal dense attention within 1e-5 (sum $sum)," \
     "README snippets print $readme_sum, $symbols symbols exported: passed"
