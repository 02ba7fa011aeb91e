"""rlhflab: declarative RLHF experiments (Hydra + Lightning + MLflow)."""

import sys


class _TorchmetricsWithoutPyplot:
    """Lightning imports torchmetrics (its LightningModule's type checks), and torchmetrics imports matplotlib.pyplot
    wherever matplotlib is installed, which MLflow installs: 23 MB of a run's peak memory that no run uses (a run plots
    nothing). This finder sees the import of torchmetrics' plot module, the one importer, and marks matplotlib as absent
    to torchmetrics only, so the module takes its no-matplotlib branch. matplotlib itself still imports for anyone
    (MLflow's log_figure, a reward function), and a process that imported matplotlib.pyplot before torchmetrics keeps
    torchmetrics' plots. It finds no module itself (find_spec returns None), so every import goes on as before."""

    done = False

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torchmetrics.utilities.plot" and not cls.done:
            cls.done = True
            flag = getattr(sys.modules.get("torchmetrics.utilities.imports"), "_MATPLOTLIB_AVAILABLE", None)
            # a lightning_utilities RequirementCache, checked at its first bool() and cached in `available`
            if flag is not None and "matplotlib.pyplot" not in sys.modules and not hasattr(flag, "available"):
                flag.available = False
                flag.message = ("rlhflab: torchmetrics' plots are off in this process (import matplotlib.pyplot before "
                                "rlhflab to keep them)")
        return None


if "torchmetrics" not in sys.modules and _TorchmetricsWithoutPyplot not in sys.meta_path:
    sys.meta_path.insert(0, _TorchmetricsWithoutPyplot)
