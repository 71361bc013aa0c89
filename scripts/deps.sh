#!/bin/sh
# deps.sh - installs the Debian 12 packages sluice builds with, when missing.
# Used by scripts/demo.sh and scripts/test.sh; safe to run again.
set -eu
pkgs="build-essential cmake pkg-config libzmq3-dev libmsgpack-dev libcriterion-dev clang libclang-rt-14-dev clang-format"
missing=""
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "sluice: installing Debian packages:$missing"
if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# shellcheck disable=SC2086
$sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
