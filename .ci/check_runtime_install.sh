#!/usr/bin/env bash
# What a new user gets: a fresh copy of this checkout, `make venv` (runtime install, no test
# extras) with an empty HOME and JAXSERVE_CACHE, then `jaxserve generate --chat` and one chat
# completion over HTTP from `jaxserve serve`. Fails if torch is in the runtime venv.
# Called by `make test` (and so by CI); runs on its own too: .ci/check_runtime_install.sh
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python3}
# the pip cache is download cache, not user state: keep it so the install is not a re-download
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$($PY -m pip cache dir 2>/dev/null || echo "$HOME/.cache/pip")}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/jaxserve-runtime.XXXXXX")
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"; sleep 2; kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
say() { echo "[runtime-install] $*"; }
fail() { echo "[runtime-install] FAIL: $*" >&2; exit 1; }

export HOME="$WORK/home" JAXSERVE_CACHE="$WORK/cache" HF_HUB_OFFLINE=1
mkdir -p "$HOME"
say "copying the checkout (tracked and new files, no .venv) to $WORK/repo"
mkdir -p "$WORK/repo"
(cd "$REPO" && git ls-files -z -co --exclude-standard | xargs -0 -I{} cp --parents {} "$WORK/repo/" 2>/dev/null || true)
[ -f "$WORK/repo/Makefile" ] || fail "copy of the checkout is incomplete"

say "make venv (runtime dependencies only)"
timeout 900 make -C "$WORK/repo" venv PY="$PY" >"$WORK/venv.log" 2>&1 || { tail -40 "$WORK/venv.log"; fail "make venv"; }
BIN="$WORK/repo/.venv/bin"
if "$BIN/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  fail "torch is installed in the runtime venv (it must be a test-only dependency)"
fi
say "torch is absent from the runtime venv"

cd "$WORK"     # not the repo: run what was installed
say "jaxserve generate --chat (empty cache: converts the default model, compiles)"
timeout 900 "$BIN/jaxserve" generate --chat "Name one colour of the sky." --max-tokens 16 \
  >"$WORK/generate.out" 2>"$WORK/generate.err" || { tail -40 "$WORK/generate.err"; fail "jaxserve generate --chat"; }
grep -q '[[:alpha:]]' "$WORK/generate.out" || { cat "$WORK/generate.out"; fail "generate printed no text"; }
say "generate printed: $(head -c 200 "$WORK/generate.out" | tr '\n' ' ')"
# the CPU kernels build from the installed sources (their headers included) on a machine
# with a C++ compiler; their fallback is a warning, so look for it
if command -v g++ >/dev/null && grep -q "using the jnp reference attention and XLA's dot" "$WORK/generate.err"; then
  grep "using the jnp reference" "$WORK/generate.err" | head -3; fail "the CPU kernels did not build"
fi

say "jaxserve serve on 127.0.0.1 (port chosen by the OS)"
"$BIN/jaxserve" serve --host 127.0.0.1 --port 0 >"$WORK/serve.out" 2>"$WORK/serve.err" &
SERVER_PID=$!
URL=""
for _ in $(seq 1 600); do
  URL=$(grep -oE 'http://127\.0\.0\.1:[0-9]+' "$WORK/serve.out" | head -1 || true)
  [ -n "$URL" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { tail -40 "$WORK/serve.err"; fail "serve exited at start"; }
  sleep 1
done
[ -n "$URL" ] || { tail -40 "$WORK/serve.err"; fail "serve did not start within 600 s"; }
"$BIN/python" - "$URL" <<'PYEOF' || { tail -40 "$WORK/serve.err"; fail "chat completion over HTTP"; }
import json, sys, time, urllib.request
url = sys.argv[1]
deadline = time.time() + 120
while True:
    try:
        urllib.request.urlopen(url + "/health", timeout=5).read()
        break
    except Exception:
        if time.time() > deadline:
            raise
        time.sleep(0.5)
body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
                   "messages": [{"role": "user", "content": "Say hello."}]}).encode()
req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"})
r = json.loads(urllib.request.urlopen(req, timeout=300).read())
text = r["choices"][0]["message"]["content"]
assert isinstance(text, str) and text.strip(), r
print("[runtime-install] chat completion:", json.dumps(text)[:200])
PYEOF
kill -TERM "$SERVER_PID"
for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
wait "$SERVER_PID" || fail "serve exited non-zero after SIGTERM"
SERVER_PID=""
say "OK"
