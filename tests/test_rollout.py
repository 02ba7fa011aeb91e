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
