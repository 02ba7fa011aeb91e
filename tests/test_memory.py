"""Memory strategies: every algorithm runs under each; lora and hydra keep one backbone and an exact reference."""

import logging

import pytest
import torch

from rlhflab.algos.registry import ALGORITHMS
from rlhflab.lit.stage_modules import lm_loss
from rlhflab.memory.full import FullMemory
from rlhflab.memory.hydra_rlhf import HydraRLHFMemory
from rlhflab.memory.lora import LoraMemory
from rlhflab.models.build import load_causal_lm, load_reward_model
from rlhflab.models.heads import ScalarHead, sequence_scores, trunk
from rlhflab.perf import model_state_bytes
from rlhflab.rollout.batch import join
from rlhflab.train import train

STRATEGIES = ["full", "lora", "hydra"]


def sft_weights_path(memory) -> str:
    """The directory the policy was loaded from (through peft's wrapper where there is one)."""
    return memory.generation_model.name_or_path


def eval_rollout(module, samples_per_prompt: int = 2):
    """Completions of the held-out prompts by the trained policy: real left/right padding and EOS."""
    torch.manual_seed(0)
    return module.source.generator.generate(
        module.memory.generation_model, module.eval_query, module.eval_prompts, samples_per_prompt, module.policy_version
    )


def param_bytes(modules) -> int:
    state = model_state_bytes(modules, None)
    return state["perf/param_bytes_trainable"] + state["perf/param_bytes_frozen"]


def adapter_bytes(memory) -> int:
    return sum(p.numel() * p.element_size() for m in memory.model_modules() for n, p in m.named_parameters() if "lora_" in n)


def backbone_copies(memory) -> int:
    """Distinct storages holding an input-embedding matrix: one per backbone the strategy keeps."""
    return len({
        p.untyped_storage().data_ptr()
        for m in memory.model_modules() for n, p in m.named_parameters() if n.endswith("embed_tokens.weight")
    })


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_trains_the_policy_and_keeps_the_reference_exact(make_cfg, strategy, algo):
    """Two RL steps: the policy moves, every trained parameter got a gradient, and the reference
    log-probs are still bit-identical to a plain from_pretrained load of the starting weights."""
    result = train(make_cfg(f"memory={strategy}", f"algo={algo}", "trainer.max_steps=2"))
    memory = result.module.memory
    rollout = eval_rollout(result.module)
    q, r, t = rollout.query, rollout.response, result.module.temperature
    plain = load_causal_lm(sft_weights_path(memory)).eval()
    with torch.no_grad():
        ref = memory.reference_logprobs(q, r, t)
        # lora's and hydra's reference is the adapted model's forward, adapters off (Hugging Face's; rl.prompt_once
        # runs plain Llamas only): the plain load's through the same
        memory.prompt_once = strategy == "full"
        assert torch.equal(ref, memory._logprobs(plain, q, r, t))
        assert not torch.allclose(memory.policy_logprobs(q, r, t), ref)
    trained = memory.policy_parameters() + memory.value_parameters()
    # Every trained parameter got a gradient: AdamW keeps state only for parameters it stepped with one
    # (the gradients themselves are freed after each step).
    state = result.module.trainer.optimizers[0].state
    assert trained and all(p.requires_grad and state.get(p) and p.grad is None for p in trained)
    assert bool(memory.value_parameters()) == ALGORITHMS[algo].needs_values


def test_lora_and_hydra_hold_one_policy_backbone(make_cfg):
    """PPO holds policy, reference, reward and value: full keeps 4 backbones, lora 2 (the reference
    is the policy with its adapter off, the reward model the critic with its adapter off), hydra 1
    (every role reads the same trunk)."""
    memories = {s: train(make_cfg(f"memory={s}", "algo=ppo", "trainer.max_steps=1")).module.memory for s in STRATEGIES}
    assert {s: backbone_copies(m) for s, m in memories.items()} == {"full": 4, "lora": 2, "hydra": 1}
    backbone = param_bytes([memories["full"].reference])
    size = {s: param_bytes(m.model_modules()) for s, m in memories.items()}
    # lora drops the reference and reward backbones and adds adapters (and the heads' copies: a few bytes).
    dropped = param_bytes([memories["full"].reference, memories["full"].reward_model]) - param_bytes([memories["lora"].reward_head])
    assert size["full"] - size["lora"] == pytest.approx(dropped - adapter_bytes(memories["lora"]), rel=0.01)
    # hydra: one backbone, two adapters and two scalar heads.
    assert size["hydra"] == pytest.approx(backbone + adapter_bytes(memories["hydra"]), rel=0.01)
    trainable = {s: model_state_bytes(m.model_modules(), None)["perf/param_bytes_trainable"] for s, m in memories.items()}
    assert trainable["lora"] < trainable["full"] / 2 and trainable["hydra"] < trainable["full"] / 2
    # every adapted layer, the policy's and the critic's, adds its adapter inside one addmm (models/lora_add.py)
    from peft.tuners.lora.layer import Linear

    from rlhflab.models.lora_add import FusedAddLinear

    for s in ("lora", "hydra"):
        layers = [type(x) for m in memories[s].model_modules() for x in m.modules() if isinstance(x, Linear)]
        assert len(layers) > 8 and set(layers) == {FusedAddLinear}, (s, layers)


def test_lora_ppo_reward_is_the_critic_backbone_with_its_adapter_off(make_cfg):
    """memory=lora with PPO scores with the critic's backbone (adapter off) and the reward model's head:
    the same scores as the separate reward model of memory=full, also after the critic has trained."""
    lora = train(make_cfg("memory=lora", "algo=ppo", "trainer.max_steps=2")).module
    full = train(make_cfg("memory=full", "algo=ppo", "trainer.max_steps=1")).module.memory
    assert lora.memory.reward_model is None and lora.memory.reward_head is not None
    rollout = eval_rollout(lora)
    q, r = rollout.query, rollout.response
    assert any(p.abs().sum() > 0 for n, p in lora.memory.value_model.named_parameters() if "lora_B" in n)  # (B starts at 0)
    with torch.no_grad():
        torch.testing.assert_close(lora.memory.scores(q, r), full.scores(q, r), rtol=1e-5, atol=1e-5)


def test_hydra_scores_are_the_stage_reward_head_on_the_shared_trunk(make_cfg, caplog):
    """Scores = the saved reward head on the plain SFT backbone; scores and reference log-probs
    of one batch take one trunk forward; a second run loads stage hydra_sft from the cache."""
    train(make_cfg("memory=hydra", "trainer.max_steps=1"))
    with caplog.at_level(logging.INFO):
        result = train(make_cfg("memory=hydra", "trainer.max_steps=1"))
    assert "stage hydra_sft: cached" in caplog.text and "training on" not in caplog.text
    memory, module = result.module.memory, result.module
    rollout = eval_rollout(module)
    q, r = rollout.query, rollout.response
    path = sft_weights_path(memory)
    plain = load_causal_lm(path).eval()
    ids = torch.cat([q, r], dim=1)
    with torch.no_grad():
        ids_, mask, positions = join(q, r, memory.pad_token_id)  # Hugging Face's own trunk forward
        hidden = plain.get_decoder()(input_ids=ids_, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
        raw = sequence_scores(ScalarHead.from_pretrained(path), hidden, ids, memory.pad_token_id)
        mean, std = memory.reward_norm
        assert torch.equal(memory.scores(q.clone(), r.clone()), (raw - mean) / std)

        calls = []
        hook = memory.causal_lm.get_decoder().register_forward_hook(lambda *_: calls.append(1))
        memory.scores(q, r)
        memory.reference_logprobs(q, r, module.temperature)
        hook.remove()
    assert len(calls) == 1


def test_joint_hydra_ppo_reads_values_off_the_policy_adapters_trunk_in_one_forward(make_cfg):
    """memory.actor_critic=joint (the paper's J-Hydra-PPO): no value adapter; the value head and the policy adapter
    train; one trunk forward gives the log-probs and values that the separate calls give, where
    actor_critic=separate (Hydra-PPO) runs two, and the values move with the policy's adapter."""
    module = train(make_cfg("memory=hydra", "memory.actor_critic=joint", "algo=ppo", "trainer.max_steps=2")).module
    joint = module.memory
    separate = train(make_cfg("memory=hydra", "algo=ppo", "trainer.max_steps=1")).module.memory
    adapters = [n for n, _ in joint.lm.named_parameters() if "lora_" in n]
    assert adapters and not any(".value." in n for n in adapters)
    assert any(".value." in n for n, _ in separate.lm.named_parameters())
    assert adapter_bytes(joint) < adapter_bytes(separate)
    assert {id(p) for p in joint.value_parameters()} == {id(p) for p in joint.value_head.parameters()}
    state = module.trainer.optimizers[0].state
    assert all(state.get(p) for p in joint.policy_parameters() + joint.value_parameters())
    rollout = eval_rollout(module)
    q, r, t = rollout.query, rollout.response, module.temperature
    for memory, forwards in ((joint, 1), (separate, 2)):
        calls = []  # each trunk forward's width: the last response token is not run (read_before)
        hook = memory.causal_lm.get_decoder().register_forward_pre_hook(
            lambda _, args, kwargs: calls.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
        with torch.no_grad():
            logprobs, values = memory.policy_logprobs_and_values(q, r, t)
        hook.remove()
        assert calls == [q.shape[1] + r.shape[1] - 1] * forwards
        with torch.no_grad():
            assert torch.equal(logprobs, memory.policy_logprobs(q, r, t)) and torch.equal(values, memory.values(q, r))
    with torch.no_grad():
        before = joint.values(q, r)
        for p in joint.policy_parameters():
            p.add_(0.05)
        assert not torch.allclose(joint.values(q, r), before)


@pytest.mark.parametrize("memory", ["memory=full", "memory=hydra memory.actor_critic=joint"])
def test_ppo_in_one_pass_reads_the_values_before_the_update_from_the_updates_own_forward(make_cfg, tmp_path, monkeypatch,
                                                                                      memory):
    """PPO with one pass over a batch in one mini-batch (algo.epochs=1 algo.num_minibatches=1): GAE's values before
    the update are the update's own forward's, detached, so the critic runs no forward of its own before it. The
    losses, KLs and value losses are those of that forward of their own, which the run no longer makes."""
    from conftest import history
    from rlhflab.lit.rl_module import RLHFModule

    calls = []
    values = RLHFModule._values
    monkeypatch.setattr(RLHFModule, "_values", lambda self, *a: calls.append(1) or values(self, *a))
    runs = {}
    for shared in (True, False):
        if not shared:  # the critic's forward of its own before the update, as before
            monkeypatch.setattr(RLHFModule, "values_from_update", property(lambda self: False))
        cfg = make_cfg(*memory.split(), "algo=ppo", "algo.epochs=1", "algo.num_minibatches=1", "trainer.max_steps=4",
                       f"output.dir={tmp_path / str(shared)}")
        calls.clear()
        runs[shared] = (cfg, train(cfg), len(calls))
    (cfg, shared, n_shared), (_, own, n_own) = runs[True], runs[False]
    assert shared.module.policy_version == own.module.policy_version == 4
    assert (n_shared, n_own) == (0, 4)
    uri = cfg.logger.tracking_uri
    for key in ["train/loss", "train/kl", "train/reward", "train/vf_loss", "train/vf_clipfrac", "train/pg_loss", "train/rlhf_reward"]:
        got, want = history(uri, shared.run_id, key), history(uri, own.run_id, key)
        assert len(got) == 4 and [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5, abs=1e-6), key


def test_hydra_trunk_and_lm_loss_match_the_models_own_forward():
    """Stage hydra_sft's shared-trunk LM loss is the loss the causal LM itself would compute."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(config).eval()
    input_ids = torch.randint(1, 40, (3, 7))
    labels = input_ids.masked_fill(torch.arange(7) < 3, -100)  # a prompt of 3 tokens is not learned
    logits = model.get_output_embeddings()(trunk(model, input_ids, torch.ones_like(input_ids)))
    torch.testing.assert_close(lm_loss(logits, labels), model(input_ids=input_ids, labels=labels).loss)


def _random_adapters(memory, seed: int = 0) -> None:
    """Non-zero adapters (LoRA B starts at 0) so the policy and value adapters really differ."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in memory.policy_parameters() + memory.value_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("strategy", [LoraMemory, HydraRLHFMemory])
def test_gradient_checkpointing_gives_the_same_gradients(make_cfg, strategy):
    """Policy then value forward, one backward: under hydra the recomputation must use the adapter
    each forward ran with, although the active adapter switched in between."""
    result = train(make_cfg(f"memory={strategy.name}", "algo=ppo", "trainer.max_steps=1"))
    memory = result.module.memory
    path = sft_weights_path(memory)
    # lora: the critic is built from the reward model (they share its backbone); hydra: the head sits with the LM
    reward_path = memory.value_model.get_base_model().name_or_path if strategy is LoraMemory else path
    q, r = torch.randint(4, 40, (4, 6)), torch.randint(4, 40, (4, 5))
    grads = []
    for checkpointing in (False, True):
        m = strategy(gradient_checkpointing=checkpointing).build(path, reward_path, True, result.module.tokenizer)
        _random_adapters(m)
        loss = m.policy_logprobs(q, r, 1.0).sum() + m.values(q, r).square().sum()
        loss.backward()
        grads.append([p.grad.clone() for p in m.policy_parameters() + m.value_parameters()])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_checkpointing_recomputes_in_backward_under_every_strategy(make_cfg, strategy):
    """With the switch on, an update's backward re-runs each layer's forward (HF checkpoints only in
    train mode, which from_pretrained does not give and Lightning does not set); off, it runs once."""
    calls = {}
    for on in (False, True):
        result = train(make_cfg(f"memory={strategy}", f"memory.gradient_checkpointing={str(on).lower()}", "trainer.max_steps=1"))
        memory = result.module.memory
        rollout = eval_rollout(result.module)
        attention = memory.generation_model.get_decoder().layers[0].self_attn
        count = []
        hook = attention.register_forward_hook(lambda *_: count.append(1))
        memory.policy_logprobs(rollout.query, rollout.response, 1.0).sum().backward()
        hook.remove()
        calls[on] = len(count)
    assert calls == {False: 1, True: 2}


def _gpt2(tie: bool = True):
    """A tiny GPT-2: Conv1D layers named c_attn/c_fc/c_proj in `transformer.h`, its LM head tied to its embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=20, n_embd=16, n_layer=2, n_head=2, n_positions=32, tie_word_embeddings=tie))


def test_lora_names_that_reach_no_decoder_layer_are_one_line():
    """The default target names are Llama's and GPT-NeoX's: on GPT-2 they reached its tied LM head alone (the policy
    trained a head adapter only; the critic's adapter raised peft's NoMatchingPeftModuleError)."""
    from peft import TaskType

    from rlhflab.errors import ConfigError
    from rlhflab.memory.lora import DEFAULT_TARGETS, adapt, lora_config

    config = lambda targets: lora_config(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets,  # noqa: E731
                                         task_type=TaskType.CAUSAL_LM)
    with pytest.raises(ConfigError, match=r"^memory\.target_modules: none of GPT2LMHeadModel's decoder layers has a "
                                          r"module it names \(their linear modules: c_attn, c_fc, c_proj\); set "
                                          r"memory\.target_modules=all-linear"):
        adapt(_gpt2(), config(list(DEFAULT_TARGETS)))
    for targets in ("all-linear", ["c_attn", "c_fc", "c_proj"]):
        wrapped = adapt(_gpt2(), config(targets))
        assert any(".h.1.mlp.c_fc" in name for name in wrapped.targeted_module_names), targets


def test_fsdp_units_are_each_models_own_decoder_layers():
    """Sharding found decoder layers at `base_model.layers` (Llama, GPT-NeoX) only: GPT-2 went whole into one unit,
    its tied head unchecked. The units are now the classes a model names in _no_split_modules, and a tied head is
    found, to share its embeddings' unit (tests/test_distributed.py trains one under trainer=fsdp)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhflab.models.sharding import decoder_layers, tied_head

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=2))
    assert decoder_layers(llama) == list(llama.model.layers)
    gpt2 = _gpt2(tie=False)
    assert decoder_layers(gpt2) == list(gpt2.transformer.h) and tied_head(gpt2) is None and tied_head(llama) is None
    tied = _gpt2()
    assert tied_head(tied) == (tied.transformer.wte, tied.lm_head)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_without_dropout_zeroes_the_attentions_own_rate_so_the_update_forward_is_samplings(arch):
    """A Llama's attention dropout is a number its attention passes to sdpa in train mode (no nn.Dropout module):
    left there, the update's forward (train mode) would drop attention weights that sampling (eval mode) kept."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    from rlhflab.models.build import without_dropout

    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, attention_dropout=0.5))
    else:
        model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                 num_attention_heads=2, attention_dropout=0.5, hidden_dropout=0.5))
    ids = torch.randint(1, 32, (4, 6))
    with torch.no_grad():
        sampling = model.eval()(ids).logits
        assert not torch.equal(model.train()(ids).logits, sampling)  # the rate is there to be zeroed
        without_dropout(model)
        assert torch.equal(model.train()(ids).logits, sampling)
    assert model.config.attention_dropout == 0.5  # the saved config is the model's own


def _value_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForTokenClassification

    from rlhflab.models.build import without_dropout

    torch.manual_seed(seed)
    return without_dropout(LlamaForTokenClassification(LlamaConfig(  # as load_value_model: no dropout
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_labels=1,
        pad_token_id=0)))


def _value_loss(model, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    values = model(input_ids=ids).logits.squeeze(-1)[:, 2:-1].float()  # as MemoryStrategy._values slices them
    return ((values - target) ** 2).mean()


def _sharded_value_rank(rank: int, ids, target) -> tuple[dict, list]:
    """One of two gloo ranks: a value model (a biased score head, as PPO's) sharded as a run shards it, its value
    loss on this rank's half of the batch, backward; (the whole gradients, the warnings seen)."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from rlhflab.models.sharding import full, shard, warm_up

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # as a run's console shows them (once per place)
        model = shard(_value_model(), mesh["data_parallel"])
        warm_up(model)
        rows = slice(rank * len(ids) // 2, (rank + 1) * len(ids) // 2)
        _value_loss(model, ids[rows], target[rows]).backward()
    return {name: full(p.grad).tolist() for name, p in model.named_parameters()}, [str(w.message) for w in seen]


def test_a_sharded_value_model_gets_one_processs_gradients_and_no_view_warning(tmp_path):
    """Under trainer=fsdp, PPO printed torch's 'FSDP2-wrapped module (FSDPLinear) returned a view tensor ... can cause
    backward to fail or produce wrong gradients' four times: a Linear with a bias on a 3-D input returns a view of
    its own output (addmm, then view), and nothing in rlhflab changes the values in place. The warning is set aside
    for those heads, and two real gloo ranks with half the batch each get one process's gradients."""
    from conftest import on_two_gloo_ranks

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 32, (4, 7), generator=gen)
    target = torch.randn(4, 4, generator=gen)
    got = on_two_gloo_ranks(_sharded_value_rank, tmp_path / "store", ids, target)
    whole = _value_model()
    _value_loss(whole, ids, target).backward()
    for name, p in whole.named_parameters():
        for rank, (grads, _) in enumerate(got):
            torch.testing.assert_close(torch.tensor(grads[name]), p.grad, msg=f"rank {rank}: {name}")
    assert not [w for _, seen in got for w in seen if "returned a view tensor" in w], got[0][1]


def _tiny_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=32, tie_word_embeddings=tie)).eval()


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("prompt_once", [True, False])
def test_log_prob_and_value_forwards_leave_out_the_last_response_token(width, prompt_once):
    """The log-probs and values of a response are read at the positions before each of its tokens, so its last token
    is not run (`read_before`): the same numbers as the whole sequence's forward sliced as TRL slices it, over one
    position fewer (the embedding sees P + R - 1 tokens), also for a one-token response."""
    from rlhflab.rollout.batch import token_logprobs

    model, critic = _tiny_llama(False), _value_model().eval()
    query = torch.randint(3, 24, (3, 5)).repeat_interleave(2, 0)  # 3 prompts, k = 2, two of them left-padded
    query[2:4, :2] = 0
    query[4:, :1] = 0
    response = torch.randint(3, 24, (6, width))
    response[0, 1:] = 0  # a completion that ended early: pads after it
    memory = FullMemory()
    memory.pad_token_id, memory.prompt_once = 0, prompt_once
    ids, mask, positions = join(query, response, 0)
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, query.shape[1] - 1 : -1]
        want_values = critic(input_ids=ids, attention_mask=mask, position_ids=positions).logits.squeeze(-1)[:, 4:-1]
        torch.testing.assert_close(memory._logprobs(model, query, response, 1.0), token_logprobs(whole, response, 1.0))
        torch.testing.assert_close(memory._values(critic, query, response), want_values)
        seen = []
        for m in (model, critic):  # a hook sends the forward through Hugging Face's, whose embedding it reads
            m.model.embed_tokens.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
        memory._logprobs(model, query, response, 1.0)
        memory._values(critic, query, response)
    assert seen == [query.shape[1] + width - 1] * 2


@pytest.mark.parametrize("tie", [False, True])
def test_lowered_linears_give_autocasts_log_probs_bit_for_bit(tie):
    """lower_linears stores each linear of a frozen model in bf16: under bf16 autocast, which casts a float32 weight
    at each call, the same log-probs bit for bit, at half the linears' bytes; embeddings and norms stay float32, and so
    does an LM head tied to the embeddings (a bf16 embedding would make the whole residual stream bf16)."""
    from torch import nn

    from rlhflab.models.build import freeze, lower_linears

    model = freeze(_tiny_llama(tie))
    query, response = torch.randint(3, 24, (4, 5)), torch.randint(3, 24, (4, 6))
    memory = FullMemory()
    memory.pad_token_id = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = memory._logprobs(model, query, response, 1.0)
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    lowered = {n for n, m in linears.items() if not (tie and n == "lm_head")}
    freed = lower_linears(model, torch.bfloat16)
    assert freed == sum(linears[n].weight.numel() * 2 for n in lowered)
    assert {n for n, m in linears.items() if m.weight.dtype == torch.bfloat16} == lowered
    kept = {n: p.dtype for n, p in model.named_parameters() if n.removesuffix(".weight") not in lowered}
    assert "model.embed_tokens.weight" in kept and set(kept.values()) == {torch.float32}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(memory._logprobs(model, query, response, 1.0), before)
    assert lower_linears(model, torch.bfloat16) == 0  # once


def test_under_bf16_mixed_the_frozen_models_are_kept_in_bf16_and_evaluated_under_autocast(make_cfg, caplog):
    """trainer.precision=bf16-mixed: memory=full's reference and reward model keep their linears in bf16 from the fit's
    start (their log-probs and scores under the steps' autocast those of the float32 weights loaded, bit for bit), and
    every evaluation runs under that autocast, those at the start and end as those between steps: a new evaluation of
    the last policy, from outside any autocast, gives the run's last one."""
    with caplog.at_level("INFO", logger="rlhflab.lit.rl_module"):
        result = train(make_cfg("trainer.precision=bf16-mixed", "trainer.max_steps=2", "rl.eval_every=1"))
    module, memory = result.module, result.module.memory
    assert ("frozen models (LlamaForCausalLM, LlamaForSequenceClassification): their linear layers kept in bfloat16, the "
            "dtype autocast computes them in") in caplog.text
    assert memory.reference.lm_head.weight.dtype == memory.reward_model.score.weight.dtype == torch.bfloat16
    assert memory.policy.lm_head.weight.dtype == torch.float32
    plain = load_causal_lm(sft_weights_path(memory)).eval()
    plain_reward = load_reward_model(memory.reward_model.name_or_path, pad_token_id=memory.pad_token_id).eval()
    rollout = eval_rollout(module)
    q, r, t = rollout.query, rollout.response, module.temperature
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(memory.reference_logprobs(q, r, t), memory._logprobs(plain, q, r, t))
        assert torch.equal(memory.scores(q, r), memory._scores(plain_reward, q, r))
    assert param_bytes([memory.reference]) < 0.6 * param_bytes([plain])
    assert [v for v, _, _ in module.eval_history] == [0, 1, 2]
    again = module.evaluate()
    assert (again["eval/gold_reward"], again["eval/kl"]) == module.eval_history[-1][1:]


def test_at_full_precision_the_reference_stays_float32(make_cfg, caplog):
    """trainer.precision=32-true (the default): no autocast, the reference's weights as loaded."""
    with caplog.at_level("INFO", logger="rlhflab.lit.rl_module"):
        result = train(make_cfg("trainer.max_steps=1"))
    assert {p.dtype for p in result.module.memory.reference.parameters()} == {torch.float32}
    assert "their linear layers kept in" not in caplog.text
