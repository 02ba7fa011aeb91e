"""Shared fixtures: compose the real config, shrink it, point caches and MLflow at tmp dirs."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see docs/ENV.md

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from rlhflab.schema import register

register()  # the group schemas, as src/train.py registers them

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")

# Small enough for seconds per stage, large enough that RL still visibly learns.
SHRINK = [
    "task.num_train_prompts=512",
    "task.num_eval_prompts=32",
    "task.num_demonstrations=512",
    "task.num_preference_pairs=1024",
    "stages.sft.epochs=2",
    "stages.rm.epochs=4",
    "rl.prompts_per_step=16",
    "rl.eval_every=0",
    "rl.log_generations=4",
    "trainer.enable_progress_bar=false",
]


def compose_cfg(overrides: list[str] = (), shrink: bool = True) -> DictConfig:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="train", overrides=(SHRINK if shrink else []) + list(overrides))


@pytest.fixture(scope="session")
def stage_cache(tmp_path_factory) -> Path:
    """One cache for the whole session: the tiny model, SFT and RM are trained once."""
    return tmp_path_factory.mktemp("rlhflab-cache")


@pytest.fixture
def make_cfg(stage_cache, tmp_path):
    """Compose + shrink + isolate (own MLflow db per test, shared stage cache)."""

    def make(*overrides: str, shrink: bool = True) -> DictConfig:
        cfg = compose_cfg([f"cache_dir={stage_cache}", *overrides], shrink=shrink)
        with open_dict(cfg):
            cfg.logger.tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
        return cfg

    return make
