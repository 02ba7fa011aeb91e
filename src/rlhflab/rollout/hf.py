"""Generation with Hugging Face `generate()`: the CPU backend (and a GPU fallback)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhflab.errors import ConfigError
from rlhflab.rollout.batch import Rollout, repeat_prompts, response_mask_from_eos


class HFGenerator:
    """Samples k completions per prompt with `model.generate`, recording behaviour log-probs.

    temperature: sampling temperature; the learner divides logits by the same value.
    top_k: must be 0 (the full distribution): the learner, the reference and every KL estimate use
      untruncated log-probs, so samples from a truncated distribution would make each ratio wrong.
    max_new_tokens: null = the task's budget.
    """

    needs_spawn = False  # the generator process may be forked
    synced = False  # set when the model is sharded over ranks: every rank runs the same number of forward steps

    def __init__(self, temperature: float = 1.0, top_k: int = 0, max_new_tokens: int | None = None) -> None:
        if top_k != 0:
            raise ConfigError(
                f"generator.top_k={top_k}: the learner's and the reference's log-probs are those of the full distribution, "
                "so top-k sampling would make every importance ratio and KL estimate wrong; set generator.top_k=0"
            )
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens

    def check_model(self, model_cfg) -> None:
        """Raise ConfigError for a model this backend cannot run (called before any model loads)."""

    def setup(self, tokenizer, max_new_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_new_tokens = self.max_new_tokens or max_new_tokens

    def for_learner(self) -> "HFGenerator":
        """What the learner samples evaluation completions with while a generator process runs: this one."""
        return self

    @torch.no_grad()
    def _generate(self, model, query: torch.Tensor, greedy: bool):
        attention_mask = (query != self.tokenizer.pad_token_id).long()
        out = model.generate(
            input_ids=query,
            attention_mask=attention_mask,
            do_sample=not greedy,
            temperature=self.temperature if not greedy else None,
            top_k=0 if not greedy else None,  # 0: no truncation (transformers' default would be 50)
            top_p=None,
            max_new_tokens=self.max_new_tokens,
            min_length=0,  # no forced length (min_new_tokens=0 would add a no-op processor that costs every token)
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            synced_gpus=self.synced,  # a sharded model's forward is a collective: no rank may stop early
        )
        response = out.sequences[:, query.shape[1] :]
        # generate() stops early once every row has finished: pad to a fixed width.
        width = self.max_new_tokens
        response = F.pad(response, (0, width - response.shape[1]), value=self.tokenizer.pad_token_id)
        logits = torch.stack(out.logits, dim=1).float() / self.temperature  # (n, steps, V)
        picked = response[:, : logits.shape[1]]
        logprobs = picked.new_zeros(response.shape, dtype=torch.float32)
        logprobs[:, : logits.shape[1]] = logits.gather(-1, picked.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        return response, logprobs

    def generate(
        self, model, query: torch.Tensor, prompts: list[str], samples_per_prompt: int, version: int, greedy_baseline: bool = False
    ) -> Rollout:
        """query: (b, P) left-padded prompts -> a Rollout of b * samples_per_prompt completions."""
        was_training = model.training
        model.eval()
        try:
            q, p = repeat_prompts(query, prompts, samples_per_prompt)
            response, logprobs = self._generate(model, q, greedy=False)
            mask = response_mask_from_eos(response, self.tokenizer.eos_token_id)
            rollout = Rollout(
                query=q,
                response=response,
                response_mask=mask,
                logprobs=logprobs * mask,
                version=version,
                prompts=p,
                texts=self.decode(response),
            )
            if greedy_baseline:
                baseline, _ = self._generate(model, query, greedy=True)
                rollout.baseline_response = baseline
                rollout.baseline_texts = self.decode(baseline)
            return rollout
        finally:
            model.train(was_training)

    def decode(self, response: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(response, skip_special_tokens=True)
