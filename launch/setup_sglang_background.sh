#!/usr/bin/env bash
# The SGLang tiers' venv made in the background while the other tiers run:  bash launch/setup_sglang_background.sh
# (launch/setup_tests.sh calls it; issue 65: about 150 s of a fresh clone's set-up leave the test command's path)
#
# Where .venv-sglang is current (launch/setup_sglang.sh --check) it does nothing; otherwise it starts
# launch/setup_sglang.sh niced in the background and returns at once. The contract and live tiers wait for it
# (tests/sglang_venv_setup.py) through fixed, git-ignored files in .sglang-setup/:
#   started  written BEFORE the job starts: a test that starts before the job writes anything still waits;
#   log      the job's output, ending with a line "[setup] SGLang venv, made in the background: exit N in S s";
#   status   the job's exit status, written last (to a temporary name, then moved: a status that exists is whole);
#   pid      the job's process id, which is also its process group's (.ci/run ends the group if it outlives pytest).
# Design decisions:
# - The files of an earlier set-up are removed first, so its status is never read as this one's; but while an
#   earlier job still runs it is left to finish and its files stay (two pips in one venv would break it).
# - niced: the tests' processes come first; pip (mostly downloads and unpacking) takes what they leave.
# - The job's stdin, stdout and stderr are its own files: nothing reading the set-up's output waits for the job.
# GSPO_SKIP_SGLANG=1 starts nothing (and clears an earlier set-up's files).
set -euo pipefail
cd "$(dirname "$0")/.."
state=.sglang-setup
if [ -f "$state/pid" ] && [ ! -f "$state/status" ] && kill -0 -- "-$(cat "$state/pid")" 2>/dev/null; then
  echo "[setup] the SGLang venv's background set-up (process group $(cat "$state/pid")) is still running;" \
    "the SGLang tiers wait for it (log: $state/log)"
  exit 0
fi
rm -rf "$state"
if [ "${GSPO_SKIP_SGLANG:-0}" = 1 ]; then
  exit 0
fi
if bash launch/setup_sglang.sh --check; then
  exit 0
fi
mkdir -p "$state"
: >"$state/started"
set -m  # job control: the job gets a process group of its own, whose id is the job's pid
(
  set +e
  began=$SECONDS
  nice -n 10 bash launch/setup_sglang.sh
  code=$?
  echo "[setup] SGLang venv, made in the background: exit $code in $((SECONDS - began)) s"
  echo "$code" >"$state/status.tmp" && mv "$state/status.tmp" "$state/status"
) </dev/null >"$state/log" 2>&1 &
echo "$!" >"$state/pid"
set +m
echo "[setup] making the SGLang venv in the background (niced; log: $state/log); the SGLang tiers wait for it"
