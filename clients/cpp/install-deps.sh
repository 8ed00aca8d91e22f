#!/usr/bin/env bash
# The Debian packages the C++ client builds with (cmake, g++, libcurl, nlohmann-json), installed
# only where missing: a machine that has them runs no apt-get. Needs root (or sudo) when it installs.
set -euo pipefail
PACKAGES=(cmake g++ libcurl4-openssl-dev nlohmann-json3-dev)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing ${missing[*]} (the C++ client's build dependencies)" >&2
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
