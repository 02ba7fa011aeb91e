"""The rollout helpers the learner and every generator share."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhflab.rollout.batch import join, response_mask_from_eos, token_logprobs

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
