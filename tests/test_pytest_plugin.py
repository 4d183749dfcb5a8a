"""The pytest marker `@pytest.mark.peak_memory(size)` (ckpt_tune/integrations/pytest_plugin.py), run in
inner pytest sessions (`pytester`), which load the plugin through its entry point as a user's run does.

Counted by hand: `Exact` allocates one uint8 tensor of a set size in each module's forward, so the bytes
live at the peak are known per module to the byte (the CPU allocator records a tensor's nbytes, no
rounding). `Tiny` is a 2-block GPT-like model (n_embd 32, seq 16) trained one step, for the names.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.integrations.pytest_plugin import attribute, module_names, read_marker
from ckpt_tune.measure.profiler import OUTSIDE
from ckpt_tune.measure.timeline import Recorder, Timeline

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# warnings are errors, as in this suite; the inner session marks the plugin's package for assertion
# rewriting, which an in-process session finds already imported by this one and warns about
ARGS = ("-W", "error", "-W", "ignore::pytest.PytestAssertRewriteWarning", "--strict-markers")

EXACT = '''
import pytest
import torch
from torch import nn


class Alloc(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return torch.empty(self.n, dtype=torch.uint8)


class Exact(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Alloc(1_000_000)
        self.b = nn.Sequential(Alloc(700_000))

    def forward(self, x):
        return self.a(x), self.b(x)


@pytest.mark.peak_memory("1.5MiB")
def test_over():
    keep = Exact()(None)
    outside = torch.empty(500, dtype=torch.uint8)


@pytest.mark.peak_memory(2_000_000)
def test_two_kept():
    a = torch.empty(1_000_000, dtype=torch.uint8)
    b = torch.empty(1_000_000, dtype=torch.uint8)


@pytest.mark.peak_memory(1_999_999)
def test_two_kept_one_byte_over():
    a = torch.empty(1_000_000, dtype=torch.uint8)
    b = torch.empty(1_000_000, dtype=torch.uint8)


@pytest.mark.peak_memory("1GB")
def test_profiles_itself():
    with torch.profiler.profile(profile_memory=True):
        torch.empty(1_000_000, dtype=torch.uint8)


@pytest.fixture
def held():
    return torch.empty(3_000_000, dtype=torch.uint8)


@pytest.mark.peak_memory("1MB")
def test_one_freed_before_the_next(held):
    a = torch.empty(1_000_000, dtype=torch.uint8)
    del a
    b = torch.empty(1_048_576, dtype=torch.uint8)
'''

TINY = '''
import pytest
import torch
import torch.nn.functional as F
from torch import nn

D, T, V = 32, 16, 64
MLP_WIDTH = {widths}


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(x.shape))


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(D, width)
        self.out = nn.Linear(width, D)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(D), Attn()
        self.ln2, self.mlp = nn.LayerNorm(D), MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(w) for w in MLP_WIDTH)
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.peak_memory({limit})
def test_step():
    torch.manual_seed(0)
    model = Tiny()
    idx = torch.randint(0, V, (4, T))
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
'''


@pytest.fixture(scope="module", autouse=True)
def profiler_imported():
    """Start torch.profiler once in this process: its first start imports torch._inductor (and with it
    triton's native extension), and an in-process inner session drops the modules first imported during
    it from sys.modules afterwards; importing that extension a second time aborts the process."""
    with Recorder("cpu"):
        pass


def _reports(result, when: str = "call") -> dict[str, pytest.TestReport]:
    return {r.nodeid.split("::")[-1]: r for r in result.reprec.getreports("pytest_runtest_logreport") if r.when == when}


def _peak(report: pytest.TestReport) -> int:
    return dict(report.user_properties)["peak_memory_bytes"]


def _cached(pytester: pytest.Pytester, nodeid: str) -> dict:
    return json.loads((pytester.path / ".pytest_cache/v/ckpt_tune/peak_memory" / nodeid).read_text())


def test_a_test_over_its_limit_fails_with_the_bytes_of_each_module_live_at_the_peak(pytester) -> None:
    pytester.makepyfile(test_exact=EXACT)
    result = pytester.runpytest_inprocess(*ARGS)
    result.assert_outcomes(passed=2, failed=3)
    calls = _reports(result)
    over = calls["test_over"].longreprtext
    assert over.splitlines()[0] == (
        "peak memory 1700500 bytes (1.6 MiB) is over the limit of 1572864 bytes "
        "(1.5 MiB, @pytest.mark.peak_memory('1.5MiB')) by +124.6 KiB"
    )
    assert "the peak is reached in no module's forward" in over  # the last tensor, allocated by the test
    assert (
        "live at the peak, by the module whose forward allocated it: "
        f"a 1000000 bytes (976.6 KiB), b.0 700000 bytes (683.6 KiB), {OUTSIDE} 500 bytes (500 B)"
    ) in over
    assert "no earlier pass of this test on this device" in over
    assert "Traceback" not in result.stdout.str()
    # two tensors of 1,000,000 bytes kept: 2,000,000 bytes, at the limit passes, one byte under fails
    assert _peak(calls["test_two_kept"]) == 2_000_000
    assert calls["test_two_kept"].passed
    assert "peak memory 2000000 bytes (1.9 MiB) is over the limit of 1999999 bytes" in calls[
        "test_two_kept_one_byte_over"
    ].longreprtext
    assert "by +1 B" in calls["test_two_kept_one_byte_over"].longreprtext
    # a freed tensor leaves the peak; the fixture's tensor was live before the call and is not counted
    assert _peak(calls["test_one_freed_before_the_next"]) == 1_048_576
    assert calls["test_one_freed_before_the_next"].passed
    # a profiler the test runs itself takes the allocator events: said, not measured as zero
    assert "recording was ended by a torch.profiler session the test ran itself" in calls[
        "test_profiles_itself"
    ].longreprtext
    assert _cached(pytester, "test_exact.py::test_two_kept") == {
        "peak_bytes": 2_000_000, "device": "cpu", "modules": {OUTSIDE: 2_000_000}
    }
    assert not (pytester.path / ".pytest_cache/v/ckpt_tune/peak_memory/test_exact.py::test_over").exists()


def test_after_a_pass_a_module_that_grew_is_named_with_its_bytes(pytester) -> None:
    pytester.makepyfile(test_tiny=TINY.format(widths=[64, 64], limit='"64MiB"'))
    first = pytester.runpytest_inprocess(*ARGS)
    first.assert_outcomes(passed=1)
    passed = _cached(pytester, "test_tiny.py::test_step")
    assert passed["peak_bytes"] == _peak(_reports(first)["test_step"])
    assert sum(passed["modules"].values()) == passed["peak_bytes"]  # every byte live at the peak has an owner
    assert {"blocks.0.mlp.fc", "blocks.1.mlp.fc", "blocks.1.attn.qkv"} <= set(passed["modules"])

    # blocks.1's MLP four times wider, and the limit at the last pass's peak
    pytester.makepyfile(test_tiny=TINY.format(widths=[64, 256], limit=passed["peak_bytes"]))
    second = pytester.runpytest_inprocess(*ARGS)
    second.assert_outcomes(failed=1)
    report = _reports(second)["test_step"]
    text = report.longreprtext
    now = _peak(report)
    assert text.splitlines()[0].startswith(f"peak memory {now} bytes")
    assert f"over the limit of {passed['peak_bytes']} bytes" in text
    grew_line = next(line for line in text.splitlines() if line.startswith("modules that grew"))
    assert f"(peak then {passed['peak_bytes']} bytes" in grew_line
    # fc's output (kept for GELU's backward) and GELU's (kept for out's): batch 4 x seq 16 x width x 4 bytes
    assert passed["modules"]["blocks.1.mlp.fc"] == passed["modules"]["blocks.1.mlp"] == 4 * 16 * 64 * 4
    for name in ("blocks.1.mlp.fc", "blocks.1.mlp"):
        assert f"{name} 16384 -> 65536 bytes (+49152 (+300.0%))" in grew_line
    assert "blocks.0." not in grew_line  # blocks.0 is unchanged
    # the cache still holds the last pass: a failure does not overwrite it
    assert _cached(pytester, "test_tiny.py::test_step") == passed


@pytest.mark.parametrize(
    ("marker", "says"),
    [
        ('"200XB"', "@pytest.mark.peak_memory('200XB'): the size '200XB' has an unknown unit 'XB'"),
        ('"lots"', "@pytest.mark.peak_memory('lots'): the size 'lots' is not a memory size"),
        ("", "@pytest.mark.peak_memory(): takes one size and an optional device="),
        (
            '"1GB", device="meta"',
            "@pytest.mark.peak_memory('1GB', device='meta'): device 'meta' is not one whose allocator can be read",
        ),
    ],
    ids=["unit", "not-a-size", "no-size", "meta"],
)
def test_a_bad_marker_is_that_tests_error_with_the_accepted_forms(pytester, marker: str, says: str) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.peak_memory({marker})
        def test_marked():
            pass

        def test_other():
            pass
        """
    )
    result = pytester.runpytest_inprocess(*ARGS)
    result.assert_outcomes(passed=1, errors=1)
    text = _reports(result, "setup")["test_marked"].longreprtext
    assert text.splitlines()[0] == says
    assert text.splitlines()[1].startswith("hint: ")
    assert "Traceback" not in result.stdout.str()


def test_an_unmarked_test_runs_as_without_the_plugin(pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch
        from torch.nn.modules import module


        def measured():
            return torch._C._autograd._profiler_enabled(), bool(module._global_forward_pre_hooks)


        def test_plain():
            x = torch.empty(10_000_000, dtype=torch.uint8)
            assert measured() == (False, False)


        @pytest.mark.peak_memory("1KiB")
        def test_marked():
            assert measured() == (True, True)
        """
    )
    result = pytester.runpytest_inprocess(*ARGS)
    result.assert_outcomes(passed=2)
    calls = _reports(result)
    assert calls["test_plain"].user_properties == []
    assert _peak(calls["test_marked"]) == 0
    stored = pytester.path / ".pytest_cache/v/ckpt_tune/peak_memory"
    assert sorted(p.name for p in stored.iterdir()) == ["test_an_unmarked_test_runs_as_without_the_plugin.py::test_marked"]
    # loading the plugin, as every pytest run does, imports no torch
    code = "import sys, ckpt_tune.integrations.pytest_plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_names_come_from_the_roots_seen_and_two_roots_are_prefixed_by_class() -> None:
    inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    outer = nn.ModuleDict({"body": inner})
    loss = nn.MSELoss()
    assert module_names([outer, inner, inner[0]]) == ["", "body", "body.0"]
    # a submodule seen before its parent is still named from the root
    assert module_names([inner[0], outer, inner]) == ["body.0", "", "body"]
    assert module_names([outer, inner[1], loss, nn.MSELoss()]) == [
        "ModuleDict", "ModuleDict.body.1", "MSELoss", "MSELoss#2"
    ]


def test_each_allocation_belongs_to_the_innermost_forward_running_and_the_owners_add_up_to_the_peak() -> None:
    # module 0 runs from t=10 to 50 and module 1 inside it from 20 to 30; the peak is at t=40
    events = [(5, 100, 1), (15, 200, 2), (25, 400, 3), (35, 1000, 4), (45, -400, 3), (55, 50, 5), (60, -1000, 4)]
    markers = {"pm>0": [10], "pm<0": [50], "pm>1": [20], "pm<1": [30]}
    peak, owners, at = attribute(Timeline.of(events, markers))
    assert peak == 1700
    assert owners == {None: 100, 0: 1200, 1: 400}
    assert at == 0
    assert attribute(Timeline.of([(1, 10, 1), (2, -10, 1)], {})) == (10, {None: 10}, None)
    assert attribute(Timeline()) == (0, {}, None)


def test_read_marker_takes_sizes_as_the_budgets_do() -> None:
    assert read_marker(("200MiB",), {}).bytes == 200 * 2**20
    assert read_marker(("24GB",), {}).bytes == 24 * 2**30
    assert read_marker((2_000_000,), {"device": "cpu"}).bytes == 2_000_000
    if not torch.cuda.is_available():
        with pytest.raises(CkptTuneError, match="sees no CUDA device"):
            read_marker(("1GB",), {"device": "cuda"})
