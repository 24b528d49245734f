#!/usr/bin/env bash
# Puts Debian's prometheus and promtool binaries into the llmq cache, without installing the
# package (no system service gets started, no root needed once apt's lists exist).
# Prints the directory holding the two binaries (`make` puts it first on PATH).
#
# The web UI's JavaScript comes from Debian's libjs-* packages, which the prometheus package
# only links to; they are unpacked beside it, so that `make screenshot` can show the UI. They are
# best-effort: without them the binaries and promtool work, and only the web UI is bare.
#
# promtool is optional: the tests that need it skip without it. Where it cannot be had (no
# apt, no package lists and no root to fetch them) this says so on stderr and exits 0, so
# `make setup` goes on; the directory printed then is where the binaries would be, which
# exists nowhere, so PATH gains nothing (an empty line would put the current directory on it).
set -euo pipefail
cache="${LLMQ_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmq}"
dest="$cache/prometheus"
if [ -x "$dest/usr/bin/promtool" ] && [ -x "$dest/usr/bin/prometheus" ] && [ -e "$dest/.web-ui-tried" ]; then
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
web_ui=(libjs-bootstrap4 libjs-d3 libjs-eonasdan-bootstrap-datetimepicker libjs-jquery libjs-jquery-hotkeys
        libjs-moment libjs-moment-timezone libjs-mustache libjs-popper.js libjs-rickshaw fonts-glyphicons-halflings)
if apt-get download "${web_ui[@]}" >/dev/null 2>&1; then
  for deb in ./*.deb; do
    [ "$deb" = "$(ls ./prometheus_*.deb)" ] || dpkg-deb -x "$deb" "$dest.partial"
  done
else
  echo "prometheus: its web UI's JavaScript packages could not be downloaded; the UI will be bare" >&2
fi
touch "$dest.partial/.web-ui-tried"
rm -rf "$dest"
mv "$dest.partial" "$dest"
echo "$dest/usr/bin"
