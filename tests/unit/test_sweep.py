"""``megatron-rl sweep``: method presets from the paper configs, the run plan, the
comparison's numbers (``observability/comparison.py``) on hand-written runs, the local
launcher's runs at a time (a stand-in ``train`` that sleeps), and the Slurm launcher
against a stand-in Slurm (sbatch, scontrol, sacct, scancel on PATH)."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import yaml
from scipy import stats as scipy_stats

from megatron_rl.cli import main
from megatron_rl.cli.sweep import expected_methods, method_preset, parse_method, plan_runs
from megatron_rl.config.lib import ConfigError
from megatron_rl.observability.comparison import RunLabel, Stat, aggregate, summarize_run, write_comparison

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "examples" / "kk_logic"
REGISTERED = ["ar", "lopti", "stapo", "tr_grpo"]


def test_presets_are_what_each_paper_config_changes_from_grpo():
    assert method_preset("grpo", PAPER) == {}
    assert method_preset("ar", PAPER) == {"algorithm.ar.alpha": 0.2}
    assert method_preset("ar_lopti", PAPER) == {
        "algorithm.ar.alpha": 0.3, "algorithm.lopti.enabled": True, "algorithm.lopti.eta": 0.5,
        "algorithm.lopti.denominator": "all",
    }  # fmt: skip
    stapo = method_preset("stapo", PAPER)
    assert stapo["algorithm.eps_high"] == 0.28 and stapo["algorithm.kl_coef"] == 0.0
    assert stapo["algorithm.stapo.tau_p"] == 0.002 and "algorithm.eps_low" not in stapo
    # every preset value is the one its paper config holds (read independently here)
    for method in ("ar", "lopti", "ar_lopti", "stapo", "tr_grpo"):
        algo = yaml.safe_load((PAPER / f"{method}_3b.yaml").read_text())["algorithm"]
        for key, value in method_preset(method, PAPER).items():
            node = algo
            for part in key.split(".")[1:]:
                node = node[part]
            assert node == value, (method, key)


def test_method_names_join_registered_methods():
    assert expected_methods("grpo", REGISTERED) == set()
    assert expected_methods("ar_lopti", REGISTERED) == {"ar", "lopti"}
    assert expected_methods("tr_grpo", REGISTERED) == {"tr_grpo"}
    for bad in ("dapo", "ar_", "ar__lopti", "lopti_grpo"):
        with pytest.raises(ConfigError, match="--methods"):
            expected_methods(bad, REGISTERED)


def _args(tmp_path, *overrides, methods="grpo,ar_lopti,stapo", seeds=2):
    return argparse.Namespace(
        config=str(ROOT / "examples" / "tiny_cpu.yaml"), overrides=list(overrides), methods=methods, seeds=seeds,
        out=str(tmp_path / "sweep"), threshold_key="eval/accuracy/mean", threshold=0.9, threshold_window=1,
        tail_fraction=0.1, methods_dir=str(PAPER), dry_run=True, launcher="local", jobs=1, sbatch_args="", sbatch_script=None, poll_s=30.0,
    )  # fmt: skip


def test_plan_orders_preset_then_user_overrides_then_the_run(tmp_path):
    from megatron_rl.config.run import load_run_config

    out, runs, base = plan_runs(_args(tmp_path, "trainer.num_steps=7", "algorithm.eps_high=0.3"))
    assert out == tmp_path / "sweep" and base.trainer.num_steps == 7
    assert [(m, s) for m, s, _ in runs] == [(m, 1234 + i) for m in ("grpo", "ar_lopti", "stapo") for i in range(2)]
    method, seed, overrides = runs[-1]
    cfg = load_run_config(ROOT / "examples" / "tiny_cpu.yaml", overrides)
    assert cfg.algorithm.stapo.enabled and cfg.algorithm.eps_high == 0.3  # the user's override wins
    assert cfg.trainer.seed == 1235 and cfg.run_dir == tmp_path / "sweep" / "stapo" / "seed1235"


def test_a_variant_adds_its_algorithm_fields_to_the_preset_under_its_own_label(tmp_path):
    from megatron_rl.config.run import load_run_config

    label = "tr_grpo:tr_grpo.placement=loss:eps_high=0.3"
    assert parse_method(label) == ("tr_grpo", ["algorithm.tr_grpo.placement=loss", "algorithm.eps_high=0.3"])
    out, runs, _ = plan_runs(_args(tmp_path, "algorithm.tr_grpo.tau=2.0", methods=f"tr_grpo,{label}", seeds=1))
    assert [m for m, _, _ in runs] == ["tr_grpo", label]
    plain, variant = (load_run_config(ROOT / "examples" / "tiny_cpu.yaml", o) for _, _, o in runs)
    assert (plain.algorithm.tr_grpo.placement, variant.algorithm.tr_grpo.placement) == ("ratio", "loss")
    assert variant.algorithm.eps_high == 0.3 and variant.algorithm.tr_grpo.tau == plain.algorithm.tr_grpo.tau == 2.0
    assert variant.algorithm.tr_grpo.mu == plain.algorithm.tr_grpo.mu  # the rest of the preset
    assert variant.run_dir == out / label / "seed1234"
    for bad, match in (("tr_grpo:placement", "not FIELD=VALUE"), (":eps_high=0.3", "names no method"),
                       ("tr_grpo:tr_grpo.placment=loss", "placment"), ("tr_grpo:tr_grpo.enabled=false", "tr_grpo")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            plan_runs(_args(tmp_path, methods=bad, seeds=1))


def test_an_override_that_disables_a_method_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="ar_lopti"):
        plan_runs(_args(tmp_path, "algorithm.lopti.enabled=false"))
    with pytest.raises(ConfigError, match="no paper config"):
        plan_runs(_args(tmp_path, methods="grpo,tr_grpo_ar"))


def test_cli_dry_run_and_usage_errors(tmp_path, capsys):
    cfg = str(ROOT / "examples" / "tiny_cpu.yaml")
    assert main(["sweep", cfg, "--methods", "grpo,ar", "--seeds", "1", "--out", str(tmp_path), "--dry-run"]) == 0
    assert "algorithm.ar.alpha=0.2" in capsys.readouterr().out
    assert main(["sweep", cfg, "--methods", "grpo,nope", "--dry-run"]) == 2
    assert main(["sweep", cfg, "--seeds", "0", "--dry-run"]) == 2
    assert main(["sweep", cfg, "--jobs", "0", "--dry-run"]) == 2
    assert main(["sweep", cfg, "--threshold-window", "0", "--dry-run"]) == 2
    assert main(["sweep", cfg, "--tail-fraction", "0", "--dry-run"]) == 2
    assert "'--tail-fraction': must be in (0, 1]" in capsys.readouterr().err
    assert main(["sweep", cfg, "--jobs", "2", "--launcher", "slurm", "--dry-run"]) == 2
    assert "'--jobs': applies to --launcher local" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def _write_run(run_dir: Path, rows: list[dict]) -> RunLabel:
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i, row in enumerate(rows, 1):
            f.write(json.dumps({"step": i, "time": 100.0 + 2 * i, **row}) + "\n")
    return RunLabel(method=run_dir.parent.name, seed=int(run_dir.name[4:]), run_dir=str(run_dir))


def _rows(acc_at: dict[int, float], n=10, share=0.5, ent=1.0):
    rows = []
    for step in range(1, n + 1):
        row = {"rollout/reward/mean": step / n, "loss/entropy": ent * (n - step + 1),
               "tokens/logit_grad_norm_sum": 0.0 if step == 1 else 1.0,
               "tokens/quartile_q1/grad_share": 0.0 if step == 1 else share}  # fmt: skip
        if step in acc_at:
            row["eval/accuracy/mean"] = acc_at[step]
        rows.append(row)
    return rows


def test_summaries_and_standard_errors(tmp_path):
    a1 = _write_run(tmp_path / "grpo" / "seed1", _rows({5: 0.5, 10: 0.8}, share=0.6))
    a2 = _write_run(tmp_path / "grpo" / "seed2", _rows({5: 0.95, 10: 1.0}, share=0.4))
    b1 = _write_run(tmp_path / "ar" / "seed1", _rows({5: 0.2, 10: 0.4}))
    s = summarize_run(a2, threshold=0.9)
    assert (s.final_accuracy, s.steps_to_threshold, s.last_step, s.wall_s) == (1.0, 5, 10, 18.0)
    assert s.final_reward == 1.0 and s.final_entropy == 1.0  # the last 10% of 10 steps: step 10
    assert s.low_quartile_grad_share == pytest.approx(0.4)  # step 1 had no gradient: left out
    assert summarize_run(a1, threshold=0.9).steps_to_threshold is None
    grpo, ar = aggregate([summarize_run(x, threshold=0.9) for x in (a1, a2, b1)])
    assert grpo.method == "grpo" and grpo.seeds == [1, 2] and ar.seeds == [1]
    assert grpo.final_accuracy.mean == pytest.approx(0.9)
    assert grpo.final_accuracy.se == pytest.approx(statistics.stdev([0.8, 1.0]) / math.sqrt(2))
    assert (grpo.steps_to_threshold.mean, grpo.num_reached) == (5, 1)
    assert ar.final_accuracy.se is None and ar.final_accuracy.text() == "0.400"
    assert Stat.of([None]).text() == "n/a"

    paths = write_comparison(tmp_path / "out", [a1, a2, b1], threshold=0.9)
    assert [p.name for p in paths] == ["comparison.md", "comparison.json", "comparison.png"]
    md = paths[0].read_text()
    assert "| grpo | 2 | 0.900 ± 0.100 | 5 (1/2) |" in md and "| ar | 1 | 0.400 | - (0/1) |" in md
    payload = json.loads(paths[1].read_text())
    assert payload["methods"][0]["final_accuracy"]["values"] == [0.8, 1.0]
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_study_that_evaluates_once_plots_each_methods_final_accuracies(tmp_path, monkeypatch):
    """One evaluation per run (at the end): a curve of one point draws nothing, so the
    accuracy panel shows each seed's final greedy and sampled accuracy per method."""
    import megatron_rl.observability.comparison as comparison

    labels = []
    for method, accs in (("grpo", (0.3, 0.33)), ("lopti", (0.22, 0.3))):
        for seed, acc in enumerate(accs, 1):
            rows = _rows({10: acc})
            rows[-1]["eval/accuracy/mean/sampled"] = acc / 3
            labels.append(_write_run(tmp_path / method / f"seed{seed}", rows))
    per_seed = [[json.loads(line) for line in open(Path(lb.run_dir) / "metrics.jsonl")] for lb in labels[2:]]
    assert comparison.final_accuracies(per_seed, "eval/accuracy/mean") == [0.22, 0.3]
    assert comparison.final_accuracies(per_seed, "eval/accuracy/mean/sampled") == pytest.approx([0.22 / 3, 0.1])
    assert comparison.plot_comparison(labels, tmp_path / "drawn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = []  # which runs the final-accuracy panel gets, from here on
    monkeypatch.setattr(comparison, "_plot_final_accuracies", lambda ax, runs: drawn.append(list(runs)))
    path = comparison.plot_comparison(labels, tmp_path / "one_eval.png")
    assert drawn == [["grpo", "lopti"]] and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    two_evals = _write_run(tmp_path / "ar" / "seed1", _rows({5: 0.1, 10: 0.2}))  # curves up to 2 evals too
    comparison.plot_comparison([two_evals], tmp_path / "two.png")
    assert len(drawn) == 2
    many = _write_run(tmp_path / "ar" / "seed2", _rows({3: 0.1, 6: 0.2, 9: 0.3}))
    comparison.plot_comparison([many], tmp_path / "curves.png")
    assert len(drawn) == 2  # three evaluations: curves


def _quartile_rows(acc: float, reward: float, q1_p: float, n=4):
    rows = _rows({n: acc}, n=n)
    for step, row in enumerate(rows, 1):
        row["rollout/reward/mean"] = reward
        for k in range(1, 5):  # q1's mean p as given, rising by quartile; the shares from step 2 on
            row[f"tokens/quartile_q{k}/mean_p"] = q1_p * k + step / 100
            row[f"tokens/quartile_q{k}/grad_share"] = 0.0 if step == 1 else 0.1 * k
    return rows


def test_the_start_of_rl_and_welchs_test_against_grpo(tmp_path):
    grpo_acc, ar_acc = [0.30, 0.34, 0.29], [0.41, 0.45, 0.40]
    labels = [
        _write_run(tmp_path / "grpo" / f"seed{i}", _quartile_rows(a, 0.5 + i / 100, 0.2))
        for i, a in enumerate(grpo_acc)
    ]
    labels += [
        _write_run(tmp_path / "ar" / f"seed{i}", _quartile_rows(a, 0.5 + i / 10, 0.3)) for i, a in enumerate(ar_acc)
    ]
    runs = [summarize_run(lb) for lb in labels]
    assert runs[0].start_quartile_mean_p == pytest.approx([0.21, 0.41, 0.61, 0.81])  # step 1
    assert runs[0].start_quartile_grad_share == pytest.approx([0.1, 0.2, 0.3, 0.4])  # step 2: step 1 had none
    grpo, ar = aggregate(runs, baseline="grpo")
    assert ar.start_q1_mean_p.mean == pytest.approx(0.31) and ar.start_q1_grad_share.mean == pytest.approx(0.1)
    # Welch's t from its definition: t = (mean_a - mean_b) / sqrt(va/na + vb/nb), Welch-Satterthwaite df.
    va, vb = statistics.variance(ar_acc) / 3, statistics.variance(grpo_acc) / 3
    t = (statistics.fmean(ar_acc) - statistics.fmean(grpo_acc)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    assert (
        ar.accuracy_p_value == pytest.approx(2 * scipy_stats.t.sf(abs(t), df), rel=1e-9) and ar.accuracy_p_value < 0.01
    )
    assert grpo.accuracy_p_value is None and grpo.reward_p_value is None  # the baseline itself
    assert ar.reward_p_value is not None and ar.reward_p_value > 0.05  # 0.5, 0.6, 0.7 vs 0.5, 0.51, 0.52
    md = write_comparison(tmp_path / "out", labels, baseline="grpo")[0].read_text()
    assert (
        f"| {ar.accuracy_p_value:.3f} / {ar.reward_p_value:.3f} |" in md and "| 0.310 ± 0.000 | 0.100 ± 0.000 |" in md
    )
    # No baseline among the methods, or one seed: no test.
    assert aggregate(runs[3:], baseline="grpo")[0].accuracy_p_value is None
    assert aggregate([runs[0], runs[3]], baseline="grpo")[1].accuracy_p_value is None
    assert (
        aggregate(runs)[1].accuracy_p_value is None
        and "p vs" not in write_comparison(tmp_path / "x", labels)[0].read_text()
    )


def test_differences_from_grpo_are_paired_by_seed(tmp_path):
    # seed 3 of ar has no grpo partner and grpo's seed 4 no ar one: both left out of the pairs
    grpo = {1: 0.30, 2: 0.40, 4: 0.90}
    ar = {1: 0.33, 2: 0.41, 3: 0.10}
    labels = [_write_run(tmp_path / m / f"seed{s}", _rows({10: a})) for m, accs in (("grpo", grpo), ("ar", ar))
              for s, a in accs.items()]  # fmt: skip
    base, other = aggregate([summarize_run(lb) for lb in labels], baseline="grpo")
    d = [0.33 - 0.30, 0.41 - 0.40]
    t = statistics.fmean(d) / (statistics.stdev(d) / math.sqrt(2))  # the paired t from its definition
    assert other.accuracy_delta.delta.values == pytest.approx(d)
    assert other.accuracy_delta.delta.se == pytest.approx(statistics.stdev(d) / math.sqrt(2))
    assert other.accuracy_delta.p_value == pytest.approx(2 * scipy_stats.t.sf(abs(t), 1), rel=1e-9)
    assert other.accuracy_delta.p_value == pytest.approx(scipy_stats.ttest_rel([0.33, 0.41], [0.30, 0.40]).pvalue)
    assert base.accuracy_delta is None  # the baseline itself
    assert other.sampled_accuracy_delta.delta.mean is None  # nothing logged
    md = write_comparison(tmp_path / "out", labels, baseline="grpo")[0].read_text()
    assert "| accuracy - grpo, paired by seed |" in md and "sampled accuracy - grpo" not in md
    assert f"| {other.accuracy_delta.delta.mean:+.3f} ± {other.accuracy_delta.delta.se:.3f} (p " in md
    # equal differences (up to rounding): nothing to test
    same = aggregate([summarize_run(lb) for lb in labels[:2]] + [
        summarize_run(_write_run(tmp_path / "lopti" / f"seed{s}", _rows({10: a + 0.11}))) for s, a in ((1, 0.30), (2, 0.40))
    ], baseline="grpo")[1]  # fmt: skip
    assert same.accuracy_delta.delta.mean == pytest.approx(0.11) and same.accuracy_delta.p_value is None


def test_a_smoothed_threshold_the_tail_and_the_sampled_accuracy(tmp_path):
    rewards = [0.1, 0.95, 0.2, 0.9, 0.95, 0.97]  # one lucky step 2, then a sustained rise from step 4
    rows = [{"rollout/reward/mean": r, "loss/entropy": float(i)} for i, r in enumerate(rewards, 1)]
    rows[-1] |= {"eval/accuracy/mean": 0.5, "eval/accuracy/mean/sampled": 0.25}
    run = _write_run(tmp_path / "grpo" / "seed1", rows)
    key = "rollout/reward/mean"
    assert summarize_run(run, threshold_key=key, threshold=0.9).steps_to_threshold == 2
    # window 3: step 6 is the first whose last three values average >= 0.9 (0.94; step 5's: 0.683)
    assert summarize_run(run, threshold_key=key, threshold=0.9, threshold_window=3).steps_to_threshold == 6
    assert summarize_run(run, threshold_key=key, threshold=0.9, threshold_window=7).steps_to_threshold is None
    with pytest.raises(ValueError, match="threshold_window"):
        summarize_run(run, threshold_window=0)
    half = summarize_run(run, tail_fraction=0.5)  # the last 3 of 6 steps
    assert half.final_reward == pytest.approx(statistics.fmean(rewards[3:])) and half.final_entropy == 5.0
    assert (half.final_accuracy, half.final_sampled_accuracy) == (0.5, 0.25)

    # With a baseline: the sampled accuracy gets a column and a Welch p-value of its own.
    grpo_sampled, ar_sampled = [0.10, 0.12, 0.11], [0.20, 0.23, 0.21]
    labels = []
    for method, sampled in (("grpo", grpo_sampled), ("ar", ar_sampled)):
        for i, a in enumerate(sampled):
            rows = _rows({10: 0.3 + i / 100})
            rows[-1]["eval/accuracy/mean/sampled"] = a
            labels.append(_write_run(tmp_path / "cmp" / method / f"seed{i}", rows))
    grpo, ar = aggregate([summarize_run(lb) for lb in labels], baseline="grpo")
    want = scipy_stats.ttest_ind(ar_sampled, grpo_sampled, equal_var=False).pvalue
    assert ar.sampled_accuracy_p_value == pytest.approx(want) and grpo.sampled_accuracy_p_value is None
    assert ar.accuracy_p_value == 1.0 and ar.reward_p_value is None  # the same greedy values; rewards constant
    md = write_comparison(tmp_path / "out", labels, baseline="grpo", threshold_window=2)[0].read_text()
    assert "| final accuracy | final sampled accuracy | steps to eval/accuracy/mean (mean of 2 values) >= 0.9" in md
    assert f"| ar | 3 | 0.310 ± 0.006 | {ar.final_sampled_accuracy.text()} |" in md
    assert f"| 1.000 / {want:.3f} / - |" in md  # p vs grpo (accuracy / sampled / reward)


# --------------------------------------------------------------------------- --launcher slurm
# A stand-in Slurm on PATH: `sbatch` starts the job script in the background (its output
# in the --output file, its exit code recorded when it ends), `scontrol show job -o ID`
# reports PENDING (first poll), RUNNING, then COMPLETED/FAILED with the exit code,
# `scancel` kills the job and marks it CANCELLED, `sacct` answers only when accounting is
# on. The job script stands in for train.sbatch: it writes a run's metrics.jsonl where
# the overrides say, or fails as the test tells it to.

FAKE_SBATCH = """\
import json, os, pathlib, subprocess, sys
d = pathlib.Path(os.environ["FAKE_SLURM"])
argv = sys.argv[1:]
with open(d / "sbatch_calls.jsonl", "a") as f:
    f.write(json.dumps(argv) + "\\n")
i, opts = 0, {}
while argv[i].startswith("-"):
    k, _, v = argv[i].partition("=")
    opts[k] = v
    i += 1
n = len(list(d.glob("*.job")))
job = str(7001 + n)
rc = d / (job + ".rc")
with open(opts["--output"].replace("%j", job), "w") as f:
    p = subprocess.Popen(["sh", "-c", '"$0" "$@"; echo $? > "$RC.tmp"; mv "$RC.tmp" "$RC"', *argv[i:]],
                         stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "RC": str(rc)}, start_new_session=True)
(d / (job + ".job")).write_text(json.dumps({"pid": p.pid, "name": opts.get("--job-name")}))
print(job + (";cluster1" if n == 0 else ""))
"""

FAKE_SCONTROL = """\
import os, pathlib, sys
d = pathlib.Path(os.environ["FAKE_SLURM"])
job = sys.argv[-1]
down = d / "down_polls"
if down.exists() and int(down.read_text()) > 0:
    down.write_text(str(int(down.read_text()) - 1))
    sys.exit("slurm_load_jobs error: Unable to contact slurm controller (connect failure)")
rc, polls = d / (job + ".rc"), d / (job + ".polls")
ended = rc.exists() or (d / (job + ".cancelled")).exists()
if not (d / (job + ".job")).exists() or (ended and os.environ.get("FAKE_PURGE") == "1"):
    sys.exit("slurm_load_jobs error: Invalid job id specified")
n = int(polls.read_text()) if polls.exists() else 0
polls.write_text(str(n + 1))
if (d / (job + ".cancelled")).exists():
    state, code = "CANCELLED", "0:15"
elif rc.exists():
    state, code = ("COMPLETED" if rc.read_text().strip() == "0" else "FAILED"), rc.read_text().strip() + ":0"
else:
    state, code = ("PENDING" if n == 0 else "RUNNING"), "0:0"
print(f"JobId={job} JobName=x UserId=root(0) JobState={state} Reason=None ExitCode={code} RunTime=00:00:01")
"""

FAKE_SACCT = """\
import os, pathlib, sys
d = pathlib.Path(os.environ["FAKE_SLURM"])
if os.environ.get("FAKE_SACCT") != "1":
    sys.exit("sacct: error: Slurm accounting storage is disabled")
job = sys.argv[sys.argv.index("-j") + 1]
code = (d / (job + ".rc")).read_text().strip()
print(("COMPLETED" if code == "0" else "FAILED") + "|" + code + ":0")
"""

FAKE_SCANCEL = """\
import json, os, pathlib, signal, sys
d = pathlib.Path(os.environ["FAKE_SLURM"])
with open(d / "scancel_calls.jsonl", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
for job in sys.argv[1:]:
    (d / (job + ".cancelled")).write_text("")
    try:
        os.killpg(json.loads((d / (job + ".job")).read_text())["pid"], signal.SIGTERM)
    except ProcessLookupError:
        pass
"""

FAKE_JOB = """\
import json, os, pathlib, sys, time
config, overrides = sys.argv[1], dict(x.split("=", 1) for x in sys.argv[2:])
method = pathlib.Path(overrides["trainer.output_dir"]).name
told = json.loads(os.environ.get("FAKE_BEHAVIOUR", "{}")).get(method, {})
print("job script:", config, json.dumps(sys.argv[2:]), flush=True)
time.sleep(told.get("sleep", 0))
if told.get("exit"):
    sys.exit(told["exit"])
run_dir = pathlib.Path(overrides["trainer.output_dir"]) / overrides["logging.run_name"]
run_dir.mkdir(parents=True, exist_ok=True)
n, seed = int(overrides["trainer.num_steps"]), int(overrides["trainer.seed"])
with open(run_dir / "metrics.jsonl", "w") as f:
    for step in range(1, n + 1):
        f.write(json.dumps({"step": step, "time": 1000.0 + step, "rollout/reward/mean": step / n,
                            "eval/accuracy/mean": min(1.0, step / n + (seed % 2) / 10), "loss/entropy": 1.0 / step,
                            "tokens/logit_grad_norm_sum": 1.0, "tokens/quartile_q1/grad_share": 0.5}) + "\\n")
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """The stand-in Slurm first on PATH; returns its state directory (and the job script)."""
    state, bin_dir = tmp_path / "slurm_state", tmp_path / "bin"
    state.mkdir()
    bin_dir.mkdir()
    for name, code in (("sbatch", FAKE_SBATCH), ("scontrol", FAKE_SCONTROL), ("sacct", FAKE_SACCT),
                       ("scancel", FAKE_SCANCEL), ("job.sh", FAKE_JOB)):  # fmt: skip
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{code}")
        path.chmod(0o755)
    monkeypatch.setenv("FAKE_SLURM", str(state))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for var in ("FAKE_BEHAVIOUR", "FAKE_PURGE", "FAKE_SACCT"):
        monkeypatch.delenv(var, raising=False)
    return state, bin_dir / "job.sh"


def _slurm_sweep(out, job_script, *extra):
    cfg = str(ROOT / "examples" / "tiny_cpu.yaml")
    return main(["sweep", cfg, "trainer.num_steps=4", "--methods", "grpo,ar", "--seeds", "2", "--out", str(out),
                 "--launcher", "slurm", "--sbatch-script", str(job_script), "--poll-s", "0.05", *extra])  # fmt: skip


def _calls(state, name):
    path = state / f"{name}_calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_slurm_launcher_submits_every_run_as_a_job(fake_slurm, tmp_path, monkeypatch, capsys):
    state, job_script = fake_slurm
    monkeypatch.setenv("FAKE_PURGE", "1")  # ended jobs vanish from scontrol, and no accounting
    (state / "down_polls").write_text("3")  # the controller does not answer the first polls
    out = tmp_path / "sweep"
    assert _slurm_sweep(out, job_script, "--sbatch-args=--nodes=1 --partition='cpu a'") == 0

    calls = _calls(state, "sbatch")
    assert len(calls) == 4
    for argv, (method, seed) in zip(calls, [(m, s) for m in ("grpo", "ar") for s in (1234, 1235)]):
        head = ["--parsable", f"--job-name=mrl-{method}-s{seed}", f"--output={out}/logs/{method}_seed{seed}-%j.log",
                "--nodes=1", "--partition=cpu a", str(job_script.resolve()), str(ROOT / "examples" / "tiny_cpu.yaml")]  # fmt: skip
        assert argv[: len(head)] == head
        overrides = argv[len(head) :]
        assert overrides[-3:] == [
            f"trainer.seed={seed}",
            f"trainer.output_dir={out / method}",
            f"logging.run_name=seed{seed}",
        ]
        assert ("algorithm.ar.alpha=0.2" in overrides) == (method == "ar") and "trainer.num_steps=4" in overrides
    # every job ran (the logs carry the job ids, the first "ID;cluster" included) and was seen to end
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert logs == ["ar_seed1234-7003.log", "ar_seed1235-7004.log", "grpo_seed1234-7001.log", "grpo_seed1235-7002.log"]
    assert "job script:" in (out / "logs" / "grpo_seed1234-7001.log").read_text()
    err = capsys.readouterr().err
    assert err.count(": COMPLETED, exit 0") == 4, err
    table = (out / "comparison.md").read_text()
    assert "| grpo | 2 |" in table and "| ar | 2 |" in table and "Failed" not in table
    # a second sweep submits nothing: every run is complete
    assert _slurm_sweep(out, job_script) == 0
    assert len(_calls(state, "sbatch")) == 4 and capsys.readouterr().err.count("complete, kept") == 4


def test_slurm_failed_job_is_reported_and_the_rest_compared(fake_slurm, tmp_path, monkeypatch, capsys):
    state, job_script = fake_slurm
    monkeypatch.setenv("FAKE_BEHAVIOUR", json.dumps({"ar": {"exit": 3}}))
    monkeypatch.setenv("FAKE_PURGE", "1")
    monkeypatch.setenv("FAKE_SACCT", "1")  # purged jobs are found in the accounting
    out = tmp_path / "sweep"
    assert _slurm_sweep(out, job_script) == 1
    table = (out / "comparison.md").read_text()
    assert "| grpo | 2 |" in table and "| ar |" not in table
    assert "Failed: ar seed 1234 (job 7003 FAILED, exit 3" in table and "ar seed 1235 (job 7004 FAILED" in table
    assert "error: failed runs" in capsys.readouterr().err


def test_slurm_refused_run_cancels_the_other_jobs(fake_slurm, tmp_path, monkeypatch):
    state, job_script = fake_slurm
    monkeypatch.setenv("FAKE_BEHAVIOUR", json.dumps({"grpo": {"exit": 2}, "ar": {"sleep": 60}}))
    out = tmp_path / "sweep"
    start = time.monotonic()
    assert _slurm_sweep(out, job_script) == 2
    assert time.monotonic() - start < 30  # did not wait for the sleeping jobs
    cancelled = [job for call in _calls(state, "scancel") for job in call]
    # both grpo jobs fail: the sweep stops at whichever it sees first and cancels the
    # other unless it has ended too; the ar jobs are always cancelled
    assert sorted(cancelled) in (["7001", "7003", "7004"], ["7002", "7003", "7004"], ["7003", "7004"])
    for job in ("7003", "7004"):  # the ar jobs were killed, not left sleeping
        pid = json.loads((state / f"{job}.job").read_text())["pid"]
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), job
    assert not (out / "comparison.md").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    )


TIMED_JOB = "import time\nstarted = time.time()\n" + FAKE_JOB + """\
with open(os.environ["FAKE_TIMES"], "a") as f:
    f.write(json.dumps([started, time.time(), method]) + "\\n")
"""
"""FAKE_JOB as a local run (``python TIMED_JOB CONFIG OVERRIDES``) that also appends
``[start, end, method]`` of each run it finishes to ``$FAKE_TIMES``."""


def _local_sweep(tmp_path, monkeypatch, jobs: int, behaviour: dict) -> tuple[int, list]:
    from megatron_rl.cli import sweep

    script, times = tmp_path / "job.py", tmp_path / "times.jsonl"
    script.write_text(TIMED_JOB)
    monkeypatch.setenv("FAKE_TIMES", str(times))
    monkeypatch.setenv("FAKE_BEHAVIOUR", json.dumps(behaviour))
    monkeypatch.setattr(sweep, "_command", lambda args, out, method, seed, overrides: [
        sys.executable, str(script), args.config, *overrides])  # fmt: skip
    code = main(["sweep", str(ROOT / "examples" / "tiny_cpu.yaml"), "trainer.num_steps=4", "--methods", "grpo,ar",
                 "--seeds", "2", "--out", str(tmp_path / "sweep"), "--jobs", str(jobs)])  # fmt: skip
    spans = [json.loads(line) for line in times.read_text().splitlines()] if times.exists() else []
    return code, spans


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_local_launcher_runs_jobs_at_a_time(jobs, tmp_path, monkeypatch, capsys):
    code, spans = _local_sweep(tmp_path, monkeypatch, jobs, {"grpo": {"sleep": 0.6}, "ar": {"sleep": 0.6}})
    assert code == 0 and len(spans) == 4
    # the most runs alive at once (counted at each run's start) is what --jobs allows
    assert max(sum(s <= start < e for s, e, _ in spans) for start, _, _ in spans) == jobs, spans
    table = (tmp_path / "sweep" / "comparison.md").read_text()
    assert "| grpo | 2 |" in table and "| ar | 2 |" in table
    assert capsys.readouterr().err.count(": exit 0 after") == 4


def test_a_refused_local_run_starts_no_further_run(tmp_path, monkeypatch, capsys):
    """Plan order is grpo x 2 seeds, then ar: both grpo runs (running together) are refused,
    so no ar run starts and the sweep exits 2."""
    code, spans = _local_sweep(tmp_path, monkeypatch, 2, {"grpo": {"exit": 2}})
    assert code == 2 and spans == []
    assert not (tmp_path / "sweep" / "ar").exists()
    assert "grpo seed 1234 was refused" in capsys.readouterr().err


def test_slurm_launcher_usage_errors(fake_slurm, tmp_path, monkeypatch, capsys):
    state, job_script = fake_slurm
    out = tmp_path / "sweep"
    assert _slurm_sweep(out, job_script, "--dry-run") == 0
    printed = capsys.readouterr().out
    assert printed.count("sbatch --parsable") == 4 and f"--output={out}/logs/ar_seed1235-%j.log" in printed
    assert _slurm_sweep(out, tmp_path / "no_such.sbatch") == 2
    assert _slurm_sweep(out, job_script, "--poll-s", "0") == 2
    assert _slurm_sweep(out, job_script, "--sbatch-args=--comment='open") == 2
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert _slurm_sweep(out, job_script) == 2
    assert "slurm needs 'sbatch' on PATH" in capsys.readouterr().err
    assert not out.exists() and _calls(state, "sbatch") == []
