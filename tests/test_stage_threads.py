"""stages.batch_threads: stages sft, rm and hydra_sft train each batch as shares in threads of their own, and learn what one
forward learns (to rounding)."""

import os
import threading

import lightning as L
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from rlhflab.lit.data import tensor_loader
from rlhflab.lit.stage_modules import BatchThreads, HydraSFTModule, RewardModule, SFTModule
from rlhflab.models.heads import ScalarHead
from rlhflab.train import batch_threads, stage_threads, with_batch_threads

PAD = 0


def tiny(cls):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=40, pad_token_id=PAD, num_labels=1)
    return cls(config)


def fit(module, loader, accumulate: int) -> None:
    L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
              enable_checkpointing=False, enable_model_summary=False, accumulate_grad_batches=accumulate).fit(module, loader)


def threads_seen(model) -> set[str]:
    """The names of the threads that run the model's forwards."""
    seen = set()
    model.model.embed_tokens.register_forward_hook(lambda *_: seen.add(threading.current_thread().name))
    return seen


def sft_data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (25, 9), generator=g)  # batches of 8: the last of 1 row, one share
    ids[::3, 7:] = PAD  # rows of different lengths
    labels = ids.clone()
    labels[:, :3] = -100  # the prompt
    labels[ids == PAD] = -100
    return ids, (ids != PAD).long(), labels


@pytest.mark.parametrize("accumulate", [1, 2])
def test_sft_in_two_batch_threads_learns_what_one_forward_learns(accumulate):
    models = {}
    for threads in (1, 2):
        model = tiny(LlamaForCausalLM)
        seen = threads_seen(model)
        module = SFTModule(model, 1e-2, threads)
        fit(module, tensor_loader(*sft_data(), batch_size=8, seed=0), accumulate)
        models[threads] = (model, seen)
    (one, seen_one), (two, seen_two) = models[1], models[2]
    # the shares ran in a thread of their own: the test compares two ways of training, not one twice
    assert not any(n.startswith("rlhflab-stage") for n in seen_one) and any(n.startswith("rlhflab-stage") for n in seen_two)
    start = tiny(LlamaForCausalLM)
    moved = 0
    for (name, a), b, s in zip(one.named_parameters(), two.parameters(), start.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)  # rounding: AdamW moves each ~1e-2
        moved += not torch.equal(a, s)
    assert moved == len(list(start.parameters()))  # every weight trained (a share's gradients dropped would differ)


def pair_data(seed: int, pairs: int):
    """(chosen, rejected) token ids, some chosen rows shorter."""
    chosen, rejected = torch.randint(1, 40, (2, pairs, 7), generator=torch.Generator().manual_seed(seed))
    chosen[::4, 5:] = PAD
    return chosen, rejected


def test_rm_in_two_batch_threads_learns_what_one_forward_learns():
    chosen, rejected = pair_data(2, 20)
    trained = {}
    for threads in (1, 2):
        model = tiny(LlamaForSequenceClassification)
        fit(RewardModule(model, 1e-2, threads), tensor_loader(chosen, rejected, batch_size=10, seed=0), 1)
        trained[threads] = model
    for (name, a), b in zip(trained[1].named_parameters(), trained[2].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)  # rounding: AdamW moves each ~1e-2


def test_hydra_sft_in_two_batch_threads_learns_what_one_forward_learns():
    """Each share is a share of the demonstrations and one of the pairs (batches of their own sizes: 8 demonstrations
    and 6 pairs a step, the pairs' last batch of 1 pair, where the step runs as one share), the LM head, the reward
    head and the trunk trained by both losses."""
    from lightning.pytorch.utilities import CombinedLoader

    chosen, rejected = pair_data(3, 13)
    trained = {}
    for threads in (1, 2):
        model = tiny(LlamaForCausalLM)
        seen = threads_seen(model)
        head = ScalarHead(model.config.hidden_size)
        loader = CombinedLoader({"sft": tensor_loader(*sft_data(), batch_size=8, seed=0),
                                 "rm": tensor_loader(chosen, rejected, batch_size=6, seed=0)}, mode="max_size_cycle")
        fit(HydraSFTModule(model, head, PAD, 1e-2, 1e-2, 0.5, threads), loader, 1)
        trained[threads] = (model, head, seen)
    (one, one_head, seen_one), (two, two_head, seen_two) = trained[1], trained[2]
    assert not any(n.startswith("rlhflab-stage") for n in seen_one) and any(n.startswith("rlhflab-stage") for n in seen_two)
    start = tiny(LlamaForCausalLM)
    for (name, a), b, s in zip([*one.named_parameters(), *one_head.named_parameters()],
                               [*two.parameters(), *two_head.parameters()], [*start.parameters(), None]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)  # rounding: AdamW moves each ~1e-2
        assert s is None or not torch.equal(a, s), name  # every weight trained


def test_a_share_that_fails_raises_its_error_after_every_share_has_ended():
    shares = BatchThreads(2)
    ended = []

    def share(rows):
        if threading.current_thread().name.startswith("rlhflab-stage"):
            raise ValueError("the second share")
        ended.append(len(rows))
        return (rows.sum(),)

    with pytest.raises(ValueError, match="the second share"):
        shares.forwards(share, torch.arange(6))
    assert ended == [3] and shares.pending == []
    shares.close()


def test_batch_threads_apply_to_one_process_on_the_cpu(make_cfg):
    assert batch_threads(make_cfg("stages.batch_threads=2")) == 2
    assert batch_threads(make_cfg("stages.batch_threads=2", "trainer=ddp")) == 1  # the ranks share the batch
    assert batch_threads(make_cfg("stages.batch_threads=2", "trainer.precision=16-mixed")) == 1  # its scaler
    gpu = make_cfg("stages.batch_threads=2")
    gpu.trainer.accelerator = "gpu"
    assert batch_threads(gpu) == 1
    stages = {"sft": {"lr": 1.0}, "rm": {"lr": 2.0}, "hydra_sft": {}}
    assert with_batch_threads(stages, 1) is stages  # one forward: the stage caches' keys as before
    assert with_batch_threads(stages, 2) == {"sft": {"lr": 1.0, "batch_threads": 2}, "rm": {"lr": 2.0, "batch_threads": 2},
                                             "hydra_sft": {}}


def test_batch_threads_share_the_cores_with_torchs_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    with stage_threads(None, 1, 2):
        assert torch.get_num_threads() == max(1, cores // 2)
    with stage_threads(3, 1, 2):  # stages.torch_threads, as given
        assert torch.get_num_threads() == 3


def test_the_helper_thread_runs_under_the_callers_autocast():
    shares = BatchThreads(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtypes = [loss.dtype for loss, in shares.forwards(lambda x: ((x @ x.T).sum(),), torch.ones(4, 3))]
    assert dtypes == [torch.bfloat16, torch.bfloat16]
    shares.close()



def test_a_sync_run_that_leaves_cores_idle_on_a_large_policy_says_so(make_cfg, monkeypatch):
    """torch_threads=1 (the default) on the 113M preset left the second core idle in sync PPO under memory=lora/hydra,
    1.5x slower than torch_threads=null: the run says so in one line, where no reference thread uses the core and the
    policy is large; the tiny default run (its reference thread on the other core) says nothing."""
    from types import SimpleNamespace

    import rlhflab.train as train

    policy = torch.nn.Linear(100, 100)  # 10,100 parameters, the threshold lowered to them
    monkeypatch.setattr(train, "THREADS_PAY_FROM", 10_000)
    sync = SimpleNamespace(name="sync", reference="learner")
    cfg = make_cfg("memory=lora", "algo=ppo")
    line = train.idle_cores_hint(cfg, sync, policy, cores=2)
    assert line.startswith("torch_threads=1: RL runs on 1 of this machine's 2 cores; on a policy of "), line
    assert "M parameters torch_threads=null (every core) is likely faster" in line, line
    assert train.idle_cores_hint(cfg, sync, policy, cores=1) is None  # no core idle
    assert train.idle_cores_hint(cfg, SimpleNamespace(name="sync", reference="thread"), policy, cores=2) is None
    assert train.idle_cores_hint(cfg, SimpleNamespace(name="async"), policy, cores=2) is None  # its own thread settings
    assert train.idle_cores_hint(make_cfg("memory=lora", "algo=ppo", "torch_threads=null"), sync, policy, cores=2) is None
    assert train.idle_cores_hint(make_cfg("memory=lora", "algo=ppo", "trainer=ddp"), sync, policy, cores=2) is None
    monkeypatch.setattr(train, "THREADS_PAY_FROM", 50_000_000)
    assert train.idle_cores_hint(cfg, sync, policy, cores=2) is None  # a small policy: one thread is as fast
