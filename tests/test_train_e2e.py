"""End to end: the real config, shrunk, through train(cfg): stages, RL, MLflow."""

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from torch.optim.optimizer import register_optimizer_step_pre_hook

from conftest import counting_migrations
from rlhflab.train import stage_threads, train

REQUIRED_METRICS = [
    "train/reward", "train/kl", "train/loss", "eval/gold_reward",
    "perf/samples_per_s", "perf/gen_s", "perf/train_s", "rollout/staleness", "train/grad_norm",
]


def test_the_gradient_norm_is_logged_before_clipping(make_cfg):
    """train/grad_norm is the norm the clip sees (as TRL's grad_norm), not the clipped one; the update is clipped."""
    cfg = make_cfg("trainer.max_steps=2", "rl.max_grad_norm=1e-6")
    result = train(cfg)
    norms = [m.value for m in MlflowClient(cfg.logger.tracking_uri).get_metric_history(result.run_id, "train/grad_norm")]
    assert len(norms) == 2 and all(n > 1e-4 for n in norms), norms
    unclipped = train(make_cfg("trainer.max_steps=2", "rl.max_grad_norm=null"))
    unclipped_norms = [m.value for m in MlflowClient(cfg.logger.tracking_uri).get_metric_history(unclipped.run_id, "train/grad_norm")]
    assert unclipped_norms[0] == pytest.approx(norms[0], rel=1e-6)  # the same first batch and weights: the same gradient
    # The clip changed the update (AdamW's state scales with the gradients it saw), so the second gradients differ.
    assert unclipped_norms[1] != pytest.approx(norms[1], rel=1e-3)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_fused_update_steps_with_its_gradients_clipped_to_max_grad_norm(make_cfg, precision):
    """The RL update clips with the norm it logs, then steps the fused AdamW, under bf16-mixed too (Lightning's
    clip refused a fused optimizer there, so bf16 ran PyTorch's per-tensor loop: 413 against 145 ms a step at 126M).
    At each step the gradients' norm is min(logged norm, rl.max_grad_norm)."""
    seen = []  # (fused, the gradients' norm) at each optimizer step

    def before_step(opt, args, kwargs):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        seen.append((opt.defaults["fused"], float(torch.nn.utils.get_total_norm(grads))))

    handle = register_optimizer_step_pre_hook(before_step)
    try:
        cfg = make_cfg("trainer.max_steps=3", "rl.max_grad_norm=0.05", f"trainer.precision={precision}")
        result = train(cfg)
    finally:
        handle.remove()
    rl = seen[-3:]  # the stages before RL step their own (unfused) optimizers
    logged = [m.value for m in MlflowClient(cfg.logger.tracking_uri).get_metric_history(result.run_id, "train/grad_norm")]
    assert len(logged) == 3 and all(n > 0.05 for n in logged), logged  # so each of the three was clipped
    assert [fused for fused, _ in rl] == [True] * 3, rl
    assert [norm for _, norm in rl] == pytest.approx([0.05] * 3, rel=1e-4), (rl, logged)


def test_16_mixed_clips_unscaled_gradients_and_skips_the_steps_a_float16_overflow_spoils(make_cfg, monkeypatch):
    """trainer.precision=16-mixed (a GPU without bf16): Lightning's manual_backward scales the loss and the scaler
    unscales only inside opt.step(), so the update took the norm of gradients times the scale (65,536 at first),
    logged it, clipped them to rl.max_grad_norm / scale (all but freezing the policy), and stopped the run at the
    first float16 overflow, which the scaler exists to skip. Lightning runs fp16 AMP on GPUs only (on CPU it runs
    bf16 instead), so here the RL stage gets the plugin itself, with a CPU loss scaler starting at 1e10, where the
    tiny model's float16 gradients overflow, and falling 1000-fold on each overflow."""
    import rlhflab.train as train_module
    from lightning.pytorch.plugins import MixedPrecision

    make_trainer = train_module._make_trainer

    def fp16_rl(cfg, logger, stage, callbacks=(), **overrides):
        if stage == "rl":  # the trainer's settings without trainer.precision, which the plugin replaces
            cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
            del cfg.trainer.precision
            scaler = torch.amp.GradScaler("cpu", init_scale=1e10, backoff_factor=1e-3)
            overrides["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler)]
        return make_trainer(cfg, logger, stage, callbacks, **overrides)

    stepped = []  # the unscaled gradients' norm at each optimizer step the scaler let through

    def before_step(opt, args, kwargs):
        if getattr(opt, "found_inf", None) is not None and float(opt.found_inf):  # the fused step skips it
            return
        scale = float(opt.grad_scale) if getattr(opt, "grad_scale", None) is not None else 1.0
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        stepped.append(float(torch.nn.utils.get_total_norm(grads)) / scale)

    monkeypatch.setattr(train_module, "_make_trainer", fp16_rl)
    handle = register_optimizer_step_pre_hook(before_step)
    try:
        cfg = make_cfg("trainer.max_steps=6", "rl.max_grad_norm=0.05", "checkpoint.every_n_steps=6")
        result = train(cfg)  # before, NonFiniteError: the gradient norm not finite at RL step 1
    finally:
        handle.remove()
    client = MlflowClient(cfg.logger.tracking_uri)
    history = {key: [m.value for m in client.get_metric_history(result.run_id, key)]
               for key in ("train/overflow", "train/loss_scale", "train/grad_norm")}
    overflows, scales, logged = history["train/overflow"], history["train/loss_scale"], history["train/grad_norm"]
    assert len(overflows) == len(scales) == 6 and overflows[0] == 1.0 and overflows[-1] == 0.0, history
    assert scales[0] == 1e10 and scales == sorted(scales, reverse=True), history  # lowered on each overflow
    kept = int(6 - sum(overflows))
    assert len(logged) == kept and all(0.05 < n < 100 for n in logged), history  # unscaled (before: times the scale)
    rl = stepped[-kept:]  # the stages before RL step their own optimizers, in float32
    assert rl == pytest.approx([0.05] * kept, rel=1e-4), (rl, history)


def test_a_steps_time_holds_what_the_loop_does_between_steps(make_cfg, monkeypatch):
    """perf/step_s (and samples/s, the overlap efficiency, the report's samples/s) ran from training_step's start
    to its end, so logging and MLflow's writes, Lightning's loop and the next batch were in no step's time (7% of a
    default sync step here), though the generator waits through them. Here each step's logging takes 2 s more:
    the step after holds it, and an evaluation's time stays out (rl.eval_every=2). (With 0.3 s, a step without it
    took 0.35 s in .ci/run under load: 2 s is far above any bare step of this tiny run.)"""
    import time

    from rlhflab.lit.rl_module import RLHFModule

    log_step = RLHFModule._log_step
    monkeypatch.setattr(RLHFModule, "_log_step", lambda self, metrics: (log_step(self, metrics), time.sleep(2.0)))
    cfg = make_cfg("trainer.max_steps=4", "rl.eval_every=2")
    result = train(cfg)
    steps = [m.value for m in MlflowClient(cfg.logger.tracking_uri).get_metric_history(result.run_id, "perf/step_s")]
    # steps 2 and 4 hold the logging of steps 1 and 3; step 3 starts after step 2's evaluation, which is in no step
    assert len(steps) == 4 and steps[1] >= 2.0 and steps[3] >= 2.0 and steps[0] < 2.0 and steps[2] < 2.0, steps
    # sync mode overlaps nothing: no overlap efficiency, as per step (its run-level one was train / step, 0.5-1)
    assert "perf/mean_samples_per_s" in result.metrics and "perf/mean_overlap_eff" not in result.metrics


def test_stage_threads_default_to_the_cores_shared_among_the_ranks_and_give_the_count_back(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(1)
    seen = {}
    for threads, local_ranks, omp in ((None, 1, None), (None, 2, None), (None, 2, "3"), (1, 1, "3"), (3, 2, None)):
        if omp:
            monkeypatch.setenv("OMP_NUM_THREADS", omp)
        else:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        with stage_threads(threads, local_ranks):
            seen[threads, local_ranks, omp] = torch.get_num_threads()
        assert torch.get_num_threads() == 1
    # OMP_NUM_THREADS is a count per process already (Lightning sets it for the ranks it starts): not divided again
    assert seen == {(None, 1, None): cores, (None, 2, None): max(1, cores // 2), (None, 2, "3"): 3, (1, 1, "3"): 1,
                    (3, 2, None): 3}


def test_default_pipeline_raises_gold_reward_and_lands_in_mlflow(make_cfg, tmp_path, caplog):
    # Its own cache: every stage runs here, whatever other tests trained before.
    cfg = make_cfg("trainer.max_steps=80", f"cache_dir={tmp_path}/cache", "stages.torch_threads=2")
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        result = train(cfg)
    # the stages with stages.torch_threads, RL and what follows with torch_threads again
    assert "stage sft: training on 512 demonstrations, 2 torch threads" in caplog.text
    assert "stage rm: training on 922 preference pairs (102 held out), 2 torch threads" in caplog.text
    assert torch.get_num_threads() == cfg.torch_threads == 1
    before, after = result.metrics["eval/gold_reward_before"], result.metrics["eval/gold_reward"]
    assert after > before + 0.2, (before, after)

    client = MlflowClient(cfg.logger.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    for key, value in {"algo": "rloo", "mode": "sync", "staleness": "0", "memory": "full", "model": "tiny"}.items():
        assert run.data.tags[key] == value
    assert run.data.params["algo.kl_coef"] == "0.05"
    # as config.yaml writes them, not Python's None, True and ['a', 'b']
    assert run.data.params["model.sft_path"] == "null" and run.data.params["trainer.enable_checkpointing"] == "false"
    assert run.data.params["output.log_policy"] == "true" and run.data.params["kl_budget"] == "null"
    assert run.data.params["rlhflab.ranks"] == "1"  # the processes that trained (trainer.devices=auto says nothing)
    from rlhflab.naming import EVAL_METRICS

    # what optimized_metric is checked against: the closing metrics' evaluations
    assert {k for k in result.metrics if k.startswith("eval/")} == {"eval/gold_reward", "eval/gold_reward_before", "eval/kl"}
    assert {"eval/gold_reward", "eval/gold_reward_before", "eval/kl"} <= set(EVAL_METRICS)
    for name in REQUIRED_METRICS:
        assert name in run.data.metrics, name
    # every RL step is logged, not just the last
    assert len(client.get_metric_history(result.run_id, "train/reward")) == 80
    gold = client.get_metric_history(result.run_id, "eval/gold_reward")
    assert gold[0].value == pytest.approx(before) and gold[-1].value == pytest.approx(after)
    # the SFT and RM stages logged into the same run
    assert "sft/loss" in run.data.metrics and "rm/held_out_accuracy" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"config.yaml", "generations.json"} <= artifacts
    # beside the database, not in ./mlruns of whatever directory the run started from (the repository's, here)
    assert run.info.artifact_uri == f"{tmp_path}/mlruns/rlhflab/{result.run_id}/artifacts"
    # (not client.load_table: it finds runs through mlflow.search_runs, in the process-wide tracking URI)
    table = json.loads(Path(client.download_artifacts(result.run_id, "generations.json", str(tmp_path))).read_text())
    assert {"prompt", "response", "reward", "gold_reward", "rl_step"} <= set(table["columns"])
    assert {row[table["columns"].index("rl_step")] for row in table["data"]} == {0, 80}
    # and the same rows beside the policy, one object each, readable without MLflow (before: in MLflow only)
    kept = [[row[c] for c in table["columns"]] for row in json.loads((result.output_dir / "generations.json").read_text())]
    assert len(kept) == len(table["data"]) == 8
    assert kept == table["data"]
    # MLflow's UI shows it as a table (the tag MLflow's log_table sets)
    assert json.loads(run.data.tags["mlflow.loggedArtifacts"]) == [{"path": "generations.json", "type": "table"}]


def test_evaluations_are_labelled_with_the_rl_step_mlflow_plots_them_at(make_cfg, caplog):
    """PPO trains 4 updates per rollout batch. Its evaluations said 'eval after 1 RL steps' after 4 updates (the
    batch count), then 'done: ... after 8 RL steps'; the generations table's rl_step was the batch count too,
    while MLflow plots eval/gold_reward at the update count."""
    cfg = make_cfg("algo=ppo", "trainer.max_steps=8", "rl.eval_every=1", "rl.log_generations=1")
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        result = train(cfg)
    said = [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().startswith("eval after")]
    assert said == ["eval after 0 RL steps", "eval after 4 RL steps (rollout batch 1)", "eval after 8 RL steps (rollout batch 2)"]
    assert [row["rl_step"] for row in result.module.generation_rows] == [0, 4, 8]
    gold = MlflowClient(cfg.logger.tracking_uri).get_metric_history(result.run_id, "eval/gold_reward")
    assert [m.step for m in gold] == [0, 4, 8]


def test_metrics_are_buffered_and_every_one_lands_by_the_run_end(tmp_path, caplog):
    """The tracker writes step metrics in batches (logger.flush_every_s): nothing before a flush is due, every
    buffered row at flush/finish, more than MLflow's 1000-per-batch limit included, a name MLflow refuses cleaned."""
    from rlhflab.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = MlflowTracker(uri, "buffered", flush_every_s=3600)
    run_id = tracker.start(OmegaConf.create({"algo": {"name": "rloo"}}), {"algo": "rloo"}, [], tmp_path)
    client = MlflowClient(uri)
    for step in range(1, 301):
        tracker.log_metrics({"train/a": step, "train/b": -step, "train/c": 0.5, "train/reward/f(x)": 1.0}, step)
    assert client.get_metric_history(run_id, "train/a") == []  # 1,200 rows buffered, none written yet
    with caplog.at_level("WARNING"):
        tracker.finish()
    assert [m.step for m in client.get_metric_history(run_id, "train/a")] == list(range(1, 301))
    assert len(client.get_metric_history(run_id, "train/reward/fx")) == 300
    assert "'train/reward/f(x)' is logged as 'train/reward/fx'" in caplog.text
    assert client.get_run(run_id).info.status == "FINISHED"
    at_once = MlflowTracker(uri, "buffered", flush_every_s=0)  # 0: each call writes before it returns
    run_id = at_once.start(OmegaConf.create({"algo": {"name": "rloo"}}), {"algo": "rloo"}, [], tmp_path)
    at_once.log_metrics({"train/a": 1.0}, 1)
    assert [m.value for m in client.get_metric_history(run_id, "train/a")] == [1.0]
    at_once.finish()


def test_step_metrics_logged_every_n_steps_are_means_peaks_and_counts_and_a_cut_window_is_kept(tmp_path):
    """trainer.log_every_n_steps=10 (window_steps): one value per metric for the steps up to each multiple of 10,
    at the last of them: the mean (over the steps that had it), a peak's largest, a count's last. A checkpoint's
    `unwritten()` and the run's end take a window cut short at its last step; a PPO run's steps (4, 8, 12, ...) are
    written where they pass a multiple of 10."""
    from rlhflab.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    tracker = MlflowTracker(uri, "window", flush_every_s=3600)
    tracker.window_steps = 10
    run_id = tracker.start(OmegaConf.create({"algo": {"name": "rloo"}}), {"algo": "rloo"}, [], tmp_path)
    for step in range(1, 14):
        odd = {"train/grad_norm": 100.0 * step} if step % 2 else {}
        tracker.log_step({"train/a": step, "perf/peak_mem_mb": step % 7, "train/skipped_batches": step // 3, **odd}, step)
    kept = tracker.unwritten()  # a checkpoint after step 13
    assert sorted((key, step, value) for key, value, _, step in kept) == [
        ("perf/peak_mem_mb", 10, 6.0), ("perf/peak_mem_mb", 13, 6.0), ("train/a", 10, 5.5), ("train/a", 13, 12.0),
        ("train/grad_norm", 10, 500.0), ("train/grad_norm", 13, 1200.0),
        ("train/skipped_batches", 10, 3.0), ("train/skipped_batches", 13, 4.0)]
    for step in range(14, 26):
        tracker.log_step({"train/a": step}, step)
    tracker.finish()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/a")] == [
        (10, 5.5), (13, 12.0), (20, 17.0), (25, 23.0)]

    ppo = MlflowTracker(uri, "window", flush_every_s=3600)
    ppo.window_steps = 10
    run_id = ppo.start(OmegaConf.create({"algo": {"name": "ppo"}}), {"algo": "ppo"}, [], tmp_path)
    for step in range(4, 36, 4):
        ppo.log_step({"train/a": step}, step)
    ppo.finish()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/a")] == [
        (12, 8.0), (20, 18.0), (32, 28.0)]


def test_a_lightning_stage_logging_each_step_writes_once_at_its_end(tmp_path):
    """Lightning calls logger.save() after every self.log step; the tracker still writes only when its
    interval is due (here never) and at the stage's end (finalize)."""
    import lightning as L
    import torch

    from rlhflab.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = MlflowTracker(uri, "buffered", flush_every_s=3600)
    run_id = tracker.start(OmegaConf.create({"algo": {"name": "rloo"}}), {"algo": "rloo"}, [], tmp_path)
    client = MlflowClient(uri)
    written_during = []

    class Stage(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            loss = (self.w * batch[0]).pow(2).mean()
            self.log("sft/loss", loss)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            written_during.append(len(client.get_metric_history(run_id, "sft/loss")))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(6, 1)), batch_size=1)
    L.Trainer(max_steps=6, logger=tracker.lightning_logger(), log_every_n_steps=1, enable_progress_bar=False,
              enable_checkpointing=False, enable_model_summary=False, accelerator="cpu").fit(Stage(), data)
    assert written_during == [0] * 6
    assert [m.step for m in client.get_metric_history(run_id, "sft/loss")] == list(range(6))
    tracker.finish()


def test_second_run_reuses_cached_stages(make_cfg, caplog):
    train(make_cfg("trainer.max_steps=1"))
    caplog.clear()
    with caplog.at_level("INFO"):
        train(make_cfg("trainer.max_steps=1"))
    text = caplog.text
    assert "model: cached" in text
    assert "stage sft: cached" in text and "stage rm: cached" in text
    assert "training on" not in text


def test_rule_reward_skips_the_reward_model_stage(make_cfg, caplog):
    with caplog.at_level("INFO"):
        result = train(make_cfg("reward=rule", "trainer.max_steps=2"))
    assert "stage rm: skipped" in caplog.text
    assert result.module.memory.reward_model is None


def test_a_step_budget_between_rollout_batches_is_rounded_up_and_said(make_cfg, caplog):
    """PPO's batch makes epochs x num_minibatches updates, never cut short: trainer.max_steps=5 trains 2 batches
    of 4 (the bar showed 8/5 and the start line '5 steps'); a budget of whole batches is taken as given."""
    with caplog.at_level("INFO"):
        result = train(make_cfg("algo=ppo", "algo.epochs=2", "algo.num_minibatches=2", "trainer.max_steps=5"))
    assert result.module.updates == 8
    assert "8 steps; trainer.max_steps=5 rounded up to whole rollout batches of 4 updates" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        assert train(make_cfg("algo=ppo", "algo.epochs=2", "algo.num_minibatches=2", "trainer.max_steps=4")).module.updates == 4
    assert "4 steps" in caplog.text and "rounded up" not in caplog.text


@pytest.mark.parametrize("memory", ["full", "lora", "hydra"])
def test_bf16_mixed_precision_and_checkpointing_switches_run(make_cfg, memory):
    cfg = make_cfg(f"memory={memory}", "memory.gradient_checkpointing=true", "trainer.precision=bf16-mixed",
                   "algo=ppo", "trainer.max_steps=4")
    result = train(cfg)
    assert result.module.trainer.precision == "bf16-mixed"
    assert result.metrics["perf/mean_samples_per_s"] > 0


def test_debug_preset_runs_the_whole_pipeline_into_its_own_experiment(tmp_path):
    """`python src/train.py debug=default`: every stage, evaluations and the saved policy, as a user runs it."""
    import os
    import subprocess
    import sys

    from conftest import TRAIN

    env = os.environ | {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "RLHFLAB_CACHE": str(tmp_path / "cache")}
    # src/train.py as python runs it, and at exit which of the 68 MB MLflow loads and the 23 MB torchmetrics loads, that
    # no run uses, were imported
    watch = ("import atexit, runpy, sys\n"
             "atexit.register(lambda: print('imported:', *sorted(m for m in ('pandas', 'pyarrow', 'matplotlib')\n"
             "                                                   if m in sys.modules)))\n"
             "sys.argv = sys.argv[1:]\n"
             "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", watch, TRAIN, "debug=default"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.splitlines()[-1] == "imported:", out.stdout[-2000:]  # none: MLflow imported without them
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rlhflab-debug").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/gold_reward")] == [0, 2, 4]
    # MLflow's system metrics, though the run is shorter than their 10 s interval (it had none)
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    assert len(list((tmp_path / "outputs" / "debug").glob("*/*/policy/model.safetensors"))) == 1
    assert "viewStateShareKey=rlhflab-gold" in out.stderr + out.stdout
    # Piped (as in a cluster job's log), each log line is one line: the policy's path and the run's URL whole.
    (policy,) = (tmp_path / "outputs" / "debug").glob("*/*/policy")
    lines = (out.stdout + out.stderr).splitlines()
    assert any(line.endswith(f"INFO     policy: {policy} (AutoModelForCausalLM.from_pretrained loads it)") for line in lines)
    assert any(f"/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning (all" in line
               for line in lines)
    assert not [line for line in lines if line != line.rstrip()]  # no padding to a console width


def test_mlflow_is_imported_without_pandas_which_imports_after_it_and_an_hdfs_store_gets_pyarrow():
    """import_mlflow hides pandas and pyarrow from MLflow's first import only (68 MB a run never used): afterwards they
    import as usual, and a run whose artifacts go to HDFS gets MLflow's HDFS store with pyarrow's names. In a fresh
    interpreter: this one imported MLflow long ago."""
    import subprocess
    import sys

    code = """if True:
        import sys
        from rlhflab.naming import import_mlflow, ready_artifact_store
        mlflow = import_mlflow()
        from mlflow.store.artifact import hdfs_artifact_repo as hdfs
        print("with MLflow:", *sorted(m for m in ("pandas", "pyarrow") if m in sys.modules))
        ready_artifact_store("file:///tmp/run/artifacts")
        print("file store:", hasattr(hdfs, "HadoopFileSystem"))
        uri = "hdfs://namenode:8020/mlflow/1/abc/artifacts"
        ready_artifact_store(uri)
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
        store = get_artifact_repository(uri)  # the class MLflow registered at its import, before the reload
        print("hdfs store:", hasattr(hdfs, "HadoopFileSystem"), "HadoopFileSystem" in type(store).log_artifact.__globals__)
        import pandas
        print("pandas:", pandas.DataFrame({"a": [1]}).shape, import_mlflow() is mlflow)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["with MLflow:", "file store: False", "hdfs store: True True", "pandas: (1, 1) True"]


def test_lightning_imports_torchmetrics_without_pyplot_which_imports_after_it_and_keeps_plots_where_it_came_first():
    """torchmetrics imports matplotlib.pyplot at its import where matplotlib is installed (MLflow installs it): 23 MB of
    a run's peak memory. Importing rlhflab turns that off for torchmetrics only; matplotlib imports as usual after, and a
    process that imported pyplot first keeps torchmetrics' plots. Fresh interpreters: this one imported both long ago."""
    import os
    import subprocess
    import sys

    after = """if True:
        import sys
        import rlhflab
        import lightning.pytorch  # a run's importer of torchmetrics (the whole run: the debug preset's test)
        from torchmetrics.utilities.imports import _MATPLOTLIB_AVAILABLE
        print("run:", "matplotlib" in sys.modules, bool(_MATPLOTLIB_AVAILABLE))
        import matplotlib.pyplot as plt
        print("after:", type(plt.figure()).__name__)
    """
    first = """if True:
        import matplotlib.pyplot
        import rlhflab
        import lightning.pytorch
        from torchmetrics.utilities.imports import _MATPLOTLIB_AVAILABLE
        from torchmetrics.utilities.plot import _AX_TYPE
        print("first:", bool(_MATPLOTLIB_AVAILABLE), _AX_TYPE.__name__)
    """
    env = os.environ | {"MPLBACKEND": "Agg"}
    lines = []
    for code in (after, first):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        lines += out.stdout.splitlines()
    assert lines == ["run: False False", "after: Figure", "first: True Axes"]


def test_the_generations_table_is_json_mlflow_reads_as_a_table_with_a_non_finite_reward_as_null(tmp_path):
    """MLflow's log_table (pandas) wrote NaN as null; written without pandas, json.dumps wrote NaN, which no JSON
    reader but Python's takes."""
    from rlhflab.tracking import MlflowTracker

    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", "table", flush_every_s=0)
    run_id = tracker.start(OmegaConf.create({"algo": {"name": "rloo"}}), {"algo": "rloo"}, [], tmp_path)
    tracker.log_generations([{"rl_step": 0, "prompt": "dog é", "reward": float("nan")},
                             {"rl_step": 2, "prompt": "cat", "reward": 0.25}])
    tracker.finish()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    text = Path(client.download_artifacts(run_id, "generations.json", str(tmp_path))).read_text(encoding="utf-8")

    def not_json(name):
        raise AssertionError(f"{name} in {text}")

    table = json.loads(text, parse_constant=not_json)
    assert table == {"columns": ["rl_step", "prompt", "reward"], "data": [[0, "dog é", None], [2, "cat", 0.25]]}
    assert json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"]) == [{"path": "generations.json", "type": "table"}]


def test_the_rl_bar_ends_on_the_last_evaluations_gold(make_cfg, capfd):
    """Where the last step was no evaluation step (rl.eval_every=3 of 4 steps), Lightning closed the bar before the
    module's final evaluation, and the bar ended on the gold of step 3 where the log and MLflow said step 4's."""
    import re

    result = train(make_cfg("trainer.enable_progress_bar=true", "rl.eval_every=3", "trainer.max_steps=4"))
    shown = re.findall(r"gold: (-?\d+\.\d{3})", capfd.readouterr().out)
    assert [step for step, _, _ in result.module.eval_history] == [0, 3, 4]
    assert shown and float(shown[-1]) == round(result.metrics["eval/gold_reward"], 3), shown


def test_the_run_names_hydras_directory_where_output_dir_moves_the_run_elsewhere(tmp_path, stage_cache):
    """With output.dir set, Hydra still writes train.log and .hydra/ to its own run directory. The run's description
    called output.dir 'Hydra output directory', and the directory holding the log was named nowhere in the run."""
    from conftest import SHRINK, cli_run, run_id_of

    out, hydra_dir = tmp_path / "out", tmp_path / "hydra"
    env = {"RLHFLAB_CACHE": str(stage_cache), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    with cli_run([*SHRINK, "trainer.max_steps=1", f"output.dir={out}", f"hydra.run.dir={hydra_dir}"], tmp_path, env) as proc:
        assert proc.wait(timeout=300) == 0, proc.stdout.read()[-3000:]
    assert (hydra_dir / "train.log").is_file() and not (out / "train.log").exists()
    tags = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(run_id_of(out)).data.tags
    assert tags["rlhflab.output_dir"] == str(out)
    assert tags["rlhflab.hydra_dir"] == str(hydra_dir)
    note = tags["mlflow.note.content"]
    assert f"Output directory (output.dir): `{out}`" in note
    assert f"Hydra output directory (train.log, .hydra/): `{hydra_dir}`" in note


@pytest.mark.mlflow_migrations
def test_a_new_sqlite_store_is_a_copy_of_the_empty_one_the_cache_keeps(tmp_path, monkeypatch):
    """MLflow ran its ~50 migrations for every new store, 2-5 s of each first run in a new directory (and of most
    tests' runs). The first new store a cache sees is MLflow's own; an empty copy of it is kept in the cache, and every
    later new store is that copy, which MLflow opens as its own: its default experiment in its own directory."""
    import sqlite3

    from rlhflab.store_template import store_template
    from rlhflab.tracking import ensure_experiment

    made, cache = counting_migrations(monkeypatch), tmp_path / "cache"
    for name in "abc":
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)  # MLflow puts its default experiment's files in the working directory
        assert ensure_experiment(f"sqlite:///{tmp_path / name}/mlflow.db", "rlhflab", cache) == "1"
    assert made == [str(tmp_path / "a" / "mlflow.db")]
    with sqlite3.connect(store_template(cache)) as kept:
        assert kept.execute("select count(*) from experiments").fetchone() == (0,)
    for name in "abc":
        experiments = MlflowClient(f"sqlite:///{tmp_path / name}/mlflow.db").search_experiments()
        assert {(e.experiment_id, e.name, e.artifact_location) for e in experiments} == {
            ("0", "Default", str(tmp_path / name / "mlruns" / "0")), ("1", "rlhflab", str(tmp_path / name / "mlruns" / "rlhflab"))}
    ensure_experiment(f"sqlite:///{tmp_path / 'a'}/mlflow.db", "other", cache)  # a store that exists is not replaced
    assert {e.name for e in MlflowClient(f"sqlite:///{tmp_path / 'a'}/mlflow.db").search_experiments()} == {"Default", "rlhflab", "other"}
    store_template(cache).write_text("not a database")  # a broken copy: MLflow makes the store, as without one
    ensure_experiment(f"sqlite:///{tmp_path}/d.db", "rlhflab", cache)
    assert made[1:] == [str(tmp_path / "d.db")] and not list(tmp_path.glob(".d.db.*"))


@pytest.mark.mlflow_migrations
def test_a_run_and_a_sweep_make_their_new_store_from_the_caches_copy(make_cfg, tmp_path, monkeypatch, stage_cache):
    """The run's tracker and the sweep's callback pass the run's cache_dir to ensure_experiment."""
    from hydra_plugins.rlhflab_mlflow.callback import MlflowSweepCallback

    made = counting_migrations(monkeypatch)
    cfg = make_cfg("trainer.max_steps=1")
    result = train(cfg)
    assert made == [] and MlflowClient(cfg.logger.tracking_uri).get_run(result.run_id).info.status == "FINISHED"
    callback = MlflowSweepCallback()
    callback._uri = f"sqlite:///{tmp_path}/sweep.db"
    assert callback._experiment_id(OmegaConf.create({"cache_dir": str(stage_cache)})) == "1" and made == []
