"""The command line's process and the cyclic garbage collector (rlhflab/startup.py): off while it imports, then on,
with what the start made frozen; a process that did not turn it off (train(cfg) called from Python) is left alone."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, SHRINK, cli_run

PROBE = """
import gc, json, sys
sys.path.insert(0, {src!r})
from rlhflab import startup
seen = []
def state(): seen.append([gc.isenabled(), gc.get_freeze_count()])
{steps}
print(json.dumps(seen))
"""


def probe(*steps: str) -> list[list]:
    """[collector on?, objects frozen] after each of `steps` (Python lines), in a fresh interpreter."""
    code = PROBE.format(src=str(ROOT / "src"), steps="\n".join(f"{s}\nstate()" for s in steps))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_paused_for_the_imports_then_on_with_them_frozen():
    paused, imported, resumed, again = probe("startup.pause()", "import json, decimal, argparse", "startup.resume()",
                                             "startup.resume()")
    assert paused == [False, 0] and imported == [False, 0]
    assert resumed[0] is True and resumed[1] > 1000, resumed  # what the start made: out of every later collection
    assert again == resumed  # once


def test_a_process_that_did_not_pause_is_left_as_it_is():
    assert probe("startup.resume()") == [[True, 0]]
    assert probe("gc.disable()", "startup.pause()", "startup.resume()") == [[False, 0]] * 3  # the caller's own choice


def test_a_process_spawned_from_the_command_line_keeps_its_collector_on():
    """multiprocessing's spawn (the generator of mode=async on CUDA) imports src/train.py as __mp_main__ and never
    runs a training job that would resume the collector: it is not paused there."""
    code = (f"import gc, runpy, sys; sys.path.insert(0, {str(ROOT / 'src')!r}); "
            f"runpy.run_path({str(ROOT / 'src' / 'train.py')!r}, run_name='__mp_main__'); print(gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr[-2000:]


def test_a_command_line_run_trains_with_the_collector_on_and_its_start_frozen(tmp_path, stage_cache):
    """src/train.py pauses the collector for its imports; the run resumes it before training: a reward function
    called during RL sees it on, with torch, Lightning and MLflow's objects frozen."""
    seen = tmp_path / "seen.json"
    (tmp_path / "gc_reward.py").write_text(
        "import gc, json\n"
        "def score(prompts, completions, **columns):\n"
        f"    open({str(seen)!r}, 'w').write(json.dumps([gc.isenabled(), gc.get_freeze_count()]))\n"
        "    return [0.0] * len(completions)\n")
    env = {"RLHFLAB_CACHE": str(stage_cache), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    args = [*SHRINK, "trainer.max_steps=1", "reward=function", "reward.fn=gc_reward.py:score", f"output.dir={tmp_path}/run"]
    with cli_run(args, tmp_path, env) as proc:
        assert proc.wait(timeout=300) == 0, proc.stdout.read()[-4000:]
    enabled, frozen = json.loads(seen.read_text())
    assert enabled is True
    assert frozen > 100_000, frozen  # ~600,000 on a default run
