"""How completions are scored: a reward model, the task's gold rule, or your own functions (the `reward=` group)."""
