#!/usr/bin/env bash
# A real client against tandem: opencode (npm opencode-ai) runs two headless turns, `opencode run`
# then `opencode run --continue`, against `tandem serve --record`; the journal must say that the
# second turn's main request resumed from a cache (cache_source not cold).
#
#     bash scripts/opencode_e2e.sh            # needs npm and the npm registry (opencode fetches
#                                             # @ai-sdk/openai-compatible on its first run)
#
# Everything lives in a temporary folder (the npm install, tandem's home, opencode's HOME and
# project), removed at the end unless KEEP=1. Environment: TANDEM (the tandem command, default
# .venv/bin/tandem), TANDEM_MODEL (default tiny), OPENCODE_VERSION (default latest),
# TURN_TIMEOUT_S (default 240). Exit status: 0 passed, 1 failed, 77 could not set up (no npm, or
# the registry unreachable: the test that runs this skips then).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TANDEM="${TANDEM:-$ROOT/.venv/bin/tandem}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
MODEL="${TANDEM_MODEL:-tiny}"
VERSION="${OPENCODE_VERSION:-latest}"
TURN_TIMEOUT_S="${TURN_TIMEOUT_S:-240}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tandem-opencode.XXXXXX")"
SERVER_PID=""

cleanup() {
    if [[ -n "$SERVER_PID" ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    if [[ "${KEEP:-0}" != 1 ]]; then rm -rf "$WORK"; else echo "kept $WORK"; fi
}
trap cleanup EXIT

skip() { echo "SKIP: $*" >&2; exit 77; }
fail() { echo "FAIL: $*" >&2; exit 1; }

command -v npm >/dev/null || skip "npm is not installed"
mkdir -p "$WORK/npm" "$WORK/home" "$WORK/oc-home" "$WORK/project"

echo "== installing opencode-ai@$VERSION into $WORK/npm"
( cd "$WORK/npm" && npm init -y >/dev/null &&
  timeout 300 npm i --no-audit --no-fund "opencode-ai@$VERSION" >"$WORK/npm.log" 2>&1 ) \
    || { tail -5 "$WORK/npm.log" >&2; skip "npm could not install opencode-ai (offline?)"; }
OPENCODE="$WORK/npm/node_modules/.bin/opencode"
[[ -x "$OPENCODE" ]] || skip "the opencode-ai package has no opencode binary"
echo "opencode $("$OPENCODE" --version 2>/dev/null || echo '?')"

PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
echo "== tandem serve on port $PORT, home $WORK/home, recording"
"$TANDEM" serve --model "$MODEL" --home "$WORK/home" --port "$PORT" --record rec \
    >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 300); do
    curl -fs "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/serve.log" >&2; fail "tandem serve exited"; }
    sleep 1
done
curl -fs "http://127.0.0.1:$PORT/health" >/dev/null || fail "tandem serve did not come up"
SERVED="$(curl -fs "http://127.0.0.1:$PORT/v1/models" | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"

# The output limit keeps a random model's answers short; opencode sends it as max_tokens.
cat >"$WORK/project/opencode.json" <<EOF
{
  "\$schema": "https://opencode.ai/config.json",
  "provider": {
    "tandem": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "tandem",
      "options": {"baseURL": "http://127.0.0.1:$PORT/v1", "apiKey": "none"},
      "models": {"$SERVED": {"name": "$SERVED", "limit": {"context": 65536, "output": 64}}}
    }
  },
  "model": "tandem/$SERVED",
  "small_model": "tandem/$SERVED",
  "autoupdate": false,
  "share": "disabled"
}
EOF
printf 'def add(a, b):\n    return a - b\n' >"$WORK/project/app.py"
( cd "$WORK/project" && git init -q . 2>/dev/null || true )

run_opencode() {
    ( cd "$WORK/project" &&
      HOME="$WORK/oc-home" XDG_CONFIG_HOME="$WORK/oc-home/.config" \
      XDG_DATA_HOME="$WORK/oc-home/.local/share" XDG_CACHE_HOME="$WORK/oc-home/.cache" \
      XDG_STATE_HOME="$WORK/oc-home/.local/state" OPENCODE_DISABLE_AUTOUPDATE=1 \
      timeout "$TURN_TIMEOUT_S" "$OPENCODE" run "$@" ) >>"$WORK/opencode.log" 2>&1
}

echo "== turn 1: opencode run"
run_opencode "What does app.py do? Answer in one line." \
    || { tail -20 "$WORK/opencode.log" >&2; fail "opencode run failed (see above)"; }
echo "== turn 2: opencode run --continue"
run_opencode --continue "And what would you change?" \
    || { tail -20 "$WORK/opencode.log" >&2; fail "opencode run --continue failed"; }

echo "== the journal"
"$PYTHON" - "$WORK/home" <<'EOF'
import json
import sys
from pathlib import Path

home = Path(sys.argv[1])
journal = {}
for line in (home / "journal.jsonl").read_text().splitlines():
    row = json.loads(line)
    if row.get("kind") == "request":
        journal[row["request_id"]] = row
records = [json.loads(line) for f in sorted((home / "rec").glob("*.jsonl"))
           for line in f.read_text().splitlines()]
# The main requests carry the tools; a turn's first one has one user query more than the last
# turn's. The second turn's first main request must resume from a cache.
main = [r for r in records if r["body"].get("tools")]
print(f"{len(records)} requests recorded, {len(main)} with tools")
for r in records:
    j = journal.get(r["response"].get("request_id"), {})
    print(f"  tools={bool(r['body'].get('tools'))!s:5} messages={len(r['body']['messages']):3d} "
          f"prompt={j.get('prompt_tokens')} cached={j.get('cached_tokens')} "
          f"source={j.get('cache_source')} ua={r['headers'].get('user-agent', '-')[:30]}")
def queries(r):
    return sum(1 for m in r["body"]["messages"] if m["role"] == "user")
if not main:
    sys.exit("FAIL: no request with tools was recorded")
first_queries = queries(main[0])
second = [r for r in main if queries(r) > first_queries]
if not second:
    sys.exit("FAIL: no request of the second turn was recorded")
row = journal[second[0]["response"]["request_id"]]
print(f"second turn: cache_source={row['cache_source']} cached={row['cached_tokens']} "
      f"of {row['prompt_tokens']}")
if row["cache_source"] in (None, "cold"):
    sys.exit("FAIL: the second turn did not resume from a cache")
print("PASS")
EOF
