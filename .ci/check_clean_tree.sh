#!/usr/bin/env bash
# After the tests: running the course (tests, notebooks, `make run`) must not change the checkout.
# Everything a run writes goes to git-ignored places (results/, checkpoints/, workspace/, ...);
# a file that git lists here was written or changed by a run, and a participant would meet it as a
# conflict on their next `git pull`.
set -euo pipefail
cd "$(dirname "$0")/.."
changed=$(git status --porcelain --untracked-files=all)
if [[ -n $changed ]]; then
    echo "CI: running the course changed the checkout (git status --porcelain):" >&2
    echo "$changed" >&2
    git --no-pager diff --stat >&2
    exit 1
fi
echo "CI: the checkout is as clean after the tests as before them"
