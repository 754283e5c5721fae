#!/usr/bin/env bash
# Instructions per turn of two commits side by side (scripts/instructions.sh on each).
#
#   scripts/compare-instructions.sh [--tracing on|off] BEFORE AFTER
#
# BEFORE and AFTER are anything `git rev-parse` takes (a commit, a branch, HEAD~1). Each is
# checked out in a temporary worktree and built in release (one target directory shared by
# both, $CARGO_TARGET_DIR or target/compare, so the second build reuses the
# dependencies); the counts are taken by this checkout's scripts/instructions.sh, so both
# commits are measured the same way. Prints a table with the change per process.
set -euo pipefail

tracing=on
commits=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tracing) tracing="$2"; shift 2 ;;
    -h|--help) sed -n 2,10p "$0"; exit 0 ;;
    *) commits+=("$1"); shift ;;
  esac
done
[ "${#commits[@]}" -eq 2 ] || { echo "usage: $0 [--tracing on|off] BEFORE AFTER" >&2; exit 2; }
cd "$(dirname "$0")/.."
root="$(pwd)"
target="${CARGO_TARGET_DIR:-$root/target/compare}"
work="$(mktemp -d -t toolfleet-compare-XXXXXX)"
cleanup() {
  for name in before after; do
    git -C "$root" worktree remove --force "$work/$name" >/dev/null 2>&1 || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

names=(before after)
for i in 0 1; do
  name="${names[$i]}"
  commit="$(git rev-parse --verify "${commits[$i]}^{commit}")"
  echo "building $name (${commits[$i]}, ${commit:0:10})" >&2
  git worktree add --detach "$work/$name" "$commit" >/dev/null 2>&1
  # Commits before the developer tools had a crate of their own ran the bench from the CLI.
  package=toolfleet-dev binary=toolfleet-dev
  [ -f "$work/$name/devtools/Cargo.toml" ] || { package=toolfleet-cli binary=toolfleet; }
  (cd "$work/$name" && CARGO_TARGET_DIR="$target" cargo build --release -q -p "$package")
  cp "$target/release/$binary" "$work/toolfleet-$name"
done
for name in "${names[@]}"; do
  echo "counting $name" >&2
  "$root/scripts/instructions.sh" --tracing "$tracing" --out "$work/$name.json" \
    "$work/toolfleet-$name" >/dev/null
done

python3 - "$work/before.json" "$work/after.json" "${commits[0]}" "${commits[1]}" "$tracing" <<'EOF'
import json, sys
before, after = (json.load(open(p))["per_turn"] for p in sys.argv[1:3])
print(f"instructions per turn of three test.noop calls, tracing {sys.argv[5]}")
print(f"| process | {sys.argv[3]} | {sys.argv[4]} | change |")
print("|---|---|---|---|")
for role in ["coordinator", "worker", "client", "all"]:
    b, a = before[role], after[role]
    print(f"| {role} | {b:,} | {a:,} | {100 * (a - b) / b:+.1f}% |")
EOF
