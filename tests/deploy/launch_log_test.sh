#!/usr/bin/env bash
# deploy/karat's daemon logs are readable by the cluster's user only (0600):
# a new log, a log appended to (restart) and a log reused by a new `up`,
# whatever the caller's umask and the old log's mode.
set -euo pipefail
# shellcheck source=../../deploy/karat
source "$(dirname "$0")/../../deploy/karat"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
umask 022

mode() { stat -c %a "$1"; }
expect_private() {
  local m
  m="$(mode "$1")"
  [ "$m" = 600 ] || { echo "FAIL: $1 has mode $m, want 600" >&2; exit 1; }
}

launch_daemon "$dir" fresh new echo first
wait
expect_private "$dir/fresh.log"
grep -qx first "$dir/fresh.log"

echo before >"$dir/old.log"
chmod 644 "$dir/old.log"
launch_daemon "$dir" old append echo appended
wait
expect_private "$dir/old.log"
[ "$(cat "$dir/old.log")" = "$(printf 'before\nappended')" ] ||
  { echo "FAIL: the appended log lost its earlier lines" >&2; exit 1; }

chmod 644 "$dir/old.log"
launch_daemon "$dir" old new echo again
wait
expect_private "$dir/old.log"
[ "$(cat "$dir/old.log")" = again ] ||
  { echo "FAIL: a new log kept the old one's lines" >&2; exit 1; }
echo "launch_log_test: ok"
