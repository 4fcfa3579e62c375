#!/usr/bin/env bash
# Render `rldyn report RUN_DIR` in headless Chromium and save a screenshot, to eyeball the page.
# usage: scripts/check_report.sh RUN_DIR OUT.png [HEIGHT]   (needs `chromium` on PATH; writes RUN_DIR/report.html)
# HEIGHT is the window height in pixels (default 3000); the screenshot shows the top HEIGHT pixels of the page.
set -euo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: $0 RUN_DIR OUT.png [HEIGHT]" >&2
  exit 2
fi
run_dir=$1
out=$(realpath -m "$2")
height=${3:-3000}
command -v chromium >/dev/null || { echo "chromium not found (apt-get install -y chromium)" >&2; exit 2; }
report="$(realpath "$run_dir")/report.html"
python -c "import sys; from rldynamics.plots.cli import report_command; sys.exit(report_command(sys.argv[1], sys.argv[2]))" \
  "$run_dir" "$report"
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$profile" --window-size=1400,$height \
  --screenshot="$out" "file://$report" >/dev/null 2>&1
test -s "$out" || { echo "no screenshot written to $out" >&2; exit 1; }
echo "screenshot: $out"
