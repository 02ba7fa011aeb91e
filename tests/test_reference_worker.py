"""mode.reference=process (lit/reference.py): a forked process computes what it is given, reports a failure with
its traceback, is noticed when it dies, ignores SIGTERM, and ends when closed."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from rlhflab.lit.reference import ReferenceCrashed, ReferenceProcess, ReferenceThread


def masked_sum(query, response, mask):
    """A stand-in for the reference's log-probs: (n, R) floats from the rows it is sent."""
    return (query.float().sum(1, keepdim=True) + response.float()) * mask


def failing(query, response, mask):
    raise ValueError("reference exploded on purpose")


ROWS = (torch.arange(6).view(2, 3), torch.arange(8).view(2, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool())


@pytest.mark.parametrize("worker", [ReferenceThread, ReferenceProcess])
def test_it_returns_what_the_function_computes(worker):
    w = worker(masked_sum)
    try:
        for _ in range(3):  # one process serves every step
            assert torch.equal(w.submit(*ROWS)(), masked_sum(*ROWS))
    finally:
        w.close()


def test_a_failure_in_the_process_reaches_the_learner_with_its_traceback():
    w = ReferenceProcess(failing)
    try:
        result = w.submit(*ROWS)
        with pytest.raises(ReferenceCrashed, match="reference exploded on purpose") as err:
            result()
        assert "Traceback" in str(err.value)
    finally:
        w.close()
    assert w.proc is None


def test_a_killed_process_is_noticed_not_waited_for():
    w = ReferenceProcess(masked_sum)
    try:
        os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.join(timeout=30)
        with pytest.raises(ReferenceCrashed, match=r"died \(exit code -9\)"):
            w.submit(*ROWS)()
    finally:
        w.close()


def test_it_ignores_sigterm_which_is_the_learners_to_handle():
    """Even one that arrives while the fork is still starting up (a scheduler signalling the process group):
    with the inherited handler it would stop the process, or announce a second checkpoint."""
    w = ReferenceProcess(masked_sum)
    try:
        os.kill(w.proc.pid, signal.SIGTERM)  # before it reaches its own code
        assert torch.equal(w.submit(*ROWS)(), masked_sum(*ROWS))  # running its loop
        os.kill(w.proc.pid, signal.SIGTERM)  # the learner finishes its step and checkpoints, then closes it
        assert torch.equal(w.submit(*ROWS)(), masked_sum(*ROWS))
        assert w.proc.is_alive()
    finally:
        w.close()
    assert w.proc is None


def test_a_learner_that_never_closes_it_still_exits():
    """A learner failing before its teardown: the process (which ignores SIGTERM) must not hold up the exit."""
    code = ("import torch\n"
            "from rlhflab.lit.reference import ReferenceProcess\n"
            "w = ReferenceProcess(lambda q, r, m: r.float())\n"
            "assert w.submit(torch.zeros(1, 1), torch.ones(1, 2), torch.ones(1, 2))().sum() == 2\n"
            "print(w.proc.pid, flush=True)\n"
            "raise SystemExit(3)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    pid = int(out.stdout.split()[0])
    with pytest.raises(ProcessLookupError):  # reaped, not left behind
        os.kill(pid, 0)


SMALL_SHM = r"""
import json, logging
import torch
from rlhflab.lit.data import encode_prompts
from rlhflab.lit.reference import ReferenceProcess
from rlhflab.rollout.hf import HFGenerator
from test_lean_decode import PROMPTS, TOK, llama

said = []
logging.getLogger("rlhflab.rollout.hf").addHandler(logging.Handler())
logging.getLogger("rlhflab.rollout.hf").handlers[-1].emit = lambda r: said.append(r.getMessage())
logging.getLogger("rlhflab.rollout.hf").setLevel(logging.INFO)
out = {}
for name, width in (("small", 32), ("large", 256)):  # ~0.1 MB and ~4 MB of float32 parameters
    policy = llama(hidden_size=width, intermediate_size=2 * width)
    w = ReferenceProcess(lambda q, r, m: (q.float().sum(1, keepdim=True) + r.float()) * m, policy)
    try:
        rows = torch.arange(6).view(2, 3), torch.arange(8).view(2, 4), torch.ones(2, 4)
        out[name] = {"splits": w.generating is not None, "shared": all(p.is_shared() for p in policy.parameters()),
                     "reference": w.submit(*rows)().tolist(), "same": []}
        query = encode_prompts(TOK, PROMPTS).repeat_interleave(2, dim=0)
        for update in range(2):
            if update:  # in place, as the optimizer writes them: the process must sample from the new weights
                with torch.no_grad():
                    policy.lm_head.weight.mul_(-1)
            drawn = []
            for split in (False, True):
                torch.manual_seed(update)
                gen = HFGenerator(temperature=1.0, max_new_tokens=10)
                gen.setup(TOK, 10)
                gen.split_with = (lambda: w.generating) if split else None
                drawn.append(gen._generate(policy, query, greedy=False)[0])
            out[name]["same"].append(torch.equal(*drawn))
    finally:
        w.close()
out["split_said"] = sum("samples the last rows of each batch" in line for line in said)
print(json.dumps(out))
"""


def test_a_policy_larger_than_dev_shm_is_shared_with_the_process_all_the_same(tmp_path):
    """In a 1 MB /dev/shm (a private mount, as a container's small one), a ~0.1 MB and a ~4 MB policy both move to
    shared memory (a memfd, which the mount does not limit): the process samples half of each batch, the tokens of the
    learner's whole batch before and after an in-place update of the weights, and computes the reference. Until the
    memfd (9ac907c) the larger stayed out of /dev/shm and the learner sampled every row; before 9ac907c share_memory_
    raised 'No space left on device'."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and unshare -m, to mount a small /dev/shm of its own")
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs /dev/shm && "
                           f"exec {sys.executable} {script}"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    expected = ((torch.arange(6).view(2, 3).float().sum(1, keepdim=True) + torch.arange(8).view(2, 4).float())).tolist()
    for name in ("small", "large"):
        assert out[name]["splits"] and out[name]["shared"], name
        assert out[name]["reference"] == expected, name
        assert out[name]["same"] == [True, True], name
    assert out["split_said"] == 4  # every split draw (a generator of its own each, which says it once)
