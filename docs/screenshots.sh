#!/usr/bin/env bash
# docs/img/mlflow_runs.png and mlflow_sweep.png: MLflow's runs table after a few real rlhflab runs, taken by
# headless Chromium: rlhflab's gold-reward view, and MLflow's own first view with the sweep's jobs nested.
#
#   nice -n 19 bash docs/screenshots.sh [OUT.png [SWEEP_OUT.png]]   # from the repository root, in the project's venv; ~4 min on 2 cores
#
# What it does:
#   1. trains four default runs (the embedded task, ~30 s each) and a 2-job sweep into a fresh SQLite store in a
#      temporary folder (nothing touches ./mlflow.db or ./outputs; the stage cache is the usual one); each run
#      changes one thing, so the names must differ;
#   2. checks the store: run names distinct, every RL run has eval/gold_reward, the experiment is tagged
#      mlflow.experimentKind=custom_model_development (model training; MLflow 3.17's UI itself picks the
#      training view from the URL's workflowType=machine_learning, which the run's URL carries);
#   3. serves the store with `mlflow ui` on a free port (stopped on exit, whatever happens) and waits until
#      /health answers;
#   4. opens the URL that the last run's closing log line prints ("all runs by gold reward: ..."; built by
#      MlflowTracker.url(table=True) in src/rlhflab/tracking.py: the training view with rlhflab's shared view
#      state, sorted by gold reward), waits until every run's row is drawn, closes MLflow's Assistant side
#      panel and the "shared view" banner (neither is part of the runs table), checks the page (gold reward
#      column, sort, no GenAI sidebar) and saves it; then opens the same table in a fresh browser profile
#      without the view (MLflow's default: newest first, nested runs under their parent) and saves that.
#
# Needs Debian's chromium (`apt-get install -y chromium`, or CHROMIUM=/path) and node/npm: the browser is driven
# with playwright-core (pinned below), installed once into ~/.cache/rlhflab/ (PLAYWRIGHT_CORE_DIR overrides).
# RUNS_DIR=dir keeps the runs there, and a second call with the same RUNS_DIR reuses them (only the picture).
set -euo pipefail
cd "$(dirname "$0")/.."

PLAYWRIGHT_CORE=1.65.1
OUT=${1:-docs/img/mlflow_runs.png}
SWEEP_OUT=${2:-docs/img/mlflow_sweep.png}
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
[ -n "$CHROMIUM" ] || { echo "error: chromium not found; apt-get install -y chromium (or set CHROMIUM=)" >&2; exit 2; }
command -v npm > /dev/null || { echo "error: npm not found (node and npm run playwright-core)" >&2; exit 2; }
python -c 'import rlhflab' 2> /dev/null || { echo "error: rlhflab is not importable; activate the project's venv" >&2; exit 2; }

TMP=$(mktemp -d -t rlhflab-shots.XXXXXX)
WORK=${RUNS_DIR:-$TMP}
mkdir -p "$WORK"
SERVER=
cleanup() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2> /dev/null || true; wait "$SERVER" 2> /dev/null || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

export MLFLOW_TRACKING_URI="sqlite:///$WORK/mlflow.db"
export COLUMNS=1000  # Rich wraps log lines at 80 columns when not on a terminal (the URL is read unwrapped below)
train() { python src/train.py "$@" trainer.enable_progress_bar=false >> "$WORK/train.log" 2>&1 \
  || { tail -n 30 "$WORK/train.log" >&2; echo "error: python src/train.py $* failed (log above)" >&2; exit 1; }; }

# 1. Runs that differ in one thing each, and a command-line sweep (a parent run with two children).
if [ ! -s "$WORK/mlflow.db" ]; then
  echo "training 4 runs and a 2-job sweep into $WORK/mlflow.db (log: $WORK/train.log)"
  train hydra.run.dir="$WORK/run/0"
  train algo=grpo hydra.run.dir="$WORK/run/1"
  train memory=lora hydra.run.dir="$WORK/run/2"
  train mode=async hydra.run.dir="$WORK/run/3"
  # Hydra's default sweep dir shape (multirun/<date>/<time>), in the temporary folder.
  train -m algo=online_dpo,remax hydra.sweep.dir="$WORK/multirun/$(date +%Y-%m-%d)/$(date +%H-%M-%S)"
fi
# The runs table URL of the last closing line ("... (all runs by gold reward: http://127.0.0.1:5000/#/...)"),
# read with spaces and line breaks taken out, in case the console wrapped it.
PAGE=$(tr -d ' \n' < "$WORK/train.log" | grep -o 'allrunsbygoldreward:http://[^)]*' | tail -n 1 | cut -d: -f2-) || true
[ -n "$PAGE" ] || { echo "error: no 'all runs by gold reward' URL in $WORK/train.log" >&2; exit 1; }

# 2. The store holds what the picture must show.
EXPECT=$(python - "$MLFLOW_TRACKING_URI" << 'EOF'
import json, sys
from mlflow.tracking import MlflowClient

client = MlflowClient(sys.argv[1])
experiment = client.get_experiment_by_name("rlhflab")
kind = experiment.tags.get("mlflow.experimentKind")
assert kind == "custom_model_development", f"experiment kind is {kind!r}, not model training"
runs = client.search_runs([experiment.experiment_id])
names = [r.info.run_name for r in runs]
assert len(names) == len(set(names)) == 7, f"run names are not 7 distinct names: {names}"
ungraded = [r.info.run_name for r in runs if "rlhflab.sweep" not in r.data.tags and "eval/gold_reward" not in r.data.metrics]
assert not ungraded, f"runs without eval/gold_reward: {ungraded}"
print(json.dumps(names))
EOF
)

# 3. The UI, on a free port.
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mlflow ui --backend-store-uri "$MLFLOW_TRACKING_URI" --host 127.0.0.1 --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 1200); do  # until it answers, or 120 s
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 "$SERVER" 2> /dev/null || { cat "$WORK/server.log" >&2; echo "error: mlflow ui exited" >&2; exit 1; }
  sleep 0.1
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "error: mlflow ui did not answer in 120 s" >&2; exit 1; }

# 4. The picture.
NODE_DIR=${PLAYWRIGHT_CORE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rlhflab/playwright-core-$PLAYWRIGHT_CORE}
if [ ! -f "$NODE_DIR/node_modules/playwright-core/package.json" ]; then
  npm install --silent --no-audit --no-fund --prefix "$NODE_DIR" "playwright-core@$PLAYWRIGHT_CORE" > /dev/null
fi
mkdir -p "$(dirname "$OUT")" "$(dirname "$SWEEP_OUT")"
URL=${PAGE/127.0.0.1:5000/127.0.0.1:$PORT} OUT=$OUT SWEEP_OUT=$SWEEP_OUT CHROMIUM=$CHROMIUM EXPECT=$EXPECT NODE_PATH="$NODE_DIR/node_modules" \
  node - << 'EOF'
const { chromium } = require('playwright-core');
const { URL: url, OUT: out, SWEEP_OUT: sweepOut, CHROMIUM: executablePath } = process.env;
const names = JSON.parse(process.env.EXPECT);
const gold = 'metrics.`eval/gold_reward`';
(async () => {
  const browser = await chromium.launch({ executablePath, args: [  // a closed network: nothing may phone home
    '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'] });
  try {
    const page = await browser.newPage({ viewport: { width: 1600, height: 640 } });
    await page.goto(url);
    for (const name of names)  // every run's row is drawn
      await page.getByRole('link', { name, exact: true }).first().waitFor({ timeout: 60000 });
    for (const id of ['mlflow.assistant.chat_panel.close', 'mlflow.experiment_page.shared_view.dismiss']) {
      const button = page.locator(`[data-component-id="${id}"]`);
      if (await button.count()) await button.first().click();
    }
    // Columns wide enough for the names in them: drag each header's right edge.
    const widen = async (colId, width, on = page) => {
      const header = on.locator(`.ag-header-cell[col-id="${colId}"]`);
      await header.waitFor();
      const box = await header.boundingBox();
      if (box.width >= width) return;
      await on.mouse.move(box.x + box.width - 2, box.y + box.height / 2);
      await on.mouse.down();
      await on.mouse.move(box.x + width, box.y + box.height / 2, { steps: 5 });
      await on.mouse.up();
    };
    await widen('attributes.`Run Name`', 230);
    await widen(gold, 150);
    await widen('metrics.`eval/gold_reward_before`', 190);
    const header = page.locator(`.ag-header-cell[col-id="${gold}"]`);
    const text = await page.locator('body').innerText();
    const problems = [];
    if (!(await header.innerText()).includes('eval/gold_reward')) problems.push('no eval/gold_reward column');
    if (!text.includes('Sort: eval/gold_reward')) problems.push('not sorted by eval/gold_reward');
    for (const genai of ['Judges', 'Evaluation runs', 'Training runs']) if (text.includes(genai)) problems.push(`GenAI view ("${genai}")`);
    if (problems.length) throw new Error(problems.join('; '));
    await page.mouse.move(0, 0);  // no hover highlight in the picture
    await page.waitForTimeout(500);
    await page.screenshot({ path: out });
    // The same runs as MLflow first shows them (newest first, a fresh browser profile): the sweep's parent
    // row with its two jobs nested under it.
    const plain = await browser.newPage({ viewport: { width: 1600, height: 640 } });
    await plain.goto(url.replace(/&viewStateShareKey=[^&]*/, ''));
    // Collapsed at first: expand every parent (the button in front of its name) so its children are drawn.
    const sweepName = names.find(name => name.startsWith('sweep '));
    await plain.getByRole('link', { name: sweepName, exact: true }).first().waitFor({ timeout: 60000 });
    await plain.locator('.ag-row', { has: plain.getByRole('link', { name: sweepName, exact: true }) })
      .locator('[col-id="attributes.`Run Name`"] button').first().click();
    for (const name of names)
      await plain.getByRole('link', { name, exact: true }).first().waitFor({ timeout: 60000 });
    const close = plain.locator('[data-component-id="mlflow.assistant.chat_panel.close"]');
    if (await close.count()) await close.first().click();
    await widen('attributes.`Run Name`', 330, plain);
    await plain.mouse.move(0, 0);
    await plain.waitForTimeout(500);
    await plain.screenshot({ path: sweepOut });
  } finally {
    await browser.close();
  }
})().catch(err => { console.error(`error: ${err.message}`); process.exit(1); });
EOF
echo "wrote $OUT and $SWEEP_OUT: $(echo "$EXPECT" | tr -d '[]"' | sed 's/,/, /g') from ${PAGE/127.0.0.1:5000/127.0.0.1:$PORT} ($("$CHROMIUM" --version 2> /dev/null), MLflow $(python -c 'import mlflow; print(mlflow.__version__)'))"
