#!/usr/bin/env bash
# Puts Debian's prometheus and promtool binaries into the llmq cache, without installing the
# package (no system service gets started, no root needed once apt's lists exist).
# Prints the directory holding the two binaries (`make` puts it first on PATH).
#
# promtool is optional: the tests that need it skip without it. Where it cannot be had (no
# apt, no package lists and no root to fetch them) this says so on stderr and exits 0, so
# `make setup` goes on; the directory printed then is where the binaries would be, which
# exists nowhere, so PATH gains nothing (an empty line would put the current directory on it).
set -euo pipefail
cache="${LLMQ_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmq}"
dest="$cache/prometheus"
if [ -x "$dest/usr/bin/promtool" ] && [ -x "$dest/usr/bin/prometheus" ]; then
  echo "$dest/usr/bin"; exit 0
fi

skip() {
  echo "promtool: skipped ($1). The tests that run promtool will skip; to run them, install" \
       "Prometheus' promtool and prometheus on PATH (Debian/Ubuntu package 'prometheus')." >&2
  echo "$dest/usr/bin"
  exit 0
}

if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
  if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    dirname "$(command -v promtool)"; exit 0
  fi
  skip "no apt-get/dpkg-deb on this machine"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
if ! apt-get download prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null || skip "apt-get update failed"
    apt-get download prometheus >/dev/null 2>&1 || skip "apt-get download prometheus failed"
  else
    skip "apt cannot download the 'prometheus' package; run 'sudo apt-get update' once"
  fi
fi
rm -rf "$dest.partial"
mkdir -p "$dest.partial"
dpkg-deb -x prometheus_*.deb "$dest.partial"
rm -rf "$dest"
mv "$dest.partial" "$dest"
echo "$dest/usr/bin"
