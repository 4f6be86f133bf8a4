#!/usr/bin/env bash
# Re-measure the README's quick-start figures: `make install` and `make verify` in a fresh copy of
# the committed tree (git archive HEAD), timed with /usr/bin/time, with the load average before and
# after (other jobs on the same cores slow both; report the load with the figures).
#   scripts/time-quickstart.sh [DIR]     (default: a new temporary folder, removed afterwards)
set -euo pipefail
root=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
dir=${1:-$(mktemp -d /tmp/kvref-quickstart.XXXXXX)}
keep=${1:+yes}
mkdir -p "$dir"
git -C "$root" archive HEAD | tar -x -C "$dir"
cd "$dir"
echo "commit $(git -C "$root" rev-parse --short HEAD), $(nproc) CPUs, python $(python3 -V 2>&1 | cut -d' ' -f2)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/time -f "make install: %e s wall" make install > install.log 2>&1 || { tail -20 install.log; exit 1; }
tail -1 install.log
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/time -f "make verify: %e s wall" make verify > verify.log 2>&1 || { tail -40 verify.log; exit 1; }
tail -1 verify.log
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
[ -n "$keep" ] || rm -rf "$dir"
