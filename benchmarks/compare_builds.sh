#!/usr/bin/env bash
# The compressed all-reduce at 1 Gbit/s (benchmarks/netns.sh) of several commits, interleaved round by round so
# that the machine's drift falls on every build alike. Each commit is checked out into a worktree and installed
# NON-editable into its own folder, run with PYTHONPATH at that folder: PYTHONPATH at a checkout is not enough
# where harmony is installed editable (the editable finder then serves harmony.runtime from that install, and
# the "old" build runs today's collectives).   Root (netns):
#
#   bash benchmarks/compare_builds.sh "98ffce6 HEAD" [rounds] [allreduce.py arguments...]
set -euo pipefail
revs=${1:?"usage: $0 \"REV REV...\" [rounds] [allreduce.py args...]"}
rounds=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--reps 5 --warmup 1 --methods q4)
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/harmony-builds.XXXX)
cleanup() {
  for rev in $revs; do git -C "$repo" worktree remove --force "$work/tree-$rev" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
for rev in $revs; do
  git -C "$repo" worktree add --detach -q "$work/tree-$rev" "$rev"
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-deps --no-build-isolation --target "$work/site-$rev" "$work/tree-$rev" >/dev/null
  echo "$rev = $(git -C "$repo" rev-parse --short "$rev")" >&2
done
for round in $(seq "$rounds"); do
  for rev in $revs; do
    echo "=== $rev (round $round) $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) ==="
    (cd "$work" && PYTHONPATH="$work/site-$rev" XDG_CACHE_HOME="$work/cache" \
      bash "$work/tree-$rev/benchmarks/netns.sh" 1gbit 4 "${args[@]}" 2>&1 | grep -E "s/sync|all_reduce \(gloo\)|Harmony")
  done
done
