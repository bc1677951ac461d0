#!/usr/bin/env bash
# Renders a `maxmoe report` page in headless Chromium and saves a PNG screenshot of its top:
# the report's browser test (tests/report/test_browser.py) and docs/observability.md's
# docs/img/report.png.
#   tools/report_screenshot.sh REPORT.html OUT.png [WIDTH,HEIGHT]     (default 1280,2000)
# Exit 0 with OUT.png written; 2 when there is no browser or no page; 1 when the browser fails.
# Host names resolve to nothing (--host-resolver-rules), so the page renders as it would offline.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 REPORT.html OUT.png [WIDTH,HEIGHT]" >&2
  exit 2
fi
page=$1
out=$2
size=${3:-1280,2000}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
  echo "report_screenshot: no chromium on PATH (Debian: apt-get install chromium)" >&2
  exit 2
fi
if [ ! -f "$page" ]; then
  echo "report_screenshot: no page '$page' (write one with: maxmoe report RUN_DIR)" >&2
  exit 2
fi
out_abs=$(realpath -m "$out")
log=$(mktemp)
trap 'rm -f "$log"' EXIT
rm -f "$out_abs"
# --no-sandbox: containers run as root; --disable-gpu: no display
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
  --disable-extensions --host-resolver-rules="MAP * ~NOTFOUND" --window-size="$size" \
  --screenshot="$out_abs" "file://$(realpath "$page")" >"$log" 2>&1 || true
if [ ! -s "$out_abs" ]; then
  echo "report_screenshot: $browser wrote no screenshot; its output:" >&2
  grep -v dbus "$log" >&2 || true
  exit 1
fi
echo "report_screenshot: wrote $out ($size)"
