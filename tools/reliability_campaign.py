"""The reliability campaign (issues 17 and 34), run against the real command line on the tiny CPU demo.

    nice -n 10 python tools/reliability_campaign.py --out /tmp/campaign [--only inputs,rewards,...]

Categories (the issue's counts): 89 config mutations, 20 bad data files, 8 bad paths,
44 adversarial reward inputs, 8 ``kill -9`` at random moments (driver, actor worker,
engine worker, during a save), 12 corrupted checkpoints, 4 non-finite runs and one
all-failing reward, 3 inputs that would run code (``!!python`` tags, a crafted pickle in a
checkpoint), 26 bad conversions; and what a shared cluster does to a run
(``tools/cluster_campaign.py``: signals, a second launch, hung and killed ranks and engines,
full disks, stale Ray files, undeclared rewards). Each case is one JSON line in
``OUT/campaign.jsonl``; the end prints the table of docs/reliability.md.

Outcomes: ``handled`` (refused with the expected exit code naming the field/file/row and
no traceback, or survived as designed), ``crashed`` (a traceback, a hang, a wrong exit
code or message), ``accepted`` (a bad input that was not refused), ``lost`` (after a kill:
a step missing or logged twice); ``code_executed`` and ``orphans`` are counted apart.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl.observability import read_metrics  # noqa: E402
from megatron_rl.rewards import reward  # noqa: E402
from tests.helpers.checkpoints import CORRUPTIONS  # noqa: E402
from tests.helpers.runs import cmdline, descendants, logged_steps, wait_tree_gone  # noqa: E402

EXAMPLE = REPO / "examples" / "tiny_cpu.yaml"
TOY = REPO / "examples" / "data" / "toy"
BASE = [f"model.tokenizer={TOY / 'tokenizer'}", f"data.train_files=[{TOY / 'train.jsonl'}]",
        f"data.eval_files=[{TOY / 'test.jsonl'}]", "logging.wandb_mode=disabled", "trainer.eval_every_steps=0",
        "trainer.num_steps=2"]  # fmt: skip
ROW = {"prompt": "copy 1 2 3 =", "ground_truth": "1 2 3"}
LONG = "copy " + " ".join("1234567890" * 4) + " ="
RESULTS: list[dict] = []
LOG: Path | None = None
"""``OUT/campaign.jsonl``, appended to as each case ends (a stage that dies keeps what it did)."""


def record(category: str, case: str, outcome: str, **details) -> None:
    entry = {"category": category, "case": case, "outcome": outcome, **details}
    RESULTS.append(entry)
    print(json.dumps(entry), flush=True)
    if LOG is not None:
        with open(LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


CODE = REPO
"""The checkout whose ``megatron_rl`` the runs use (``--code``: e.g. an export of the old code)."""


def _env() -> dict[str, str]:
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(CODE), str(REPO / "tools"), os.environ.get("PYTHONPATH", "")])
    )


def run(args: list[str], *, timeout: float = 600, cwd: Path | None = None) -> tuple[int, str]:
    """``(exit code, stdout + stderr)`` of ``python -m megatron_rl ARGS`` (-9: timed out)."""
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl", *args], cwd=cwd or CODE, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, out
    return proc.returncode, out


def train_args(out: Path, *overrides: str, config: Path = EXAMPLE, dry_run: bool = False) -> list[str]:
    args = ["train", str(config), f"trainer.output_dir={out}", *BASE, *overrides]
    return args + (["--dry-run"] if dry_run else [])


def judge(code: int, out: str, needles: tuple[str, ...], *, expect: int = 2, no_ray: bool = True) -> str:
    if "Traceback" in out or code == -9:
        return "crashed"
    if code == 0 and expect != 0:
        return "accepted"
    # A case whose field no longer exists is refused as an unknown key: that proves nothing
    # about the value, so it counts against the campaign rather than for it.
    if code != expect or not all(n in out for n in needles) or (no_ray and "Ray" in out) or "unknown field" in out:
        return "crashed"
    return "handled"


def _case_dir(root: Path, name: str) -> Path:
    """A run directory of its own per case: a bad value that is accepted trains and leaves
    checkpoints, which must not turn the next case into a resume with other settings."""
    return root / "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:80]


# --------------------------------------------------------------------------- config, data, paths


def _float_fields() -> list[str]:
    import dataclasses
    import typing

    from megatron_rl.config.lib import iter_sections
    from megatron_rl.config.lib.schema import _type_hints
    from megatron_rl.config.run import RunConfig

    out = []
    for path, cls in iter_sections(RunConfig):
        hints = _type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] is float or float in typing.get_args(hints[f.name]):
                out.append(f"{path}.{f.name}".lstrip("."))
    return out


def _bomb(tmp: Path) -> Path:
    anchors = ["    a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    anchors += [f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    path = tmp / "bomb.yaml"
    path.write_text(
        EXAMPLE.read_text().replace("rollout:\n", "rollout:\n  engine_args:\n" + "\n".join(anchors) + "\n", 1)
    )
    return path


def config_cases(tmp: Path) -> list[tuple[str, list[str], tuple[str, ...], Path]]:
    """Every float field of the config at .inf and at .nan (31 fields today: 62 cases), 27
    absurd values, engines and rewards, and 2 bad config files (the issue's campaign had 89)."""
    cases = []
    for key in _float_fields():
        for value in (".inf", ".nan"):
            cases.append((f"{key}={value}", [f"{key}={value}"], (key, "finite"), EXAMPLE))
    absurd = [
        "rollout.temperature=1e-300", "data.reward_timeout_s=3e6", "data.num_reward_workers=100000",
        "rollout.num_engines=100000", f"parallel.num_actor_ranks={2**20}", f"trainer.seed={2**64}", "trainer.seed=-1",
        "rollout.max_new_tokens=100000000", "rollout.max_prompt_tokens=100000000",
        "rollout.num_prompts_per_step=1000000000", "rollout.num_samples_per_prompt=1000000",
        "rollout.weight_sync_bucket_mb=10000000", "model.tiny.hidden_size=10000000", "model.tiny.vocab_size=1000000000",
        "model.tiny.num_layers=100000", "trainer.max_tokens_per_microbatch=10000000000", "trainer.num_steps=1000000000000",
        "rollout.pool.restart_timeout_s=1e9", "rollout.pool.max_inflight_buckets=1000000",
        "model.fp8_amax_history_len=1000000000", "actor.logits_chunk_tokens=1000000000000",
        "rollout.engine=vllm", "rollout.engine_args={bogus: 1}", "rollout.engine_args={max_batch_rows: 0}",
        "rollout.engine=no_such_module_qq:Engine", "data.task=builtins:eval", "data.task=builtins:exec",
    ]  # fmt: skip
    for item in absurd:
        key = item.partition("=")[0]
        key = "rollout.engine_args" if key.startswith("rollout.engine_args") else key
        cases.append((item, [item], (key,), EXAMPLE))
    cases.append(("yaml_alias_bomb", [], ("bomb.yaml", "expands to more than"), _bomb(tmp)))
    cases.append(("config=/dev/zero", [], ("/dev/zero", "not a regular file"), Path("/dev/zero")))
    return cases


def _jsonl(path: Path, rows: list, raw: dict[int, bytes] | None = None) -> Path:
    lines = [json.dumps(r).encode() for r in rows]
    for row, data in (raw or {}).items():
        lines[row - 1] = data
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def data_cases(tmp: Path) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """24 bad data files, 2 that must pass the dry run (a UTF-8 byte-order mark, blank lines)
and duplicate ids, which must pass with a warning."""
    toy = [json.loads(line) for line in (TOY / "train.jsonl").read_text().splitlines()]
    long_row = [dict(r) for r in toy]
    long_row[399]["prompt"] = LONG
    (tmp / "dir.jsonl").mkdir(exist_ok=True)
    (tmp / "bad.parquet").write_bytes(b"PAR1 not really")
    (tmp / "blank.jsonl").write_text("\n  \n\n")

    def train(name: str, rows: list, raw=None) -> list[str]:
        return [f"data.train_files=[{_jsonl(tmp / name, rows, raw)}]"]

    return [
        ("empty_file", train("empty.jsonl", []), ("empty.jsonl", "no rows")),
        ("blank_lines_only", [f"data.train_files=[{tmp / 'blank.jsonl'}]"], ("blank.jsonl", "no rows")),
        (
            "non_utf8_row_3",
            train("latin.jsonl", [ROW] * 4, {3: b'{"prompt": "caf\xe9", "ground_truth": "1"}'}),
            ("row 3", "UTF-8"),
        ),
        ("invalid_json_row_5", train("json.jsonl", [ROW] * 6, {5: b'{"prompt": '}), ("row 5", "JSON")),
        ("row_not_an_object", train("list.jsonl", [ROW, [1, 2]]), ("row 2", "object")),
        ("missing_prompt", train("np.jsonl", [ROW, {"ground_truth": "1"}]), ("row 2", "prompt")),
        ("null_prompt", train("nullp.jsonl", [ROW, {"prompt": None, "ground_truth": "1"}]), ("row 2", "prompt")),
        ("prompt_not_a_string", train("int.jsonl", [ROW, {"prompt": 7, "ground_truth": "1"}]), ("row 2", "prompt")),
        ("blank_prompt", train("bp.jsonl", [ROW, {"prompt": "  ", "ground_truth": "1"}]), ("row 2", "prompt")),
        ("missing_ground_truth", train("ngt.jsonl", [ROW, {"prompt": "copy 1 ="}]), ("row 2", "ground_truth")),
        ("long_prompt_row_400", train("long.jsonl", long_row), ("row 400", "max_prompt_tokens")),
        (
            "long_prompt_in_eval",
            [f"data.eval_files=[{_jsonl(tmp / 'el.jsonl', [{**ROW, 'prompt': LONG}])}]"],
            ("el.jsonl", "max_prompt_tokens"),
        ),  # fmt: skip
        ("empty_eval_file", [f"data.eval_files=[{_jsonl(tmp / 'ee.jsonl', [])}]"], ("ee.jsonl", "no rows")),
        ("missing_train_file", [f"data.train_files=[{tmp / 'nope.jsonl'}]"], ("nope.jsonl", "no such file")),
        ("txt_extension", train("rows.txt", [ROW]), ("rows.txt", "unsupported")),
        ("directory_as_file", [f"data.train_files=[{tmp / 'dir.jsonl'}]"], ("dir.jsonl", "not a regular file")),
        ("corrupt_parquet", [f"data.train_files=[{tmp / 'bad.parquet'}]"], ("bad.parquet",)),
        ("no_train_files", ["data.train_files=[]"], ("data.train_files",)),
        (
            "non_utf8_in_eval",
            [f"data.eval_files=[{_jsonl(tmp / 'le.jsonl', [ROW] * 2, {2: bytes([0xFF, 0xFE]) + b'{}'})}]"],
            ("le.jsonl, row 2", "UTF-8"),
        ),  # fmt: skip
        ("nul_byte_row_2", train("nul.jsonl", [ROW] * 3, {2: b'{"prompt": "copy 1 =\x00", "ground_truth": "1"}'}),
         ("nul.jsonl", "row 2", "NUL")),
        ("nul_character_in_prompt", train("nulc.jsonl", [ROW, {"prompt": "copy 1\u0000 =", "ground_truth": "1"}]),
         ("nulc.jsonl", "row 2", "NUL")),
        ("nan_ground_truth_row_2", train("nan.jsonl", [ROW] * 2, {2: b'{"prompt": "copy 1 =", "ground_truth": NaN}'}),
         ("nan.jsonl", "row 2", "ground_truth")),
        ("infinite_ground_truth", train("inf.jsonl", [ROW, {"prompt": "copy 1 =", "ground_truth": [float("inf")]}]),
         ("inf.jsonl", "row 2", "ground_truth")),
        ("utf8_bom_is_dropped", train("bom.jsonl", [ROW] * 2, {1: b"\xef\xbb\xbf" + json.dumps(ROW).encode()}) + ["DRY"],
         ()),
        ("blank_lines_are_skipped", train("gaps.jsonl", [ROW, ROW], {1: json.dumps(ROW).encode() + b"\n\n  "}) + ["DRY"],
         ()),
        (
            "duplicate_ids",
            train("dup.jsonl", [{**ROW, "id": "x"}, {**ROW, "id": "x"}]) + ["DRY"],
            ("dup.jsonl row 2", "id"),
        ),
    ]


def path_cases(tmp: Path) -> list[tuple[str, list[str], tuple[str, ...]]]:
    model = tmp / "model6"
    model.mkdir(exist_ok=True)
    cfg = {"model_type": "qwen2", "hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 32, "max_position_embeddings": 64}  # fmt: skip
    (model / "config.json").write_text(json.dumps(cfg))
    mistral = tmp / "mistral"
    mistral.mkdir(exist_ok=True)
    (mistral / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    (tmp / "a_file").write_text("x")
    hf = ["model.tiny=null"]
    return [
        ("hf_config_missing", [*hf, f"model.hf_config={tmp / 'no_model'}"], ("model.hf_config", "no_model")),
        ("hf_config_model_type", [*hf, f"model.hf_config={mistral}"], ("model.hf_config", "mistral")),
        (
            "tp_not_dividing_heads",
            [*hf, f"model.hf_config={model}", "parallel.num_actor_ranks=4", "parallel.tensor_model_parallel_size=4"],
            ("parallel.tensor_model_parallel_size",),
        ),  # fmt: skip
        ("tokenizer_missing", [f"model.tokenizer={tmp / 'no_tok'}"], ("model.tokenizer",)),
        ("checkpoint_missing", ["model.init=pretrained", f"model.checkpoint={tmp / 'no_ckpt'}"], ("model.checkpoint",)),
        ("resume_missing", [f"trainer.resume={tmp / 'no_resume'}"], ("trainer.resume",)),
        ("output_dir_is_a_file", [f"trainer.output_dir={tmp / 'a_file'}"], ("trainer.output_dir",)),
        ("output_dir_unwritable", ["trainer.output_dir=/proc/megatron_rl_campaign"], ("trainer.output_dir",)),
    ]


def campaign_inputs(out: Path) -> None:
    tmp = out / "inputs"
    tmp.mkdir(parents=True, exist_ok=True)
    for name, overrides, needles, config in config_cases(tmp):
        code, text = run(train_args(_case_dir(out / "cfg", name), *overrides, config=config), timeout=300)
        record("config", name, judge(code, text, needles), exit=code, message=_error_line(text))
    for category, cases in (("data", data_cases(tmp)), ("paths", path_cases(tmp))):
        for name, overrides, needles in cases:
            dry = "DRY" in overrides
            overrides = [o for o in overrides if o != "DRY"]
            code, text = run(train_args(_case_dir(out / category, name), *overrides, dry_run=dry), timeout=300)
            outcome = judge(code, text, needles, expect=0 if dry else 2, no_ray=not dry)
            record(category, name, outcome, exit=code, message=_error_line(text))


def _error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(("error:", "warning:"))]
    return lines[-1][:300] if lines else text.strip().splitlines()[-1][:300] if text.strip() else ""


# --------------------------------------------------------------------------- rewards


@reward
def always_raises(response, ground_truth):
    """A reward that cannot read any ground truth (the all-failing reward run)."""
    raise KeyError("answer")


@reward
def greedy(response, ground_truth):
    """A reward that allocates 2 GiB (touching every page) or scores 1e308, as ``response`` says."""
    if response == "allocate":
        block = bytearray(2 << 30)
        block[:: 1 << 12] = b"x" * len(block[:: 1 << 12])
    return 1e308


def _greedy_rewards() -> None:
    """A reward past its worker's memory cap (``data.reward_memory_mb``) and one beyond
    ``data.max_abs_reward``: each scores as a failure naming why; the driver lives on."""
    from megatron_rl.rewards import RewardPool

    with RewardPool("reliability_campaign:greedy", num_workers=1, timeout_s=60, memory_mb=1024, max_abs_score=1e6) as pool:
        results = pool.score(["allocate", "huge"], [None, None])
    for case, result, needle in zip(("past_reward_memory_mb", "beyond_max_abs_reward"), results,
                                    ("MemoryError", "(data.max_abs_reward)")):  # fmt: skip
        ok = result.error is not None and needle in result.error and result.score == 0.0  # a failure scores 0
        record("rewards", case, "handled" if ok else "accepted", score=result.score, error=(result.error or "")[:120])


def campaign_rewards(out: Path) -> None:
    from megatron_rl.rewards import RewardPool
    from megatron_rl.tasks import get_reward

    marker = out / "reward_code_ran"
    payload = f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    generic = [
        "", " " * 1_000_000, "\x00" * 10_000, "\ud800\udfff broken surrogates", "\u202e reversed", "9" * 1_000_000,
        "(" * 100_000 + ")" * 100_000, "<answer>" * 50_000, payload, f"eval({payload!r})",
        "{{7*7}} ${7*7} `touch x`", "a" * 10_000_000, "\\boxed{" * 20_000, "\\frac{1}{0}",
    ]  # fmt: skip
    per_reward = {
        "kk_logic": generic[:10] + ["<think>" * 100_000, "<answer>" + "(1) Jack is a knight\n" * 100_000 + "</answer>",
                                    f"<answer>{payload}</answer>", "<answer>(1) Jack is a " + "knight " * 1_000_000,
                                    "<think>x</think><answer>(1) Jack is a knave</answer>"],
        "math": generic[:10] + ["\\boxed{10^{10^{10^{10^{10}}}}}", "\\boxed{\\frac{1}{0}}", f"\\boxed{{{payload}}}",
                                "\\boxed{" + "9" * 100_000 + "}", "\\boxed{x^{x^{x^{x}}} + \\int_0^\\infty e^{-x^2} dx}"],
        "toy_copy": generic,
    }  # fmt: skip
    truths = {
        "kk_logic": {"solution": [{"name": "Jack", "role": "knight"}], "solution_text_format": "(1) Jack is a knight"},
        "math": "42",
        "toy_copy": "1 2 3",
    }
    for name, responses in per_reward.items():
        with RewardPool(get_reward(name), num_workers=2, timeout_s=10) as pool:
            start = time.monotonic()
            try:
                results = pool.score(responses, [truths[name]] * len(responses))
            except Exception as e:  # the pool itself failed: every case of this reward crashed
                for i in range(len(responses)):
                    record("rewards", f"{name}#{i}", "crashed", error=f"{type(e).__name__}: {e}"[:300])
                continue
            seconds = time.monotonic() - start
        for i, result in enumerate(results):
            ok = result.score == result.score and abs(result.score) != float("inf")
            record("rewards", f"{name}#{i}", "handled" if ok else "crashed", score=result.score,
                   timed_out=result.timed_out, error=(result.error or "")[:120], batch_seconds=round(seconds, 1))  # fmt: skip
    record("code_execution", "reward_inputs", "crashed" if marker.exists() else "handled")
    _greedy_rewards()


# --------------------------------------------------------------------------- kills


def _start(out: Path, *overrides: str, env: dict[str, str] | None = None, piped: bool = False) -> subprocess.Popen:
    """The run, started in a session of its own; ``piped``: its output readable (read it)."""
    output = subprocess.PIPE if piped else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "megatron_rl", *train_args(out, *overrides)], cwd=CODE,
                            env={**_env(), **(env or {})}, stdout=output, stderr=subprocess.STDOUT if piped else output,
                            text=True, start_new_session=True)  # fmt: skip


KILL_STEPS = ("trainer.num_steps=6", "trainer.save_every_steps=2")


def _kill_once(run_out: Path, target: str, after_step: int, delay: float) -> tuple[bool, str, dict[int, int], int]:
    """Start the run and SIGKILL ``target`` once ``after_step`` steps are logged (or, for a
    save, once the checkpoint's temporary directory appears). Returns ``(killed, what was
    killed, the run's process tree at the kill, the driver's exit code)``."""
    run_dir = run_out / "tiny_cpu"
    victim = _start(run_out, *KILL_STEPS)
    deadline = time.monotonic() + 900
    while victim.poll() is None and time.monotonic() < deadline:
        if target == "driver_during_save":
            if any(run_dir.glob("checkpoints/.step_*.tmp")):
                break
            time.sleep(0.005)
        elif (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= after_step:
            break
        else:
            time.sleep(0.1)
    time.sleep(delay)
    tree = descendants({victim.pid})
    pid = victim.pid
    if target in ("actor", "engine"):
        wanted = "ray::ActorWorker" if target == "actor" else "ray::EngineWorker"
        pid = next((p for p in tree if wanted in cmdline(p)), victim.pid)
    killed = cmdline(pid).split()[0] if cmdline(pid).startswith("ray::") else "the driver"
    done_before = victim.poll() is not None
    if not done_before:
        os.kill(pid, signal.SIGKILL)
        if target == "driver_during_save":  # the save's temporary directory was there at the kill
            killed += " (during a save)" if any(run_dir.glob("checkpoints/.step_*.tmp")) else " (after the save)"
    try:
        victim.wait(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
    return not done_before, killed, tree, victim.returncode


def campaign_kills(out: Path, *, seed: int = 17) -> None:
    rng = random.Random(seed)
    ref_out = out / "kill_ref"
    code, text = run(train_args(ref_out, *KILL_STEPS))
    reference = {r["step"]: r for r in read_metrics(ref_out / "tiny_cpu")} if code == 0 else {}
    targets = ["driver", "driver", "driver", "actor", "actor", "engine", "engine", "driver_during_save"]
    for i, target in enumerate(targets):
        after_step = rng.randint(1, 5 if target.startswith("driver") else 4)  # a worker: not while shutting down
        delay = rng.uniform(0.0, 0.5) if target != "driver_during_save" else 0.0
        for attempt in range(3):  # a save can finish before the poll sees it: start the case again
            run_out = out / f"kill_{i}" if attempt == 0 else out / f"kill_{i}_retry{attempt}"
            killed_it, killed, tree, victim_code = _kill_once(run_out, target, after_step, delay)
            if killed_it:
                break
        if not killed_it:
            record("kills", f"{target}#{i}", "crashed", reason="the run ended before the kill, three times")
            continue
        run_dir = run_out / "tiny_cpu"
        orphans = [line[:60] for line in wait_tree_gone(tree, timeout_s=10).values()]
        for _ in range(3):  # resume until the run completes
            if logged_steps(run_dir) == list(range(1, 7)) and victim_code == 0:
                break
            code, text = run(train_args(run_out, *KILL_STEPS))
            if code == 0:
                break
        steps = logged_steps(run_dir)
        lost = steps != list(range(1, 7))
        same = not lost and bool(reference) and all(
            abs(r["rollout/reward/mean"] - reference[r["step"]]["rollout/reward/mean"]) < 1e-9
            and abs(r["loss/total"] - reference[r["step"]]["loss/total"]) < 1e-6
            for r in read_metrics(run_dir)
        )  # fmt: skip
        outcome = "lost" if lost else ("crashed" if orphans else "handled")
        record("kills", f"{target}#{i}", outcome, killed=killed, after_step=after_step, attempts=attempt + 1,
               steps=steps, reproduces_uninterrupted=same, orphans=orphans)  # fmt: skip


# --------------------------------------------------------------------------- checkpoints, non-finite runs


# The 11 corruptions of tests/helpers/checkpoints.py and a 12th: ``latest`` as an absolute
# path to another run's (valid) checkpoint, which the old code followed.
CORRUPT: dict[str, Callable[[Path], object]] = {
    **CORRUPTIONS,
    "latest_absolute_elsewhere": lambda c: (c / "latest").write_text(
        str(c.parents[1] / "other" / "tiny_cpu" / "checkpoints" / "step_000002")
    ),
}


def campaign_checkpoints(out: Path) -> None:
    trained = out / "ckpt_trained"
    code, text = run(train_args(trained, "trainer.num_steps=2", "trainer.save_every_steps=1"))
    assert code == 0, text
    for name, corrupt in CORRUPT.items():
        case = out / f"ckpt_{name}"
        shutil.copytree(trained, case)
        shutil.copytree(trained, case / "other")  # another run with valid checkpoints, for the outside pointers
        corrupt(case / "tiny_cpu" / "checkpoints")
        code, text = run(train_args(case, "trainer.num_steps=3", "trainer.save_every_steps=1"))
        steps = [r["step"] for r in read_metrics(case / "tiny_cpu")]
        warned = "warning: config field 'trainer.resume'" in text and "skipped" in text
        ok = code == 0 and warned and steps == [1, 2, 3] and "Traceback" not in text
        record("checkpoints", name, "handled" if ok else ("lost" if code == 0 else "crashed"), exit=code, steps=steps,
               message=next((line for line in text.splitlines() if "skipped" in line), "")[:300])  # fmt: skip


def _latest_finite(run_dir: Path, out: Path) -> bool | None:
    """Whether the latest checkpoint's weights are all finite (``None``: there is none)."""
    import torch
    from safetensors.torch import load_file

    from megatron_rl.models.convert.hf_mcore import McoreToHfOptions, mcore_to_hf

    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        return None
    export = out / f"export_{run_dir.parent.name}"
    mcore_to_hf(McoreToHfOptions(mcore_dir=run_dir / "checkpoints" / latest.read_text().strip(), out_dir=export))
    return all(bool(torch.isfinite(t).all()) for t in load_file(export / "model.safetensors").values())


def campaign_nonfinite(out: Path) -> None:
    runs = {
        "lr1e30_save_every_step": ("trainer.lr=1e30", "trainer.save_every_steps=1"),
        "lr1e30_warmup_then_save": ("trainer.lr=1e30", "trainer.lr_warmup_steps=2", "trainer.save_every_steps=1"),
        "lr1e30_no_periodic_save": ("trainer.lr=1e30", "trainer.save_every_steps=0"),
        "lr1e30_resume_from_last_good": ("trainer.lr=1e30", "trainer.lr_warmup_steps=2", "trainer.save_every_steps=1"),
    }
    for name, overrides in runs.items():
        run_out = out / ("nf_lr1e30_warmup_then_save" if name.startswith("lr1e30_resume") else f"nf_{name}")
        code, text = run(train_args(run_out, "trainer.num_steps=5", *overrides))
        finite = _latest_finite(run_out / "tiny_cpu", out / f"nf_export_{name}")
        ok = code == 1 and "error: step" in text and "Traceback" not in text and finite is not False
        record("nonfinite", name, "handled" if ok else "crashed", exit=code, latest_finite=finite,
               message=_error_line(text))  # fmt: skip
    # Importable as ``reliability_campaign``: tools/ is on the runs' PYTHONPATH.
    code, text = run(
        train_args(out / "reward_fail", "trainer.num_steps=6", "data.task=reliability_campaign:always_raises")
    )
    steps = [r["step"] for r in read_metrics(out / "reward_fail" / "tiny_cpu")]
    ok = code == 1 and "failed on every response for 3 steps" in text and steps == [1, 2, 3]
    record("nonfinite", "reward_always_raises", "handled" if ok else "accepted", exit=code, steps=steps,
           message=_error_line(text))  # fmt: skip


# --------------------------------------------------------------------------- code execution


class _Payload:
    """Unpickling this creates a file: a stand-in for whatever a crafted pickle would run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def campaign_code(out: Path) -> None:
    """Inputs that would run code if they were executed or unpickled: ``!!python`` YAML tags
    (in a config file and in an override) and a crafted pickle in a resumed checkpoint's RNG
    file, with the manifest rewritten to match (whoever can plant a file can do that too)."""
    import torch

    from megatron_rl.storage.checkpoints import checkpoint_files, file_digest, write_manifest

    tmp = out / "code"
    tmp.mkdir(parents=True, exist_ok=True)
    tag = "!!python/object/apply:os.system ['touch {}']"
    config = tmp / "tag.yaml"
    config.write_text(EXAMPLE.read_text().replace(
        "rollout:\n", f"rollout:\n  engine_args:\n    x: {tag.format(tmp / 'yaml_file_ran')}\n", 1))  # fmt: skip
    cases = [
        ("yaml_python_tag_in_file", train_args(tmp / "f", config=config), tmp / "yaml_file_ran", ("tag.yaml",)),
        ("yaml_python_tag_in_override",
         train_args(tmp / "o", f"rollout.engine_args={{x: {tag.format(tmp / 'yaml_override_ran')}}}"),
         tmp / "yaml_override_ran", ("rollout.engine_args",)),
    ]  # fmt: skip
    for name, args, marker, needles in cases:
        code, text = run(args, timeout=300)
        outcome = judge(code, text, needles) if not marker.exists() else "crashed"
        record("code_execution", name, outcome, exit=code, code_ran=marker.exists(), message=_error_line(text))

    trained = out / "ckpt_trained"  # the checkpoints stage's run, when it ran first
    if not (trained / "tiny_cpu" / "checkpoints" / "latest").exists():
        code, text = run(train_args(trained, "trainer.num_steps=2", "trainer.save_every_steps=1"))
        assert code == 0, text
    case = tmp / "poisoned"
    shutil.copytree(trained, case)
    step = case / "tiny_cpu" / "checkpoints" / "step_000002"
    marker = tmp / "pickle_ran"
    torch.save({"layout": {"tp": 1, "pp": 1, "dp": 1}, "state": _Payload(marker)}, step / "rng" / "rank0.pt")
    write_manifest(step, {name: file_digest(step / name) for name in checkpoint_files(step)})
    code, text = run(train_args(case, "trainer.num_steps=3", "trainer.save_every_steps=1"))
    steps = [r["step"] for r in read_metrics(case / "tiny_cpu")]
    refused = "not a tensor-only RNG file, so it was not unpickled" in text
    ok = code == 0 and refused and not marker.exists() and steps == [1, 2, 3] and "Traceback" not in text
    record("code_execution", "crafted_pickle_in_rng_file", "handled" if ok else "crashed", exit=code,
           code_ran=marker.exists(), warned=refused, steps=steps)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="work directory (created; cases write there)")
    parser.add_argument("--only", default="inputs,rewards,kills,checkpoints,nonfinite,code,conversions,cluster")
    parser.add_argument("--code", type=Path, default=REPO, help="checkout whose megatron_rl the runs use")
    args = parser.parse_args()
    global CODE, LOG
    CODE = args.code.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    LOG = args.out / "campaign.jsonl"
    LOG.write_text("")
    from cluster_campaign import campaign_cluster  # tools/ is this script's directory
    from conversion_campaign import campaign_conversions

    stages = {"inputs": campaign_inputs, "rewards": campaign_rewards, "kills": campaign_kills,
              "checkpoints": campaign_checkpoints, "nonfinite": campaign_nonfinite, "code": campaign_code,
              "conversions": lambda out: campaign_conversions(out, record, run),
              "cluster": lambda out: campaign_cluster(out, record, functools.partial(_start, piped=True))}  # fmt: skip
    unknown = [name for name in args.only.split(",") if name not in stages]
    if unknown:
        parser.error(f"--only: unknown stage(s) {', '.join(unknown)}; the stages are {', '.join(stages)}")
    start = time.monotonic()
    for name in args.only.split(","):
        stages[name](args.out)
    counts: dict[str, Counter] = {}
    for r in RESULTS:
        counts.setdefault(r["category"], Counter())[r["outcome"]] += 1
    print(f"\n| category | tried | handled | crashed | silently accepted | lost |  ({time.monotonic() - start:.0f} s)")
    print("|---|---|---|---|---|---|")
    for category, c in counts.items():
        skipped = f" ({c['skipped']} skipped)" if c["skipped"] else ""
        print(
            f"| {category} | {sum(c.values())}{skipped} | {c['handled']} | {c['crashed']} | {c['accepted']} | {c['lost']} |"
        )
    kills = [r for r in RESULTS if r["category"] == "kills"]
    if kills:
        print(f"kills: {sum(r.get('reproduces_uninterrupted', False) for r in kills)}/{len(kills)} reproduce the "
              f"uninterrupted run; {sum(len(r.get('orphans', ())) for r in kills)} process(es) alive 10 s after the "
              "driver ended")  # fmt: skip


if __name__ == "__main__":
    main()
