"""How runs stop and fail (issue 12): interruptions, non-finite values, full disks, bad model directories, hub ids
and credentials. Each stops in one line, keeps what it can (a checkpoint, the metrics) and says how to go on."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf, open_dict

from conftest import ROOT, SHRINK, cli_run, compose_cfg, history, run_id_of, wait_for
from test_sweep import mlflow_server  # noqa: F401  (a fixture: `mlflow server` on a free local port)
from rlhflab.algos.registry import RLOO
from rlhflab.errors import ConfigError, NonFiniteError, RunInterrupted, TrackingLost, WriteFailed
from rlhflab.rewards.builtin import RuleReward
from rlhflab.train import train


# ---- interruptions ---------------------------------------------------------------------------

def burner():
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def test_a_repeated_signal_while_the_stop_unwinds_is_the_same_stop(monkeypatch, capsys, tmp_path):
    """Ctrl-C twice under DDP: rank 1's second SIGINT landed after train() had put the default handler back, in
    its last cleanup, and it printed a KeyboardInterrupt traceback. The command line's main() keeps rlhflab's
    handler until it exits: the late signal is the same stop, exit 130 and one line."""
    import rlhflab.train as entry
    from rlhflab.interrupts import STOP

    def stopped_train(cfg):
        try:
            with STOP.installed():
                STOP.signum = signal.SIGINT
                STOP.run_made = True  # as train() marks it once its MLflow run exists
                raise RunInterrupted(signal.SIGINT)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # the repeat, after train's handlers are restored
            time.sleep(0)  # a bytecode boundary: Python runs the handler here

    monkeypatch.setattr(entry, "train", stopped_train)
    cfg = OmegaConf.create({"output": {"dir": str(tmp_path / "run")}})  # no checkpoint there: nothing to resume
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's; a background job has SIG_IGN
    try:
        with pytest.raises(SystemExit) as exit:
            entry.main(cfg)
    except KeyboardInterrupt:
        pytest.fail("the repeated SIGINT reached Python's default handler: KeyboardInterrupt")
    finally:
        restored = signal.signal(signal.SIGINT, before)
    assert exit.value.code == 130
    assert capsys.readouterr().err == ("stopped: stopped by SIGINT; the MLflow run is KILLED: it stopped before its first "
                                       "checkpoint, so there is nothing to resume; the same command starts a new run (the "
                                       "stages that finished are cached)\n")
    assert restored is signal.default_int_handler  # put back as the process had it


@pytest.mark.parametrize("when, ends", [("ending", "FINISHED"), ("ending", "FAILED"), ("final eval", "FINISHED")])
def test_a_signal_after_the_last_step_boundary_waits_for_the_runs_end(make_cfg, monkeypatch, capsys, when, ends):
    """Ctrl-C as the MLflow run was being ended (its last metrics, then its status; a slow store makes that window
    long) stopped the ending itself: the run stayed RUNNING, though it had trained to the end or failed. One in the
    final eval (after RL's last step boundary) was dropped: the run ended FINISHED, exit 0, and a sweep went on. The
    signal now waits for the run's end, then stops the command (a sweep too) in one line that says how the run ended.
    It is sent from inside MLflow's set_terminated, before the status is written, or from the final eval."""
    import rlhflab.train as entry
    from rlhflab.interrupts import STOP
    from rlhflab.lit.rl_module import RLHFModule

    owner, name = (MlflowClient, "set_terminated") if when == "ending" else (RLHFModule, "final_evaluation")
    real = getattr(owner, name)

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0)  # a bytecode boundary: Python runs the handler here
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    cfg = make_cfg("trainer.max_steps=2", *(nan_reward(2) if ends == "FAILED" else ()))
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as exit:
            entry.main(cfg)
    finally:
        signal.signal(signal.SIGINT, before)
    assert exit.value.code == 130
    client = MlflowClient(cfg.logger.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("rlhflab").experiment_id])[0]
    assert run.info.status == ends
    line = capsys.readouterr().err.strip().splitlines()[-1]
    if ends == "FINISHED":
        assert (Path(cfg.output.dir) / "policy").is_dir()
        assert line == (f"stopped: stopped by SIGINT; the MLflow run is FINISHED: it had trained to the end (policy: "
                        f"{cfg.output.dir}/policy)")
    else:
        assert line.startswith("stopped: stopped by SIGINT; the MLflow run is FAILED (NonFiniteError: the rewards "
                               "(train/reward) not finite at RL step 2"), line
    assert STOP.ended == ends


def test_a_stop_that_a_finalizer_swallowed_is_raised_again(capfd):
    """A signal raises its stop at once outside the RL loop. Landing in a finalizer (a weakref callback the garbage
    collector ran: SQLAlchemy's, in stage sft), the raise was printed as 'Exception ignored in ...' with a traceback and
    lost: the run trained on, and a test that waited for its exit failed. It is raised again once out of there."""
    import weakref

    from rlhflab.interrupts import STOP

    class Held:
        pass

    def callback(ref):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0)  # the handler runs here, inside the callback: Python prints what it raises and goes on

    with pytest.raises(RunInterrupted) as stop:
        with STOP.installed():
            held = Held()
            ref = weakref.ref(held, callback)  # noqa: F841
            del held
            threading.Event().wait(60)  # a signal's handler runs in it (lock waits are interruptible)
            pytest.fail("the stop was lost")
    assert stop.value.signum == signal.SIGINT
    assert "Exception ignored" not in capfd.readouterr().err
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL  # as it was


def accept_from(server, proc):
    """The next connection to `server` that `proc` made. Under pytest-xdist another worker's test may connect to a
    port it probed and released, which this server then took: that one is closed and passed over."""
    while True:
        conn, (_, port) = server.accept()
        if any(c.laddr.port == port for c in psutil.Process(proc.pid).net_connections(kind="tcp")):
            return conn
        conn.close()


@pytest.mark.parametrize("answered", [0, 1])
def test_a_stop_before_the_run_exists_says_so_in_one_line(tmp_path, answered):
    """Ctrl-C while a tracking server does not answer. In the command line's check (answered=0) it printed a
    KeyboardInterrupt traceback; once that check had its answer (a proxy's 404) and the run's own check hung
    (answered=1), the line said 'the MLflow run is KILLED. Continue with ... resume=auto' of a run that was never
    made. The accepted connection is the event: the signal lands while that request waits."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        server.settimeout(120)
        held = []
        with cli_run([f"logger.tracking_uri=http://127.0.0.1:{server.getsockname()[1]}", f"output.dir={tmp_path}/run"],
                     tmp_path) as proc:
            for i in range(answered + 1):
                conn = accept_from(server, proc)
                held.append(conn)
                if i < answered:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    conn.close()
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=60)
            output = proc.stdout.read()
        for conn in held:
            conn.close()
    assert rc == 130, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert "Traceback" not in output and "KILLED" not in output, output[-3000:]
    assert last == ("stopped: stopped by SIGINT before its MLflow run was made: there is nothing to resume; run the "
                    "command again" if answered else "stopped: stopped by SIGINT while no run was training"), output[-3000:]


def test_an_error_raised_as_a_stop_went_through_a_lock_is_the_stop_and_is_said(caplog):
    """A sweep's job stopped by Ctrl-C in stage sft ended FAILED ('RuntimeError: release unlocked lock'), not KILLED:
    the stop was raised inside threading's Condition.wait after it had released its lock, and the `with` around the
    wait released it again. The same chain, made by a real lock."""
    from rlhflab.interrupts import as_interrupt

    lock = threading.Lock()

    def waited():
        with lock:
            lock.release()  # where Condition.wait was when the stop came: its lock released, not yet taken back
            raise RunInterrupted(signal.SIGINT)

    with pytest.raises(RuntimeError, match="release unlocked lock") as raised:
        waited()
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        stop = as_interrupt(raised.value)
    assert isinstance(stop, RunInterrupted) and stop.signum == signal.SIGINT
    assert "RuntimeError: release unlocked lock, raised as the stop went through it" in caplog.text
    # an error of its own, or one raised while another error (not a stop) went through, is not a stop
    try:
        try:
            raise ValueError("bad value")
        finally:
            raise RuntimeError("cleanup failed")
    except RuntimeError as err:
        assert as_interrupt(err) is None
    assert as_interrupt(RuntimeError("release unlocked lock")) is None


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_a_stop_before_the_first_checkpoint_does_not_promise_a_resume(tmp_path, sweep):
    """Ctrl-C in stage sft said 'Continue with the same command and resume=auto', which started a new MLflow run
    (there was no checkpoint) and left the KILLED one empty; in a sweep, 'Continue this job alone: ... resume=auto'."""
    out = tmp_path / "run" / ("0" if sweep else "")
    env = {"RLHFLAB_CACHE": str(tmp_path / "cache"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    args = [*SHRINK, "stages.sft.epochs=200"]
    with cli_run(["-m", "seed=1,2", *args, f"output.dir={tmp_path}/run/${{hydra:job.num}}"] if sweep else
                 [*args, f"output.dir={out}", f"hydra.run.dir={out}"], tmp_path, env) as proc:
        lines: list[str] = []  # (a sweep's job logs to its job directory under multirun/: its console is read)
        reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
        reader.start()
        wait_for(lambda: any("stage sft: training on" in line for line in lines), 300, "stage sft", proc)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
        reader.join(timeout=30)
        output = "".join(lines)
    assert rc == 130, output[-3000:]
    last = output.strip().splitlines()[-1]
    if not sweep:
        assert last == (
            "stopped: stopped by SIGINT; the MLflow run is KILLED: it stopped before its first checkpoint, so there is "
            "nothing to resume; the same command starts a new run (the stages that finished are cached)"), output[-3000:]
        return
    said, _, job = last.partition(" Run it alone: ")
    assert said == ("stopped: stopped by SIGINT; the MLflow run is KILLED, and the sweep stops here; this job stopped before "
                    "its first checkpoint, so there is nothing to resume."), output[-3000:]
    assert job.startswith("python src/train.py seed=1 ") and job.endswith(f" hydra.mode=RUN output.dir={out}"), last
    assert "resume" not in job, last


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, group", [(signal.SIGINT, 130, False), (signal.SIGTERM, 143, True)])
def test_signal_under_load_stops_within_seconds_killed_with_checkpoint(tmp_path, stage_cache, sig, code, group):
    """A second CPU-heavy process runs meanwhile (from the RL stage on: the stop is the subject, not the start).
    The async run stops in under 30 s, its MLflow run is KILLED, a checkpoint is left, the exit code says which
    signal, and no process is left behind. SIGTERM goes to the whole process group, as a scheduler's preemption
    may send it: the generator leaves it to the learner, which finishes its step with a checkpoint."""
    env = {"RLHFLAB_CACHE": str(stage_cache), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    out = tmp_path / "run"
    load = None
    try:
        with cli_run([*SHRINK, "mode=async", "trainer.max_steps=100000", f"output.dir={out}", f"hydra.run.dir={out}"],
                     tmp_path, env) as proc:
            wait_for(lambda: "eval after 0 RL steps" in (out / "train.log").read_text() if (out / "train.log").exists() else False,
                     300, "the RL stage", proc)
            load = burner()
            children = psutil.Process(proc.pid).children(recursive=True)
            sent = time.monotonic()
            (os.killpg if group else os.kill)(proc.pid, sig)
            rc = proc.wait(timeout=60)
            took = time.monotonic() - sent
            output = proc.stdout.read()
    finally:
        if load:
            load.kill()
            load.wait()
    assert rc == code, output[-3000:]
    assert took < 30, took
    assert list((out / "checkpoints").glob("step-*")), output[-3000:]
    assert MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(run_id_of(out)).info.status == "KILLED"
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert "Traceback" not in output
    assert output.count(f"{sig.name} received") == 1, output[-3000:]  # the learner's, not the generator's too


@pytest.mark.parametrize("merged", [False, True], ids=["stdout", "2>&1"])
def test_a_closed_output_pipe_stops_the_run_killed_with_a_checkpoint(tmp_path, stage_cache, merged):
    """`python src/train.py | head` (grep -m1, a pager quit): once the reader had its lines and closed the pipe,
    every log line printed '--- Logging error ---' and a BrokenPipeError traceback on stderr, and Rich's progress bar
    exited 1: the run ended FAILED with `SystemExit: 1` and no checkpoint. A closed pipe is SIGPIPE's stop: the run
    stops after its step with a checkpoint, KILLED and tagged why, exit 141, its metrics kept; stderr has the stop's
    line alone (with 2>&1 it has nowhere to go). The reader leaves once RL's first line is in train.log."""
    env = {"RLHFLAB_CACHE": str(stage_cache), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    out, err = tmp_path / "run", tmp_path / "stderr.txt"
    log = out / "train.log"
    with open(err, "w") as stderr, cli_run([*SHRINK, "rl.eval_every=1", "trainer.max_steps=100", f"output.dir={out}",
                                            f"hydra.run.dir={out}"], tmp_path, env,
                                           subprocess.STDOUT if merged else stderr) as proc:
        wait_for(lambda: log.exists() and "eval after 0 RL steps" in log.read_text(), 300, "the RL stage", proc)
        proc.stdout.close()  # the reader has what it wanted; the run's next line (step 1's eval) meets a closed pipe
        rc = proc.wait(timeout=120)
    said = err.read_text()
    assert rc == 141, said[-3000:]
    run = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(run_id_of(out))
    assert run.info.status == "KILLED"
    assert run.data.tags["rlhflab.stopped"] == "stopped by SIGPIPE (its output pipe was closed)"
    steps = [int(p.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-*")]
    assert steps and max(steps) < 100 and not (out / "policy").exists(), said[-3000:]
    assert history(env["MLFLOW_TRACKING_URI"], run.info.run_id, "eval/gold_reward")[-1][0] == max(steps)  # none lost
    assert "the output pipe was closed (SIGPIPE): stopping after this step with a checkpoint" in log.read_text()
    if not merged:
        assert "Traceback" not in said and "BrokenPipe" not in said and "Logging error" not in said, said[-3000:]
        assert said.strip().splitlines()[-1] == ("stopped: stopped by SIGPIPE (its output pipe was closed); the MLflow run "
                                                 f"is KILLED. Continue with the same command and resume=auto output.dir={out}")


def test_a_pipe_closed_on_hydras_own_lines_stops_the_next_job_as_it_starts(capfd):
    """`python src/train.py -m ... | head -1`: the reader left while Hydra wrote a sweep's own lines ('[HYDRA] Launching
    2 jobs locally'), before any job: each printed '--- Logging error ---' and a BrokenPipeError traceback, and the sweep
    ran every job to its end for no reader. Hydra's lines go through rlhflab's handler (conf/hydra/hydra_logging), and
    the next job stops as it starts, as a job whose pipe closed (exit 141; the sweep stops)."""
    from rlhflab.interrupts import STOP
    from rlhflab.quiet import HydraConsoleHandler

    read, write = os.pipe()
    os.close(read)  # the reader is gone
    stream = os.fdopen(write, "w")
    logger = logging.getLogger("test_hydra_lines")
    handler = HydraConsoleHandler(stream)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("Launching 2 jobs locally")
        with pytest.raises(RunInterrupted) as stop:
            with STOP.installed():
                pytest.fail("the job started")
    finally:
        logger.removeHandler(handler)
        stream.close()
    assert stop.value.signum == signal.SIGPIPE and not STOP.closed_before
    assert "Logging error" not in capfd.readouterr().err


# ---- non-finite values ----------------------------------------------------------------------

class NaNReward(RuleReward):
    """The gold rule, NaN on the training batches numbered in `bad` (1-based; evaluation does not
    score when rl.log_generations=0)."""

    bad: set[int] = set()
    calls = 0

    def score(self, memory, task, rollout):
        type(self).calls += 1
        scores = super().score(memory, task, rollout)
        return scores * float("nan") if type(self).calls in self.bad else scores


def nan_reward(*bad: int) -> list[str]:
    NaNReward.bad, NaNReward.calls = set(bad), 0
    return ["reward=rule", "reward._target_=test_failures.NaNReward", "rl.log_generations=0"]


class NaNLossRLOO(RLOO):
    """RLOO whose loss turns NaN at its third update (and every one after it, or only those in `bad`)."""

    updates = 0
    bad: set[int] | None = None

    def loss(self, logprobs, values, batch):
        type(self).updates += 1
        loss, metrics = super().loss(logprobs, values, batch)
        nan = type(self).updates >= 3 if self.bad is None else type(self).updates in self.bad
        return (loss * float("nan") if nan else loss), metrics


def test_nan_reward_stops_naming_step_and_quantity_and_keeps_the_checkpoint(make_cfg):
    cfg = make_cfg(*nan_reward(4, 5, 6, 7, 8), "trainer.max_steps=8", "checkpoint.every_n_steps=2")
    with pytest.raises(NonFiniteError) as err:
        train(cfg)
    message = str(err.value)
    assert message.startswith("the rewards (train/reward) not finite at RL step 4") and "\n" not in message
    assert "the last good checkpoint is" in message and message.endswith("step-00000002")
    client = MlflowClient(cfg.logger.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("rlhflab").experiment_id])[0]
    assert run.info.status == "FAILED"
    # what ended it, as a sweep's failed child has it (the UI said FAILED, not why)
    assert run.data.tags["rlhflab.error"] == f"NonFiniteError: {message}"


@pytest.mark.parametrize("mode", ["mode=sync", "mode=async staleness=1", "mode=async staleness=0"])
def test_diverged_weights_stop_in_one_line_not_naming_their_checkpoint_as_good(make_cfg, tmp_path, mode):
    """rl.lr=1e30: the first update's loss and clipped gradient are finite, its step is not. Sampling with those
    weights failed in torch.multinomial, a traceback (in the generator process: 'generator process failed' and
    its traceback); and the checkpoint of step 1 holds them."""
    cfg = make_cfg("rl.lr=1e30", "trainer.max_steps=6", "checkpoint.every_n_steps=1", *mode.split(), f"output.dir={tmp_path}")
    with pytest.raises(NonFiniteError) as err:
        train(cfg)
    message = str(err.value)
    assert "\n" not in message and "lower rl.lr (now 1e+30)" in message, message
    # staleness 1: the learner meets the NaN first, in its loss on the batch sampled one update earlier
    if mode != "mode=async staleness=1":
        assert message.startswith("the policy's sampling probabilities (NaN/Inf logits: its weights have diverged) "
                                  "not finite at RL step 2"), message
    assert message.endswith("step 1's weights may be the cause; no checkpoint before them"), message
    assert MlflowClient(cfg.logger.tracking_uri).get_run(run_id_of(tmp_path)).info.status == "FAILED"


def test_diverged_weights_before_the_first_checkpoint_do_not_ask_for_checkpoints_already_asked_for(make_cfg, tmp_path):
    """With checkpoint.every_n_steps=20 and the weights diverged at step 1, the line said '(set
    checkpoint.every_n_steps)'."""
    cfg = make_cfg("rl.lr=1e30", "trainer.max_steps=6", "checkpoint.every_n_steps=20", f"output.dir={tmp_path}")
    with pytest.raises(NonFiniteError) as err:
        train(cfg)
    assert str(err.value).endswith("no checkpoint before them (checkpoint.every_n_steps=20: the first was due at step 20)"), err


def test_nan_loss_stops_before_the_update(make_cfg):
    NaNLossRLOO.updates, NaNLossRLOO.bad = 0, None
    with pytest.raises(NonFiniteError, match=r"^train/loss not finite at RL step 3"):
        train(make_cfg("algo._target_=test_failures.NaNLossRLOO", "trainer.max_steps=6"))


def test_skip_batch_goes_on_past_a_non_finite_batch(make_cfg):
    cfg = make_cfg(*nan_reward(3), "trainer.max_steps=4", "rl.on_nonfinite=skip_batch")
    result = train(cfg)
    assert (result.module.updates, result.module.skipped_batches, result.module.policy_version) == (4, 1, 5)
    skipped = history(cfg.logger.tracking_uri, result.run_id, "train/skipped_batches")
    assert skipped == [(2, 1.0)]  # logged at the step it happened after


def test_skip_batch_stops_a_run_whose_every_batch_is_skipped(make_cfg):
    """A cause in every batch (a NaN reward weight, a reward that is always NaN): skip_batch skipped 47,664 rollout
    batches over 460 s, one warning each, and the run ended FINISHED with nothing trained."""
    with pytest.raises(NonFiniteError, match=r"^rl.on_nonfinite=skip_batch: 20 rollout batches in a row had non-finite "
                                             r"values \(the last at RL step 1\), so nothing is being trained; fix what "
                                             r"the warnings above name"):
        train(make_cfg(*nan_reward(*range(1, 10_000)), "trainer.max_steps=4", "rl.on_nonfinite=skip_batch"))
    assert NaNReward.calls == 20


def test_a_nan_reward_weight_is_one_line_before_any_model_loads(make_cfg, tmp_path):
    """reward.weights=[nan] passed the checks: every reward NaN, found at RL step 1 (or, under skip_batch, the run
    above); a weight is checked with their count now."""
    fn = tmp_path / "r.py"
    fn.write_text("def score(prompts, completions, **columns):\n    return [1.0 for _ in completions]\n")
    for weight in ("nan", "inf"):
        with pytest.raises(ConfigError, match=rf"^reward.weights: {weight} is not a finite number; give each function a "
                                              "finite weight$"):
            train(make_cfg("reward=function", f"reward.fn={fn}:score", f"reward.weights=[{weight}]"))


def test_a_batch_skipped_after_its_forward_leaves_no_activations_counted(make_cfg, tmp_path):
    """A batch whose loss is NaN is skipped after its policy forward saved activations for a backward that never
    runs: the meter forgets them, so the run's activation peak is that of the same run skipping the same batch
    before any forward (a NaN reward), or that forward's own where it saved more than any other batch's (the peak is
    the largest batch's: rl.prompt_once's forward saved 9.26 MB in this run's skipped batch, the others' at most
    8.79), and never the skipped batch's and the next one's together, as a meter that kept them would count."""
    NaNLossRLOO.updates, NaNLossRLOO.bad = 0, {3}
    after = train(make_cfg(*nan_reward(), "algo._target_=test_failures.NaNLossRLOO", "trainer.max_steps=4",
                           "rl.on_nonfinite=skip_batch", f"output.dir={tmp_path / 'after'}"))
    before = train(make_cfg(*nan_reward(3), "trainer.max_steps=4", "rl.on_nonfinite=skip_batch", f"output.dir={tmp_path / 'before'}"))
    assert after.module.skipped_batches == before.module.skipped_batches == 1
    peak, other = after.module.activations.peak, before.module.activations.peak
    assert 0 < other <= peak < 1.5 * other, (peak, other)


# ---- a full disk -------------------------------------------------------------------------------

@contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` mounted at `path`: a disk that really fills (ENOSPC). It needs root; skipped elsewhere."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small disk needs `mount -t tmpfs` (root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_resume_continues(tmp_path, stage_cache):
    """Before: torch.save's '[enforce fail at inline_container.cc:672] unexpected pos 624640 vs 624532', in a
    70-line traceback that said neither the file nor the disk. Now one line: the checkpoint, the cause, the space
    left, and how to continue from the newest checkpoint, which stays whole; once there is room, it does."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {"RLHFLAB_CACHE": str(stage_cache), "MLFLOW_TRACKING_URI": uri}
    with small_disk(tmp_path / "disk", "2M") as disk:  # one checkpoint of the tiny policy (~1.1 MiB) fits, not two
        out = disk / "run"
        args = [*SHRINK, "checkpoint.every_n_steps=2", f"output.dir={out}", f"hydra.run.dir={out}"]
        with cli_run([*args, "trainer.max_steps=6"], tmp_path, env) as proc:
            rc = proc.wait(timeout=300)
            output = proc.stdout.read()
        assert rc == 1, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        (line,) = [line for line in output.splitlines() if line.startswith("error: ")]
        first = out / "checkpoints" / "step-00000002"
        assert line.startswith(f"error: checkpoint: could not write {out}/checkpoints/step-00000004: No space left on "
                               "device ("), line
        assert line.endswith(f"free on its disk); make room on that disk; its newest checkpoint is {first}: once fixed, the "
                             f"same command with resume=auto output.dir={out} continues from it"), line
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]  # no partial one
        run_id = run_id_of(out)
        assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"
        subprocess.run(["mount", "-o", "remount,size=8M", str(disk)], check=True)  # room made
        with cli_run([*args, "trainer.max_steps=6", "resume=auto"], tmp_path, env) as proc:
            rc = proc.wait(timeout=300)
            output = proc.stdout.read()
        assert rc == 0, output[-3000:]
        assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
        assert [s for s, _ in history(uri, run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]  # each step once, one run
        assert (out / "policy" / "model.safetensors").is_file()


def test_a_full_disk_for_the_policy_or_the_cache_is_one_line_and_leaves_no_part(make_cfg, tmp_path, capsys):
    """The policy at the end of a run and a cache entry (here the base model) met save_pretrained's
    'SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)' in a traceback.
    The policy's line did not say that the trained weights were gone with it, so that the run is to do again."""
    import rlhflab.train as entry

    with small_disk(tmp_path / "disk", "300K") as disk:  # less than the tiny policy's 345 KiB of weights
        with pytest.raises(SystemExit):
            entry.main(make_cfg("trainer.max_steps=1", f"output.dir={disk}/run"))
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert re.fullmatch(rf"error: policy: could not write {disk}/run/policy: No space left on device \(\d+\.\d KiB free "
                            r"on its disk\); make room on that disk; no checkpoint was written before it \(set "
                            r"checkpoint\.every_n_steps to keep some\), so once fixed the same command starts anew \(the "
                            r"stages that finished are cached\)", line), line
        assert not (disk / "run" / "policy").exists()  # half a policy would load as garbage
        with pytest.raises(WriteFailed, match=rf"^model: could not write {disk}/cache/models/tiny-\w+: No space left on "
                                              r"device \(.* free on its disk\); make room on that disk, or set cache_dir="):
            train(make_cfg("trainer.max_steps=1", f"cache_dir={disk}/cache"))
        assert [p.name for p in (disk / "cache" / "models").iterdir() if not p.name.endswith(".lock")] == []
    assert WriteFailed.of(FileNotFoundError(2, "No such file or directory"), "policy", tmp_path) is None  # not the disk


def test_a_full_disk_under_the_sqlite_store_is_said_once_without_tracebacks(make_cfg, tmp_path, capfd):
    """A full disk under mlflow.db is the store stopping (the run stops with a checkpoint keeping its metrics). Before,
    MLflow's SQLite store also logged each failed write with two chained tracebacks (~45 lines, at every write until
    the stop) around rlhflab's own warning and error line."""
    from rlhflab.tracking import ensure_experiment

    with small_disk(tmp_path / "disk", "4M") as disk:
        uri = f"sqlite:///{disk}/mlflow.db"
        ensure_experiment(uri, "rlhflab")  # the store's tables, ~950 KiB
        room = shutil.disk_usage(disk).used + 64 * 1024  # the run and its params fit, not 30 steps of metrics
        subprocess.run(["mount", "-o", f"remount,size={room}", str(disk)], check=True)
        cfg = make_cfg("trainer.max_steps=30", "checkpoint.keep=1")
        with open_dict(cfg):
            cfg.logger.tracking_uri = uri
        with pytest.raises(TrackingLost, match=r"stopped answering \(\(sqlite3.OperationalError\) database or disk is full\);"):
            train(cfg)  # without SQLAlchemy's '(Background on this error at: https://sqlalche.me/...)'
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SQLAlchemy database error" not in err, err[-3000:]


@pytest.mark.mlflow_migrations
def test_a_full_disk_as_the_sqlite_store_is_made_is_one_short_line(tmp_path):
    """The line held SQLAlchemy's whole CREATE TABLE statement and its FAQ link, and no fix."""
    from rlhflab.tracking import ensure_experiment

    with small_disk(tmp_path / "disk", "64K") as disk:  # the store's tables take ~950 KiB
        uri = f"sqlite:///{disk}/mlflow.db"
        with pytest.raises(ConfigError) as err:
            ensure_experiment(uri, "rlhflab")
    assert str(err.value) == (f"logger.tracking_uri: MLflow cannot open '{uri}' (from MLFLOW_TRACKING_URI or logger.tracking_uri=): "
                              "OperationalError: (sqlite3.OperationalError) database or disk is full; make room on its disk, "
                              "or give a database on another (logger.tracking_uri=sqlite:///<path>)")


def test_a_full_sqlite_store_under_a_flushing_query_is_said_in_its_own_words():
    """A full disk under mlflow.db met as a query flushed MLflow's metrics batch (seen: stage sft's 184 values, then RL
    step 1): the line was '(raised as a result of Query-invoked autoflush; consider using a session.no_autoflush block
    if this flush is occurring prematurely) (sqlite3.OperationalError) database or disk is full [SQL: INSERT INTO
    metrics ...] [parameters: ', cut at 300 characters. The exception as MLflow's SQLite store raises it."""
    import sqlite3

    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException

    from rlhflab.tracking import store_error, store_failed

    full = sqlalchemy.exc.OperationalError('INSERT INTO metrics ("key", value, timestamp, step, is_nan, run_uuid) VALUES '
                                           "(?, ?, ?, ?, ?, ?)", [("sft/loss", 2.5, 1764300852000, 3, False, "ab12")] * 40,
                                           sqlite3.OperationalError("database or disk is full"))
    full.add_detail("raised as a result of Query-invoked autoflush; consider using a session.no_autoflush block if this "
                    "flush is occurring prematurely")
    err = MlflowException(message=full, error_code="TEMPORARILY_UNAVAILABLE")
    assert "[SQL: INSERT" in str(err.message) and store_failed(err)
    assert store_error(err) == "(sqlite3.OperationalError) database or disk is full"


def test_a_full_artifact_store_is_said_at_the_start_and_at_the_end_keeps_the_run_and_no_part(make_cfg, tmp_path, caplog):
    """MLflow keeps a run's files (config.yaml, generations.json, the policy) in the experiment's artifact store, not in
    mlflow.db. With that disk full, a run's start was a 30-line traceback. At its end the policy was half copied
    there (a truncated model.safetensors, listed as the run's policy), and the warning said the tracking store had
    stopped answering and that the run would stop at its next RL step (it had ended); generations.json was then
    dropped without a word."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with small_disk(tmp_path / "disk", "64K") as disk:  # config.yaml and generations.json fit, not the 345 KiB policy
        client = MlflowClient(uri)
        client.create_experiment("rlhflab", artifact_location=str(disk))
        cfg = make_cfg("trainer.max_steps=2", f"output.dir={tmp_path}/run")
        with open_dict(cfg):
            cfg.logger.tracking_uri = uri
        with caplog.at_level(logging.WARNING, logger="rlhflab"):
            result = train(cfg)
        run = client.get_run(result.run_id)
        policy = tmp_path / "run" / "policy"
        (line,) = [r.getMessage() for r in caplog.records if "artifact" in r.getMessage() or "mlflow" in r.getMessage()]
        assert line == (f"mlflow: the run's policy/: could not write {run.info.artifact_uri}/policy: No space left on device "
                        f"({line.split('(')[1].split(')')[0]}); make room on that disk (experiment 'rlhflab' keeps its "
                        f"runs' files there); it is in {policy}, and once there is room MLFLOW_TRACKING_URI={uri} mlflow "
                        f"artifacts log-artifacts --local-dir {policy} --run-id {result.run_id} --artifact-path policy logs it")
        assert run.info.status == "FINISHED" and run.data.tags["perf/mem_method"]  # the store took what came after
        assert sorted(a.path for a in client.list_artifacts(result.run_id)) == ["config.yaml", "generations.json"]  # no part
        subprocess.run(["mount", "-o", "remount,size=1M", str(disk)], check=True)  # room made: the line's command works
        command = line.split("room ")[-1].removesuffix(" logs it").split()
        subprocess.run([sys.executable, "-m", *command[1:]], env={**os.environ, "MLFLOW_TRACKING_URI": uri}, check=True,
                       capture_output=True)
        assert [a.path for a in client.list_artifacts(result.run_id, "policy")] == [f"policy/{f.name}" for f in sorted(policy.iterdir())]
        used = shutil.disk_usage(disk).used
        subprocess.run(["mount", "-o", f"remount,size={used}", str(disk)], check=True)  # full: not even config.yaml fits
        with open_dict(cfg):
            cfg.output.dir = str(tmp_path / "again")  # (its own: the first run's policy is in run/)
        with pytest.raises(WriteFailed, match=rf"^mlflow: the run's config.yaml: could not write {disk}/\w+/artifacts/"
                                              r"config.yaml: No space left on device \(0 B free on its disk\); make room on "
                                              r"that disk \(experiment 'rlhflab' keeps its runs' files there\)$"):
            train(cfg)
        failed = client.search_runs([run.info.experiment_id], order_by=["start_time DESC"])[0]
        assert failed.info.status == "FAILED" and not client.list_artifacts(failed.info.run_id)


# ---- bad model directories, hub ids, credentials ----------------------------------------------

def test_damaged_model_directories_are_one_line_before_anything_loads(tmp_path, capsys):
    from rlhflab.cli import preflight

    bad_json, truncated, bare = tmp_path / "bad_json", tmp_path / "truncated", tmp_path / "bare"
    for d in (bad_json, truncated, bare):
        d.mkdir()
    (bad_json / "config.json").write_text("{not json")
    (truncated / "config.json").write_text("{}")
    (truncated / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    (bare / "config.json").write_text("{}")  # its weights not copied: transformers' OSError after the stages ran
    for path, problem in ((bad_json, "config.json is not valid JSON"), (truncated, "model.safetensors is truncated"),
                          (bare, "no weights there (model.safetensors or pytorch_model.bin)")):
        with pytest.raises(SystemExit) as exit:
            preflight([f"model.sft_path={path}"])
        assert exit.value.code == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"error: model.sft_path: '{path}' is not an intact saved model ({problem}") and "\n" not in line
    # a path that is not there: it said 'not an intact saved model (no config.json there)', as of an empty directory
    with pytest.raises(SystemExit):
        preflight([f"model.sft_path={tmp_path}/none"])
    assert capsys.readouterr().err.strip() == (f"error: model.sft_path: no such directory '{tmp_path}/none'; give a directory "
                                               "written by save_pretrained, a hub id, or null to build/train it")


def test_a_tokenizer_saved_alone_is_a_model_tokenizer_and_a_reward_model_is_no_policy(tmp_path, capsys):
    """model.tokenizer=<what tokenizer.save_pretrained wrote> (the docs' fix for a tokenizer without a pad token) was
    refused for its missing config.json. A sequence classifier given as the policy loaded with a random LM head, and
    the run trained and saved it without a word (the mirror of a language model given as the reward model)."""
    from transformers import GPTNeoXConfig, GPTNeoXForSequenceClassification

    from rlhflab.cli import preflight
    from rlhflab.config import validate
    from rlhflab.tasks.sentiment import SentimentTask

    SentimentTask().build_tokenizer().save_pretrained(tmp_path / "tok")
    preflight([f"model.tokenizer={tmp_path}/tok"])  # its own line comes later: a model built from arch has its own
    with pytest.raises(SystemExit):
        preflight([f"model.tokenizer={tmp_path}"])
    assert capsys.readouterr().err.startswith(f"error: model.tokenizer: '{tmp_path}' is not a saved tokenizer (none of "
                                              "tokenizer.json, tokenizer_config.json, tokenizer.model, ... there); give")
    GPTNeoXForSequenceClassification(GPTNeoXConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, num_labels=1)).save_pretrained(tmp_path / "rm")
    for key in ("sft_path", "name_or_path"):
        with pytest.raises(ConfigError, match=rf"^model.{key}: '{tmp_path}/rm' is a reward model "
                                              r"\(GPTNeoXForSequenceClassification\) with no language-model head"):
            validate(compose_cfg([f"model.{key}={tmp_path}/rm"]))


@pytest.mark.parametrize("offline", [True, False])
def test_an_unknown_hub_id_is_one_line_and_creates_no_run(make_cfg, tmp_path, monkeypatch, offline):
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = make_cfg("model.name_or_path=nobody/no-such-model", "model.arch=null")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^model.name_or_path: 'nobody/no-such-model' is not in the local Hugging Face cache"):
        train(cfg)
    assert time.monotonic() - started < 30  # not a minute of retries
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("offline", [True, False])
def test_an_unknown_hub_dataset_is_one_line_and_creates_no_run(make_cfg, tmp_path, monkeypatch, offline):
    """A hub dataset name that is neither cached nor reachable: before, the MLflow run was made first, then
    datasets' retries (30 s here) and a warning line led to the error."""
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "datasets")  # read at import: the attribute
    example = ROOT / "examples" / "reverse"
    cfg = make_cfg("task=prompts", f"task.path={example}/train.jsonl", "task.eval_path=nobody/no-such-data",
                   f"task.demonstrations_path={example}/demos.jsonl", "task.tokenizer=char", "reward=function",
                   f"reward.fn={example}/reward.py:exact", shrink=False)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^task.eval_path: 'nobody/no-such-data' is not in the local Hugging Face "
                                          r"datasets cache and (HF_HUB_OFFLINE is set|the hub cannot be reached)"):
        train(cfg)
    assert time.monotonic() - started < 30  # not datasets' retries
    assert not (tmp_path / "mlflow.db").exists()
    # one that a load cached where datasets reads it offline passes the check (the load reads it)
    from rlhflab.models.checks import check_hub_dataset

    (tmp_path / "datasets" / "nobody___my_data" / "default" / "0.0.0" / ("0" * 16)).mkdir(parents=True)
    check_hub_dataset("task.eval_path", "nobody/MyData")


@pytest.mark.slow
def test_credentials_never_reach_params_artifacts_or_logs(mlflow_server, tmp_path, stage_cache):
    """A tracking URI with a password (here against a real `mlflow server`, which ignores it) is redacted
    in the params, the config.yaml artifact, the tags, the log and mlflow_run.json."""
    secret = mlflow_server.replace("http://", "http://alice:s3cr3t-token@")
    out = tmp_path / "run"
    env = {"RLHFLAB_CACHE": str(stage_cache), "MLFLOW_TRACKING_URI": secret, "NO_PROXY": "127.0.0.1,localhost"}
    with cli_run([*SHRINK, "trainer.max_steps=1", f"output.dir={out}", f"hydra.run.dir={out}"], tmp_path, env) as proc:
        assert proc.wait(timeout=300) == 0, proc.stdout.read()[-3000:]
        console = proc.stdout.read()
    client = MlflowClient(mlflow_server)
    run = client.get_run(run_id_of(out))
    texts = {"params": json.dumps(run.data.params), "tags": json.dumps(run.data.tags), "console": console,
             "train.log": (out / "train.log").read_text(), "mlflow_run.json": (out / "mlflow_run.json").read_text(),
             "config.yaml": Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text()}
    assert [name for name, text in texts.items() if "s3cr3t" in text] == []
    assert run.data.params["logger.tracking_uri"].startswith("http://alice:***@127.0.0.1")
