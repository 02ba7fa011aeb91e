"""Every config option composes and instantiates; bad input fails in one line before any model loads."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import NEOX_LINEAR, ROOT, compose_cfg, save_tiny_neox
from rlhflab.config import check_trainer, validate
from rlhflab.errors import ConfigError
from rlhflab.models.cache import config_key
from rlhflab.rollout.vllm import check_vllm_available, vllm_build
from rlhflab.train import per_rank_stages, train


def vllm_unavailable() -> str | None:
    """The one-line error generator=vllm gives here, or None where a vLLM build can run."""
    try:
        check_vllm_available()
    except ConfigError as err:
        return str(err)
    return None


# Options that only make sense with a partner option.
EXAMPLE = ROOT / "examples" / "reverse"
PARTNERS = {
    ("task", "tldr"): ["model=pythia1b_tldr"],
    ("task", "prompts"): [f"task.path={EXAMPLE}/train.jsonl", f"task.demonstrations_path={EXAMPLE}/demos.jsonl",
                          "reward=function", f"reward.fn={EXAMPLE}/reward.py:exact"],
    ("reward", "function"): [f"reward.fn={EXAMPLE}/reward.py:exact"],
}
if vllm_build() == "cpu":  # its attention wants a head size of 32 or more
    PARTNERS[("generator", "vllm")] = ["model.arch.num_attention_heads=2", "model.arch.num_key_value_heads=2"]
GROUPS = ["task", "model", "algo", "reward", "memory", "mode", "off_policy", "generator", "trainer", "logger"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(group, option, tmp_path):
    if group == "trainer" and option != "cpu":
        cfg = compose_cfg([f"{group}={option}"])  # composes; instantiating a GPU trainer needs a GPU
        assert cfg.trainer._target_ == "lightning.Trainer"
        return
    overrides = [f"{group}={option}", f"logger.tracking_uri=sqlite:///{tmp_path}/m.db", *PARTNERS.get((group, option), [])]
    cfg = compose_cfg(overrides, shrink=False)
    if group == "generator" and option.startswith("vllm") and (error := vllm_unavailable()):
        with pytest.raises(ConfigError) as err:  # composes; the engine needs vllm and a GPU
            validate(cfg)
        assert str(err.value) == error and error.startswith("generator=vllm: ")
        return
    plan = validate(cfg)
    assert plan.tags["algo"] and plan.tags["memory"]
    if group == "trainer":
        obj = instantiate(cfg.trainer, logger=False)
        assert obj.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml") if not p.stem.startswith("sweep_")))
def test_every_experiment_composes_and_validates(experiment):
    cfg = compose_cfg([f"experiment={experiment}"], shrink=False)
    if cfg.generator._target_.endswith("VLLMGenerator") and (error := vllm_unavailable()):
        with pytest.raises(ConfigError) as err:  # everything else checked below, with the HF generator
            validate(cfg)
        assert str(err.value) == error
        cfg = compose_cfg([f"experiment={experiment}", "generator=hf"], shrink=False)
    plan = validate(cfg)
    assert plan.tags["model"]


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS if g not in ("model", "trainer") for o in options(g)])
def test_every_schema_declares_exactly_its_targets_parameters(group, option):
    """The schema an option starts from (rlhflab/schema.py) names the same settings as its class, so a
    setting cannot be typed and checked but ignored, nor taken by the class but unchecked."""
    import inspect

    from hydra.utils import get_class

    cfg = compose_cfg([f"{group}={option}", *PARTNERS.get((group, option), [])], shrink=False)
    node = cfg[group]
    schema = {f for f in OmegaConf.get_type(node).__dataclass_fields__ if f != "_target_"}
    params = inspect.signature(get_class(node._target_)).parameters
    passed_by_code = {"generator", "correction"}  # the rollout source gets its generator and correction from train()
    assert schema == set(params) - passed_by_code - {"self"}


def test_real_preset_loads_through_from_pretrained_names():
    cfg = compose_cfg(["model=pythia1b_tldr"], shrink=False)
    validate(cfg)  # hub ids pass validation; they are only fetched at load time
    assert cfg.model.sft_path.startswith("mnoukhov/pythia1b-sft") and "-rm-" in cfg.model.reward_model_path


@pytest.mark.parametrize(
    "override, key",
    [
        ("task=tldr", "model.sft_path"),
        ("memory=hydra model.reward_model_path=/tmp", "model.reward_model_path"),
        ("algo.samples_per_prompt=1", "algo.samples_per_prompt"),
        ("algo=online_dpo algo.samples_per_prompt=1", "algo.samples_per_prompt"),
        ("algo=grpo algo.samples_per_prompt=1", "algo.samples_per_prompt"),
        ("algo.num_minibatches=3", "rl.prompts_per_step"),
        ("staleness=2", "staleness"),
        ("mode=async mode.reference=gpu", "mode.reference"),
        ("mode=async mode.reference=generator mode.start_method=spawn", "mode.reference"),
        ("mode=async mode.reference=balance mode.start_method=spawn", "mode.reference"),
        ("mode.reference=balance", "mode.reference"),  # sync mode has no generator process to share the reference with
        ("mode.reference=generator", "mode.reference"),
        ("mode.reference=thread memory=lora", "mode.reference=thread"),
        ("mode.reference=thread algo=ppo", "mode.reference=thread"),
        ("mode.reference=thread algo.epochs=2", "mode.reference=thread"),
        ("mode.reference=thread torch_threads=64", "mode.reference=thread"),
        ("mode.reference=process memory=hydra", "mode.reference=process"),
        ("mode.reference=process trainer=gpu", "mode.reference=process"),
        ("memory=hydra memory.actor_critic=shared", "memory.actor_critic"),
        ("model.sft_path=/nonexistent/sft", "model.sft_path"),
        ("model.name_or_path=./no/such/model", "model.name_or_path"),
        ("algo.kl_estimator=k9", "algo.kl_estimator"),
        ("+algo.kl_coeff=0.1", "algo.kl_coeff"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        # each KL weight has its algorithm's own name (issue 10, defect 7)
        ("algo=grpo +algo.kl_coef=0.1", "algo.kl_coef"),
        ("algo=online_dpo +algo.kl_coef=0.1", "algo.kl_coef"),
        ("algo=rloo +algo.beta=0.1", "algo.beta"),
        # top-k sampling would make every ratio wrong (defect 6); it fails the same without vllm installed
        ("generator.top_k=5", "generator.top_k"),
        ("generator=vllm generator.top_k=5", "generator.top_k"),
        ("generator.decode=fast", "generator.decode"),
        ("train_attention=flash", "train_attention"),
        ("algo=online_dpo off_policy=tis", "off_policy=tis"),
        ("algo.loss_agg=token-sum", "algo.loss_agg"),
        ("algo=online_dpo algo.ties=drop", "algo.ties"),
        ("off_policy=tis off_policy.cap=0.5", "off_policy.cap"),
        ("off_policy=decoupled off_policy.cap=0.5", "off_policy.cap"),
        # float16 weights under AdamW turn NaN at the first step (stage sft said to lower its lr)
        ("model.dtype=float16", "model.dtype=float16: memory=full would train whole weights in float16"),
        ("model.dtype=float16 memory=lora", "model.dtype=float16: stage sft would train"),
        # a built model has the task's tokenizer: another one was read as [UNK] after the run was made, or indexed past
        ("model.tokenizer=EleutherAI/pythia-14m", "model.tokenizer=EleutherAI/pythia-14m: a model built from model.arch"),
        # hydra's stage is hydra_sft (it said 'stage sft'), and it trains from a given model.sft_path too (it passed)
        ("model.dtype=float16 memory=hydra", "model.dtype=float16: stage hydra_sft would train"),
        ("model.dtype=float16 memory=hydra model.sft_path=EleutherAI/pythia-14m", "model.dtype=float16: stage hydra_sft"),
        ("model.dtype=float16 memory=hydra reward=rule", "model.dtype=float16: stage sft would train"),
        ("model.dtype=float16 memory=lora reward=model model.sft_path=EleutherAI/pythia-14m", "model.dtype=float16: stage rm"),
    ],
)
def test_bad_settings_are_one_line_naming_the_key(override, key):
    cfg = compose_cfg(override.split(), shrink=False)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    message = str(err.value)
    assert message.startswith(key) and "\n" not in message, message


def test_every_range_errors_fix_is_a_value_in_the_range():
    """task.eval_fraction=0 said '0.0 must be > 0 and < 1; set e.g. task.eval_fraction=0' (the bound itself, from
    a field with no example), as did memory.lora_alpha and generator.gpu_memory_utilization."""
    import dataclasses

    from rlhflab.schema import SCHEMAS, SettingError, _check_value

    seen = 0
    for schema in {cls for options in SCHEMAS.values() for cls in options.values()}:
        for field in dataclasses.fields(schema):
            meta = dict(field.metadata)
            if not {"ge", "gt", "le", "lt"} & set(meta):
                continue
            outside = meta["gt"] if "gt" in meta else meta["ge"] - 1 if "ge" in meta else meta.get("lt", meta.get("le", 0) + 1)
            with pytest.raises(SettingError) as err:
                _check_value(field.name, outside, meta)
            example = str(err.value).rpartition(f"set e.g. {field.name}=")[2]
            _check_value(field.name, float(example) if "." in example else int(example), meta)  # in range
            seen += 1
    assert seen >= 20


def test_float16_is_left_to_lora_when_no_stage_trains_whole_weights():
    cfg = compose_cfg(["model.dtype=float16", "memory=lora", "reward=rule", "model.sft_path=EleutherAI/pythia-14m"], shrink=False)
    assert validate(cfg).memory.name == "lora"


def run_cli(*args: str, cwd: Path):
    return subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_cli_bad_task_file_is_one_line_and_loads_nothing(tmp_path):
    out = run_cli(f"task.words_file={tmp_path}/missing.json", f"cache_dir={tmp_path}/cache", cwd=tmp_path)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: task.words_file: no such file '{tmp_path}/missing.json'; point it at a JSON file with "
                      "'positive', 'negative', 'neutral' word lists, or set task.words_file=null"]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "cache").exists()  # failed before building any model
    assert not (tmp_path / "mlflow.db").exists()  # and before creating an MLflow run


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA GPU is visible: trainer=gpu would run")
def test_cli_gpu_settings_without_a_gpu_are_one_line_and_load_nothing(tmp_path):
    """trainer=gpu used to run the stages, then fail in Lightning ('No supported gpu backend found!') in a Hydra
    traceback; mode.device=cuda:1 with spawn, in a generator that 'died without a traceback'."""
    for args, error in [(["trainer=gpu"], "error: trainer.accelerator=gpu: no CUDA GPU is visible here"),
                        (["mode=async", "mode.device=cuda:1"], "error: mode.device=cuda:1: no CUDA GPU")]:
        out = run_cli(*args, f"cache_dir={tmp_path}/cache", cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-2000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(error), errors
        assert "Traceback" not in out.stderr
        assert not (tmp_path / "cache").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("override, visible, key", [
    ("trainer=gpu", 1, None),
    ("trainer=ddp trainer.devices=4", 2, "trainer.devices=4: only 2 CUDA GPU(s)"),
    ("trainer=ddp trainer.devices=4", 0, None),  # accelerator auto: CPU processes where no GPU is visible
    ("trainer=ddp trainer.devices=2 trainer.accelerator=cpu", 1, None),
    ("mode=async mode.device=cuda:1 mode.start_method=spawn trainer=gpu", 2, None),
    ("mode=async mode.device=cuda:2 mode.start_method=spawn trainer=gpu", 2, "mode.device=cuda:2: only 2 CUDA GPU(s) are visible"),
    ("mode=async mode.device=cuda:x mode.start_method=spawn", 0, "mode.device=cuda:x: not a device"),
    # read as the CPU, then the generator process died on torch's device string, after the models had loaded
    ("mode=async mode.device=gpu", 0, "mode.device=gpu: not a device; give cuda:N"),
    ("mode=async mode.device=0", 2, "mode.device=0: not a device; give cuda:N"),
    ("mode=async mode.device=cpu", 0, None),
    # accelerator auto: validate() said the generator's GPU 0 clashed with training GPUs 0, 1 on a machine without a
    # GPU (training ran on CPUs) and told to set cuda:2, which then found no GPU; the clash is judged where GPUs are
    ("trainer=ddp trainer.devices=2 mode=async mode.device=cuda:0", 0, "mode.device=cuda:0: no CUDA GPU is visible here"),
    ("trainer=ddp trainer.devices=2 mode=async mode.device=cuda:0", 4, "mode.device: cuda:0 gives the generator(s) GPU 0, 1"),
    ("trainer=ddp trainer.devices=2 mode=async mode.device=cuda:2", 4, None),
    # nccl with accelerator auto where no GPU is: torch's 'Distributed package doesn't have NCCL built in', twice
    ("trainer=ddp trainer.strategy.process_group_backend=nccl", 0, "trainer.strategy.process_group_backend=nccl: NCCL needs GPUs"),
    ("trainer=ddp trainer.strategy.process_group_backend=nccl", 2, None),
])
def test_the_gpus_a_config_asks_for_are_checked_against_those_visible(monkeypatch, override, visible, key):
    import torch

    from rlhflab.config import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    cfg = compose_cfg(override.split(), shrink=False)

    def checks():  # as train() makes them: validate() (which knows no GPU count), then check_devices
        validate(cfg)
        check_devices(cfg)

    if key is None:
        checks()
    else:
        with pytest.raises(ConfigError, match="^" + __import__("re").escape(key)):
            checks()


def test_more_cpu_ranks_than_cores_are_warned(monkeypatch, caplog):
    """experiment=rloo_pythia6.9b_tldr (trainer=fsdp, accelerator auto, 8 devices) started 8 CPU processes on this
    2-core machine without a word."""
    import torch

    from rlhflab.config import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    check_devices(compose_cfg(["trainer=ddp", "trainer.devices=2"], shrink=False))
    assert "CPU processes share" not in caplog.text
    check_devices(compose_cfg(["trainer=ddp", "trainer.devices=8"], shrink=False))
    assert "trainer.devices=8: no CUDA GPU is visible, so 8 CPU processes share 2 core(s)" in caplog.text


def test_async_torch_threads_beyond_the_cores_are_warned(monkeypatch, caplog):
    """mode=async's generator threads run beside the learner's: 2+2 on 2 cores ran 10x slower, said by nothing but
    the run's speed."""
    import torch

    from rlhflab.config import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    check_devices(compose_cfg(["mode=async"], shrink=False))
    check_devices(compose_cfg(["mode=sync", "torch_threads=2"], shrink=False))
    assert "torch threads" not in caplog.text
    check_devices(compose_cfg(["mode=async", "mode.generator_threads=2", "mode.learner_threads=2"], shrink=False))
    assert ("mode.generator_threads=2 + mode.learner_threads=2: 4 torch threads on 2 core(s), which slows both sides "
            "(2+2 on 2 cores ran 10x slower); keep their sum at most 2") in caplog.text
    caplog.clear()
    check_devices(compose_cfg(["mode=async", "trainer=ddp", "trainer.devices=2"], shrink=False))
    assert "4 torch threads (2 ranks, each with its generator) on 2 core(s)" in caplog.text


def test_half_precision_on_a_cpu_without_its_kernels_is_warned(monkeypatch, caplog):
    """bf16 on an AVX2-only CPU (no oneDNN bf16 kernels) ran a 113M Llama's forward and backward in 24x float32's time,
    float16 weights a linear 6.2x, said by nothing but the run's speed: the setting that asks for it is named, with the
    faster one; nothing where the CPU has the kernels."""
    import torch

    import rlhflab.config
    from rlhflab.config import check_devices
    from rlhflab.rollout.sources import cpu_has_half_kernels

    # this CPU's own answers, as generator.prepack reads them
    assert cpu_has_half_kernels(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_has_half_kernels(torch.float16) == torch.ops.mkldnn._is_mkldnn_fp16_supported()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kernels = {torch.bfloat16: False, torch.float16: False}
    monkeypatch.setattr(rlhflab.config, "cpu_has_half_kernels", lambda dtype: kernels[dtype])
    check_devices(compose_cfg([], shrink=False))  # float32: nothing to say
    assert "kernels" not in caplog.text
    check_devices(compose_cfg(["trainer.precision=bf16-mixed"], shrink=False))
    assert ("trainer.precision=bf16-mixed: this CPU has no bfloat16 kernels (oneDNN's need AVX-512 or AMX; torch "
            f"reports {torch.backends.cpu.get_cpu_capability()}), so it runs far slower than float32 here (a 113M "
            "Llama's forward and backward 24x in bf16 on an AVX2 CPU); trainer.precision=32-true is faster") in caplog.text
    caplog.clear()
    check_devices(compose_cfg(["model.dtype=bfloat16", "trainer.precision=bf16-true"], shrink=False))
    assert "trainer.precision=bf16-true and model.dtype=bfloat16: this CPU has no bfloat16 kernels" in caplog.text
    assert "; trainer.precision=32-true and model.dtype=float32 is faster" in caplog.text
    caplog.clear()
    check_devices(compose_cfg(["model.dtype=float16", "trainer.precision=bf16-mixed"], shrink=False))
    assert ("trainer.precision=bf16-mixed and model.dtype=float16: this CPU has no bfloat16 or float16 kernels "
            "(oneDNN's need AVX-512 or AMX, and AVX-512 FP16 or AMX-FP16; torch reports") in caplog.text
    caplog.clear()
    kernels[torch.bfloat16] = True  # an AVX-512 CPU without AVX-512 FP16: only the float16 weights are said
    check_devices(compose_cfg(["model.dtype=float16", "trainer.precision=bf16-mixed"], shrink=False))
    assert "model.dtype=float16: this CPU has no float16 kernels (oneDNN's need AVX-512 FP16 or AMX-FP16;" in caplog.text
    assert "trainer.precision=bf16-mixed" not in caplog.text and caplog.text.rstrip().endswith("model.dtype=float32 is faster")
    caplog.clear()
    kernels[torch.float16] = True  # AMX: both pay there
    check_devices(compose_cfg(["trainer.precision=bf16-mixed", "model.dtype=float16"], shrink=False))
    assert "kernels" not in caplog.text


def test_cli_mlflow_file_store_is_one_line_naming_the_key(tmp_path):
    """MLflow 3 refuses its file store: the user gets one line naming the key, and no model is built."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"}
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), f"logger.tracking_uri=file://{tmp_path}/mlruns",
                          f"cache_dir={tmp_path}/cache"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: logger.tracking_uri: MLflow cannot open 'file://{tmp_path}/mlruns'")
    assert "sqlite:///mlflow.db" in errors[0]  # MLflow's own fix, kept
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "cache").exists()


def test_a_tracking_store_that_cannot_be_opened_is_one_line_for_a_run_and_a_sweep(tmp_path):
    """A sqlite path through a file stopped at FileExistsError, postgresql:// without its driver at
    ModuleNotFoundError, databricks without credentials at MlflowException: tracebacks, a sweep's through Hydra."""
    from rlhflab.tracking import ensure_experiment

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    uri = f"sqlite:///{a_file}/mlflow.db"
    with pytest.raises(ConfigError, match=re.escape(f"logger.tracking_uri: MLflow cannot open '{uri}' (from MLFLOW_TRACKING_URI "
                                                    "or logger.tracking_uri=): FileExistsError: ")) as said:
        ensure_experiment(uri, "rlhflab")
    assert str(said.value).endswith("; give a database file in a directory this user can write, e.g. "
                                    "logger.tracking_uri=sqlite:///mlflow.db")  # the cause alone said no fix
    for args in (["trainer.max_steps=2"], ["-m", "seed=0,1"]):
        out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), *args, f"logger.tracking_uri={uri}",
                              f"cache_dir={tmp_path}/cache"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.startswith(f"error: logger.tracking_uri: MLflow cannot open '{uri}'"), out.stderr[-2000:]
        assert "Traceback" not in out.stderr and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "override, where",
    [
        ("", "fastest"),  # the default: memory=full, one pass, trainer=cpu, torch_threads=1 on a 2-core machine
        ("memory=lora", "learner"),  # the reference is the policy with its adapter off: same modules
        ("algo=ppo", "learner"),
        ("algo.num_minibatches=2", "learner"),
        ("torch_threads=64", "learner"),  # no core left free
        ("trainer=gpu", "learner"),  # on a GPU both forwards would queue on one stream
        ("trainer=ddp trainer.devices=2", "learner"),  # two processes
        ("mode.reference=learner", "learner"),
        ("mode.reference=process", "process"),  # asked for, where it can run: kept
        ("mode.reference=thread", "thread"),
    ],
)
def test_sync_reference_auto_takes_a_thread_or_process_only_where_it_can_run(override, where):
    if len(os.sched_getaffinity(0)) < 2 and where in ("thread", "process", "fastest"):
        pytest.skip("one core: no core is free for the reference")
    assert validate(compose_cfg(override.split(), shrink=False)).source.reference == where


def test_thread_reference_refused_for_torch_threads_null_names_the_key_as_typed(monkeypatch):
    """torch_threads=null (torch's own count, every core) leaves none free: the refusal said 'torch_threads=None',
    a value the command line does not take, and no thread count that would leave a core free."""
    import torch

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(["mode.reference=thread", "torch_threads=null"], shrink=False))
    message = str(err.value)
    assert f"mode.reference=thread: torch_threads=null ({cores} threads) leaves no core of {cores} free" in message, message
    assert "None" not in message
    if cores > 1:
        assert f"torch_threads={cores - 1} would" in message


@pytest.mark.parametrize(
    "override, where",
    [
        ("", "generator"),  # forked: the generator shares the reference model and the learner's step loses a forward
        ("mode.start_method=spawn", "learner"),
        ("memory=lora", "generator"),
        ("memory=hydra", "learner"),  # it reads the trunk output the reward head scored with (reward=model): free there
        ("memory=hydra reward=rule", "generator"),  # no reward head: the reference is a forward wherever it runs
        ("memory=hydra mode.reference=generator", "generator"),  # asked for: kept
        ("mode.reference=balance", "balance"),
    ],
)
def test_async_reference_auto_is_the_generator_unless_the_learners_costs_nothing(override, where):
    assert validate(compose_cfg(["mode=async", *override.split()])).source.reference == where


@pytest.mark.parametrize("override, error", [
    ("trainer.strategy=deepspeed", "trainer: Lightning's Trainer refuses it: To use the `DeepSpeedStrategy`, you must have "
                                   "DeepSpeed installed"),
    ("trainer.accelerator=mps", "trainer: Lightning's Trainer refuses it: `MPSAccelerator` can not run on your system"),
    ("trainer.num_nodes=2", "trainer.num_nodes=2: nothing started this process as one of 2 nodes"),  # it waited forever
    # Lightning warned twice and trained in bf16-mixed; the run's params said 16-mixed (a sweep of the two: twins)
    ("trainer.precision=16-mixed", "trainer.precision=16-mixed: Lightning would run bf16-mixed instead (AMP with fp16 is "
                                   "not supported on CPU); set trainer.precision=bf16-mixed, or run on a GPU (trainer=gpu)"),
])
def test_what_lightnings_trainer_refuses_is_one_line_before_the_run(make_cfg, tmp_path, override, error):
    """Each stopped at stage sft as Hydra's 'Error executing job ... MisconfigurationException', its MLflow run made."""
    with pytest.raises(ConfigError, match=re.escape(error)):
        train(make_cfg(override))
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("env", [
    {"NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"},  # Lightning's launch by hand: the same command on each node
    {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "job", "SLURM_NODELIST": "n[1-2]",
     "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"},  # srun (hydra/launcher=slurm)
    {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "GROUP_RANK": "0",
     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},  # torchrun --nnodes=2
], ids=["by-hand", "slurm", "torchrun"])
def test_several_nodes_pass_where_something_launched_them(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    check_trainer(compose_cfg(["trainer=ddp", "trainer.num_nodes=2", "trainer.devices=2"]))
    # trainer=fsdp's data_parallel_size was trainer.devices: the README's 2-node command was refused (2 shards, 4 ranks)
    cfg = compose_cfg(["trainer=fsdp", "trainer.num_nodes=2", "trainer.devices=2"])
    validate(cfg)
    assert cfg.trainer.strategy.data_parallel_size == 4


@pytest.mark.parametrize("override, tag", [
    ("", "tiny"),
    ("model.name_or_path=EleutherAI/pythia-410m", "pythia-410m"),  # tagged 'tiny' whatever it trained
    ("model.name_or_path=EleutherAI/pythia-410m model.arch=null", "tiny"),  # a preset of one's own: its name
    ("model=pythia410m_tldr", "pythia410m_tldr"),
])
def test_the_model_tag_names_the_model_that_runs(override, tag):
    assert validate(compose_cfg(override.split())).tags["model"] == tag


@pytest.mark.parametrize(
    "override, method, reference",
    [
        ("", "fork", "generator"),
        ("mode.device=cuda:1", "spawn", "learner"),  # alone: it asked for 'set mode.start_method=spawn' first
        ("mode.device=cuda:1 mode.start_method=spawn", "spawn", "learner"),
        ("mode.start_method=spawn", "spawn", "learner"),
        ("mode.start_method=fork mode.reference=balance", "fork", "balance"),
    ],
)
def test_async_start_method_auto_spawns_for_a_cuda_generator_else_forks(override, method, reference):
    """validate() judges GPU configs on a machine without one (check_devices is the run's GPU check)."""
    source = validate(compose_cfg(["mode=async", *override.split()])).source
    assert (source.start_method, source.reference) == (method, reference)


@pytest.mark.parametrize("override, error", [
    ("mode.device=cuda:1 mode.reference=generator", "mode.reference=generator: needs a forked generator"),
    ("mode.device=cuda:1 mode.start_method=fork", "mode.device=cuda:1: CUDA cannot run in a forked process"),
])
def test_async_start_method_that_cannot_hold_is_one_line(override, error):
    with pytest.raises(ConfigError, match=error):
        validate(compose_cfg(["mode=async", *override.split()]))


@pytest.mark.parametrize("overrides, correction", [
    (["algo=grpo"], "Decoupled"),                            # grpo's own choice (conf/algo/grpo.yaml)
    (["algo=grpo", "off_policy=behaviour"], "Behaviour"),    # the command line still decides
    (["algo=grpo", "mode=async", "off_policy.cap=3.0"], "Decoupled"),
    (["algo=rloo"], "Behaviour"),
    (["algo=online_dpo"], "Behaviour"),                      # decoupled would be refused: DPO has no ratio
])
def test_an_algorithm_can_choose_its_off_policy_correction(overrides, correction):
    cfg = compose_cfg(overrides)
    assert cfg.off_policy._target_.rsplit(".", 1)[1] == correction
    validate(cfg)  # and the composed choice passes every check


def test_run_names_carry_each_setting_once_and_tell_like_keys_apart():
    """A key given twice (a preset's command line with one more override) was named twice, 'max_steps=20 ...
    max_steps=100000'; stages.sft.epochs and stages.rm.epochs were both 'epochs='."""
    from rlhflab.naming import run_name

    assert run_name("online_dpo", ["algo=online_dpo", "mode=async", "staleness=2", "rl.lr=3e-4", "logger.run_name=x"]) \
        == "online_dpo async staleness=2 lr=3e-4"
    assert run_name("rloo", ["debug=default", "memory=lora", "output.dir=x"]) == "rloo debug lora"
    assert run_name("rloo", ["trainer.max_steps=20", "rl.lr=1e-3", "trainer.max_steps=100000"]) \
        == "rloo max_steps=100000 lr=1e-3"
    assert run_name("rloo", ["stages.sft.epochs=2", "stages.rm.epochs=4", "+rl.eos_penalty=null"]) \
        == "rloo sft.epochs=2 rm.epochs=4 eos_penalty=null"
    # a path by its last part (the whole path is the run's param): these names filled 250 characters with two paths
    assert run_name("rloo", ["model.sft_path=/tmp/w/.cache/rlhflab/stages/sft-f354fe44e62a/", "model.name_or_path=EleutherAI/pythia-1b"]) \
        == "rloo sft_path=sft-f354fe44e62a name_or_path=EleutherAI/pythia-1b"


def test_a_sweep_jobs_path_is_named_apart_from_the_sweeps_other_paths():
    """Each job of `model.sft_path=/x/a/policy,/y/a/policy` knew only its own value: both runs were 'sft_path=a/policy'."""
    from rlhflab.naming import run_name

    swept = {"model.sft_path": "/x/a/policy,/y/a/policy", "rl.lr": "1e-3,1e-4"}
    assert [run_name("rloo", [f"model.sft_path={p}", "rl.lr=1e-3"], swept) for p in ("/x/a/policy", "/y/a/policy")] \
        == ["rloo sft_path=x/a/policy lr=1e-3", "rloo sft_path=y/a/policy lr=1e-3"]
    assert run_name("rloo", ["model.sft_path=/x/a/policy"]) == "rloo sft_path=a/policy"  # a single run: as before
    assert run_name("rloo", ["model.sft_path=/x/a/policy"], {"algo": "rloo,ppo"}) == "rloo sft_path=a/policy"


def test_a_list_of_paths_is_named_by_each_ones_file():
    """reward.fn=/home/me/r/a.py:f named a run 'fn=a.py:f', and reward.fns=[/home/me/r/a.py:f,/home/me/r/b.py:g]
    '[/home/me/r/a.py:f,b.py:g]' (the first item kept whole); a sweep over lists was split inside them."""
    from rlhflab.naming import run_name, short_override

    assert run_name("rloo", ["reward=function", "reward.fns=[/home/me/r/a.py:f,/home/me/r/b.py:g]"]) == "rloo function fns=[a.py:f,b.py:g]"
    assert run_name("rloo", ["reward.fns=[my_pkg.r:f, my_pkg.s:g]"]) == "rloo fns=[my_pkg.r:f,my_pkg.s:g]"
    assert short_override("reward.fns=[/x/a.py:f,/x/b.py:g],[/x/c.py:h]") == "fns=[a.py:f,b.py:g],[c.py:h]"


def test_a_sweep_job_given_a_run_name_is_named_by_it_and_by_what_it_sweeps():
    """-m algo=rloo,grpo seed=1,2 logger.run_name=ablation named every child 'ablation', alike in MLflow's list."""
    from rlhflab.naming import named_run

    swept = {"algo": "rloo,grpo", "seed": "1,2"}
    names = [named_run("ablation", algo, [f"algo={algo}", f"seed={seed}", "rl.lr=1e-3", "logger.run_name=ablation"], swept)
             for algo in ("rloo", "grpo") for seed in (1, 2)]
    assert names == ["ablation rloo seed=1", "ablation rloo seed=2", "ablation grpo seed=1", "ablation grpo seed=2"]
    assert named_run("ablation", "rloo", ["seed=1"], {"seed": "1,2"}) == "ablation seed=1"  # algo not swept: not named
    assert named_run("ablation", "rloo", ["seed=1"]) == "ablation"  # a single run: the name as given
    assert named_run(None, "rloo", ["seed=1"], {"seed": "1,2"}) == "rloo seed=1"


def test_run_names_give_a_long_decimal_three_significant_digits():
    """An Optuna trial's values named its runs 'rloo kl_coef=0.08025955666793813 lr=0.0006380556092044456 ...'."""
    from rlhflab.naming import run_name

    assert run_name("rloo", ["algo.kl_coef=0.08025955666793813", "rl.lr=0.0006380556092044456", "experiment=sweep_optuna"]) \
        == "rloo kl_coef=0.0803 lr=0.000638 sweep_optuna"
    assert run_name("rloo", ["rl.lr=3e-4", "algo.kl_coef=0.05", "seed=12345678901", "task.gold_fn=a.py:f"]) \
        == "rloo lr=3e-4 kl_coef=0.05 seed=12345678901 gold_fn=a.py:f"  # short values and non-decimals as given


def test_run_names_show_a_sweep_jobs_values_as_typed_and_are_cut_between_settings():
    """A sweep job's overrides come escaped by Hydra's sweeper: its run was named 'rloo fn=reward.py\\:score'.
    A name past its limit was cut mid-value ('... fn=reward.py:')."""
    from rlhflab.naming import MAX_RUN_NAME, run_name

    assert run_name("rloo", ["reward.fn=reward.py\\:score", "task.path=a\\,b.jsonl"]) == "rloo fn=reward.py:score path=a,b.jsonl"
    long = run_name("rloo", [f"+x.k{i}=value{i}" for i in range(40)])
    assert len(long) <= MAX_RUN_NAME and long.endswith(" ...") and long[:-4].split()[-1].startswith("k")
    assert all("=value" in part for part in long[:-4].split()[1:])
    one = run_name("rloo", ["task.system_prompt=" + "x" * 300])  # one value past the limit was named 'rloo ...'
    assert len(one) <= MAX_RUN_NAME and one.startswith("rloo system_prompt=xxx") and one.endswith("x ...")


def test_a_path_given_with_a_tilde_is_under_the_home_directory(tmp_path, monkeypatch):
    """Quoted past the shell and Hydra ('output.dir="~/runs/a"'), '~' was a directory named '~' in the working
    directory for output.dir, and for a sqlite tracking URI the database went to ./~/m.db while its lock went to
    $HOME/m.db.lock. Every path setting now expands it, as task.path, resume and the model checks did."""
    from rlhflab.schema import check

    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data" / "train.jsonl").write_text('{"prompt": "1="}\n')
    monkeypatch.setenv("HOME", str(home))
    cfg = compose_cfg(['output.dir="~/runs/a"', 'cache_dir="~/cache"', 'logger.tracking_uri="sqlite:///~/m.db"',
                       'resume="~/runs/a/checkpoints/step-4"', "task=prompts", 'task.path="~/data/train.jsonl"'],
                      shrink=False)
    check(cfg)
    assert (cfg.output.dir, cfg.cache_dir, cfg.resume, cfg.task.path) == (
        f"{home}/runs/a", f"{home}/cache", f"{home}/runs/a/checkpoints/step-4", f"{home}/data/train.jsonl")
    assert cfg.logger.tracking_uri == f"sqlite:///{home}/m.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///~/env.db")  # quoted in the shell: 'sqlite:///~/env.db'
    cfg = compose_cfg([], shrink=False)
    check(cfg)
    assert cfg.logger.tracking_uri == f"sqlite:///{home}/env.db"


def test_stage_batches_are_per_optimizer_step_over_all_ranks_and_their_cache_keys_name_the_ranks():
    """Under DDP every rank loaded stages.sft.batch_size demonstrations (a global batch twice the size), and the
    SFT policy was cached under the key a single process uses: a later single-process default run read it and
    reached a gold reward of 0.650, not 0.818. Each rank now loads its share, and the ranks are in the key."""
    stages = OmegaConf.to_container(compose_cfg(shrink=False).stages, resolve=True)
    assert per_rank_stages(stages, 1) == stages
    two = per_rank_stages(stages, 2)
    for name in ("sft", "rm"):
        assert two[name]["batch_size"] * 2 == stages[name]["batch_size"] == 128
        assert config_key(two[name]) != config_key(stages[name]) != config_key(per_rank_stages(stages, 4)[name])
    assert two["hydra_sft"] == stages["hydra_sft"]  # it trains with sft's and rm's batch sizes


def test_stage_cache_keys_name_the_trainer_settings_that_change_what_a_stage_learns():
    """A run with trainer.precision=bf16-mixed cached its SFT and reward models under the keys of a 32-true run:
    the later 32-true run read them as its own ('stage sft: cached'), its held-out accuracy 0.961 not 0.966."""
    from rlhflab.train import with_trainer_settings

    def keys(*overrides):
        cfg = compose_cfg(list(overrides), shrink=False)
        stages = with_trainer_settings(OmegaConf.to_container(cfg.stages, resolve=True),
                                       OmegaConf.to_container(cfg.trainer, resolve=True), cfg.train_attention)
        return [config_key(stages[name]) for name in ("sft", "rm")]

    plain = keys()
    assert keys("trainer.precision=32") == keys("trainer.enable_progress_bar=false") == keys("trainer.max_steps=7") == plain
    assert keys("trainer=ddp") == plain  # its ranks are in stages.<stage>.ranks (above)
    assert keys("train_attention=sdpa") == plain  # float32 stages attend through sdpa either way
    bf16, accumulate = keys("trainer.precision=bf16-mixed"), keys("+trainer.accumulate_grad_batches=2")
    bf16_sdpa = keys("trainer.precision=bf16-mixed", "train_attention=sdpa")  # a half forward's attention differs
    assert all(len({a, b, c, d}) == 4 for a, b, c, d in zip(plain, bf16, accumulate, bf16_sdpa))


@pytest.mark.parametrize("extra", [["experiment=reverse"], ["task=tldr"], ["task=prompts", "task.path=data.jsonl"], []])
def test_the_debug_preset_fits_every_task(extra):
    """`debug=default` set the sentiment task's demonstration and pair counts, so with any other task (the --help
    line offers it beside any command) it failed: 'task.num_demonstrations: not a setting of task; valid keys: (see
    python src/train.py --cfg job)', a key the user never set. It now sets only what every task has."""
    cfg = compose_cfg(["debug=default", *extra], shrink=False)
    assert cfg.task.num_eval_prompts == 8 and cfg.trainer.max_steps == 4


@pytest.mark.parametrize("override, said", [
    ("model.arch.num_attention_heads=3", "The hidden size (64) is not a multiple of the number of attention heads (3)"),
    ("model.arch.hidden_size=abc", "Field 'hidden_size' expected int"),
    ("+model.arch.rope_theta=abc", "TypeError: unsupported operand"),
    # built, and failed in stage sft's first step (a 160-line traceback; the broken model cached)
    ("model.arch.num_key_value_heads=3", "cannot run a model of it (RuntimeError: The size of tensor a (4) must match"),
    # built, trained and cached without layers; stage rm then blamed its learning rate
    ("model.arch.num_hidden_layers=0", "model.arch.num_hidden_layers=0: a model needs at least one layer; give"),
    # kept by the config as one more attribute, read by no module: the default width, built without a word
    ("+model.arch.hiden_size=128", "model.arch.hiden_size: not a setting of LlamaConfig, which would keep it unused (did "
                                   "you mean hidden_size?); fix its name, or remove it"),
])
def test_a_model_arch_transformers_refuses_is_one_line_before_the_run(make_cfg, tmp_path, override, said):
    """Each was transformers' traceback when the base model was built, after the MLflow run was made."""
    from rlhflab.train import train

    with pytest.raises(ConfigError, match=r"^model.arch") as err:
        train(make_cfg(override, f"cache_dir={tmp_path}/cache"))
    assert said in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()


def test_a_model_arch_beside_a_given_sft_path_builds_nothing_and_is_said(tmp_path):
    """Under model.sft_path (and no model.name_or_path) a base model was built from model.arch, though no stage starts
    from it, and logged as the run's rlhflab.base_model; model.arch.* given beside it was dropped without a word."""
    from mlflow.tracking import MlflowClient
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import SHRINK, cli_run, run_id_of
    from rlhflab.tasks.sentiment import SentimentTask

    words = SentimentTask().build_tokenizer()
    LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, pad_token_id=words.pad_token_id)).save_pretrained(tmp_path / "sft")
    words.save_pretrained(tmp_path / "sft")
    args = [*SHRINK, f"model.sft_path={tmp_path}/sft", "model.arch.num_attention_heads=3", "reward=rule", "trainer.max_steps=1",
            f"cache_dir={tmp_path}/cache", f"output.dir={tmp_path}/run", f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    with cli_run(args, tmp_path) as proc:
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    assert (f"model.arch.num_attention_heads: not used; model.sft_path={tmp_path}/sft is the model (its own config.json), "
            "and model.arch builds one only where neither model.name_or_path nor model.sft_path is given") in output
    assert not (tmp_path / "cache" / "models").exists()  # nothing built
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id_of(tmp_path / "run"))
    assert run.data.params["rlhflab.base_model"] == "null" and run.data.params["rlhflab.policy_start"] == f"{tmp_path}/sft"


def test_lora_targets_the_built_model_lacks_are_one_line_before_the_run(tmp_path):
    """memory.target_modules=[nope]: a good line, but only after the MLflow run was made and the models loaded (helper
    28); the model built from model.arch is judged on the meta device before, as its arch is."""
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), "memory=lora", "memory.target_modules=[nope,q]"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
                              "RLHFLAB_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 2 and out.stderr.startswith("error: memory.target_modules: none of LlamaForCausalLM's decoder "
                                                         "layers has a module it names"), out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any from_pretrained of a model raises ModelLoaded: what comes before it is what runs before any model loads."""
    import transformers

    class ModelLoaded(Exception):
        pass

    def refuse(*args, **kwargs):
        raise ModelLoaded(args[1:2])

    for auto in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoModelForTokenClassification"):
        monkeypatch.setattr(getattr(transformers, auto), "from_pretrained", refuse)
    return ModelLoaded


@pytest.mark.parametrize("key", ["name_or_path", "sft_path"])
def test_lora_targets_a_given_model_lacks_are_one_line_before_the_run(make_cfg, tmp_path, no_model_loads, key):
    """memory.target_modules=[nope] beside a model given by path (loaded by from_pretrained, as the hub presets' are)
    passed every check before the run: adapt's line came after the MLflow run was made (and stage sft had trained,
    under model.name_or_path). Its config is read and its skeleton judged on the meta device before, as model.arch's
    is; targets it has pass, up to the first load."""
    given = save_tiny_neox(tmp_path / "neox")
    with pytest.raises(ConfigError) as err:
        train(make_cfg(f"model.{key}={given}", "memory=lora", "memory.target_modules=[nope]", "reward=rule"))
    assert str(err.value) == ("memory.target_modules: none of GPTNeoXForCausalLM's decoder layers has a module it names "
                              f"(their linear modules: {NEOX_LINEAR}); set memory.target_modules=all-linear, or "
                              "memory.target_modules=[dense,dense_4h_to_h,dense_h_to_4h,query_key_value]")
    assert not (tmp_path / "mlflow.db").exists()
    with pytest.raises(no_model_loads):  # past the checks, to the first from_pretrained: the policy's
        train(make_cfg(f"model.{key}={given}", "memory=lora", "memory.target_modules=[query_key_value,nope]", "reward=rule"))


def test_lora_targets_of_a_given_model_in_the_command_line_stop_before_the_run(tmp_path):
    """The same from the command line, as memory=hydra: one line, no MLflow store, nothing cached."""
    given = save_tiny_neox(tmp_path / "neox")
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), f"model.name_or_path={given}", "memory=hydra",
                          "memory.target_modules=[nope]"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
                              "RLHFLAB_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 2 and out.stderr.startswith("error: memory.target_modules: none of GPTNeoXForCausalLM's "
                                                         f"decoder layers has a module it names (their linear modules: "
                                                         f"{NEOX_LINEAR}); "), out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()


def test_lora_targets_of_a_model_not_in_the_cache_wait_for_its_load(monkeypatch):
    """A hub id whose config is not in the local Hugging Face cache (or a path that is not there) is not read: no
    download, no error of its own; adapt judges its targets once it loads."""
    import socket

    from rlhflab.models.build import check_given_targets

    def no_network(*args, **kwargs):
        raise AssertionError("the check asked the network")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    check_given_targets("rlhflab-tests/not-a-cached-model", ["nope"])
    check_given_targets("/nonexistent/rlhflab-model", ["nope"])


def test_lora_targets_of_a_hub_id_in_the_local_cache_are_judged_from_its_cached_config(tmp_path):
    """A hub id (the presets' model.name_or_path) whose config.json is in the local Hugging Face cache is judged as a
    local directory is, without the network; its snapshot here is the tiny GPT-NeoX's config alone."""
    import shutil

    snapshot = tmp_path / "hub" / "models--rlhflab-tests--tiny-neox" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    shutil.copy(save_tiny_neox(tmp_path / "neox") / "config.json", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    script = """
import socket
def no_network(*args, **kwargs):
    raise AssertionError("the check asked the network")
socket.getaddrinfo = socket.socket.connect = no_network
from rlhflab.errors import ConfigError
from rlhflab.models.build import check_given_targets
check_given_targets("rlhflab-tests/tiny-neox", ["dense", "nope"])
try:
    check_given_targets("rlhflab-tests/tiny-neox", ["nope"])
except ConfigError as err:
    print(err)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("memory.target_modules: none of GPTNeoXForCausalLM's decoder layers has a module it "
                                 f"names (their linear modules: {NEOX_LINEAR}); "), out.stdout + out.stderr


def test_lora_targets_are_judged_on_the_critic_a_given_reward_model_gives(tmp_path):
    """memory=lora with values (PPO) puts the critic's adapter on the reward model's backbone where that model reads
    the policy's tokens (LoraMemory.build): targets the policy has and the reward model lacks (q_proj: the tiny
    Llama's, not GPT-NeoX's) failed after the stages. A reward model of its own tokenizer is not adapted (the critic
    is the policy's): nothing to judge there."""
    from rlhflab.tasks.sentiment import SentimentTask
    from rlhflab.train import check_lora_targets

    words = SentimentTask().build_tokenizer()
    rm = save_tiny_neox(tmp_path / "rm", reward=True)
    cfg = compose_cfg(["memory=lora", "algo=ppo", f"model.reward_model_path={rm}", "memory.target_modules=[q_proj]"])
    plan = validate(cfg)
    with pytest.raises(ConfigError, match=r"^memory\.target_modules: none of GPTNeoXForTokenClassification's decoder "
                                          rf"layers \(the critic, on model\.reward_model_path={rm}\) has a module it names "
                                          rf"\(their linear modules: {NEOX_LINEAR}\); set memory\.target_modules=all-linear, "
                                          rf"or memory\.target_modules=\[q_proj,{NEOX_LINEAR.replace(', ', ',')}\]$"):
        check_lora_targets(cfg, plan, lambda: words)  # the list it offers keeps the policy's q_proj
    from peft import TaskType
    from transformers import AutoModelForTokenClassification

    from rlhflab.memory.lora import adapt, critic_of, lora_config

    with pytest.raises(ConfigError) as at_load:  # adapt's own line, where the load comes first, is the same
        adapt(AutoModelForTokenClassification.from_pretrained(rm), lora_config(8, 16, 0.0, ["q_proj"], TaskType.TOKEN_CLS),
              critic_of(rm), keep=["q_proj"])
    with pytest.raises(ConfigError, match=re.escape(str(at_load.value))):
        check_lora_targets(cfg, plan, lambda: words)
    for algo, targets in (("rloo", "[q_proj]"), ("ppo", "[q_proj,query_key_value]")):  # no critic; targets both have
        cfg = compose_cfg(["memory=lora", f"algo={algo}", f"model.reward_model_path={rm}", f"memory.target_modules={targets}"])
        check_lora_targets(cfg, validate(cfg), lambda: words)
    from conftest import tokenizer_without_pad

    own = tokenizer_without_pad(unk=True)
    own.add_special_tokens({"pad_token": "[PAD]"})
    foreign = save_tiny_neox(tmp_path / "foreign", reward=True, tokenizer=own)
    cfg = compose_cfg(["memory=lora", "algo=ppo", f"model.reward_model_path={foreign}", "memory.target_modules=[q_proj]"])
    check_lora_targets(cfg, validate(cfg), lambda: words)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_a_cache_dir_that_cannot_be_made_is_one_line_naming_it():
    """cache_dir=/proc/x as root: os.access calls /proc writable, so the check before the run passed, and the first
    entry's mkdir was a FileNotFoundError traceback."""
    from rlhflab.models.cache import cached

    built = []
    with pytest.raises(ConfigError, match=r"^cache_dir: cannot write '/proc/rlhflab-x/models' \(.+\); give a directory "
                                          r"you can write \(cache_dir=<dir>, or RLHFLAB_CACHE\)$"):
        cached(Path("/proc/rlhflab-x"), "models", "tiny", "k", "model", built.append)
    assert not built


def test_params_are_written_as_the_config_writes_them():
    """MLflow's params read 'None', 'True' and "['a.py:f', 'b.py:g']" (Python's str) where config.yaml and the command
    line say null, true and a list; a search for params.model.sft_path = 'null' found nothing."""
    from rlhflab.tracking import flatten

    cfg = {"model": {"sft_path": None}, "output": {"log_policy": True, "merge_lora": False},
           "reward": {"fns": ["a.py:f", "b.py:g"], "weights": [1.0, 0.5]}, "rl": {"lr": 0.001}, "seed": 0,
           "logger": {"tracking_uri": "http://alice:secret@host:5000"}}
    assert flatten(cfg) == {"model.sft_path": "null", "output.log_policy": "true", "output.merge_lora": "false",
                            "reward.fns": '["a.py:f", "b.py:g"]', "reward.weights": "[1.0, 0.5]", "rl.lr": "0.001",
                            "seed": "0", "logger.tracking_uri": "http://alice:***@host:5000"}


def test_a_sqlite_store_that_is_a_directory_is_one_line_at_once(tmp_path):
    """sqlite:///<a directory>: MLflow retried 'unable to open database file' for ~100 s, printing every retry."""
    import time

    from rlhflab.tracking import ensure_experiment

    uri = f"sqlite:///{tmp_path}"
    start = time.monotonic()
    with pytest.raises(ConfigError, match=re.escape(f"logger.tracking_uri: '{uri}' names a directory, not a database file; "
                                                    f"give a file in it, e.g. logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db")):
        ensure_experiment(uri, "rlhflab")
    assert time.monotonic() - start < 10
    assert list(tmp_path.iterdir()) == []  # no store, no lock file


def test_an_empty_tracking_uri_from_the_environment_is_one_line(tmp_path):
    """MLFLOW_TRACKING_URI= (set, empty): the run was made in MLflow's default store, then a 50-line traceback."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": ""}
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), f"cache_dir={tmp_path}/cache"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("error: logger.tracking_uri: empty (from MLFLOW_TRACKING_URI= or logger.tracking_uri=)"), \
        out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()
