#!/usr/bin/env bash
# Installs the Debian packages questkv builds with, when any is missing.
# As root it runs one `apt-get update` and a non-interactive install; as
# another user it names what is missing and stops.
set -euo pipefail

packages=(g++ cmake ninja-build pkg-config git
          libgtest-dev libgmock-dev libbenchmark-dev
          liburing-dev libhwloc-dev libboost-dev
          python3 python3-numpy
          libtorch-dev python3-torch libopenblas0-pthread)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "questkv: missing packages: ${missing[*]}" >&2
  echo "install them (sudo apt-get install ${missing[*]}) or run this as root" >&2
  exit 1
fi
echo "questkv: installing ${missing[*]}" >&2
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
