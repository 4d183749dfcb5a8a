"""The command line as a user meets it: exit codes, one-line errors without tracebacks, JSON on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ckpt_tune.plan.file import load_plan
from tests.fixtures.models import write_target_file
from tests.harness import measured_peak

ROOT = Path(__file__).resolve().parent.parent
CASES = "tests/assets/targets/cases.py"


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "ckpt_tune", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def assert_clean_error(p: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert p.returncode == code, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("error: "), p.stderr
    for w in words:
        assert w in p.stderr, p.stderr


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("no_colon_here", ["bad target", "file.py:fn"]),
        ("does/not/exist.py:build", ["file not found"]),
        ("tests/assets/targets/no_make_batch.py:build", ["make_batch", "--batch-fn"]),
        (f"{CASES}:build_raises", ["raised"]),
        (f"{CASES}:build_bad_forward", ["raised"]),
        ("tests/assets/targets/build_returns_int.py:build", ["int", "nn.Module"]),
    ],
)
def test_user_errors_exit_1_with_one_clear_line(target, words):
    p = run("profile", target, "--device", "cpu", "--batch-size", "2")
    assert_clean_error(p, 1, *words)


def test_user_code_error_with_debug_shows_traceback():
    p = run("--debug", "profile", f"{CASES}:build_raises", "--device", "cpu")
    assert p.returncode != 0
    assert "Traceback" in p.stderr


def test_usage_error_exits_2():
    p = run("profile", "x.py:build", "--batch-size", "zero")
    assert p.returncode == 2


def test_bad_budget_exits_1():
    p = run("search", "examples/gpt.py:build", "--device", "cpu", "--vram", "lots")
    assert_clean_error(p, 1, "lots")


def test_profile_json_matches_allocator(tmp_path):
    from tests.fixtures.models import ZOO

    target = write_target_file(tmp_path, "mlp_blocks")
    p = run("profile", target, "--device", "cpu", "--batch-size", "8", "--json", "--save", str(tmp_path / "p.yaml"))
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    for key in ("batch_size", "device", "peak_bytes", "breakdown", "modules"):
        assert key in d
    assert set(d["breakdown"]) == {"params", "grads", "optimizer", "activations", "other"}
    assert {"name", "type", "activation_bytes", "param_bytes", "forward_ms"} <= set(d["modules"][0])
    fx = ZOO["mlp_blocks"]
    assert d["peak_bytes"] == measured_peak(fx.build, fx.make_batch, fx.loss_fn, 8)
    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["peak_bytes"] == d["peak_bytes"]
    assert "Activation memory by module" in p.stderr
    assert "peak" in p.stderr
    # nothing after the answer: no report of objects left to the interpreter's exit (nanobind's, where
    # triton is installed, as it is beside CUDA builds of torch)
    assert "leaked" not in p.stderr
    assert "nanobind" not in p.stderr


def test_search_writes_a_plan_that_fits_when_applied_independently(tmp_path):
    from tests.fixtures.models import ZOO

    fx = ZOO["mlp_blocks"]
    target = write_target_file(tmp_path, "mlp_blocks")
    every = measured_peak(fx.build, fx.make_batch, fx.loss_fn, 32, checkpoint=[f"blocks.{i}" for i in range(6)])
    none = measured_peak(fx.build, fx.make_batch, fx.loss_fn, 32)
    budget = (every + none) // 2
    out, patch = tmp_path / "plan.yaml", tmp_path / "patch.py"
    p = run("search", target, "--device", "cpu", "--vram", str(budget), "--batch-size", "32", "--out", str(out), "--patch", str(patch), "--json")
    assert p.returncode == 0, p.stderr
    plan = load_plan(out)
    assert plan.batch_size == 32
    assert plan.budget_bytes == budget
    assert 0 < len(plan.checkpoint) < 6  # cheaper than checkpointing every block
    truth = measured_peak(fx.build, fx.make_batch, fx.loss_fn, 32, checkpoint=list(plan.checkpoint))
    assert truth <= budget
    assert abs(plan.predicted_peak_bytes - truth) <= 0.03 * truth
    compile(patch.read_text(), str(patch), "exec")
    assert json.loads(p.stdout)["plan"]["batch_size"] == 32


def test_search_budget_too_small_exits_3(tmp_path):
    target = write_target_file(tmp_path, "mlp_blocks")
    p = run("search", target, "--device", "cpu", "--vram", "1MiB")
    assert_clean_error(p, 3, "nothing fits", "weights + gradients + optimizer state alone", "16.0 bytes per trainable parameter")


def test_every_command_has_help():
    for cmd in ("profile", "search"):
        p = run(cmd, "--help")
        assert p.returncode == 0
        assert "Usage" in p.stdout


def test_readme_shows_the_two_commands_and_every_command():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme
    assert "make test" in readme
    from ckpt_tune.cli import app

    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert {"profile", "search", "check"} <= set(names)
    for name in names:
        assert f"ckpt-tune {name}" in readme, f"README does not show `ckpt-tune {name}`"
        assert run(name, "--help").returncode == 0


def test_version_prints_the_installed_package_version():
    from importlib.metadata import version

    import ckpt_tune

    p = run("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"ckpt-tune {version('ckpt-tune')}\n"
    assert version("ckpt-tune") == ckpt_tune.__version__


def test_boolean_options_are_shown_as_flags_in_every_help():
    for command in ([], ["profile"], ["search"], ["check"], ["diagnose"]):
        p = run(*command, "--help")
        assert p.returncode == 0, p.stderr
        assert "--json" in p.stdout or not command
        for shown in ("<bool>", "BOOLEAN"):
            assert shown not in p.stdout, (command, p.stdout)


def test_ctrl_c_exits_130_with_one_line(tmp_path):
    import signal
    import time

    (tmp_path / "slow.py").write_text(
        "import pathlib, time, torch\n"
        "def build():\n"
        "    pathlib.Path('started').write_text('')\n"
        "    time.sleep(120)\n"
        "    return torch.nn.Linear(2, 2)\n"
        "def make_batch(b):\n"
        "    return torch.randn(b, 2)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # SIGINT as a terminal delivers it: a suite started in the background (`make test &`) ignores SIGINT,
    # and a child inherits that, so Python would install no KeyboardInterrupt handler and Ctrl-C be lost
    p = subprocess.Popen([sys.executable, "-m", "ckpt_tune", "search", "slow.py:build", "--device", "cpu", "--vram", "1GiB",
                          "--out", "plan.yaml"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:  # the child never outlives the test, whatever fails (a search left running would hold a core)
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists():
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130
    assert err == "interrupted (Ctrl-C)\n"
    assert out == ""
    assert not (tmp_path / "plan.yaml").exists()


def test_shell_completion_completes_commands_and_options():
    env = {**os.environ, "_CKPT_TUNE_COMPLETE": "complete_bash", "COMP_WORDS": "ckpt-tune search --pre", "COMP_CWORD": "2"}
    p = subprocess.run([str(Path(sys.executable).parent / "ckpt-tune")], capture_output=True, text=True, env=env, timeout=120)
    assert p.stdout.split() == ["--precision"], p.stderr
    env.update(COMP_WORDS="ckpt-tune dia", COMP_CWORD="1")
    p = subprocess.run([str(Path(sys.executable).parent / "ckpt-tune")], capture_output=True, text=True, env=env, timeout=120)
    assert p.stdout.split() == ["diagnose"], p.stderr


def test_an_error_in_ckpt_tunes_own_code_is_not_blamed_on_the_step():
    from ckpt_tune.errors import LimitationError, UserCodeError
    from ckpt_tune.measure.session import user_errors
    from ckpt_tune.tune.planner import solve

    ours = r"its own code, not in your step: .*ckpt_tune/tune/planner.py:\d+"
    with pytest.raises(LimitationError, match=ours), user_errors("searching"):
        solve(None, (), 0)  # the planner's arithmetic on nothing: an error of ours

    def users_forward():
        raise ValueError("shape mismatch in my model")

    with pytest.raises(UserCodeError, match="the training step raised ValueError: shape mismatch"), user_errors("searching"):
        users_forward()
