"""The training stages before RL (sft, rm, hydra_sft) and the pipeline that runs those a memory strategy needs."""
