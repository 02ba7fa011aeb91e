#!/usr/bin/env bash
# docs/img/mlflow_runs.png: the MLflow UI's runs table after a few real runs, taken by headless Chromium.
#
#   bash docs/screenshots.sh            # from the repository root, in the project's venv (~4 min on 2 cores)
#
# Needs Debian's chromium (`apt-get install -y chromium`). It trains a few short runs into a fresh
# SQLite store in a temporary folder (nothing touches ./mlflow.db), serves it with `mlflow ui` on a free
# port, opens the URL that a run's closing log line prints (the runs table in the training view, sorted
# by gold reward: src/rlhflab/tracking.py), and saves the page. The server is always stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
[ -n "$CHROMIUM" ] || { echo "error: chromium not found; apt-get install -y chromium (or set CHROMIUM=)" >&2; exit 2; }
OUT=${1:-docs/img/mlflow_runs.png}
WORK=$(mktemp -d)
SERVER=
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
export MLFLOW_TRACKING_URI="sqlite:///$WORK/mlflow.db"
Q="trainer.enable_progress_bar=false"  # the default runs (80 steps each), so that names show only what differs

# Runs whose names must tell them apart: the defaults, one override each, and a 2-job sweep (a parent).
python src/train.py $Q hydra.run.dir="$WORK/run0" > "$WORK/log" 2>&1
python src/train.py $Q algo=grpo hydra.run.dir="$WORK/run1" >> "$WORK/log" 2>&1
python src/train.py $Q memory=lora hydra.run.dir="$WORK/run2" >> "$WORK/log" 2>&1
python src/train.py $Q mode=async staleness=1 hydra.run.dir="$WORK/run3" >> "$WORK/log" 2>&1
python src/train.py -m $Q algo=online_dpo,remax hydra.sweep.dir="$WORK/multirun" >> "$WORK/log" 2>&1
# The URL the last run printed ("all runs by gold reward: http://127.0.0.1:5000/#/experiments/...").
PAGE=$(tr -d ' \n' < "$WORK/log" | grep -o 'http://127.0.0.1:5000/#/experiments/[0-9]*/runs?workflowType=machine_learning&viewStateShareKey=[a-z-]*' | tail -1)
[ -n "$PAGE" ] || { echo "error: no runs-table URL in the runs' log ($WORK/log)" >&2; exit 1; }

PORT=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mlflow ui --backend-store-uri "$MLFLOW_TRACKING_URI" --host 127.0.0.1 --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 600); do  # until it answers (an event, not a guessed sleep), or 60 s
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
  sleep 0.1
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "error: mlflow ui did not answer" >&2; exit 1; }

"$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$WORK/chromium" --hide-scrollbars \
  --window-size=1920,1000 --virtual-time-budget=20000 --screenshot="$OUT" "${PAGE/5000/$PORT}" 2> "$WORK/chromium.log"
echo "wrote $OUT from ${PAGE/5000/$PORT}"
