"""Entry point: `python src/train.py [group=option ...] [key=value ...]` (add -m to sweep)."""

import os

# Before torch is imported: with active OpenMP waiting, 2 threads on 2 cores run 5-20x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from rlhflab.train import main as run

    return run(cfg)


if __name__ == "__main__":
    main()
