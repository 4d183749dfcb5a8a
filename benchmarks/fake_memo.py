"""Fake steps with and without the op memo (ckpt_tune/measure/fake_memo.py), side by side.

For each example, one runner under fake tensors with the CPU allocator's rules records the same step
(every other block checkpointed, at `--batch`) alternately with the memo and without it, after one
warm-up of each; the table gives the median seconds of each and their ratio, and whether the two
recorded timelines were equal event for event (they must be).

    .venv/bin/python benchmarks/fake_memo.py [--repeats 7] [--batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import md_table, write_results  # noqa: E402
from ckpt_tune.measure import fake  # noqa: E402
from ckpt_tune.measure.fake_memo import OpMemo  # noqa: E402
from ckpt_tune.measure.runner import StepSettings  # noqa: E402
from ckpt_tune.measure.session import Settings, fake_twin, load  # noqa: E402
from ckpt_tune.tune.candidates import find_blocks  # noqa: E402

EXAMPLES = ["gpt", "hf_gpt2", "vit", "resnet", "unet", "qlora_gpt"]


def _timeline(m):
    tl = m.timeline
    return m.peak_bytes, tl.times, tl.deltas, tl.live, tl.markers


def run(name: str, batch: int, repeats: int) -> dict:
    runner = fake_twin(load(f"examples/{name}.py:build", Settings(device="cpu")), StepSettings(device="cpu"))
    units = find_blocks(runner.model)
    checkpoint = units[::2]
    memo = OpMemo()
    seconds: dict[str, list[float]] = {"with": [], "without": []}
    timelines = {}
    for k in range(repeats + 1):
        for label, m in (("with", memo), ("without", None)):
            fake.MEMO = m
            t0 = time.perf_counter()
            rec = runner.measure(batch, checkpoint=checkpoint, units=units)
            if k:  # the first of each is the warm-up
                seconds[label].append(time.perf_counter() - t0)
            timelines[label] = _timeline(rec)
    fake.MEMO = OpMemo()
    with_s, without_s = statistics.median(seconds["with"]), statistics.median(seconds["without"])
    return {
        "example": name, "batch": batch, "checkpointed": len(checkpoint), "blocks": len(units),
        "with_memo_s": with_s, "without_memo_s": without_s, "ratio": without_s / with_s,
        "equal_timelines": timelines["with"] == timelines["without"], "peak_bytes": timelines["with"][0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in EXAMPLES:
        rows.append(run(name, args.batch, args.repeats))
        r = rows[-1]
        print(f"{name}: {r['without_memo_s']:.3f} s -> {r['with_memo_s']:.3f} s ({r['ratio']:.2f}x), equal {r['equal_timelines']}", flush=True)
    body = "\n\n".join([
        f"One torch thread; each example's step (every other block checkpointed, batch {args.batch}) recorded under fake "
        f"tensors with the CPU allocator's rules, alternately with and without the memo, {args.repeats} times each after "
        "a warm-up of each; median seconds.",
        md_table(
            ["example", "blocks (checkpointed)", "without memo", "with memo", "ratio", "timelines equal", "peak B"],
            [[r["example"], f"{r['blocks']} ({r['checkpointed']})", f"{r['without_memo_s']:.3f} s", f"{r['with_memo_s']:.3f} s",
              f"{r['ratio']:.2f}x", "yes" if r["equal_timelines"] else "NO", f"{r['peak_bytes']:,}"] for r in rows],
        ),
    ])
    print(body)
    write_results("fake_memo", "Fake steps with and without the op memo", {"rows": rows, "repeats": args.repeats}, body)


if __name__ == "__main__":
    main()
