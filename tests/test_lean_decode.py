"""rollout/lean.py: the decode loop draws what generate() draws, the forward computes what the HF forward computes,
and both stand aside where they cannot."""

import itertools
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhflab.errors import ConfigError
from rlhflab.lit.data import encode_prompts
from rlhflab.rollout.hf import HFGenerator
from rlhflab.rollout.batch import join
from rlhflab.models import attention
from rlhflab.rollout import lean
from rlhflab.rollout.lean import SPLIT_MIN_ROWS, lean_forward, lean_unsupported, prompt_once_logits
from rlhflab.tasks.sentiment import SentimentTask

TASK = SentimentTask(response_words=8, seed=0)
TOK = TASK.build_tokenizer()
# The task's prompts are all as long; cut some shorter, so the batch is left-padded as a real one is.
PROMPTS = [" ".join(p.split()[: 2 + i % 5]) for i, p in enumerate(TASK.prompts("train")[:8])]
UNPADDED = TASK.prompts("train")[8:16]  # as the task gives them: a batch without padding (no attention mask)


def llama(**arch) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = dict(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id)
    return LlamaForCausalLM(LlamaConfig(**{**config, **arch})).eval()


def draw(model, decode: str, greedy: bool, temperature: float, seed: int, padded: bool = True):
    gen = HFGenerator(temperature=temperature, max_new_tokens=10, decode=decode)
    gen.setup(TOK, 10)
    query = encode_prompts(TOK, PROMPTS if padded else UNPADDED).repeat_interleave(2, dim=0)
    if padded:
        assert (query[:, 0] == TOK.pad_token_id).any() and (query[:, 0] != TOK.pad_token_id).any()  # left padding
    else:
        assert (query != TOK.pad_token_id).all()
    torch.manual_seed(seed)
    return gen._generate(model, query, greedy=greedy)


ARCH_CASES = {
    "mha": {},  # as the embedded tiny model: 4 heads, 4 key/value heads
    "gqa-tied": {"num_key_value_heads": 2, "tie_word_embeddings": True},  # grouped-query attention, tied lm_head
    "rope-linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}},
}
ARCHS = pytest.mark.parametrize("arch", list(ARCH_CASES.values()), ids=list(ARCH_CASES))
WIDE = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12}  # model=llama100m's width


@ARCHS
def test_lean_decoding_draws_generates_tokens_and_log_probs(arch):
    """From the same torch seed, decode=lean (under inference mode) returns generate()'s tokens (a row ended by EOS
    padded after it, the batch as wide as its longest completion) and the log-probs BehaviourLogprobs records, at
    temperature 1 and 0.7 and greedy; on a random model several rows end early and several run to the budget. With
    left-padded prompts (a boolean mask at every token) and without (no mask after the prompt's forward)."""
    model = llama(**arch)
    assert lean_unsupported(model) is None
    ended_early = 0
    for seed, padded in itertools.product(range(3), (True, False)):
        for greedy, temperature in ((False, 1.0), (False, 0.7), (True, 1.0)):
            ours, theirs = (draw(model, decode, greedy, temperature, seed, padded) for decode in ("lean", "generate"))
            assert torch.equal(ours[0], theirs[0]), (seed, padded, greedy, temperature)
            # drawn under inference mode, returned as plain tensors (a step may modify them or save them for backward)
            assert not any(t.is_inference() for t in ours if t is not None)
            if greedy:
                assert ours[1] is None and theirs[1] is None
            else:
                torch.testing.assert_close(ours[1], theirs[1], atol=1e-6, rtol=0)
                ended = (ours[0] == TOK.eos_token_id).any(1)
                ended_early += int(ended.any() and not ended.all())
    assert ended_early > 0


@pytest.fixture
def one_thread():
    """One torch thread, a run's default (torch_threads=1), restored after: at 2 threads the 113M width's decode loop
    was not repeatable call to call on the Intel Xeon host (3.8e-5 between two identical calls in some processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", [*ARCH_CASES.values(), WIDE], ids=[*ARCH_CASES, "113m-width"])
def test_each_prompts_prefill_runs_once_and_gives_every_sample_the_batchs_numbers(arch, monkeypatch, one_thread):
    """A prompt's k samples (repeat_prompts: equal consecutive rows) share one prefill forward, whose keys, values and
    last hidden states are copied to each: the same tokens and log-probs, bit for bit, as the prefill of every row,
    with 4 samples a prompt, with 2, and in a batch where only some rows repeat (the rest run as they are). At the
    113M preset's width the LM head's product over each prompt's row alone gave other last bits than over every
    row (the first token's log-probs ~5e-7 off on the Intel Xeon host with AMX), so the head runs on every row."""
    from rlhflab.rollout import lean

    embedded = []  # the (rows, tokens) of each forward the loop runs
    embed = lean._embed
    monkeypatch.setattr(lean, "_embed", lambda e, ids: embedded.append(tuple(ids.shape)) or embed(e, ids))
    model = llama(**arch)
    query = encode_prompts(TOK, PROMPTS)
    mixed = torch.cat([query[:3].repeat_interleave(3, dim=0), query[3:]])  # 3 prompts x 3, then 5 prompts once
    for batch in (query.repeat_interleave(4, dim=0), query.repeat_interleave(2, dim=0), mixed):
        for seed, temperature in ((0, 1.0), (1, 0.7), (2, None)):
            drawn = []
            for share in (True, False):
                torch.manual_seed(seed)
                embedded.clear()
                with torch.inference_mode():
                    drawn.append(lean._sample(model, batch, TOK.pad_token_id, TOK.eos_token_id, 10, temperature, share))
                assert embedded[0] == ((len(PROMPTS) if share else len(batch)), query.shape[1])  # the prefill's rows
            (tokens, logprobs), (tokens_each, logprobs_each) = drawn
            assert torch.equal(tokens, tokens_each), (len(batch), seed)
            assert (logprobs is None) == (temperature is None)
            if logprobs is not None:
                assert torch.equal(logprobs, logprobs_each), (len(batch), seed)


@ARCHS
def test_a_batch_split_with_the_reference_process_samples_the_whole_batchs_tokens(arch, caplog, one_thread):
    """mode.split_generation: the reference's forked process samples a batch's last rows from the learner's
    generator state, the learner the first: generate()'s tokens and log-probs, bit for bit (log-probs where the
    response mask keeps them), and the generator as many draws on, for even and odd batches, cut at half and
    SPLIT_MIN_ROWS from either end (SplitRows moves the cut), and a batch too small to split, sampled at two
    temperatures and greedy; after the policy's weights change in place (an update making EOS likely, so the
    halves end at different tokens), the process samples from the new ones (they are in shared memory).
    On one thread, as a run with the process has it (a core left free, config.resolve_reference) and the process
    always is: with the interpreter's 2 threads the learner's half's log-probs were ~1e-7 off the process's."""
    from rlhflab.lit.reference import ReferenceProcess
    from rlhflab.rollout.batch import response_mask_from_eos

    model = llama(**arch)
    uneven = 0
    process = ReferenceProcess(lambda *rows: None, model)
    try:
        gen = HFGenerator(temperature=1.0, max_new_tokens=10)
        gen.setup(TOK, 10)
        query = encode_prompts(TOK, PROMPTS).repeat_interleave(2, dim=0)
        for update in range(2):
            if update:  # in place, as the optimizer writes them: EOS made likely (~half the mass), so rows end early
                with torch.no_grad():
                    h = model.model(query).last_hidden_state.mean((0, 1))
                    model.lm_head.weight[TOK.eos_token_id] = 4 * h / h.dot(h)
            for rows in (query, query[:-1], query[:6]):  # 6 rows: not split (a part of 3 samples other floats)
                for seed, temperature in ((0, 1.0), (1, 0.7), (2, None)):
                    drawn = []
                    cut = (len(rows) // 2, SPLIT_MIN_ROWS, len(rows) - SPLIT_MIN_ROWS)[(seed + update) % 3]
                    for split in (False, True):
                        gen.temperature = temperature or 1.0
                        gen.split_with = (lambda: process.generating) if split else None
                        process.split.cuts[len(rows)] = cut
                        torch.manual_seed(seed)
                        with caplog.at_level(logging.INFO, logger="rlhflab.rollout.hf"):
                            response, logprobs = gen._generate(model, rows, greedy=temperature is None)
                        drawn.append((response, logprobs, torch.rand(3)))
                    (whole, whole_lp, after), (split, split_lp, split_after) = drawn
                    what = (update, len(rows), seed, temperature)
                    assert torch.equal(whole, split), what
                    assert torch.equal(after, split_after), what  # the generator's state after them
                    assert not any(t.is_inference() for t in (split, split_lp) if t is not None)
                    if temperature is None:
                        assert whole_lp is None and split_lp is None
                    else:
                        mask = response_mask_from_eos(whole, TOK.eos_token_id)
                        assert torch.equal(whole_lp * mask, split_lp * mask), what
                    # how many tokens each half's own loop ran (to its last row's EOS, or the budget)
                    length = torch.where((whole == TOK.eos_token_id).any(1),
                                         (whole == TOK.eos_token_id).int().argmax(1) + 1, whole.shape[1])
                    if len(rows) >= 2 * SPLIT_MIN_ROWS:
                        uneven += int(length[:cut].max() != length[cut:].max())
    finally:
        process.close()
    assert uneven > 0  # the halves' loops ended at different tokens: the generator's draws past the shorter one's
    assert caplog.text.count("samples the last rows of each batch") == 1


def test_split_rows_moves_the_cut_toward_both_parts_ending_together():
    """SplitRows starts at half; a process slower than the learner gets fewer rows at the next batch of that size, a
    faster one more, by half the rows the times' difference is worth, at most an eighth of the batch a step, each
    part keeping a quarter of the rows and SPLIT_MIN_ROWS; level times leave it; another batch size has its own
    cut; a batch too small for two such parts stays at half."""
    from rlhflab.lit.reference import SplitRows

    split = SplitRows(lambda *args: None)
    assert split.cut(64) == 32 and split.cut(7) == 3
    split.took(64, 0.0077, 0.0136)  # the process's core 1.7x slower: 64 * 5.9 / 21.3 / 2 = 8.9 rows, capped at 8
    assert split.cut(64) == 40 and split.cut(7) == 3
    split.took(64, 0.0082, 0.0115)  # 64 * 3.3 / 19.7 / 2 = 5.4
    assert split.cut(64) == 45
    split.took(64, 0.0100, 0.0100)
    assert split.cut(64) == 45
    split.took(64, 0.0200, 0.0100)  # now the learner's core is the slow one
    assert split.cut(64) == 37
    for _ in range(20):
        split.took(64, 0.0, 1.0)
    assert split.cut(64) == 48
    for _ in range(20):
        split.took(64, 1.0, 0.0)
    assert split.cut(64) == 16
    for _ in range(20):
        split.took(10, 1.0, 0.0)
    assert split.cut(10) == SPLIT_MIN_ROWS
    split.took(6, 1.0, 0.0)  # (rollout/hf.py splits no batch this small)
    assert split.cut(6) == 3


def test_sampling_from_diverged_weights_says_so_in_one_line():
    """NaN weights: the lean loop (which draws without torch.multinomial's per-token checks) and its split with the
    reference process raise DivergedWeights, as generate() did through multinomial's refusal."""
    from rlhflab.errors import DivergedWeights
    from rlhflab.lit.reference import ReferenceProcess

    model = llama()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    process = ReferenceProcess(lambda *rows: None, model)
    try:
        for split in (False, True):
            gen = HFGenerator(max_new_tokens=4)
            gen.setup(TOK, 4)
            gen.split_with = (lambda: process.generating) if split else None
            with pytest.raises(DivergedWeights, match="weights have diverged"):
                gen._generate(model, encode_prompts(TOK, PROMPTS), greedy=False)
    finally:
        process.close()


def test_lean_unsupported_walks_every_module_once_and_sees_changes_after_a_verdict():
    """lean_unsupported's own walk over the modules (`_submodules`, not named_modules): model.modules()'s modules, each
    once, where a module is held twice or its children lead back to a parent; a hook added or a projection replaced
    deep in the model after a first verdict is seen at the next call."""
    model = llama()
    assert lean_unsupported(model) is None
    layer = model.model.layers[-1]
    layer.self_attn.again = layer.mlp  # held twice
    layer.mlp.back = model.model  # a cycle
    walked = [id(m) for m in lean._submodules(model)]
    assert len(walked) == len(set(walked)) and set(walked) == {id(m) for m in model.modules()}
    assert lean_unsupported(model) is None
    handle = layer.mlp.down_proj.register_forward_pre_hook(lambda *args: None)
    assert "forward hooks" in lean_unsupported(model)
    handle.remove()
    assert lean_unsupported(model) is None
    layer.mlp.down_proj = torch.nn.Sequential(layer.mlp.down_proj)
    assert "a projection is a Sequential" in lean_unsupported(model)


def test_auto_decoding_leaves_what_it_cannot_reproduce_to_generate_and_says_why(caplog):
    """A LoRA-wrapped policy (memory=lora), autocast (bf16-mixed) and eager attention go to generate() under
    decode=auto, logged once with the reason; decode=lean says in one line why it cannot run."""
    from peft import LoraConfig, get_peft_model

    plain = llama()
    lora = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert "not a plain LlamaForCausalLM (or Llama sequence or token classifier)" in lean_unsupported(lora)
    assert "LoRA or quantised" in lean_unsupported(lora.base_model.model)
    eager = llama(attn_implementation="eager")
    assert "attn_implementation='eager'" in lean_unsupported(eager)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in lean_unsupported(plain)
    assert lean_unsupported(plain) is None

    with pytest.raises(ConfigError) as err:
        draw(lora.base_model.model, "lean", False, 1.0, 0)
    assert str(err.value).startswith("generator.decode=lean cannot run here: a projection is a ") and "\n" not in str(err.value)

    gen = HFGenerator(max_new_tokens=4)
    gen.setup(TOK, 4)
    query = encode_prompts(TOK, TASK.prompts("train")[:2])
    with caplog.at_level(logging.INFO, logger="rlhflab.rollout.hf"):
        for _ in range(2):
            gen._generate(eager, query, greedy=False)
    told = [r.getMessage() for r in caplog.records if "generate()" in r.getMessage()]
    assert told == ["generator: Hugging Face generate(), as attn_implementation='eager' (the lean loops reproduce sdpa's)"]


@ARCHS
def test_the_lean_forward_computes_the_hf_forwards_logits_and_gradients_bit_for_bit(arch):
    """The learner's forward (MemoryStrategy._forward: policy with grad, reference without) over prompt + response,
    with left padding (a boolean mask) and without (plain causal attention), whole or the last logits_to_keep: the
    same logits and the same gradient in every parameter as model(...)."""
    model = llama(**arch).train()
    torch.manual_seed(1)
    response = torch.randint(3, len(TOK), (16, 9))
    for prompts in (PROMPTS, [p for p in TASK.prompts("train")[:8]]):
        query = encode_prompts(TOK, prompts).repeat_interleave(2, dim=0)
        ids, mask, positions = join(query, response, TOK.pad_token_id)
        assert bool(mask.all()) == (prompts is not PROMPTS)
        for keep in (0, 10):
            got = []
            for lean in (True, False):
                model.zero_grad()
                if lean:
                    logits = lean_forward(model, ids, mask, positions, logits_to_keep=keep)
                else:
                    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                                   logits_to_keep=keep).logits
                (logits.log_softmax(-1)[..., 3] * torch.linspace(-1, 1, logits.shape[1])).sum().backward()
                got.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
            assert torch.equal(got[0][0], got[1][0]), (arch, keep)
            assert all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1])), (arch, keep)


def _heads_of(arch: dict) -> dict:
    """The tiny Llama's trunk under each head the lean forward runs: a reward model (sequence classifier), a value
    model (token classifier, its dropout at 0 as `without_dropout` leaves it), a causal LM; each in train mode."""
    from transformers import LlamaForSequenceClassification, LlamaForTokenClassification

    models = {}
    for name, cls in (("reward", LlamaForSequenceClassification), ("value", LlamaForTokenClassification)):
        torch.manual_seed(0)
        config = llama(**arch).config
        config.num_labels = 1
        models[name] = cls(config).train()
        torch.nn.init.normal_(models[name].score.weight)  # not HF's small init: scores that differ row by row
    models["value"].dropout.p = 0.0
    models["causal"] = llama(**arch).train()
    return models


@ARCHS
def test_the_lean_forward_computes_reward_value_and_stage_forwards_bit_for_bit(arch):
    """Reward and value models (`MemoryStrategy._scores`, `_values`), stage rm's score (no position ids: 0.. on every
    row), stage sft's loss (`lm_loss_of`: the model's own loss function, with and without num_items_in_batch) and
    the shared trunk (`models.heads.trunk`): the same outputs and the same gradient in every parameter as the HF
    forward, over left-padded rows (the learner's), right-padded rows (the stages') and rows without padding."""
    from rlhflab.models.heads import trunk

    models = _heads_of(arch)
    torch.manual_seed(1)
    left = join(encode_prompts(TOK, PROMPTS).repeat_interleave(2, dim=0), torch.randint(3, len(TOK), (16, 9)),
                TOK.pad_token_id)
    right = torch.randint(3, len(TOK), (16, 12))
    right[torch.arange(12)[None] >= torch.randint(5, 13, (16, 1))] = TOK.pad_token_id
    batches = {"left-padded": left, "right-padded": (right, (right != TOK.pad_token_id).long(), None),
               "unpadded": (right[:, :4], torch.ones(16, 4, dtype=torch.long), None)}
    labels = right.masked_fill(right == TOK.pad_token_id, -100)

    def hf_call(name, model, ids, mask, positions):
        if name == "trunk":
            return model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
        if name.startswith("loss"):
            return model(input_ids=ids, attention_mask=mask, labels=labels[:, :ids.shape[1]], **LOSS[name]).loss
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits

    def lean_call(name, model, ids, mask, positions):
        if name == "trunk":
            return trunk(model, ids, mask, positions)
        if name.startswith("loss"):
            return lean.lm_loss_of(model, ids, mask, labels[:, :ids.shape[1]], **LOSS[name])
        return lean.forward_logits(model, ids, mask, position_ids=positions)

    LOSS = {"loss": {}, "loss-items": {"num_items_in_batch": 37}}
    cases = [("reward", "reward"), ("value", "value"), ("trunk", "causal"), ("loss", "causal"), ("loss-items", "causal")]
    for (name, which), (padding, (ids, mask, positions)) in ((c, b) for c in cases for b in batches.items()):
        if name.startswith("loss") and padding == "left-padded":
            continue  # stage sft's rows are right-padded
        model = models[which]
        assert lean_unsupported(model) is None
        got = []
        for call in (lean_call, hf_call):
            model.zero_grad()
            out = call(name, model, ids, mask, positions)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            got.append((out.detach(), [p.grad.clone() if p.grad is not None else None for p in model.parameters()]))
        assert torch.equal(got[0][0], got[1][0]), (name, padding)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got[0][1], got[1][1])), (name, padding)


def test_attention_dropout_in_training_leaves_the_forward_to_hf():
    """HF's attention applies config.attention_dropout in train mode, which the lean layers do not: such a model goes
    through Hugging Face until its dropout is off (`without_dropout`) or it is in eval mode."""
    model = llama(attention_dropout=0.1).train()
    assert lean_unsupported(model) == "attention dropout is on (HF's attention applies it in training)"
    assert lean_unsupported(model.eval()) is None


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the larger tensor's largest magnitude."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


@ARCHS
def test_each_prompts_positions_run_once_in_the_learners_forward(arch, monkeypatch):
    """rl.prompt_once: the logits that predict the response (the last R + 1), each distinct prompt's positions run
    once for all of its rows, its rows neighbours (repeat_prompts) or apart (rl.length_buckets' groups), with left
    padding (a boolean mask) and without. In float32 within 2e-6 of the lean forward over every row (its floats are
    HF's: the test above), and so are the gradients of every parameter. None where no two rows share a prompt, and
    without grad where the products saved are fewer than NO_GRAD_MIN_WORK's (this tiny model's always are)."""
    model = llama(**arch).train()
    torch.manual_seed(1)
    response = torch.randint(3, len(TOK), (16, 9))
    for prompts in (PROMPTS, [p for p in TASK.prompts("train")[:8]]):
        distinct = encode_prompts(TOK, prompts)
        for query in (distinct.repeat_interleave(2, dim=0), distinct.repeat(2, 1)):
            ids, mask, positions = join(query, response, TOK.pad_token_id)
            assert bool(mask.all()) == (prompts is not PROMPTS)
            got = []
            for once in (True, False):
                model.zero_grad()
                if once:
                    logits = prompt_once_logits(model, query, response, TOK.pad_token_id)
                else:
                    logits = lean_forward(model, ids, mask, positions, logits_to_keep=response.shape[1] + 1)
                (logits.log_softmax(-1)[..., 3] * torch.linspace(-1, 1, logits.shape[1])).sum().backward()
                got.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
            assert got[0][0].shape == got[1][0].shape
            assert _close(got[0][0], got[1][0]) < 2e-6, arch
            assert max(_close(a, b) for a, b in zip(got[0][1], got[1][1])) < 2e-6, arch
            with torch.no_grad():
                assert prompt_once_logits(model, query, response, TOK.pad_token_id) is None
                monkeypatch.setattr(lean, "NO_GRAD_MIN_WORK", 0)
                assert _close(prompt_once_logits(model, query, response, TOK.pad_token_id), got[1][0]) < 2e-6
                monkeypatch.undo()
        assert prompt_once_logits(model, distinct, response[:8], TOK.pad_token_id) is None


@ARCHS
def test_a_reward_models_scores_run_each_prompts_positions_once(arch, monkeypatch):
    """rl.prompt_once for a reward model (`MemoryStrategy._scores`): its score head at each row's rightmost real token
    (a response cut short by padding, one all padding: the prompt's last token; one with a padding token inside), each distinct prompt's positions run
    once for its rows, neighbours or apart, left-padded or not: within 2e-6 of the lean (HF's) forward over every
    row. None where no two rows share a prompt, for a causal LM or token classifier, and where the products saved are
    fewer than NO_GRAD_MIN_WORK's (this tiny model's always are)."""
    from rlhflab.rollout.lean import prompt_once_scores

    models = _heads_of(arch)
    reward = models["reward"].eval()
    torch.manual_seed(2)
    response = torch.randint(3, len(TOK), (16, 9))
    response[torch.arange(9)[None] >= torch.randint(1, 10, (16, 1))] = TOK.pad_token_id
    response[5] = TOK.pad_token_id
    response[3] = torch.randint(3, len(TOK), (9,))
    response[3, 2] = TOK.pad_token_id  # a padding token sampled inside a completion: the rightmost real one still counts
    with torch.no_grad():
        for prompts in (PROMPTS, TASK.prompts("train")[:8]):
            distinct = encode_prompts(TOK, prompts)
            for query in (distinct.repeat_interleave(2, dim=0), distinct.repeat(2, 1)):
                ids, mask, positions = join(query, response, TOK.pad_token_id)
                full = lean_forward(reward, ids, mask, positions)
                assert prompt_once_scores(reward, query, response, TOK.pad_token_id) is None
                monkeypatch.setattr(lean, "NO_GRAD_MIN_WORK", 0)
                once = prompt_once_scores(reward, query, response, TOK.pad_token_id)
                assert once.shape == full.shape == (16, 1) and _close(once, full) < 2e-6, arch
                assert prompt_once_scores(reward, distinct, response[:8], TOK.pad_token_id) is None
                for other in (models["causal"], models["value"]):
                    assert prompt_once_scores(other, query, response, TOK.pad_token_id) is None
                monkeypatch.undo()


@ARCHS
def test_a_value_models_values_run_each_prompts_positions_once(arch):
    """rl.prompt_once for a value model (`MemoryStrategy._values`, PPO's critic): its score head at the prompt's last
    position and each response position but the last, each distinct prompt's positions run once for its rows,
    neighbours or apart: values and every gradient within 2e-6 of the lean (HF's) forward over every row, which
    `_values` runs when rl.prompt_once is off. None where no two rows share a prompt, and for the other heads."""
    from rlhflab.memory.base import MemoryStrategy
    from rlhflab.rollout.lean import prompt_once_values

    models = _heads_of(arch)
    value = models["value"]
    memory = MemoryStrategy()
    memory.pad_token_id = TOK.pad_token_id
    torch.manual_seed(3)
    response = torch.randint(3, len(TOK), (16, 9))
    response[torch.arange(9)[None] >= torch.randint(1, 10, (16, 1))] = TOK.pad_token_id
    for prompts in (PROMPTS, TASK.prompts("train")[:8]):
        distinct = encode_prompts(TOK, prompts)
        for query in (distinct.repeat_interleave(2, dim=0), distinct.repeat(2, 1)):
            got = []
            for once in (True, False):
                memory.prompt_once = once
                value.zero_grad()
                values = memory._values(value, query, response)
                (values * torch.linspace(-1, 1, values.shape[1])).sum().backward()
                got.append((values.detach(), [p.grad.clone() for p in value.parameters()]))
            assert got[0][0].shape == got[1][0].shape == (16, 9)
            assert _close(got[0][0], got[1][0]) < 2e-6, arch
            assert max(_close(a, b) for a, b in zip(got[0][1], got[1][1])) < 2e-6, arch
            inputs = response[:, :-1]
            # what _values returned with rl.prompt_once on is the shared-prompt forward's (with grad, as PPO's update)
            assert torch.equal(prompt_once_values(value, query, inputs, TOK.pad_token_id).squeeze(-1).detach(), got[0][0])
            assert prompt_once_values(value, distinct, inputs[:8], TOK.pad_token_id) is None
            for other in (models["causal"], models["reward"]):
                assert prompt_once_values(other, query, inputs, TOK.pad_token_id) is None


@pytest.mark.parametrize("block", [8, 16])
def test_sdpas_keys_padded_to_whole_vector_blocks_give_the_same_attention(block, monkeypatch):
    """prompt_once_logits pads sdpa's keys with masked-out zero columns to whole blocks of the CPU's vector lanes
    (`padded_keys`; its flash kernel runs the keys past the last whole block one by one): logits and every gradient
    within 2e-6 of the unpadded call's, the prompts' attention (6 keys) and the response rows' (6 + 9) both padded,
    with left padding and without."""
    model = llama().train()
    torch.manual_seed(1)
    response = torch.randint(3, len(TOK), (16, 9))
    for prompts in (PROMPTS, TASK.prompts("train")[:8]):
        query = encode_prompts(TOK, prompts).repeat_interleave(2, dim=0)
        got = []
        for pad in (True, False):
            monkeypatch.setattr(lean, "kv_block", lambda: block if pad else 1)
            assert all(bool(lean.padded_keys(keys)) == pad for keys in (query.shape[1], query.shape[1] + 9))
            model.zero_grad()
            logits = prompt_once_logits(model, query, response, TOK.pad_token_id)
            (logits.log_softmax(-1)[..., 3] * torch.linspace(-1, 1, logits.shape[1])).sum().backward()
            got.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
        assert _close(got[0][0], got[1][0]) < 2e-6
        assert max(_close(a, b) for a, b in zip(got[0][1], got[1][1])) < 2e-6


def test_prompt_once_under_bf16_autocast_trains_with_the_models_own_attention():
    """Under bf16 autocast (trainer.precision=bf16-mixed) the forward runs as transformers runs it there, attention
    included (sdpa_trains_eager: eager with grad): its logits and gradients are HF's up to bf16's rounding, as near to
    float32's as HF's own."""
    model = attention.use_for_training(llama(hidden_size=64, intermediate_size=128).train())
    torch.manual_seed(1)
    response = torch.randint(3, len(TOK), (16, 9))
    query = encode_prompts(TOK, PROMPTS).repeat_interleave(2, dim=0)
    ids, mask, positions = join(query, response, TOK.pad_token_id)
    weight = model.model.layers[0].self_attn.q_proj.weight

    def run(once: bool):
        if once:
            logits = prompt_once_logits(model, query, response, TOK.pad_token_id)
        else:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                           logits_to_keep=response.shape[1] + 1).logits
        return logits.float(), torch.autograd.grad(logits.float().log_softmax(-1)[..., 3].sum(), weight)[0]

    exact = run(False)
    with torch.autocast("cpu", torch.bfloat16):
        hf, once = run(False), run(True)
    assert hf[0].dtype == once[0].dtype == torch.float32
    assert _close(once[0], hf[0]) < 2e-2 and _close(once[1], hf[1]) < 5e-2
    for mine, theirs, e in zip(once, hf, exact):  # as far from float32's numbers as HF's, within a factor
        assert _close(mine, e) < 3 * _close(theirs, e) + 1e-3


def test_the_lean_loops_leave_checkpointed_or_hooked_models_to_hf():
    """Activation checkpointing lives in HF's decoder layers, FSDP's and accelerate's gathering in forward hooks:
    the lean forward would skip both, so such models go through HF."""
    model = llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert "activation checkpointing" in lean_unsupported(model)
    model = llama()
    handle = model.model.layers[1].mlp.register_forward_pre_hook(lambda module, args: None)
    assert lean_unsupported(model) == "a LlamaMLP has forward hooks (FSDP, accelerate or another wrapper)"
    handle.remove()
    assert lean_unsupported(model) is None
    # a projection or the embedding whose forward was replaced after the structure's verdict: read as weights by the
    # loops, it would be skipped, so the model goes through HF
    for module in (model.model.layers[0].mlp.down_proj, model.model.embed_tokens):
        module.forward = lambda x, module=module: type(module).forward(module, x) * 2.0
        assert lean_unsupported(model) == f"a {type(module).__name__}'s forward was replaced on the instance (the lean loops read its weights)"
        del module.forward
        assert lean_unsupported(model) is None


def test_the_lean_loops_call_norms_and_activations_they_do_not_know():
    """RMSNorm and SiLU run inline only as transformers' own classes with their own forward: a subclass, or an
    instance whose forward was replaced (a kernel hub's kernelize()), is called, so the numbers stay the model's."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class ShiftedNorm(LlamaRMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) + 0.5

    model = llama()
    old = model.model.layers[0].input_layernorm
    model.model.layers[0].input_layernorm = ShiftedNorm(old.weight.shape[0], eps=old.variance_epsilon)
    model.model.layers[1].mlp.act_fn.forward = lambda x: torch.nn.functional.gelu(x)
    model.model.norm.forward = lambda x: LlamaRMSNorm.forward(model.model.norm, x) * 2.0
    ids, mask, positions = join(encode_prompts(TOK, PROMPTS), torch.randint(3, len(TOK), (8, 9)), TOK.pad_token_id)
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        plain = llama()(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        assert lean_unsupported(model) is None
        assert torch.equal(lean_forward(model, ids, mask, positions), hf)
    assert not torch.allclose(hf, plain)  # each replacement changed the numbers


def test_generate_samples_a_training_policy_as_in_eval_mode_and_leaves_its_mode(monkeypatch):
    """The learner's policy is in train mode. Hugging Face's generate() runs it in eval mode (its modules read the
    mode: a Llama's attention applies its dropout rate in training), then gives the mode back; the lean loop reads no
    mode, so it samples without switching it (each switch walks every module) and draws the same tokens."""
    model = llama(attention_dropout=0.5)
    evaluated = draw(model, "generate", False, 1.0, seed=0)
    model.train()
    switches = []
    monkeypatch.setattr(type(model), "train", lambda self, mode=True: switches.append(mode) or
                        torch.nn.Module.train(self, mode))
    for decode in ("generate", "lean"):
        switches.clear()
        tokens, logprobs = draw(model, decode, False, 1.0, seed=0)
        assert torch.equal(tokens, evaluated[0]) and torch.allclose(logprobs, evaluated[1], atol=1e-6), decode
        assert model.training and switches == ([False, True] if decode == "generate" else []), decode
