"""The rollout carrier and the sequence helpers every part shares."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class Rollout:
    """Completions of one batch of prompts, tagged with the policy version that made them.

    n = prompts * samples_per_prompt; each prompt's samples are contiguous.
    P = padded prompt length (left-padded), R = the batch's longest completion, at most max_new_tokens
    (right-padded): the forwards after generation run on P + R tokens, not on the whole budget.
    """

    query: torch.Tensor  # (n, P) prompt token ids, left-padded
    response: torch.Tensor  # (n, R) sampled token ids, pad after EOS
    response_mask: torch.Tensor  # (n, R) 1.0 for response tokens up to and including EOS
    logprobs: torch.Tensor  # (n, R) behaviour log-probs the generator sampled with
    version: int  # policy version (number of updates) whose weights generated it
    prompts: list[str]  # (n,) prompt texts, repeated per sample
    texts: list[str]  # (n,) decoded responses
    baseline_response: torch.Tensor | None = None  # (n // k, R) greedy completion per prompt (ReMax)
    baseline_texts: list[str] | None = None
    rows: torch.Tensor | None = None  # (n,) the dataset row of each sample's prompt (reward functions read its columns)
    split: str = "train"  # which split `rows` index
    ref_logprobs: torch.Tensor | None = None  # (n, R) the frozen reference's log-probs, 0 after EOS, when the source computed them
    extras: dict = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return self.response.shape[0]

    def has_eos(self, eos_token_id: int) -> torch.Tensor:
        """(n,) bool: did the completion end with EOS."""
        return ends(self.response, eos_token_id)

    def baseline_has_eos(self, eos_token_id: int) -> torch.Tensor:
        """(n // k,) bool: did each greedy completion end with EOS."""
        return ends(self.baseline_response, eos_token_id)

    def state(self) -> dict:
        """Plain types (tensors, lists, numbers, strings) that torch.load(weights_only=True) reads back."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict) -> "Rollout":
        return cls(**state)

    def with_version(self, version: int) -> "Rollout":
        return replace(self, version=version)

    def to(self, device) -> "Rollout":
        """The same rollout with every tensor on `device` (a no-op when they are there already)."""
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return replace(self, **moved)


def ends(response: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(n, R) ids -> (n,) bool: the completion emitted EOS within its budget."""
    return (response == eos_token_id).any(dim=1)


def response_mask_from_eos(response: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(n, R) float mask that is 1 up to and including the first EOS, else to the end."""
    is_eos = response == eos_token_id
    length = response.shape[1]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], length, dtype=torch.long))
    positions = torch.arange(length, device=response.device).unsqueeze(0)
    return (positions <= first.unsqueeze(1)).float()


def join(query: torch.Tensor, response: torch.Tensor, pad_token_id: int):
    """Concatenate left-padded queries and right-padded responses.

    Returns input_ids (n, P+R), attention_mask (n, P+R) and position_ids
    (n, P+R) counted from the first real token, as generate() counts them.
    Only the prompt's left padding is masked: every response position is
    attended, as in generation, so a pad id the policy sampled mid-response
    keeps its place (pads after EOS only feed positions that are masked out).
    """
    input_ids = torch.cat([query, response], dim=1)
    attention_mask = torch.cat([(query != pad_token_id).long(), torch.ones_like(response)], dim=1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def read_before(response: torch.Tensor) -> torch.Tensor:
    """The response tokens a log-prob or value forward runs: every one but the last. What is read of response token
    t is the output at the position before it (the prompt's last for t = 0), and in a causal model no earlier
    position attends to a later one, so the last token's position changes nothing that is read; running it cost
    1 / (R + 1) of the response positions' products, and of the LM head's (TRL runs it and drops its logits)."""
    return response[:, :-1]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(token) under logits / temperature: (n, R, V), (n, R) -> (n, R).

    The same temperature as sampling, so training log-probs are those of the
    distribution the tokens were drawn from. At temperature 1 the logits are used as they are: x / 1.0 is x, and
    the division would copy an (n, R, V) tensor (131 MB for 32 x 32 tokens of a 32,000-token vocabulary).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def trim_left(query: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Left-padded (n, P) prompts without the leading columns that are padding in every row: a batch is as wide
    as its own longest prompt, not the dataset's. Those columns are masked out wherever the prompts are read
    (generation, `join`), and positions count from each row's first real token, so nothing else changes."""
    return query[:, first_column(query, pad_token_id):]


def first_column(query: torch.Tensor, pad_token_id: int) -> int:
    """The first column of left-padded (n, P) prompts where some row's prompt has begun (`trim_left` cuts there)."""
    started = (query != pad_token_id).any(0)
    return int(started.int().argmax()) if bool(started.any()) else query.shape[1] - 1


def completion_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """(n, R) mask -> (n,) each row's width up to its last masked-in token (holes inside a row count)."""
    width = response_mask.shape[1]
    last = width - response_mask.flip(1).ne(0).int().argmax(1)
    return torch.where(response_mask.ne(0).any(1), last, torch.zeros_like(last))


def length_buckets(response_mask: torch.Tensor, prompt_width: int, max_buckets: int,
                   min_saving: float = 0.125) -> list[torch.Tensor] | None:
    """Rows grouped by completion length so that each group's forward pads to its own longest row, not the batch's.

    A batch is as wide as its longest completion: one completion that runs to the budget pads every other row
    to it, and every forward after generation (reference, old policy, update, values) pays for the padding.
    Sorted by length, the rows are cut where a cut removes the most padded tokens (prompt_width + width per
    row), one cut at a time, while a cut removes at least `min_saving` of the batch's tokens (each cut adds a
    forward: its fixed cost must be paid for) and there are fewer than `max_buckets` groups.
    Returns the groups' row indices, shortest first, or None when one forward over the batch is best.
    """
    n = response_mask.shape[0]
    if max_buckets <= 1 or n < 2:
        return None
    lengths = completion_lengths(response_mask).clamp(min=1).cpu()
    order = torch.argsort(lengths, stable=True)
    ranked = lengths[order].tolist()
    total = n * (prompt_width + ranked[-1])

    def cost(a: int, b: int) -> int:  # rows a..b-1 of the sorted order, padded to the longest of them
        return (b - a) * (prompt_width + ranked[b - 1])

    cuts = [0, n]
    while len(cuts) - 1 < max_buckets:
        best = (0, None)
        for a, b in zip(cuts, cuts[1:]):
            whole = cost(a, b)
            for c in range(a + 1, b):
                if ranked[c - 1] < ranked[c]:  # cut only between different lengths
                    saving = whole - cost(a, c) - cost(c, b)
                    if saving > best[0]:
                        best = (saving, c)
        if best[1] is None or best[0] < min_saving * total:
            break
        cuts = sorted(cuts + [best[1]])
    if len(cuts) == 2:
        return None
    return [order[a:b].to(response_mask.device) for a, b in zip(cuts, cuts[1:])]


def by_length(forward, query: torch.Tensor, response: torch.Tensor, response_mask: torch.Tensor,
              buckets: list[torch.Tensor] | None, pad_token_id: int, rows: slice | None = None) -> torch.Tensor:
    """forward(query, response) -> (m, w) per group of rows (`length_buckets`), put back as (n, R) in the batch's
    row order and multiplied by the mask (a forward that returns a tuple of them: a tuple of (n, R)). Each group's
    response is cut to its longest row and its query to the columns where some row's prompt has begun: the cut
    columns are padding the forward masks out (prompt) or never reads (causal attention: positions after a row's
    last token), so the numbers are those of one forward over the batch. Gradients flow to every group's forward.

    rows: only these rows of the batch ((len, R) out; mode.reference=balance, where the generator computes a batch's
    first rows and the learner the rest). Each is computed in the group the whole batch puts it in, cut to that
    group's widths, so it gets the numbers it gets in the batch's own forwards wherever a row's numbers do not
    depend on the rows beside it in a forward (on the CPU in float32 on one thread they do not; under bf16 autocast,
    or on more threads, a wide forward's rows can depend on how many it holds: tests/test_rollout.py). A group's
    widths set the numbers: cut to its own rows' widths, a split moved them by ~5e-7."""
    mask = response_mask if rows is None else response_mask[rows]
    if buckets is None:
        return each(forward(query, response) if rows is None else forward(query[rows], response[rows]), lambda t: t * mask)
    start, stop, step = (rows or slice(None)).indices(len(response))
    if step != 1:
        raise ValueError(f"rows={rows}: a slice of consecutive rows")
    width = response.shape[1]
    lengths = completion_lengths(response_mask).clamp(min=1)
    parts, placed = [], []
    for group in buckets:
        mine = group if rows is None else group[(group >= start) & (group < stop)]
        if len(mine):
            w, first = int(lengths[group].max()), first_column(query[group], pad_token_id)  # the whole group's widths
            parts.append(each(forward(query[mine, first:], response[mine, :w]),
                              lambda t, w=w: torch.nn.functional.pad(t, (0, width - w))))
            placed.append(mine - start)
    if not parts:
        return torch.zeros(mask.shape, device=mask.device)
    placed = torch.cat(placed)
    inverse = torch.empty_like(placed)
    inverse[placed] = torch.arange(len(placed), device=placed.device)
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column)[inverse] * mask for column in zip(*parts))
    return torch.cat(parts)[inverse] * mask


def each(out, fn):
    """fn of a forward's (n, R) output, or of each of a tuple of them (by_length's forward may return several)."""
    return tuple(fn(t) for t in out) if isinstance(out, tuple) else fn(out)


def pad_completions(tokens: list[list[int]], logprobs: list[list[float]], budget: int, pad_token_id: int):
    """Variable-length completions (as an inference engine returns them) -> right-padded (n, R) tensors, R the
    longest completion (as HFGenerator's batches: the forwards after generation run on R, not the budget).

    Returns response (n, R) token ids with `pad_token_id` after each completion and
    logprobs (n, R) float32 with 0 there. A completion longer than `budget` is an error.
    """
    n = len(tokens)
    width = max(1, *map(len, tokens)) if tokens else 1
    response = torch.full((n, width), pad_token_id, dtype=torch.long)
    lp = torch.zeros((n, width), dtype=torch.float32)
    for i, (t, l) in enumerate(zip(tokens, logprobs, strict=True)):
        if len(t) != len(l) or len(t) > budget:
            raise ValueError(f"completion {i}: {len(t)} tokens, {len(l)} log-probs, budget {budget}")
        response[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        lp[i, : len(l)] = torch.tensor(l, dtype=torch.float32)
    return response, lp


def repeat_prompts(query: torch.Tensor, prompts: list[str], k: int):
    """Repeat each prompt k times, keeping each prompt's samples contiguous."""
    return query.repeat_interleave(k, dim=0), [p for p in prompts for _ in range(k)]
