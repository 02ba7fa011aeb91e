"""Distributed runs that stop: a signal to every rank or to rank 0 (one checkpoint, a resume), a rank that fails while
rank 0 is busy, a collective whose peer is gone. 2 CPU ranks over gloo, from the command line as a user runs them
(tests/test_distributed.py has the runs that finish)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from mlflow.tracking import MlflowClient

from conftest import cli_run, wait_for
from test_distributed import SHORT, clean_env, run

@pytest.mark.slow
@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm-rank0"])
def test_a_signal_stops_both_ranks_with_one_checkpoint_and_resumes(tmp_path, stage_cache, sig, group):
    """Ctrl-C in a terminal sends SIGINT to every rank; `kill PID` sends SIGTERM to rank 0 alone. Either way both
    ranks stop at the same step boundary, one checkpoint is written, and the run exits 128 + the signal without a
    traceback. Before: with SIGINT, rank 1 (which does not hold the written path) took the checkpoint for missing
    and gathered for a second one after rank 0 had left (a gloo 'Connection closed by peer' traceback); with
    SIGTERM, Lightning's handler (installed after on_fit_start took the signals back) broadcast from inside the
    signal handler while rank 1 was in the backward's all-reduce: both ranks hung. The checkpoint then resumes
    on two ranks into the same MLflow run."""
    out = tmp_path / "run"
    args = ["trainer=ddp", *SHORT, f"output.dir={out}", f"hydra.run.dir={out}"]
    with cli_run([*args, "trainer.max_steps=100000"], tmp_path, clean_env(tmp_path, stage_cache)) as proc:
        log = out / "train.log"
        wait_for(lambda: log.exists() and "eval after 0 RL steps" in log.read_text(), 600, "the RL stage", proc)
        (os.killpg if group else os.kill)(proc.pid, sig)  # the terminal signals the whole foreground group
        rc = proc.wait(timeout=120)
        output = proc.stdout.read()
    assert rc == 128 + sig, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    (checkpoint,) = (out / "checkpoints").glob("step-*")
    assert output.count("checkpoint: ") == 1, output[-4000:]
    assert output.count("stopped: ") == 1, output[-4000:]  # rank 0 speaks for both
    assert output.count(" received: stopping after this step") == 1, output[-4000:]  # was once per rank
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(run_id).info.status == "KILLED"
    if sig == signal.SIGTERM:
        return  # the resume is the same either way
    step = int(checkpoint.name.split("-")[1])
    run(tmp_path, *args, f"trainer.max_steps={step + 2}", "resume=auto", cache=stage_cache)
    assert client.get_run(run_id).info.status == "FINISHED"
    losses = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert losses == list(range(1, step + 3)), losses  # every step once, the resumed ones in the same run


@pytest.mark.slow
def test_a_rank_that_fails_while_rank_0_is_busy_ends_the_run_failed_in_one_line(tmp_path, stage_cache):
    """Rank 1's reward function raises while rank 0's is still working. Before, Lightning's observer SIGKILLed rank
    0 five seconds after rank 1 exited: exit 137, no line from rank 0, and the MLflow run RUNNING forever. Now rank
    0's watch gives it GRACE_S to end by itself, then marks the run FAILED and says which rank failed."""
    (tmp_path / "rank_reward.py").write_text(
        "import os, time\n"
        "def score(prompts, completions, **columns):\n"
        "    if os.environ.get('LOCAL_RANK') == '1':\n"
        "        raise ValueError('rank 1 refuses')\n"
        "    time.sleep(600)  # rank 0: busy far longer than the watch waits\n")
    out = tmp_path / "run"
    args = ["trainer=ddp", *SHORT, "reward=function", "reward.fn=rank_reward.py:score", f"output.dir={out}"]
    with cli_run(args, tmp_path, clean_env(tmp_path, stage_cache)) as proc:
        rc = proc.wait(timeout=300)
        output = proc.stdout.read()
    assert rc == 1, output[-4000:]
    assert "Traceback" not in output and "zombies" not in output, output[-4000:]  # Lightning's observer is not there
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and errors[0].startswith("error: rank 1 of 2: reward function score raised ValueError: "
                                                     "rank 1 refuses"), errors
    assert errors[1] == ("error: rank 1 of 2 exited with code 1 (its error is above); rank 0 stopped the run; "
                         "the MLflow run is FAILED"), errors
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    assert MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id).info.status == "FAILED"


def _rank(rank: int, store: str, results) -> None:
    """One of two forked ranks over gloo: a shared error, then rank 1 leaves and rank 0's collective fails."""
    import torch

    from rlhflab import distributed
    from rlhflab.errors import NonFiniteError

    code = 0
    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        shared = distributed.as_rank_error(NonFiniteError("loss not finite", shared=True))
        results.put((rank, "shared", shared.rank, shared.quiet, str(shared)))
        distributed.barrier()
        if rank == 1:
            code = 1  # gone without a word, as a rank that crashed
            return
        try:
            distributed.gather("anything")
        except RuntimeError as err:
            said = distributed.as_rank_error(err)
            results.put((rank, type(said).__name__, said.rank, said.quiet, str(said)))
    except BaseException as err:  # the test says what went wrong at once, not after its timeout
        results.put((rank, "crashed", repr(err), None, ""))
    finally:
        results.close()
        results.join_thread()  # what it put is in the pipe before the process goes
        os._exit(code)


def test_a_collective_that_lost_its_peer_is_one_line_and_a_shared_error_is_said_once(tmp_path):
    """Before, the rank left alone printed gloo's 'Connection closed by peer' as a Hydra traceback, and an error
    every rank raised together (a non-finite loss) printed once per rank."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), results)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        got = []
        while len(got) < 3 and not any(g[1] == "crashed" for g in got):
            got.append(results.get(timeout=120))
        got.sort()
    finally:
        for p in procs:
            p.kill()
            p.join()
    lost = got[0][4]  # gloo says 'Connection closed by peer' or 'Read error [...]: Connection reset by peer'
    assert got[0][:4] == (0, "RankLost", "rank 0 of 2", False) and " by peer" in lost, got
    assert lost.startswith("another rank stopped first (its own error line says why, or its log): RuntimeError: "), got
    assert got[1] == (0, "shared", "rank 0 of 2", False, "loss not finite"), got
    assert got[2] == (1, "shared", "rank 1 of 2", True, "loss not finite"), got
