#!/usr/bin/env bash
# Puts Debian's prometheus and promtool binaries into the llmq cache, without installing the
# package (no system service gets started, no root needed once apt's lists exist).
# Prints the directory holding the two binaries.
set -euo pipefail
cache="${LLMQ_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmq}"
dest="$cache/prometheus"
if [ -x "$dest/usr/bin/promtool" ] && [ -x "$dest/usr/bin/prometheus" ]; then
  echo "$dest/usr/bin"; exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
if ! apt-get download prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null
    apt-get download prometheus >/dev/null
  else
    echo "cannot fetch Debian's prometheus package: run 'sudo apt-get update' once, or install promtool" >&2
    exit 1
  fi
fi
rm -rf "$dest.partial"
mkdir -p "$dest.partial"
dpkg-deb -x prometheus_*.deb "$dest.partial"
rm -rf "$dest"
mv "$dest.partial" "$dest"
echo "$dest/usr/bin"
