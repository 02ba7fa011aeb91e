"""Entry point: `python src/train.py [group=option ...] [key=value ...]` (add -m to sweep, --help for the groups)."""

import os
import sys

from rlhflab import startup  # light: the standard library only

if __name__ == "__main__":  # not where a spawned process (mode=async on CUDA) imports this file as __mp_main__
    startup.pause()  # no cyclic garbage collection while torch, Lightning and MLflow import (rlhflab/startup.py)

# Before torch is imported: with active OpenMP waiting, 2 threads on 2 cores run 5-20x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from rlhflab.cli import preflight  # noqa: E402  (light: no torch)
from rlhflab.schema import register  # noqa: E402
from rlhflab.store_template import make_aside  # noqa: E402  (light: the standard library)

register()  # the typed schemas every option file starts from


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from rlhflab.train import main as run

    return run(cfg)


if __name__ == "__main__":
    try:
        stores = preflight(sys.argv[1:])  # --help, and one-line errors before anything heavy loads
        make_aside(stores)  # a new store's empty copy made on the other core while rlhflab.train imports
        main()
    except KeyboardInterrupt:  # Ctrl-C outside rlhflab's handlers (while loading, or between a sweep's jobs)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # rank 0 speaks for the ranks it launched
            print("stopped: stopped by SIGINT while no run was training", file=sys.stderr)
        sys.exit(130)
