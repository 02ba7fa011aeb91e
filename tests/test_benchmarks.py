"""benchmarks/vs_trl.py's memory measurement: a process tree's PSS counts pages shared after fork once."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MB = 1024  # KiB

# A child holds 64 MiB, forks, and the grandchild writes 64 MiB of its own; both say "ready" and wait on stdin.
TREE = r"""
import os, sys
held = bytearray(64 << 20)
for i in range(0, len(held), 4096):
    held[i] = 1
r, w = os.pipe()
if os.fork() == 0:
    own = bytearray(64 << 20)
    for i in range(0, len(own), 4096):
        own[i] = 1
    print("ready", flush=True)
    sys.stdin.read()
    os._exit(0)
print("ready", flush=True)
sys.stdin.read()
os.wait()
"""


def load_vs_trl():
    spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "benchmarks" / "vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib only at import time (TRL is imported by the child runs)
    return module


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc/<pid>/smaps_rollup")
def test_tree_pss_counts_the_grandchild_and_shared_pages_once():
    vs_trl = load_vs_trl()
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert [proc.stdout.readline().strip() for _ in range(2)] == ["ready", "ready"]  # both processes hold their memory
        pids = vs_trl.tree_pids(proc.pid)
        assert len(pids) == 2
        tree = vs_trl.tree_pss_kb(proc.pid)
        child = vs_trl.pss_kb(proc.pid)
        # 64 MiB shared after fork (once) + 64 MiB the grandchild wrote: a sum of RSS would count 192 MiB or more.
        assert tree is not None and 128 * MB < tree < 180 * MB, tree / MB
        assert child < tree - 60 * MB  # the grandchild's own 64 MiB is not the child's
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        finally:
            proc.kill()
            proc.wait()


def test_table_takes_ratios_against_the_fastest_trl_side():
    vs_trl = load_vs_trl()
    a = vs_trl.parse(["--algos", "rloo", "--sides", "rlhflab_2threads,trl,trl_2threads"])
    run = lambda cps, tokens=9.0: {"completions_per_s": cps, "completion_tokens": tokens, "peak_rss_mb": 1.0,  # noqa: E731
                                   "peak_pss_mb": 1.0, "final_reward": 0.5}
    results = {"rloo": {"rlhflab_2threads": [run(30.0)], "trl": [run(10.0, 3.25)], "trl_2threads": [run(20.0)]}}
    row = next(line for line in vs_trl.table(a, results).splitlines() if line.startswith("| RLOO"))
    assert "| 1.50x |" in row  # 30 / max(10, 20), not 30 / 10
    assert "| 9.0 / 3.2 / 9.0 |" in row  # each side's completion length beside its speed
    assert "rlhflab sync 2 threads / best TRL" in vs_trl.table(a, results)
    assert "TRL 2 threads: 2" in vs_trl.table(a, results)


def test_vs_trl_times_the_same_steps_of_both_sides_whatever_their_logging():
    """--log-every 10 (TRL's logging_steps default, both sides): rlhflab's MLflow rows are at steps 10, 20, ..., each
    the mean over its 10 steps, TRL's clock ticks every step; both are timed from the end of step 10 to the end of the
    last, and the final reward is the mean of the last 10 steps either way. Fewer steps than two logged ones: refused."""
    vs_trl = load_vs_trl()
    a = vs_trl.parse(["--steps", "30"])
    assert a.log_every == 10 and vs_trl.parse(["--steps", "5"]).log_every == 1
    assert "trainer.log_every_n_steps=10" in vs_trl.rlhflab_cmd(a, "rloo", None, 30, ROOT, [], "rlhflab")
    log1 = vs_trl.rlhflab_cmd(a, "rloo", None, 30, ROOT, [], "rlhflab_log1")
    assert [arg for arg in log1 if arg.startswith("trainer.log_every_n_steps=")] == ["trainer.log_every_n_steps=1"]
    rewards = [float(step) for step in range(1, 31)]
    lengths = [40.0 - step for step in range(1, 31)]  # the timed steps 11..30: 29..10 tokens, 19.5 on average
    ends = [0.5 * step for step in range(1, 31)]  # 2 steps a second, 8 completions a step: 16 completions/s
    each = vs_trl.summarize(list(range(1, 31)), ends, rewards, lengths, 8, a.log_every)
    windows = vs_trl.summarize([10, 20, 30], ends[9::10], [5.5, 15.5, 25.5], [34.5, 24.5, 14.5], 8, a.log_every)
    for res in (each, windows):
        assert (res["first"], res["steps"], res["rl_s"]) == (10, 30, 10.0)
        assert res["completions_per_s"] == pytest.approx(16.0) and res["final_reward"] == pytest.approx(25.5)
        assert res["completion_tokens"] == pytest.approx(19.5)
    three = vs_trl.summarize([1, 2, 3], [1.0, 2.0, 4.0], [0.0, 1.0, 2.0], [9.0, 5.0, 2.0], 8, 1)
    assert three["completions_per_s"] == pytest.approx(16 / 3) and three["completion_tokens"] == pytest.approx(3.5)
    with pytest.raises(RuntimeError, match="the end of step 10 and a later one are needed"):
        vs_trl.summarize([10], [5.0], [5.5], [9.0], 8, 10)
    with pytest.raises(RuntimeError, match="2 completion lengths recorded for 3 steps"):
        vs_trl.summarize([1, 2, 3], [1.0, 2.0, 4.0], [0.0, 1.0, 2.0], [9.0, 5.0], 8, 1)
    with pytest.raises(SystemExit):
        vs_trl.parse(["--steps", "15", "--log-every", "10"])


def test_trl_completion_lengths_count_as_rlhflab_s_response_len():
    """TRL's side measures a completion's length from the ids its reward function gets (masked after the first EOS
    for RLOO and GRPO, padded rows for online DPO); rlhflab logs response_mask_from_eos's sum. Same numbers."""
    import torch

    from rlhflab.rollout.batch import response_mask_from_eos

    vs_trl = load_vs_trl()
    eos, pad = 2, 0
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 40, (64, 12), generator=g)
    stops = torch.randint(0, 16, (64,), generator=g)  # >= 12: no EOS, the row runs to the end
    for i, stop in enumerate(stops.tolist()):
        if stop < 12:
            rows[i, stop] = eos
            rows[i, stop + 1:] = pad
    want = response_mask_from_eos(rows, eos).sum(1).tolist()
    padded = [vs_trl.completion_length(row, eos) for row in rows.tolist()]
    masked = [vs_trl.completion_length(row[: row.index(eos) + 1] if eos in row else row, eos) for row in rows.tolist()]
    assert padded == masked == want and min(want) == 1 and max(want) == 12 and 1 < sum(w == 12 for w in want) < 64


def test_the_results_json_keeps_the_arguments_as_json_values(tmp_path):
    """args were Python text ("['rloo', 'grpo']", "None", "False"): a reader had to eval them."""
    vs_trl = load_vs_trl()
    a = vs_trl.parse(["--algos", "rloo,grpo", "--reps", "2", "--out", str(tmp_path / "t.md")])
    vs_trl.save(a, "| table |", "/x/sft", {"rloo": {}})
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["args"]["algos"] == ["rloo", "grpo"] and saved["args"]["reps"] == 2 and saved["args"]["keep"] is False
    assert saved["args"]["out"] == str(tmp_path / "t.md") and saved["args"]["max_new_tokens"] is None
    assert saved["sft"] == "/x/sft" and (tmp_path / "t.md").read_text() == "| table |\n"


@pytest.mark.parametrize("favoured, expected", [("positive", 1.0), ("negative", -1.0), ("eos", 0.0)])
def test_policy_reward_judges_only_the_completion(tmp_path, favoured, expected):
    """A policy that always emits one word (lm_head bias) scores that word's gold reward: 8/8, -8/8, or an empty
    response. The prompt's own words would count if the judge scored the prompt too."""
    import torch
    from transformers import GPTJConfig, GPTJForCausalLM

    from rlhflab.tasks.sentiment import SentimentTask

    vs_trl = load_vs_trl()
    task = SentimentTask(response_words=8, seed=0)
    tok = task.build_tokenizer()
    word = {"positive": task.words.positive[0], "negative": task.words.negative[0], "eos": tok.eos_token}[favoured]
    cfg = GPTJConfig(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, rotary_dim=4, n_positions=64,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = GPTJForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.fill_(-30.0)
        model.lm_head.bias[tok.convert_tokens_to_ids(word)] = 30.0
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    mean, se = vs_trl.policy_reward(str(tmp_path), temperature=1.0, max_new_tokens=None, response_words=8, num_prompts=70,
                                    samples=3, seed=1)  # 70 prompts: a full batch of 64 and a partial one
    assert mean == pytest.approx(expected) and se == pytest.approx(0.0)


# import_rss.py: a package whose body holds 48 MiB, imported by one that holds nothing; 24 MiB more after the
# imports; then an exit code the tool must pass on.
FAT = "held = bytearray(48 << 20)\nfor i in range(0, len(held), 4096):\n    held[i] = 1\n"
THIN = "import fat\nimport fat.inner\n"
PROGRAM = ("import thin\nlater = bytearray(24 << 20)\nfor i in range(0, len(later), 4096):\n    later[i] = 1\n"
           "raise SystemExit(3)\n")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc/self/statm")
def test_import_rss_charges_each_package_its_own_load(tmp_path):
    (tmp_path / "fat").mkdir()
    (tmp_path / "fat" / "__init__.py").write_text("")
    (tmp_path / "fat" / "inner.py").write_text(FAT)
    (tmp_path / "thin.py").write_text(THIN)
    (tmp_path / "program.py").write_text(PROGRAM)
    out = tmp_path / "rss.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "import_rss.py"), "--json", str(out), "--",
                           str(tmp_path / "program.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr  # the program's own exit code
    res = json.loads(out.read_text())
    assert 46 < res["packages_mb"]["fat"] < 56, res["packages_mb"]
    assert res["modules_mb"]["fat.inner"] > 46  # the module whose body allocated, not its package's __init__
    assert abs(res["packages_mb"]["thin"]) < 3  # what thin imported is fat's, not thin's
    assert res["first_importer"]["fat"] == "thin"
    rest = res["peak_rss_mb"] - res["start_mb"] - res["imports_mb"]
    assert 22 < rest < 40, rest  # the 24 MiB allocated outside any import
    assert "fat" in proc.stderr and "first imported by" in proc.stderr


@pytest.mark.parametrize("args, said", [
    (["--reps", "0"], "--reps 0: give 1 or more"),  # an empty table, exit 0
    (["--sides", ",,"], "--sides: none given"),  # ZeroDivisionError
    (["--steps", "1"], "--steps 1: give 2 or more"),  # a RuntimeError after the run
    (["--eval-samples", "0"], "--eval-samples 0: give 1 or more"),  # a policy reward from 0 samples
    (["--max-new-tokens", "0"], "--max-new-tokens 0: give 1 or more"),  # read as the task's budget
    (["--model", "bogus"], "--model bogus: not an rlhflab model preset; choose from llama100m"),  # failed in the SFT run
    (["--sides", "trl,rlhflab,trl"], "--sides: trl given more than once"),  # ran twice into one median, two columns
    (["--algos", "rloo,rloo"], "--algos: rloo given more than once"),  # the same, and the table's row twice
    (["--eos-penalty", "nan"], "--eos-penalty nan: give a finite number"),  # refused by the first run, after the SFT run
    (["--lr", "inf"], "--lr inf: give a finite number"),
])
def test_vs_trl_refuses_bad_arguments_before_any_run(capsys, args, said):
    vs_trl = load_vs_trl()
    with pytest.raises(SystemExit) as stop:
        vs_trl.parse(args)
    assert stop.value.code == 2 and said in capsys.readouterr().err


def test_vs_trl_checks_every_rlhflab_command_before_the_sft_run():
    """An override one algorithm lacks (GRPO names its KL weight kl_loss_coef) failed halfway through a benchmark."""
    vs_trl = load_vs_trl()
    vs_trl.check_commands(vs_trl.parse(["--algos", "rloo", "--rlhflab-override", "algo.kl_coef=0.1"]))  # RLOO has it
    with pytest.raises(SystemExit, match=r"^rlhflab grpo \(rlhflab\): rlhflab would refuse its command: error: algo.kl_coef: "
                                         "not a setting of algo"):
        vs_trl.check_commands(vs_trl.parse(["--algos", "rloo,grpo", "--rlhflab-override", "algo.kl_coef=0.1"]))


def test_vs_trl_precision_sets_both_sides_and_keeps_one_sft_policy(tmp_path):
    """--precision bf16 runs both frameworks under bf16 autocast (TRL's default bf16=True; rlhflab
    trainer.precision=bf16-mixed), and fp32 neither; the SFT policy's run is float32 either way (its stage cache keys
    on the precision: a bf16 benchmark would have started from another policy); an --rlhflab-override of the precision
    changes one side only, and is said."""
    vs_trl = load_vs_trl()
    for precision, rlhflab, trl in (("fp32", "trainer.precision=32-true", {}), ("bf16", "trainer.precision=bf16-mixed",
                                                                             {"bf16": True})):
        a = vs_trl.parse(["--precision", precision, "--sides", "rlhflab_async,trl"])
        run = vs_trl.rlhflab_cmd(a, "rloo", "/x/sft", 5, tmp_path, [], "rlhflab_async")
        assert [arg for arg in run if arg.startswith("trainer.precision=")] == [rlhflab]
        prep = vs_trl.rlhflab_cmd(a, "rloo", None, 1, tmp_path, [], precision="fp32")
        assert [arg for arg in prep if arg.startswith("trainer.precision=")] == ["trainer.precision=32-true"]
        assert vs_trl.PRECISION[precision]["trl"] == trl
        assert vs_trl.parse_child(["--algo", "rloo", "--sft", "s", "--json", "j", "--steps", "2", "--prompts-per-step", "1",
                                   "--k", "2", "--lr", "1", "--temperature", "1", "--seed", "0", "--response-words", "8",
                                   "--precision", precision]).precision == precision
        vs_trl.check_commands(a)  # rlhflab's preflight takes every command
    none = {algo: {side: [] for side in vs_trl.SIDES} for algo in vs_trl.ALGOS}  # the header alone
    assert ", 60 steps, logging every 10, float32; " in vs_trl.table(vs_trl.parse([]), none)
    assert ", 60 steps, logging every 10, bf16 autocast over float32 weights" in vs_trl.table(vs_trl.parse(["--precision", "bf16"]), none)
    assert vs_trl.one_sided(["trainer.precision=bf16-mixed"]) == [
        "vs_trl.py: warning: --rlhflab-override trainer.precision=bf16-mixed: the TRL side keeps --precision's value; "
        "give that flag instead; the sides no longer run the same setting"]


def test_vs_trl_says_bf16_measures_the_fallback_on_a_cpu_without_bf16_kernels(monkeypatch):
    """--precision bf16 on an AVX2-only CPU times torch's bf16 fallback loops on both sides (a 113M forward and
    backward 24x float32's time): said before the runs, and nothing where the CPU has the kernels or in float32."""
    import rlhflab.rollout.sources as sources

    monkeypatch.setattr(sources, "cpu_has_half_kernels", lambda dtype: False)
    vs_trl = load_vs_trl()
    assert vs_trl.slow_bf16("fp32") is None
    assert vs_trl.slow_bf16("bf16").startswith("--precision bf16: this CPU has no bfloat16 kernels")
    monkeypatch.setattr(sources, "cpu_has_half_kernels", lambda dtype: True)
    assert vs_trl.slow_bf16("bf16") is None


def test_a_failed_child_is_said_with_its_error_line_and_a_kept_log(tmp_path):
    """'failed (exit 2); see <log>' named a log the work directory's removal had deleted, and a run killed at
    --timeout said only 'exit -9'."""
    vs_trl = load_vs_trl()
    log = tmp_path / "log.txt"
    log.write_text("[12:00:00] INFO stage sft\nerror: trainer.max_steps: 0 must be >= 1\n")
    said = str(vs_trl.child_failed("rlhflab rloo (rlhflab) rep 1", 2, 3.0, log, 1800).code)
    assert said.startswith("rlhflab rloo (rlhflab) rep 1 failed (exit 2): error: trainer.max_steps: 0 must be >= 1")
    assert said.endswith(f"its log: {log}")
    killed = str(vs_trl.child_failed("TRL rloo (trl) rep 1", -9, 4.2, log, 4).code)
    assert killed.startswith("TRL rloo (trl) rep 1 failed (killed at --timeout 4 s)")
    # a traceback: its exception, not Hydra's closing advice
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\nFileNotFoundError: [Errno 2] No such "
                   "file or directory: '/proc/nope'\n\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n")
    said = str(vs_trl.child_failed("preparing the SFT policy", 1, 3.0, log, 1800).code)
    assert said.startswith("preparing the SFT policy failed (exit 1): FileNotFoundError: [Errno 2]")


def test_a_benchmarks_work_directory_goes_when_it_ends_well_and_stays_when_it_fails_or_is_kept(tmp_path, monkeypatch,
                                                                                                capsys):
    """benchmarks/step_flops.py left its work directory (1.6 MB: logs, an MLflow db, the policies) in /tmp after every
    run, the test suite's too: 52 of them on this host in a day. It now shares vs_trl.py's rule."""
    import tempfile
    vs_trl = load_vs_trl()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with vs_trl.work_directory("bench-", keep=False) as work:
        (work / "run.log").write_text("ok")
    assert not work.exists() and "kept" not in capsys.readouterr().out
    with vs_trl.work_directory("bench-", keep=True) as kept:
        pass
    assert kept.is_dir() and f"kept: {kept}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        with vs_trl.work_directory("bench-", keep=False) as failed:
            sys.exit("a side failed; its output: <log>")
    assert failed.is_dir() and f"kept: {failed}" in capsys.readouterr().err


def test_vs_trl_refuses_an_out_path_it_could_not_write_before_any_run(tmp_path, capsys):
    """--out under a file was a FileExistsError after the whole benchmark, its JSON lost."""
    vs_trl = load_vs_trl()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        vs_trl.parse(["--out", str(tmp_path / "file" / "x.md")])
    assert "is not a writable directory" in capsys.readouterr().err
    assert vs_trl.parse(["--out", str(tmp_path / "new" / "x.md")]).out == tmp_path / "new" / "x.md"


def test_import_rss_help_and_bad_arguments():
    """--help printed a bare usage line to stderr and exited 1; --top -3 dropped the last three rows; a --json it could
    not write was a traceback after the whole program had run, its JSON lost."""
    script = str(ROOT / "benchmarks" / "import_rss.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "Where a Python program's peak RSS goes" in shown.stdout and "--top" in shown.stdout
    for args, said in ((["--top", "-3", "--", script], "--top -3: give 0 or more"), ([], "give the program after --"),
                       ([script, "reward=rule"], "give the program after --"),  # 'unrecognized arguments
                       (["--json", str(ROOT), "--", script], "a directory; give a file path"),
                       (["--json", str(ROOT / "README.md" / "x.json"), "--", script], "is not a writable directory")):
        out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and said in out.stderr, out.stderr


def test_rlhflabs_optuna_plugin_imports_without_hydra_optuna_sweeper():
    """vs_trl.py's venv (`pip install -e ".[bench]"`) has no hydra-optuna-sweeper, the dev extra's: Hydra's plugin
    scan warned "Error importing 'hydra_plugins.rlhflab_mlflow.optuna_sweeper'. Plugin is incompatible with this Hydra
    version or buggy." at every start, and vs_trl.py's preflight passed those lines on before rlhflab's one error line.
    The scan imports the module as below; hydra-optuna-sweeper is hidden from it where it is installed."""
    code = (
        "import importlib, sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[:2] == ['hydra_plugins', 'hydra_optuna_sweeper']:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name='hydra_plugins.hydra_optuna_sweeper')\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from hydra.plugins.plugin import Plugin\n"
        "module = importlib.import_module('hydra_plugins.rlhflab_mlflow.optuna_sweeper')\n"
        "print(issubclass(module.RlhflabOptunaSweeper, Plugin))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr  # imported; no plugin without its base


def test_rlhflab_runs_write_only_into_their_directory_and_the_record_gives_the_same_command():
    """Each rlhflab run of vs_trl.py left Hydra's train.log and .hydra/ in outputs/<date>/<time>/ of the repository
    (61 directories for the default --reps 5), past the work directory the script deletes. The import_rss.py command
    docs/MEASUREMENTS.md gives (the README's before it moved there) is 'the sync RLOO run of the table ... same
    settings': the script's own command, word for word."""
    import re

    vs_trl = load_vs_trl()
    cmd = vs_trl.rlhflab_cmd(vs_trl.parse([]), "rloo", "$SFT", 60, Path("$W/run"), [])
    assert "hydra.run.dir=$W/run" in cmd and "output.dir=$W/run" in cmd
    record = (ROOT / "docs" / "MEASUREMENTS.md").read_text()
    shown = re.search(r"import_rss\.py --json \$W/rlhflab\.json -- src/train\.py (.*?)\n    python", record, re.S)
    assert shown and shown.group(1).replace("\\\n", " ").split() == cmd[2:]


def benchmark_running_a_child(log: Path, child: str, before: str = "") -> subprocess.Popen:
    """A Python process that loads benchmarks/vs_trl.py, stops on its signals as the script does, runs `before`
    (code that may patch `vs_trl`), then `run_child` of `python -c child` logging to `log`; stderr piped."""
    parent = ("import importlib.util, sys\n"
              f"spec = importlib.util.spec_from_file_location('vs_trl', {str(ROOT / 'benchmarks' / 'vs_trl.py')!r})\n"
              "vs_trl = importlib.util.module_from_spec(spec); spec.loader.exec_module(vs_trl)\n"
              "vs_trl.stop_on_signals()\n"
              f"{before}"
              f"vs_trl.run_child([sys.executable, '-c', {child!r}], vs_trl.Path({str(log)!r}), 300, {{}})\n")
    return subprocess.Popen([sys.executable, "-c", parent], stderr=subprocess.PIPE, text=True)


def test_a_terminated_benchmark_takes_its_running_child_with_it(tmp_path):
    """SIGTERM to vs_trl.py (`timeout`, `kill`) ended it without its `finally`s: the child run, in a session of its
    own, trained on alone (with mode=async, its generator as well)."""
    import os
    import signal
    import time

    log = tmp_path / "log.txt"
    proc = benchmark_running_a_child(log, "import os, time; print(os.getpid(), flush=True); time.sleep(120)")
    try:
        for _ in range(300):
            if log.is_file() and log.read_text().strip():
                break
            time.sleep(0.1)
        child = int(log.read_text())
        proc.send_signal(signal.SIGTERM)
        assert "vs_trl.py: stopped by SIGTERM" in proc.communicate(timeout=60)[1]
        for _ in range(100):  # killed and reaped by the parent's wait4
            if not Path(f"/proc/{child}").exists():
                break
            time.sleep(0.1)
        assert not Path(f"/proc/{child}").exists(), "the child outlived the benchmark"
    finally:
        proc.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except (NameError, ProcessLookupError):
            pass


def test_a_sigterm_while_the_benchmark_starts_its_watchers_ends_the_child_and_the_benchmark(tmp_path):
    """A SIGTERM that came while run_child started its PSS thread (Thread.start waits for it: longer on a loaded
    machine, where .ci/run met it) was raised before the `try`: the child trained on and the uncancelled timeout
    timer held the benchmark's exit for the whole timeout. Here the signal comes inside PeakPss.start, every time."""
    import os
    import signal

    pidfile = tmp_path / "child.pid"
    late = ("import os, signal\n"
            "start = vs_trl.PeakPss.start\n"
            "def late(self):\n"
            f"    open({str(pidfile)!r}, 'w').write(str(self.pid))\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    start(self)\n"
            "vs_trl.PeakPss.start = late\n")
    proc = benchmark_running_a_child(tmp_path / "log.txt", "import time; time.sleep(120)", before=late)
    try:
        assert "vs_trl.py: stopped by SIGTERM" in proc.communicate(timeout=60)[1]
        child = int(pidfile.read_text())
        assert not Path(f"/proc/{child}").exists(), "the child outlived the benchmark"
    finally:
        proc.kill()
        try:
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            pass


def test_vs_trl_help_gives_every_default():
    """--prompts-per-step, --lr, --temperature and --seed had no help, so --help gave no default; --eval-samples said
    'default: None' though tiny's is 8."""
    shown = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--help"], capture_output=True,
                           text=True, timeout=60).stdout
    text = " ".join(shown.split())
    for said in ("(default: 32)", "(default: 0.001)", "(default: 1.0)", "(default: 0)", "tiny 512", "tiny 8"):
        assert said in text, said
    assert "None" not in text.split("--eval-samples EVAL_SAMPLES ")[1].split("--sft")[0]


def test_an_override_of_what_both_sides_share_is_warned():
    """--rlhflab-override rl.lr=... (or a task or algorithm setting) changed the rlhflab side alone, and the table
    compared unequal settings without a word."""
    vs_trl = load_vs_trl()
    said = vs_trl.one_sided(["rl.lr=0.01", "task.prompt_words=3", "algo.kl_coef=0.1", "torch_threads=2", "model.dtype=bfloat16"])
    assert said == [
        "vs_trl.py: warning: --rlhflab-override rl.lr=0.01: the TRL side keeps --lr's value; give that flag instead; the "
        "sides no longer run the same setting",
        "vs_trl.py: warning: --rlhflab-override task.prompt_words=3: the TRL side keeps conf/task/sentiment.yaml's task; "
        "the sides no longer run the same setting",
        "vs_trl.py: warning: --rlhflab-override algo.kl_coef=0.1: the TRL side keeps its matched settings (TRL_ALGO in "
        "benchmarks/vs_trl.py); the sides no longer run the same setting",
        "vs_trl.py: warning: --rlhflab-override model.dtype=bfloat16: the TRL side keeps float32 on both sides; the sides "
        "no longer run the same setting"]  # torch_threads: rlhflab's own (the TRL child has --threads)
    parsed = vs_trl.parse([])
    for key, flag in vs_trl.SHARED_KEYS.items():  # each is what rlhflab_cmd sets from the shared flag
        assert any(arg.startswith(f"{key}=") for arg in vs_trl.rlhflab_cmd(parsed, "rloo", None, 1, ROOT, [])), key


def test_the_generation_benchmarks_lean_loop_samples_what_generate_samples(tmp_path):
    """benchmarks/generation.py times rlhflab's own decode loop (generator.decode=lean) against generate(); its
    numbers say something only while the loop draws the same tokens and log-probs from the same seed (and, for the
    prefill's own share, while each prompt's prefill once draws what every row's does). Checked on another Llama than
    the one it was measured on: grouped-query attention and a tied LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhflab.tasks.sentiment import SentimentTask

    words = SentimentTask().build_tokenizer()
    sft = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 pad_token_id=words.pad_token_id, eos_token_id=words.eos_token_id)).save_pretrained(sft)
    words.save_pretrained(sft)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generation.py"), "--sft", str(sft), "--calls", "2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("the loop draws the same tokens and log-probs as generate()") == 5, out.stdout
    assert out.stdout.count("each prompt's prefill once draws the same tokens and log-probs as every row's") == 5
    assert [line.split(" |")[0] for line in out.stdout.splitlines() if line.startswith(("| generate", "| lean"))] == [
        f"| {call}, {n} rows" for n in (32, 64, 128) for call in ("generate()", "lean loop")] + [
        f"| lean loop alone, {how}, {n} rows" for n in (64, 128)
        for how in ("each prompt's prefill once", "every row's prefill")]


@pytest.mark.slow
def test_step_flops_times_and_counts_every_part_a_ppo_step_runs(tmp_path):
    """benchmarks/step_flops.py wraps rlhflab's own step parts by name; a renamed part would time nothing, a part run
    twice (the final evaluation's) would be counted into the last step. On the tiny model, 3 steps: LoRA-PPO runs the
    reference's forward and two trunk passes in its update, J-Hydra-PPO reads the reference from the scoring forward
    and runs one trunk pass for policy and critic, so it counts about half LoRA-PPO's update FLOPs and none for the
    reference."""
    data = tmp_path / "out.json"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_flops.py"), "--model", "tiny", "--steps", "3",
                          "--sides", "lora16,joint16", "--out", str(tmp_path / "out.md")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**__import__("os").environ, "RLHFLAB_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    work = Path(re.search(r"^work directory: (\S+)", out.stdout, re.M).group(1))
    assert not work.exists(), f"{work} left behind"
    results = json.loads(data.read_text())["results"]
    lora, joint = results["lora16"], results["joint16"]
    assert lora["samples"] == joint["samples"] == [32, 32, 32]
    for r, parts in ((lora, ["generate", "reward scores", "reference log-probs"]), (joint, ["generate", "reward scores"])):
        parts += ["update: first forward", "update: the rest (forwards, backward, step)"]
        assert [p for p in parts if r["flops"].get(p, 0) <= 0 or r["times"].get(p, [0])[0] <= 0] == [], r
    assert joint["flops"].get("reference log-probs", 0) < 0.05 * lora["flops"]["reference log-probs"]
    # the generation, the scoring forward and (the final evaluation left out) the reference's: the same rows' forward
    assert lora["flops"]["reference log-probs"] == pytest.approx(lora["flops"]["reward scores"], rel=0.05)
    for part in ("update: first forward", "update: the rest (forwards, backward, step)"):
        assert joint["flops"][part] == pytest.approx(lora["flops"][part] / 2, rel=0.1)
    assert "| J-Hydra-PPO, 16 prompts |" in (tmp_path / "out.md").read_text()


def test_attention_train_compares_bf16_sdpa_and_eager_attention_and_the_two_model_attentions(tmp_path):
    """benchmarks/attention_train.py: both tables, on a tiny model; table 1's ratio is its two times', and each
    product's and query gradient's error a bf16 rounding's; the model table names transformers' sdpa and rlhflab's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sft = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4)).save_pretrained(sft)
    out_md = tmp_path / "attention.md"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_train.py"), "--lengths", "8,16",
                          "--tokens", "32", "--rows", "2", "--length", "12", "--rounds", "1", "--sft", str(sft),
                          "--out", str(out_md)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    table = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith(("| 8 ", "| 16 "))]
    assert [row[1] for row in table] == ["4", "2"]  # rows = tokens / keys
    for row in table:
        bf16_ms, ours_ms, ratio = float(row[2]), float(row[3]), float(row[4].rstrip("x"))
        assert (bf16_ms - 0.05) / (ours_ms + 0.05) - 0.005 <= ratio <= (bf16_ms + 0.05) / (ours_ms - 0.05) + 0.005
        errors = [float(x) for x in (*row[6:9], row[9].rstrip(" |"))]  # bf16 products: a rounding's, not 0, not more
        assert len(errors) == 4 and all(1e-5 < e < 5e-2 for e in errors), row
    models = [line for line in out.stdout.splitlines() if line.startswith("| sdpa")]
    assert [m.split(" (")[0] for m in models] == ["| sdpa", "| sdpa_trains_eager"], out.stdout
    assert out_md.read_text().count("forward and backward") == 2
    assert "AMX tiles: " in out_md.read_text()  # which CPU it ran on: the bf16 choices were measured on AMX first
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_train.py"), "--lengths", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--lengths '2': each at least 4" in bad.stderr


def test_autocast_generation_times_the_generators_two_cpu_bf16_options_each_turned_off(tmp_path):
    """benchmarks/autocast_generation.py --options: rlhflab's generator as it runs, and with generator.prepack=false
    and generator.autocast_cache=false, each drawing from the same seeds (the options change how the
    products run, not what is sampled: the same tokens); --out names the CPU, for the options were measured on an AMX
    CPU first."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhflab.tasks.sentiment import SentimentTask

    words = SentimentTask().build_tokenizer()
    sft = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, pad_token_id=words.pad_token_id,
                                 eos_token_id=words.eos_token_id)).save_pretrained(sft)
    words.save_pretrained(sft)
    out_md = tmp_path / "gen.md"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "autocast_generation.py"), "--sft", str(sft),
                          "--rows", "4", "--max-new-tokens", "6", "--calls", "1", "--options", "--out", str(out_md)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = [line.split(" | ")[0][2:] for line in out.stdout.splitlines() if line.startswith("| bf16, cache off, rlhflab")]
    assert rows == ["bf16, cache off, rlhflab's generator", "bf16, cache off, rlhflab's generator, generator.prepack=false",
                          "bf16, cache off, rlhflab's generator, generator.autocast_cache=false"], out.stdout
    for option in ("prepack", "autocast_cache"):  # the same tokens from the same seeds: the same numbers, computed otherwise
        assert f"generator.{option}=false: the same tokens as the generator as it runs in 1 of 1 calls" in out.stdout
    text = out_md.read_text()
    assert "AMX tiles: " in text and "generator.prepack=false" in text and "--options" in text


def test_logprob_forward_times_each_saving_against_the_same_numbers(tmp_path):
    """benchmarks/logprob_forward.py on the tiny setting, 2 pairs: a row per saving (read_before, padded_keys) with
    grad and without, each side's log-probs within 1e-5 of the other's, so each saving is timed against the same
    numbers computed another way."""
    out = tmp_path / "out.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "logprob_forward.py"), "--settings", "tiny",
                           "--pairs", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| tiny |")]
    assert [(r[1], r[2]) for r in rows] == [(s, g) for s in ("read_before", "padded_keys")
                                           for g in ("forward + backward", "forward, no grad")]
    assert all(float(r[6]) < 1e-5 and float(r[7].rstrip(" |")) < 1e-5 for r in rows), rows
