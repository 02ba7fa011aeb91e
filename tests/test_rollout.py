"""The rollout helpers the learner and every generator share."""

import contextlib
import logging
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from rlhflab.rollout.batch import by_length, completion_lengths, join, length_buckets, response_mask_from_eos, token_logprobs

PAD, EOS = 0, 1


def test_learner_sees_a_sampled_pad_as_generation_did():
    """A policy may sample the pad id mid-response; the learner must attend to it (and count its position)
    exactly as generation did, or its log-probs for the later tokens differ from the behaviour ones."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=32)).eval()
    prompt = torch.tensor([5, 6, 7])
    response = torch.tensor([[8, PAD, 9, 10, EOS, PAD, PAD]])  # pad sampled at 1; real padding after EOS
    query = torch.cat([torch.full((2,), PAD), prompt]).unsqueeze(0)  # left-padded to P=5
    with torch.no_grad():
        # Generation's view: the unpadded prompt, then every generated token attended.
        plain = model(torch.cat([prompt.unsqueeze(0), response], dim=1)).logits
        expected = token_logprobs(plain[:, len(prompt) - 1 : -1], response, 1.0)
        ids, mask, positions = join(query, response, PAD)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = token_logprobs(logits[:, query.shape[1] - 1 : -1], response, 1.0)
    keep = response_mask_from_eos(response, EOS).bool()
    assert keep.tolist() == [[True] * 5 + [False] * 2]
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-5, rtol=0)


def test_hf_generator_records_the_sampled_tokens_log_probs_without_keeping_every_steps_logits():
    """HFGenerator's behaviour log-probs (recorded step by step, not from generate()'s per-step logits) are the
    learner's log-probs of the same completions at the same temperature; the draws are those of plain
    generate(temperature=T, top_k=0) with the same seed; a batch is as wide as its longest completion (generate() stops there), not the budget."""
    from rlhflab.lit.data import encode_prompts
    from rlhflab.rollout.hf import HFGenerator
    from rlhflab.tasks.sentiment import SentimentTask

    task = SentimentTask(response_words=8, seed=0)
    tok = task.build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).eval()
    prompts = task.prompts("train")[:6]
    query = encode_prompts(tok, prompts)
    T, R = 0.7, 12
    gen = HFGenerator(temperature=T, max_new_tokens=R)
    gen.setup(tok, R)
    torch.manual_seed(1)
    rollout = gen.generate(model, query, prompts, samples_per_prompt=2, version=0)
    q = query.repeat_interleave(2, dim=0)
    torch.manual_seed(1)
    plain = model.generate(input_ids=q, attention_mask=(q != tok.pad_token_id).long(), do_sample=True, temperature=T,
                           top_k=0, top_p=None, max_new_tokens=R, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    drawn = plain[:, q.shape[1]:]
    assert torch.equal(rollout.response, drawn)
    with torch.no_grad():
        ids, mask, positions = join(q, rollout.response, tok.pad_token_id)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        learner = token_logprobs(logits[:, q.shape[1] - 1 : -1], rollout.response, T) * rollout.response_mask
    assert rollout.logprobs.shape == drawn.shape and (rollout.logprobs[rollout.response_mask.bool()] < 0).all()
    torch.testing.assert_close(rollout.logprobs, learner, atol=1e-5, rtol=0)

    # A model that always ends at once: generate() stops after one step, and the rollout is one token wide, so the
    # reference and the update run on the prompt and that token, not on the budget's R padding tokens more.
    model.lm_head = torch.nn.Linear(32, len(tok), bias=True)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.zero_()
        model.lm_head.bias[tok.eos_token_id] = 50.0
    early = gen.generate(model, query, prompts, samples_per_prompt=2, version=0)
    assert early.response.shape == early.logprobs.shape == early.response_mask.shape == (12, 1)
    assert (early.response[:, 0] == tok.eos_token_id).all() and (early.response_mask == 1).all()
    assert early.logprobs[:, 0].abs().max() < 1e-3  # EOS is all but certain


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


class WeightCasts(TorchDispatchMode):
    """Counts the casts autocast makes of the given weights (by their storage)."""

    def __init__(self, weights: set[int]) -> None:
        super().__init__()
        self.weights, self.n = weights, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.weights:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_length_buckets_cut_where_padding_is_saved():
    """One run-on completion among short ones gets a forward of its own; equal lengths, a cut that saves
    little, or rl.length_buckets=1 keep one forward over the batch."""
    lengths = [3, 9, 2, 3, 32, 2, 9, 3]
    groups = length_buckets(_mask(lengths, 32), prompt_width=5, max_buckets=4)
    # 8 x 37 tokens -> 7 x 14 + 37; cutting the 9s off too would save 30 more, under 1/8 of 296
    assert [sorted(lengths[i] for i in g.tolist()) for g in groups] == [[2, 2, 3, 3, 3, 9, 9], [32]]
    assert sorted(torch.cat(groups).tolist()) == list(range(8))  # every row once
    three = [2] * 6 + [16] * 4 + [32]
    groups = length_buckets(_mask(three, 32), prompt_width=2, max_buckets=4)
    assert [sorted(three[i] for i in g.tolist()) for g in groups] == [[2] * 6, [16] * 4, [32]]
    assert len(length_buckets(_mask(three, 32), prompt_width=2, max_buckets=2)) == 2
    assert length_buckets(_mask(lengths, 32), prompt_width=5, max_buckets=1) is None
    assert length_buckets(_mask([9] * 8, 9), prompt_width=5, max_buckets=4) is None
    assert length_buckets(_mask([8, 9, 9, 9], 9), prompt_width=5, max_buckets=4) is None  # saves 1 of 56 tokens
    # A hole inside a row (a masked-out token before its end) does not shorten it.
    holed = _mask([6, 2], 6)
    holed[0, 2] = 0
    assert completion_lengths(holed).tolist() == [6, 2]


def test_by_length_gives_one_forwards_numbers_and_gradients():
    """Each group's forward on its own rows, cut to its longest completion and its longest prompt, gives the
    log-probs and the gradients of one forward over the padded batch, back in the batch's row order."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64)).eval()
    n, P, R = 8, 6, 16
    lengths = [2, 16, 3, 2, 9, 3, 2, 9]
    prompt_lengths = [2, 6, 2, 3, 3, 2, 2, 3]  # the long prompt is the run-on completion's
    query = torch.full((n, P), PAD)
    for i, p in enumerate(prompt_lengths):
        query[i, P - p :] = torch.randint(2, 20, (p,))
    response = torch.randint(2, 20, (n, R))
    mask = _mask(lengths, R)
    response[mask == 0] = PAD

    def forward(q, r):
        ids, att, pos = join(q, r, PAD)
        return token_logprobs(model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, q.shape[1] - 1 : -1], r, 1.0)

    groups = length_buckets(mask, P, max_buckets=4)
    assert groups is not None and len(groups) >= 2
    shapes = []
    one = by_length(forward, query, response, mask, None, PAD)
    one.sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    split = by_length(lambda q, r: shapes.append((q.shape, r.shape)) or forward(q, r), query, response, mask, groups, PAD)
    split.sum().backward()
    torch.testing.assert_close(split, one, atol=1e-5, rtol=0)
    assert (split[mask == 0] == 0).all()
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # the short rows ran without the run-on row's padding, and without its long prompt's
    assert [(q[1], r[1]) for q, r in shapes] == [(3, 3), (6, 16)]
    # a forward that returns two per-token tensors (PPO's log-probs and values from one trunk forward): each is put
    # back as the single one is, its gradients flow the same
    model.zero_grad()
    pair = by_length(lambda q, r: (forward(q, r), forward(q, r).exp()), query, response, mask, groups, PAD)
    assert isinstance(pair, tuple) and len(pair) == 2
    assert torch.equal(pair[0], split) and torch.equal(pair[1], (split.exp() * mask))
    pair[0].sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    whole = by_length(lambda q, r: (forward(q, r), -forward(q, r)), query, response, mask, None, PAD)
    assert torch.equal(whole[0], one) and torch.equal(whole[1], -one)


def test_a_batchs_length_groups_share_one_bf16_cast_of_each_weight(make_cfg, tmp_path, monkeypatch):
    """Under bf16 autocast with Lightning's cast cache off, each length group's forward (rl.length_buckets) cast
    every trainable weight again and kept its casts for the backward: a policy-sized bf16 copy per extra group
    (226 MB on the 113M model, whose sync online DPO side peaked 60-80 MB higher). The groups share one cast of
    each weight: the same log-probs bit for bit, and the same gradients to bf16's rounding (the groups' gradients
    of a weight now meet in bf16, at its cast, as a single forward's do)."""
    import rlhflab.lit.rl_module as rl_module
    from rlhflab.train import train

    module = train(make_cfg("trainer.max_steps=1", f"output.dir={tmp_path / 'run'}")).module
    policy, pad = module.memory.policy, module.memory.pad_token_id
    weights = [m.weight for m in policy.modules() if isinstance(m, torch.nn.Linear) and m.weight.requires_grad]
    linears = {w.data_ptr() for w in weights}
    torch.manual_seed(0)
    n, P, R = 8, 4, 16
    query = torch.randint(3, 20, (n, P))
    response = torch.randint(3, 20, (n, R))
    mask = _mask([2, 16, 3, 2, 9, 3, 2, 9], R)
    response[mask == 0] = pad
    groups = length_buckets(mask, P, module.cfg.length_buckets)
    assert groups is not None and len(groups) >= 2

    def update_forward():
        casts = WeightCasts(linears)
        policy.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # as Lightning's bf16-mixed enters it
            with casts:
                logprobs = module._policy_logprobs(query, response, mask)
            assert not torch.is_autocast_cache_enabled()
            logprobs.sum().backward()
        return logprobs.detach(), [w.grad.float() for w in weights], casts.n

    shared, shared_grads, shared_casts = update_forward()
    monkeypatch.setattr(rl_module, "casts_once", lambda enabled=True: contextlib.nullcontext())
    own, own_grads, own_casts = update_forward()
    assert shared_casts == len(linears) and own_casts == len(groups) * len(linears)
    assert torch.equal(shared, own)
    for got, want in zip(shared_grads, own_grads):
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))


def test_casts_once_starts_from_an_empty_cast_cache():
    """A layer recomputed in a backward (memory.gradient_checkpointing) re-enters the autocast its forward ran in,
    casts_once's with the cache on, and leaves its casts cached; an optimizer step then makes them stale. casts_once
    empties the cache on the way in, so what runs inside reads the weights as they are."""
    from rlhflab.rollout.sources import casts_once

    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            layer(x)  # its weight's cast cached; leaving an inner region does not empty the cache
        with torch.no_grad():
            layer.weight.zero_()
            layer.bias.zero_()
        with casts_once():
            out = layer(x)
    assert torch.equal(out, torch.zeros_like(out))


def test_a_reference_thread_leaves_the_learners_cast_cache_as_it_was():
    """Autocast's cast cache is one for all threads, and a thread that leaves its outermost autocast empties it.
    The reference's thread (mode.reference=thread) runs each call under the learner's autocast beside the policy's
    forward, whose length groups share their weights' casts through that cache; its calls must not empty it."""
    from rlhflab.lit.reference import ReferenceThread

    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    worker = ReferenceThread(lambda q, r, m: q.float() @ torch.ones(4, 4))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            cast = layer(x)  # the weight's cast cached
            worker.submit(torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 4))()
            with torch.no_grad():
                layer.weight.zero_()
                layer.bias.zero_()
            assert torch.equal(layer(x), cast)  # the weights' casts cached before the call, read again
    finally:
        worker.close()


def _scored_batch(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, n: int, P: int, R: int,
                  left_padded: bool):
    """(forward, query, response, mask): a random Llama's response log-probs and a random batch of n rows of P
    prompt tokens (left-padded to random lengths, or whole) and up to R response tokens (right-padded)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                         num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=64)).eval()
    g = torch.Generator().manual_seed(1)
    query = torch.randint(3, vocab, (n, P), generator=g)
    if left_padded:
        for i, p in enumerate(torch.randint(3, P + 1, (n,), generator=g).tolist()):
            query[i, : P - p] = PAD
    mask = _mask(torch.randint(1, R + 1, (n,), generator=g).tolist(), R)
    response = torch.randint(3, vocab, (n, R), generator=g).masked_fill(mask == 0, PAD)

    def forward(q, r):
        ids, att, pos = join(q, r, PAD)
        return token_logprobs(model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, q.shape[1] - 1 : -1], r, 1.0)

    return forward, query, response, mask


def test_a_batchs_rows_split_anywhere_get_the_whole_batchs_numbers_bit_for_bit():
    """mode.reference=balance: the generator computes the reference log-probs of a batch's first m rows, the learner
    the rest, m following timings. Each side computes its rows in the groups and at the widths the whole batch's
    forwards give them, so any m gives the numbers of the whole batch exactly and a rerun is bit for bit. Grouped
    by their own lengths instead (each side's rows bucketed apart), 8 of 17 splits moved some log-probs by ~5e-7."""
    n, P, R = 64, 12, 9
    forward, query, response, mask = _scored_batch(48, 64, 128, 2, 4, n, P, R, left_padded=True)
    groups = length_buckets(mask, P, max_buckets=4)
    assert groups is not None and len(groups) >= 2
    with torch.no_grad():
        whole = by_length(forward, query, response, mask, groups, PAD)
        for m in range(n + 1):
            first = by_length(forward, query, response, mask, groups, PAD, rows=slice(0, m))
            rest = by_length(forward, query, response, mask, groups, PAD, rows=slice(m, n))
            assert first.shape == (m, R) and rest.shape == (n - m, R)
            assert torch.equal(torch.cat([first, rest]), whole), m
        assert torch.equal(by_length(forward, query, response, mask, None, PAD, rows=slice(5, 40)),
                           by_length(forward, query, response, mask, None, PAD)[5:40])


def test_on_wide_layers_a_split_is_bit_for_bit_in_float32_on_one_thread_only():
    """The same split at the 113M preset's width (768): in float32 on one thread (each async side's default) the rows
    get the whole batch's numbers exactly; under bf16 autocast (oneDNN's kernels on this host's AMX: ~8e-3 here) or on
    2 threads (~1e-6) a forward's rows can depend on how many it holds, which is why mode.reference=balance warns
    there (test_async.py), yet they stay within that precision's rounding of the whole batch's."""
    n, P, R = 32, 6, 24
    forward, query, response, mask = _scored_batch(256, 768, 3072, 1, 12, n, P, R, left_padded=False)
    threads = torch.get_num_threads()
    try:
        for n_threads, bf16, atol in ((1, False, 0.0), (1, True, 0.05), (2, False, 1e-4)):
            torch.set_num_threads(n_threads)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                whole = by_length(forward, query, response, mask, None, PAD)
                for m in (8, 16, 24):
                    split = torch.cat([by_length(forward, query, response, mask, None, PAD, rows=slice(0, m)),
                                       by_length(forward, query, response, mask, None, PAD, rows=slice(m, n))])
                    if atol:
                        torch.testing.assert_close(split, whole, rtol=0, atol=atol)
                    else:
                        assert torch.equal(split, whole), m
    finally:
        torch.set_num_threads(threads)


def test_balances_reference_runs_each_rows_own_forward_which_a_split_cannot_move():
    """rl.prompt_once's shared-prompt forward packs a batch's prompts and responses into its products, so a row's
    floats depend on the rows beside it, and it runs without grad only where it saves enough (a group with few rows
    of a prompt declines it): on 768-wide layers at k = 4, mode.reference=balance's splits of a batch moved the
    reference's log-probs by up to ~1e-6. Under balance (`split_reference`) the reference runs every row's own
    forward, and every split gets the whole batch's numbers, bit for bit."""
    from rlhflab.memory.base import MemoryStrategy

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=768, intermediate_size=2048, num_hidden_layers=2,
                                         num_attention_heads=12, max_position_embeddings=64, pad_token_id=PAD)).eval()
    strategy = MemoryStrategy()
    strategy.pad_token_id, strategy.prompt_once = PAD, True
    g = torch.Generator().manual_seed(1)
    n, k, P, R = 32, 4, 16, 24
    prompts = torch.randint(3, 512, (n // k, P), generator=g)
    for i, p in enumerate(torch.randint(4, P + 1, (n // k,), generator=g).tolist()):
        prompts[i, : P - p] = PAD
    query = prompts.repeat_interleave(k, 0)
    mask = _mask(torch.randint(1, R + 1, (n,), generator=g).tolist(), R)
    response = torch.randint(3, 512, (n, R), generator=g).masked_fill(mask == 0, PAD)
    groups = length_buckets(mask, P, max_buckets=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        moved = {}
        for shared in (True, False):
            def forward(q, r, shared=shared):
                return strategy._logprobs(model, q, r, 1.0, shared_prompt=shared)

            with torch.no_grad():
                whole = by_length(forward, query, response, mask, groups, PAD)
                moved[shared] = [m for m in range(0, n + 1, 3) if not torch.equal(whole, torch.cat([
                    by_length(forward, query, response, mask, groups, PAD, rows=slice(0, m)),
                    by_length(forward, query, response, mask, groups, PAD, rows=slice(m, n))]))]
    finally:
        torch.set_num_threads(threads)
    assert moved[True] and not moved[False], moved


def test_prompt_batches_are_as_wide_as_their_own_longest_prompt():
    """Prompts are padded once to the dataset's longest; each batch drops the columns that are padding in all of
    its rows, so one long prompt in the dataset does not widen every batch's generation and forwards."""
    from rlhflab.lit.data import PromptBatches

    lengths = [2, 3, 2, 12, 3, 2, 2, 3]
    query = torch.full((8, 12), PAD)
    for i, n in enumerate(lengths):
        query[i, 12 - n :] = torch.arange(2, 2 + n)
    stream = iter(PromptBatches(query, prompts_per_step=2, seed=0, pad_token_id=PAD))
    for _ in range(8):
        batch, index, _ = next(stream)
        width = max(lengths[i] for i in index.tolist())
        assert batch.shape == (2, width) and torch.equal(batch, query[index][:, 12 - width :])
    untrimmed, _, _ = next(iter(PromptBatches(query, prompts_per_step=2, seed=0)))
    assert untrimmed.shape == (2, 12)


def test_hf_generator_samples_the_policy_as_it_is_whatever_its_generation_config_says(caplog):
    """A hub model's generation_config.json (Qwen2.5-Instruct's: repetition_penalty 1.05, top_k 20, top_p 0.8,
    temperature 0.7) filled every setting generate() was not passed: the repetition penalty, a suppressed token or
    a minimum length reshaped what the policy was sampled from, unlike the learner's log-probs. The draws are
    now those of the same model with a plain config, the log-probs the learner's, and the config is put back."""
    import logging

    from transformers import GenerationConfig

    from rlhflab.lit.data import encode_prompts
    from rlhflab.rollout.hf import HFGenerator
    from rlhflab.tasks.sentiment import SentimentTask

    tok = SentimentTask(response_words=8, seed=0).build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).eval()
    prompts = SentimentTask(response_words=8, seed=0).prompts("train")[:8]
    query = encode_prompts(tok, prompts)
    gen = HFGenerator(temperature=1.0, max_new_tokens=10, decode="generate")  # decode=lean never reads the config
    gen.setup(tok, 10)

    def sample():
        torch.manual_seed(1)
        return gen.generate(model, query, prompts, samples_per_prompt=4, version=0)

    plain = sample()
    hub = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=3.0,
                           no_repeat_ngram_size=1, min_new_tokens=6, suppress_tokens=[tok.eos_token_id + 1],
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model.generation_config = hub
    with caplog.at_level(logging.INFO, logger="rlhflab.rollout.hf"):
        got = sample()
    assert torch.equal(got.response, plain.response)
    torch.testing.assert_close(got.logprobs, plain.logprobs, atol=0, rtol=0)
    assert model.generation_config is hub  # put back: the saved policy keeps its own
    told = [r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage()]
    assert told == ["generator: sampling the policy as it is, without its generation_config.json's min_new_tokens=6, "
                    f"no_repeat_ngram_size=1, repetition_penalty=3.0, suppress_tokens=[{tok.eos_token_id + 1}]"]


def test_generation_under_lightnings_autocast_casts_each_trainable_weight_once_per_call():
    """trainer.precision=bf16-mixed: Lightning's autocast has its cast cache off, so generate() in the training step
    cast every weight again at every token (bf16 generation of the 113M model ran at 0.95x float32's speed on an AMX
    CPU). HFGenerator casts each trainable weight once per call (not a sharded model's), draws what the cached
    autocast draws, leaves no cast behind (an in-place update after it is read by the next call) and puts the cache
    setting back."""
    from rlhflab.lit.data import encode_prompts
    from rlhflab.rollout.hf import HFGenerator
    from rlhflab.tasks.sentiment import SentimentTask

    task = SentimentTask(response_words=8, seed=0)
    tok = task.build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    prompts = task.prompts("train")[:4]
    query = encode_prompts(tok, prompts)
    gen = HFGenerator(temperature=1.0, max_new_tokens=8, prepack=False)  # prepack's own casts: the test below
    gen.setup(tok, 8)
    linears = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Linear)}

    def sample(cache_enabled: bool):
        casts = WeightCasts(linears)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled), casts:
            rollout = gen.generate(model, query, prompts, samples_per_prompt=2, version=0)
            assert torch.is_autocast_cache_enabled() == cache_enabled
        return rollout, casts.n

    lightning, casts = sample(cache_enabled=False)  # as Lightning's MixedPrecision plugin enters it
    assert lightning.response.shape[1] > 2  # several forwards, each of which re-cast every weight before
    assert casts == len(linears)
    # A model sharded over ranks (generator.synced, trainer=fsdp) is left as Lightning runs it: its gathered weights
    # are freed after each layer, and a cast kept for the call would hold the whole policy on every rank.
    from rlhflab.rollout.sources import casts_once

    casts = WeightCasts(linears)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), casts:
        with casts_once(enabled=False):
            model(query)
            model(query)
    assert casts.n == 2 * len(linears)
    cached, _ = sample(cache_enabled=True)
    assert torch.equal(lightning.response, cached.response)
    torch.testing.assert_close(lightning.logprobs, cached.logprobs, atol=0, rtol=0)
    # Nothing cached outlives the call: after the head is zeroed in place, the next call samples uniformly.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        gen.generate(model, query, prompts, samples_per_prompt=1, version=0)
        model.lm_head.weight.zero_()
        uniform = gen.generate(model, query, prompts, samples_per_prompt=1, version=0)
    mask = uniform.response_mask.bool()
    torch.testing.assert_close(uniform.logprobs[mask], torch.full((int(mask.sum()),), -math.log(len(tok))))


@pytest.mark.parametrize("width", [(32, 64, 4, False), (32, 64, 4, True), (768, 3072, 12, False)],
                         ids=["tiny", "tiny-lora", "113m-width"])
def test_prepacked_bf16_weights_sample_what_autocasts_own_products_sample(width, caplog):
    """generator.prepack (rollout.sources.packs_once): under CPU bf16 autocast each linear layer multiplies through a
    bf16 weight oneDNN laid out once per generate() call, not at every token, and samples the same tokens and
    log-probs as autocast's own products, at the 113M model's width and with LoRA adapters (memory=lora: PEFT's
    layer calls its base and adapter Linears) too. Every Linear runs packed while it samples and none after (its
    forward put back, so an in-place update is read by the next call); nothing is packed in float32 or with grad
    on."""
    from rlhflab.lit.data import encode_prompts
    from rlhflab.rollout.hf import HFGenerator
    from rlhflab.rollout.sources import cpu_has_half_kernels, packs_once
    from rlhflab.tasks.sentiment import SentimentTask

    hidden, inner, heads, lora = width
    task = SentimentTask(response_words=8, seed=0)
    tok = task.build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inner,
                                         num_hidden_layers=2, num_attention_heads=heads, max_position_embeddings=64,
                                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    prompts = task.prompts("train")[:4]
    query = encode_prompts(tok, prompts)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]

    class Products(TorchDispatchMode):
        """Counts the products through packed weights."""
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.mkldnn._linear_pointwise.default:
                Products.n += 1
            return func(*args, **(kwargs or {}))

    def sample(prepack: bool, autocast: bool = True):
        gen = HFGenerator(temperature=1.0, max_new_tokens=8, prepack=prepack)
        gen.setup(tok, 8)
        Products.n = 0
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=autocast), Products():
            rollout = gen.generate(model, query, prompts, samples_per_prompt=2, version=0)
        return rollout, Products.n

    own, none = sample(prepack=False)
    with caplog.at_level(logging.INFO, logger="rlhflab.rollout.hf"):
        packed, products = sample(prepack=True)
    told = [r.getMessage() for r in caplog.records if "generator.prepack" in r.getMessage()]
    if not cpu_has_half_kernels(torch.bfloat16):
        # A CPU without AVX-512 (an AMD EPYC of family 25, model 1, with AVX2): oneDNN has no bf16 kernel to lay the
        # weights out for, so prepack stands aside, says nothing and samples autocast's own products.
        assert told == [] and products == 0 and none == 0
        assert torch.equal(own.response, packed.response)
        torch.testing.assert_close(own.logprobs, packed.logprobs, atol=0, rtol=0)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packs_once(model, 8) as laid_out:
            assert laid_out == 0 and not any("forward" in m.__dict__ for m in linears)
        pytest.skip("oneDNN has no bf16 support on this CPU (it needs AVX-512): checked that generator.prepack stands "
                    "aside; its packed products were not run")
    assert told == [f"generator: bf16 products through {len(linears)} linear layers' weights laid out for oneDNN once "
                    "per generate() call (generator.prepack=true)"]
    assert none == 0 and packed.response.shape[1] > 2
    assert products >= len(linears) * packed.response.shape[1]  # every layer, at every token
    assert not any("forward" in m.__dict__ for m in linears)  # put back
    assert torch.equal(own.response, packed.response)
    torch.testing.assert_close(own.logprobs, packed.logprobs, atol=0, rtol=0)
    assert sample(prepack=True, autocast=False)[1] == 0  # float32: nothing to lay out
    with torch.autocast("cpu", dtype=torch.bfloat16), packs_once(model, 8):
        assert not any("forward" in m.__dict__ for m in linears)  # grad on: the packed product has no backward
    # The next call lays the weights out again: after the head is zeroed in place, it samples uniformly.
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    uniform, _ = sample(prepack=True)
    mask = uniform.response_mask.bool()
    torch.testing.assert_close(uniform.logprobs[mask], torch.full((int(mask.sum()),), -math.log(len(tok))),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", [(32, 64, 4, 4, False), (32, 64, 4, 2, False), (32, 64, 4, 4, True),
                                  (768, 3072, 12, 12, False)], ids=["tiny", "tiny-gqa", "tiny-lora", "113m-width"])
def test_a_bf16_key_value_cache_samples_what_generates_own_cache_samples(arch, caplog):
    """generator.autocast_cache (rollout.sources.autocast_cache): under CPU bf16 autocast generate() keeps its keys
    and values in bf16, the numbers autocast's attention reads, rather than float32 keys cast again at every token:
    the same tokens and log-probs as generate()'s own cache, with grouped-query attention, LoRA adapters and at the
    113M model's width, with and without generator.prepack. Said once; nothing in float32."""
    from rlhflab.lit.data import encode_prompts
    from rlhflab.rollout.hf import HFGenerator
    from rlhflab.rollout.sources import autocast_cache
    from rlhflab.tasks.sentiment import SentimentTask

    hidden, inner, heads, kv_heads, lora = arch
    task = SentimentTask(response_words=8, seed=0)
    tok = task.build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inner,
                                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                         max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    prompts = task.prompts("train")[:4]
    query = encode_prompts(tok, prompts)
    given = []
    generate = model.generate

    def spied(**kwargs):
        given.append(kwargs.get("past_key_values"))
        return generate(**kwargs)

    model.generate = spied

    def sample(cached: bool, prepack: bool = True, autocast: bool = True):
        gen = HFGenerator(temperature=1.0, max_new_tokens=8, prepack=prepack, autocast_cache=cached)
        gen.setup(tok, 8)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=autocast):
            return gen.generate(model, query, prompts, samples_per_prompt=2, version=0)

    for prepack in (True, False):
        own = sample(cached=False, prepack=prepack)
        assert given.pop() is None
        with caplog.at_level(logging.INFO, logger="rlhflab.rollout.hf"):
            half = sample(cached=True, prepack=prepack)
        cache = given.pop()
        assert half.response.shape[1] > 2
        assert {layer.keys.dtype for layer in cache.layers} == {layer.values.dtype for layer in cache.layers} == {
            torch.bfloat16}
        assert torch.equal(own.response, half.response)
        torch.testing.assert_close(own.logprobs, half.logprobs, atol=0, rtol=0)
    told = [r.getMessage() for r in caplog.records if "generator.autocast_cache" in r.getMessage()]
    assert told == ["generator: generate()'s key/value cache held in bfloat16, as autocast's attention reads it "
                    "(generator.autocast_cache=true)"] * 2  # once per generator
    assert autocast_cache(model) is None  # float32: generate()'s own cache (a plain Llama's runs the lean loop)
    model.generation_config.cache_implementation = "static"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_cache(model) is None  # a model that asks for another cache gets it
