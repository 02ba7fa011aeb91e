"""The example's reward functions, with TRL's signature: fn(prompts, completions, **columns) -> list[float].

`answer` comes from the dataset's column of the same name.
"""


def correct_digits(prompts, completions, answer, **kwargs):
    """The share of positions where the completion has the answer's digit (a dense signal)."""
    return [sum(a == b for a, b in zip(c.strip(), ans)) / len(ans) for c, ans in zip(completions, answer)]


def exact(prompts, completions, answer, **kwargs):
    """1 for the exact answer, else 0 (the example's gold judgement too)."""
    return [float(c.strip() == ans) for c, ans in zip(completions, answer)]
