"""Project configuration: `[tool.ckpt-tune]` in pyproject.toml or ckpt-tune.toml, found upward from the
current directory, read as the defaults of the command options (flags on the command line win)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tune.cli import config as cfg
from ckpt_tune.cli.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"

# The option names of the real commands that the configuration can reach (checked against the app below).
PARAMS = {
    "profile": {"target", "batch_size", "device", "precision", "optimizer", "batch_fn", "loss_fn", "hf_config",
                "seq_len", "attn", "top", "depth", "as_json", "save"},
    "search": {"target", "vram", "batch_size", "target_batch", "device", "precision", "optimizer", "margin",
               "batch_fn", "loss_fn", "hf_config", "seq_len", "attn", "world_size", "shard", "segments", "out",
               "patch", "as_json"},
    "check": {"target", "baseline", "tolerance", "reserved_tolerance", "update", "batch_size", "plan", "device",
              "precision", "optimizer", "batch_fn", "loss_fn", "hf_config", "seq_len", "attn", "world_size", "shard",
              "top", "as_json"},
    "diagnose": {"target", "vram", "batch_size", "device", "precision", "optimizer", "margin", "batch_fn",
                 "loss_fn", "hf_config", "seq_len", "attn", "world_size", "shard", "lora_rank", "oom_message",
                 "report_path", "as_json"},
}

TINY = '''"""A tiny target for the configuration tests."""
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def make_batch(batch_size):
    return torch.ones(batch_size, 8)
'''


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def load(start: Path, explicit: Path | None = None) -> cfg.Config | None:
    return cfg.load(start, PARAMS, explicit=explicit)


def defaults(tmp_path: Path, body: str, name: str = "ckpt-tune.toml") -> dict:
    write(tmp_path / name, body)
    found = load(tmp_path)
    assert found is not None
    return found.defaults


def config_error(tmp_path: Path, body: str, name: str = "ckpt-tune.toml") -> ConfigError:
    write(tmp_path / name, body)
    with pytest.raises(ConfigError) as info:
        load(tmp_path)
    assert info.value.exit_code == 1
    return info.value


# --- where the file is found ----------------------------------------------------------------------------


def test_found_from_the_current_directory_upward(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.ckpt-tune]\ndevice = "cpu"\n')
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    found = load(deep)
    assert found is not None
    assert found.path == tmp_path / "pyproject.toml"
    assert found.describe() == f"{tmp_path / 'pyproject.toml'} [tool.ckpt-tune]"
    assert found.defaults["profile"] == {"device": "cpu"}


def test_the_nearest_configured_directory_wins(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.ckpt-tune]\ndevice = "cpu"\n')
    write(tmp_path / "a" / "pyproject.toml", '[tool.ckpt-tune]\ndevice = "meta"\n')
    found = load(tmp_path / "a")
    assert found.path == tmp_path / "a" / "pyproject.toml"
    assert found.defaults["profile"] == {"device": "meta"}


def test_a_pyproject_without_the_table_is_skipped(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.ckpt-tune]\ndevice = "cpu"\n')
    # mentions ckpt-tune, so it is parsed; it has no [tool.ckpt-tune] table, so the search goes on upward
    write(tmp_path / "a" / "pyproject.toml", '[project]\nname = "uses-ckpt-tune"\n\n[tool.ruff]\nline-length = 99\n')
    # a broken pyproject.toml that cannot hold the table is skipped without being parsed
    write(tmp_path / "a" / "b" / "pyproject.toml", "[project\nname = \n")
    found = load(tmp_path / "a" / "b")
    assert found.path == tmp_path / "pyproject.toml"


def test_ckpt_tune_toml_beats_pyproject_in_the_same_directory(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.ckpt-tune]\ndevice = "cpu"\n')
    write(tmp_path / "ckpt-tune.toml", 'device = "meta"\n')
    found = load(tmp_path)
    assert found.path == tmp_path / "ckpt-tune.toml"
    assert found.table == ""
    assert found.describe() == str(tmp_path / "ckpt-tune.toml")
    assert found.defaults["search"] == {"device": "meta"}


def test_an_empty_ckpt_tune_toml_still_counts(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.ckpt-tune]\ndevice = "cpu"\n')
    write(tmp_path / "a" / "ckpt-tune.toml", "")
    found = load(tmp_path / "a")
    assert found.path == tmp_path / "a" / "ckpt-tune.toml"
    assert found.defaults == {}


def test_no_file_no_config(tmp_path):
    write(tmp_path / "a" / "pyproject.toml", '[project]\nname = "x"\n')
    found = cfg.find(tmp_path / "a")
    assert found is None or tmp_path not in found[0].parents  # nothing here (a directory above is not ours)


def test_the_repository_itself_has_no_configuration():
    """The suite runs from the repository root: its pyproject.toml must keep no [tool.ckpt-tune] table."""
    assert cfg._pyproject_table(ROOT / "pyproject.toml") is None
    assert not (ROOT / "ckpt-tune.toml").exists()


def test_explicit_file(tmp_path):
    other = write(tmp_path / "elsewhere" / "my.toml", 'target = "m.py:build"\n')
    found = load(tmp_path, explicit=other)
    assert found.path == other
    assert found.defaults["profile"]["target"] == f"{tmp_path / 'elsewhere' / 'm.py'}:build"
    py = write(tmp_path / "x" / "pyproject.toml", '[tool.ckpt-tune]\nattn = "eager"\n')
    assert load(tmp_path, explicit=py).defaults["profile"] == {"attn": "eager"}


def test_disabled_by_env():
    assert cfg.disabled_by_env({"CKPT_TUNE_NO_CONFIG": "1"})
    assert cfg.disabled_by_env({"CKPT_TUNE_NO_CONFIG": "true"})
    for off in ("", "0", "false", "no"):
        assert not cfg.disabled_by_env({"CKPT_TUNE_NO_CONFIG": off})
    assert not cfg.disabled_by_env({})


# --- what the keys become -------------------------------------------------------------------------------


def test_keys_go_only_to_commands_that_have_the_option(tmp_path):
    d = defaults(tmp_path, 'vram = "24GB"\nbaseline = "mem.yaml"\nbatch-size = 4\nprecision = "bf16-mixed"\n')
    assert d["profile"] == {"batch_size": 4, "precision": "bf16-mixed"}
    assert d["search"] == {"vram": "24GB", "precision": "bf16-mixed"}  # a top-level batch-size does not fix search's
    assert d["diagnose"] == {"vram": "24GB", "batch_size": 4, "precision": "bf16-mixed"}
    assert d["check"] == {"baseline": str(tmp_path / "mem.yaml"), "batch_size": 4, "precision": "bf16-mixed"}


def test_snake_case_keys_are_accepted(tmp_path):
    d = defaults(tmp_path, 'batch_size = 4\nseq_len = 128\nbatch_fn = "data.py:make"\n')
    assert d["profile"] == {"batch_size": 4, "seq_len": 128, "batch_fn": f"{tmp_path / 'data.py'}:make"}


def test_per_command_tables_override_the_top_level(tmp_path):
    body = (
        '[tool.ckpt-tune]\ndevice = "cpu"\nvram = "24GB"\nhf-config = "cfg/config.json"\n\n'
        '[tool.ckpt-tune.search]\nvram = "80GB"\nbatch-size = 16\n\n'
        '[tool.ckpt-tune.profile]\ntarget = "m.py:build"\n'
    )
    d = defaults(tmp_path, body, name="pyproject.toml")
    assert d["search"] == {"device": "cpu", "vram": "80GB", "batch_size": 16, "hf_config": str(tmp_path / "cfg" / "config.json")}
    assert d["diagnose"]["vram"] == "24GB"
    # a per-command target replaces the top-level hf-config: one run builds one model
    assert d["profile"] == {"device": "cpu", "target": f"{tmp_path / 'm.py'}:build"}
    found = load(tmp_path)
    assert found.origins[("search", "vram")] == ("vram", f"{tmp_path / 'pyproject.toml'} [tool.ckpt-tune.search]")
    assert found.origins[("search", "device")] == ("device", f"{tmp_path / 'pyproject.toml'} [tool.ckpt-tune]")


def test_per_command_tables_in_ckpt_tune_toml(tmp_path):
    d = defaults(tmp_path, 'device = "cpu"\n[check]\nbaseline = "ci/mem.yaml"\n[diagnose]\nmargin = 0.1\n')
    assert d["check"] == {"device": "cpu", "baseline": str(tmp_path / "ci" / "mem.yaml")}
    assert d["diagnose"] == {"device": "cpu", "margin": "0.1"}


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("target", "models/m.py:build", "{d}/models/m.py:build"),
        ("target", "../up.py:build", "{p}/up.py:build"),
        ("target", "m:build", "m:build"),  # a module: left alone
        ("target", "pkg.models:build", "pkg.models:build"),
        ("target", "/abs/m.py:build", "/abs/m.py:build"),
        ("batch-fn", "data/batches.py:make_batch", "{d}/data/batches.py:make_batch"),
        ("loss-fn", "pkg.losses:lm_loss", "pkg.losses:lm_loss"),
        ("hf-config", "configs/llama", "{d}/configs/llama"),
        ("baseline", "ci/memory.yaml", "{d}/ci/memory.yaml"),
        ("baseline", "/abs/memory.yaml", "/abs/memory.yaml"),
    ],
)
def test_relative_paths_are_read_from_the_config_files_directory(tmp_path, key, value, expected):
    proj = tmp_path / "proj"
    d = defaults(proj, f'{key} = "{value}"\n')
    option = key.replace("-", "_")
    command = "check"  # has every path option
    assert d[command][option] == expected.format(d=proj, p=tmp_path)


def test_sizes_and_margins_as_numbers(tmp_path):
    d = defaults(tmp_path, "vram = 25769803776\nmargin = 0.05\n")
    assert d["search"] == {"vram": "25769803776", "margin": "0.05"}


def test_every_key_reaches_an_option_of_the_real_commands():
    import typer

    from ckpt_tune.cli import app

    group = typer.main.get_command(app)
    real = {name: {p.name for p in cmd.params} for name, cmd in group.commands.items()}
    assert set(real) == set(PARAMS)
    for name, options in PARAMS.items():
        assert options <= real[name], name
    for key in cfg.KEYS:
        assert any(key.replace("-", "_") in options for options in real.values()), key


# --- errors: the file, the key, a hint; exit code 1 -----------------------------------------------------


def test_unknown_key_suggests_the_close_one(tmp_path):
    e = config_error(tmp_path, "[tool.ckpt-tune]\nbatchsize = 8\n", name="pyproject.toml")
    assert str(tmp_path / "pyproject.toml") in e.message
    assert "[tool.ckpt-tune]" in e.message
    assert "'batchsize'" in e.message
    assert e.hint == "did you mean 'batch-size'?"


def test_unknown_key_without_a_close_one_lists_the_keys(tmp_path):
    e = config_error(tmp_path, "colour = 'blue'\n")
    assert "unknown key 'colour'" in e.message
    assert "known keys: target, batch-fn" in e.hint


def test_misspelt_command_table(tmp_path):
    e = config_error(tmp_path, "[tool.ckpt-tune.serch]\nvram = '24GB'\n", name="pyproject.toml")
    assert "unknown key 'serch'" in e.message
    assert "did you mean 'search'?" in e.hint


def test_wrong_type_names_the_key(tmp_path):
    e = config_error(tmp_path, 'batch-size = "eight"\n')
    assert e.message == f"{tmp_path / 'ckpt-tune.toml'}: batch-size must be a positive integer, got 'eight' (a string)"
    assert "batch-size = 8" in e.hint


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("seq-len = 0\n", ["seq-len must be a positive integer", "0 (an integer)"]),
        ("batch-size = true\n", ["batch-size must be a positive integer", "(a boolean)"]),
        ("device = 3\n", ["device must be a non-empty string", "3 (an integer)"]),
        ('device = "gpu"\n', ["device = 'gpu' is not a device"]),
        ('precision = "bf16mixed"\n', ["precision = 'bf16mixed' is not one of fp32"]),
        ('optimizer = "adamw8"\n', ["optimizer = 'adamw8'"]),
        ('attn = "flash2"\n', ["attn = 'flash2'"]),
        ('target = "examples/gpt.py"\n', ["target = 'examples/gpt.py' is not path/to/file.py:fn"]),
        ("vram = []\n", ["vram must be a memory size", "(an array)"]),
        ("margin = true\n", ["margin must be a percentage"]),
        ('target = "m.py:build"\nhf-config = "c.json"\n', ["target and hf-config are both set"]),
        ('batch-size = 2\nbatch_size = 3\n', ["batch-size is set twice"]),
        ('search = "fast"\n', ["search must be a table"]),
        ('[profile]\nvram = "24GB"\n', ["[profile]: vram", "`ckpt-tune profile` has no --vram option"]),
    ],
)
def test_bad_values(tmp_path, body, words):
    e = config_error(tmp_path, body)
    assert e.message.startswith(str(tmp_path / "ckpt-tune.toml")), e.message
    for w in words:
        assert w in e.message, e.message
    assert e.hint


def test_close_choice_is_suggested(tmp_path):
    assert config_error(tmp_path, 'precision = "bf16mixed"\n').hint == "did you mean 'bf16-mixed'?"


def test_toml_syntax_error_names_the_file_and_line(tmp_path):
    e = config_error(tmp_path, '[tool.ckpt-tune]\ndevice = "cpu"\nvram = 24GB\n', name="pyproject.toml")
    assert str(tmp_path / "pyproject.toml") in e.message
    assert "is not valid TOML" in e.message
    assert "line 3" in e.message
    assert "CKPT_TUNE_NO_CONFIG=1" in e.hint


def test_tool_ckpt_tune_must_be_a_table(tmp_path):
    e = config_error(tmp_path, '[tool]\nckpt-tune = "yes"\n', name="pyproject.toml")
    assert "tool.ckpt-tune must be a table" in e.message


def test_explicit_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load(tmp_path, explicit=tmp_path / "missing.toml")
    py = write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"has no \[tool.ckpt-tune\] table"):
        load(tmp_path, explicit=py)


# --- through the command line, in this process ----------------------------------------------------------


@pytest.fixture
def cli(monkeypatch, capsys):
    """cli(cwd, *args) -> (exit code, stdout, stderr) of `ckpt-tune *args` run in `cwd`."""
    from ckpt_tune.cli import main

    monkeypatch.delenv("CKPT_TUNE_NO_CONFIG", raising=False)

    def run(cwd: Path, *args: str) -> tuple[int, str, str]:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            main(list(args))
        out = capsys.readouterr()
        code = info.value.code
        return (code if isinstance(code, int) else 0 if code is None else 1), out.out, out.err

    return run


def assert_clean_error(code: int, err: str, expected: int, *words: str) -> None:
    """As in test_cli, after the `config: FILE` line that a run with a configuration starts with."""
    assert code == expected, err
    assert "Traceback" not in err, err
    first = err.removeprefix(err.splitlines()[0] + "\n") if err.startswith("config: ") else err
    assert first.startswith("error: "), err
    err = " ".join(err.split())  # rich wraps long lines at 120 columns
    for w in words:
        assert w in err, err


def test_cli_bad_key_exits_1_with_file_key_and_hint(tmp_path, cli):
    write(tmp_path / "pyproject.toml", "[tool.ckpt-tune]\nbatchsize = 8\n")
    code, out, err = cli(tmp_path, "profile")
    assert_clean_error(
        code, err, 1, f"{tmp_path / 'pyproject.toml'} [tool.ckpt-tune]: unknown key 'batchsize'", "hint: did you mean 'batch-size'?"
    )
    assert out == ""


def test_cli_wrong_type_exits_1(tmp_path, cli):
    write(tmp_path / "ckpt-tune.toml", 'batch-size = "eight"\n')
    code, _, err = cli(tmp_path, "search", "--vram", "1GB")
    assert_clean_error(code, err, 1, "ckpt-tune.toml", "batch-size must be a positive integer")


def test_cli_toml_syntax_error_exits_1(tmp_path, cli):
    write(tmp_path / "ckpt-tune.toml", 'device = "cpu"\nbatch-size = \n')
    code, _, err = cli(tmp_path, "profile")
    assert_clean_error(code, err, 1, "ckpt-tune.toml", "not valid TOML", "line 2")


def test_help_still_works_with_a_broken_config(tmp_path, cli):
    write(tmp_path / "ckpt-tune.toml", "nonsense = 1\n")
    code, out, _ = cli(tmp_path, "profile", "--help")
    assert code == 0
    assert "Usage" in out


def test_no_config_flag_and_env_var_turn_it_off(tmp_path, cli, monkeypatch):
    write(tmp_path / "ckpt-tune.toml", "nonsense = 1\n")
    write(tmp_path / "m.py", TINY)
    # without the configuration, the run gets as far as reading --vram
    code, _, err = cli(tmp_path, "--no-config", "search", "m.py:build", "--device", "cpu", "--vram", "lots")
    assert_clean_error(code, err, 1, "lots")
    assert "nonsense" not in err
    monkeypatch.setenv("CKPT_TUNE_NO_CONFIG", "1")
    code, _, err = cli(tmp_path, "search", "m.py:build", "--device", "cpu", "--vram", "lots")
    assert_clean_error(code, err, 1, "lots")
    assert "nonsense" not in err


def test_config_and_no_config_together_is_a_usage_error(tmp_path, cli):
    write(tmp_path / "ckpt-tune.toml", "")
    code, _, _ = cli(tmp_path, "--config", str(tmp_path / "ckpt-tune.toml"), "--no-config", "profile")
    assert code == 2


def test_an_error_from_a_configured_value_names_the_file(tmp_path, cli):
    write(tmp_path / "m.py", TINY)
    write(tmp_path / "pyproject.toml", '[tool.ckpt-tune]\ntarget = "m.py:build"\ndevice = "cpu"\nvram = "lots"\n')
    code, _, err = cli(tmp_path, "search")
    assert_clean_error(code, err, 1, "lots", f"vram = 'lots' is set in {tmp_path / 'pyproject.toml'} [tool.ckpt-tune]")


def test_configured_target_file_not_found_names_the_file(tmp_path, cli):
    write(tmp_path / "ckpt-tune.toml", 'target = "models/missing.py:build"\ndevice = "cpu"\n')
    (tmp_path / "sub").mkdir()
    code, _, err = cli(tmp_path / "sub", "profile")
    assert_clean_error(code, err, 1, "file not found", str(tmp_path / "models" / "missing.py"), "is set in")


@pytest.fixture
def project(tmp_path):
    """A project with its model under models/, configured in pyproject.toml; runs happen in src/."""
    write(tmp_path / "models" / "tiny.py", TINY)
    write(
        tmp_path / "pyproject.toml",
        '[project]\nname = "demo"\n\n[tool.ckpt-tune]\ndevice = "cpu"\nbatch-size = 3\n'
        'hf-config = "nowhere/config.json"\n\n'  # dropped wherever a target wins (see below)
        '[tool.ckpt-tune.profile]\ntarget = "models/tiny.py:build"\n\n'
        '[tool.ckpt-tune.check]\ntarget = "models/tiny.py:build"\nbaseline = "ci/memory.yaml"\n',
    )
    (tmp_path / "src").mkdir()
    return tmp_path


def test_cli_profile_uses_the_configured_target_and_says_which_file(project, cli):
    code, out, err = cli(project / "src", "profile", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["batch_size"] == 3
    assert d["device"] == "cpu"
    assert err.splitlines()[0] == f"config: {project / 'pyproject.toml'} [tool.ckpt-tune]"
    assert "config:" not in out


def test_cli_flags_override_the_configuration(project, cli):
    code, out, err = cli(project / "src", "profile", "--batch-size", "5", "--json")
    assert code == 0, err
    assert json.loads(out)["batch_size"] == 5


def test_cli_target_on_the_command_line_beats_configured_target_and_hf_config(project, cli):
    other = write(project / "other.py", TINY.replace("nn.Linear(32, 4)", "nn.Linear(32, 2)"))
    # search's configuration carries the top-level hf-config (no per-command target): a TARGET on the
    # command line must win over it, or the run would try to read nowhere/config.json
    code, out, err = cli(project / "src", "search", f"{other}:build", "--vram", "1GiB", "--batch-size", "2", "--json")
    assert code == 0, err
    assert "nowhere" not in err
    assert json.loads(out)["plan"]["batch_size"] == 2


def test_cli_check_takes_its_baseline_from_the_configuration(project, cli):
    code, _, err = cli(project / "src", "check")
    assert code == 0, err
    assert (project / "ci" / "memory.yaml").is_file()  # relative to pyproject.toml, not to src/
    code, _, err = cli(project / "src", "check", "--baseline", "here.yaml")
    assert code == 0, err
    assert (project / "src" / "here.yaml").is_file()  # a flag is relative to the current directory


def test_cli_search_uses_the_configured_target(tmp_path, cli):
    write(tmp_path / "models" / "tiny.py", TINY)
    write(tmp_path / "ckpt-tune.toml", 'target = "models/tiny.py:build"\ndevice = "cpu"\n\n[search]\nvram = "64MiB"\nbatch-size = 4\n')
    code, out, err = cli(tmp_path, "search", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["budget"]["total_bytes"] == 64 * 2**20
    assert d["plan"]["batch_size"] == 4
    assert err.startswith(f"config: {tmp_path / 'ckpt-tune.toml'}\n")


def test_cli_explicit_config_file(tmp_path, cli):
    write(tmp_path / "models" / "tiny.py", TINY)
    conf = write(tmp_path / "conf" / "run.toml", 'target = "../models/tiny.py:build"\ndevice = "cpu"\nbatch-size = 2\n')
    write(tmp_path / "ckpt-tune.toml", "nonsense = 1\n")  # not read: --config searches nothing
    code, out, err = cli(tmp_path, "--config", str(conf), "profile", "--json")
    assert code == 0, err
    assert json.loads(out)["batch_size"] == 2
    assert f"config: {conf}" in err


# --- end to end, as a user runs it ----------------------------------------------------------------------


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("CKPT_TUNE_NO_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "ckpt_tune", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture
def gpt_project(tmp_path):
    write(tmp_path / "pyproject.toml", f'[project]\nname = "demo"\n\n[tool.ckpt-tune]\ntarget = "{GPT}:build"\n')
    return tmp_path


def test_end_to_end_profile_without_a_target(gpt_project):
    """`search --vram 160MiB --device cpu` on this project takes about a minute on 2 CPU cores: it is run by
    hand, and `test_cli_search_uses_the_configured_target` runs search on a small model instead."""
    p = run(gpt_project, "profile", "--batch-size", "2", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["batch_size"] == 2
    assert p.stderr.splitlines()[0] == f"config: {gpt_project / 'pyproject.toml'} [tool.ckpt-tune]"
