#!/usr/bin/env bash
# The picture of a memory report's timeline that the documentation shows
# (docs/images/report-timeline.png): the page of REPORT.json rebuilt from the JSON, then the
# top of it (the device's headline and the timeline) as headless Chromium draws it at 1,280 px.
#   scripts/report-picture.sh build/demo-report/train.json [docs/images/report-timeline.png]
set -euo pipefail
cd "$(dirname "$0")/.."
report=${1:?usage: scripts/report-picture.sh REPORT.json [PICTURE.png]}
picture=$(realpath -m "${2:-docs/images/report-timeline.png}")
browser=$(command -v chromium || command -v chromium-browser || true)
[[ -n $browser ]] || { echo "report-picture: needs chromium (apt-get install chromium)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$report" "$work/run.json"
PYTHONPATH=$PWD/bindings/python python3 -m zeroalloc report "$work/run.json" >/dev/null
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,660 \
  --screenshot="$picture" "file://$work/run.html" 2>/dev/null
echo "report-picture: $picture from $report"
