"""Does the advice survive the recordings a production exporter would make? Every matrix
recording replayed as recorded and again with scrapes or KV-event messages lost.

    PYTHONPATH=. .venv/bin/python -m bench.perturb_replay [tests/fixtures/gpu/matrix] [RUN ...]
        [--drop-scrapes 0.1] [--drop-events 0.02] [--seed 7] [--json]

The matrix was recorded on a quiet machine: every 1 s scrape answered and every KV-event
message arrived. A live exporter loses some of both: a scrape that times out under load
(the window then has a 2 s interval), a ZMQ message dropped at the publisher's high-water
mark or a subscriber that fell behind (the what-if then misses the blocks of a step, and a
block it never saw stored cannot be a hit). Each recording is replayed three times with
default thresholds: as recorded (the baseline), with each scrape dropped with probability
`--drop-scrapes`, and with each event message dropped with probability `--drop-events`
(the same seed for every run, so a run is perturbed the same way each time). Each final
advice is judged against the measured truth at the size it speaks about
(bench/advice_eval.py `Truths.judge`), and the summary gives, per perturbation, how many
final actions (and recommended sizes) stayed those of the baseline, how many agree with the
truth, and how many are harmful.
"""

from __future__ import annotations

import json
import lzma
import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.advice_eval import MATRIX, Truths
from bench.common import markdown_table, recording_metas, recordings_parser
from bench.pool import replay_pool
from exporter.config import Config
from exporter.recording import KV_EVENTS, METRICS, open_text
from exporter.replay import replay_one

# The perturbations, in the order of the table: the baseline first.
MODES = ("as recorded", "scrapes dropped", "events dropped")


def perturbed(src: Path, dest: Path, drop: str | None, share: float, seed: int) -> Path:
    """A copy of the recording `src` under `dest` where each line of `drop` (METRICS or
    KV_EVENTS, the file with or without .xz) is left out with probability `share`; every other
    file as it is. The same seed leaves out the same lines."""
    out = dest / src.name
    out.mkdir(parents=True)
    rnd = random.Random(seed)
    for f in sorted(src.iterdir()):
        if drop is not None and f.name in (drop, f"{drop}.xz"):
            with open_text(f) as lines:
                kept = [
                    line for line in lines.read().splitlines() if line and rnd.random() >= share
                ]
            with lzma.open(out / f"{drop}.xz", "wt") as o:
                o.write("".join(f"{line}\n" for line in kept))
        elif f.is_file():
            shutil.copy(f, out / f.name)
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    run: str
    mode: str
    action: str
    reason: str
    recommended_bytes: float | None
    truth: str = "unknown"  # at the size the advice speaks about
    agrees: bool = False
    harmful: bool = False


def _replay(job: tuple[Path, str, str | None, float, int]) -> Outcome:
    """One replay with default thresholds (a worker process)."""
    run, mode, drop, share, seed = job
    with tempfile.TemporaryDirectory() as tmp:
        rec = perturbed(run, Path(tmp), drop, share, seed) if drop else run
        r = replay_one(rec, Config())
    (e,) = (x for t in r.final.targets for x in t.engines)
    a = e.advice
    return Outcome(run.name, mode, str(a.action), str(a.reason), a.recommended_buffer_bytes)


def evaluate(
    root: Path,
    names: Sequence[str] = (),
    drop_scrapes: float = 0.1,
    drop_events: float = 0.02,
    seed: int = 7,
    workers: int | None = None,
) -> list[Outcome]:
    """Every recording (or those named) under each perturbation, judged."""
    metas = recording_metas(root, names)
    runs = [root / n for n in (names or sorted(metas))]
    jobs = [
        job
        for r in runs
        for job in (
            (r, MODES[0], None, 0.0, seed),
            (r, MODES[1], METRICS, drop_scrapes, seed),
            (r, MODES[2], KV_EVENTS, drop_events, seed),
        )
    ]
    with replay_pool(workers) as pool:
        done = list(pool.map(_replay, jobs))
    truths = Truths(root)
    out = []
    for o in done:
        truth, agrees, harmful = truths.judge(o.run, o.action, o.recommended_bytes)
        out.append(Outcome(**{**asdict(o), "truth": truth, "agrees": agrees, "harmful": harmful}))
    return out


@dataclass(frozen=True, slots=True)
class Row:
    """One perturbation over every run."""

    mode: str
    runs: int
    same_as_recorded: int  # final action and recommended size those of the baseline
    agree: int
    harmful: tuple[str, ...]
    changed: tuple[str, ...]


def summary(outcomes: Sequence[Outcome]) -> list[Row]:
    """Per perturbation, against the baseline (MODES[0]) of the same runs."""
    base = {o.run: o for o in outcomes if o.mode == MODES[0]}

    def same(o: Outcome) -> bool:
        b = base[o.run]
        return (o.action, o.recommended_bytes) == (b.action, b.recommended_bytes)

    rows = []
    for mode in MODES:
        got = [o for o in outcomes if o.mode == mode]
        rows.append(
            Row(
                mode,
                len(got),
                sum(same(o) for o in got),
                sum(o.agrees for o in got),
                tuple(sorted(o.run for o in got if o.harmful)),
                tuple(sorted(o.run for o in got if not same(o))),
            )
        )
    return rows


def _action(o: Outcome) -> str:
    size = f" {o.recommended_bytes / (1 << 30):.0f} GiB" if o.recommended_bytes else ""
    return f"{o.action}{size} ({o.reason}; {o.truth})"


def markdown(outcomes: Sequence[Outcome]) -> str:
    """The summary table, then each run whose final advice changed, in every mode."""
    rows = summary(outcomes)
    base = rows[0]
    lines = [
        markdown_table(
            ("replayed", "runs", "final advice as recorded", "agree", "harmful"),
            [
                (
                    r.mode,
                    str(r.runs),
                    f"{r.same_as_recorded} ({r.same_as_recorded / max(r.runs, 1):.0%})",
                    f"{r.agree} ({r.agree / max(base.agree, 1):.2f} x as recorded)",
                    ", ".join(r.harmful) or "none",
                )
                for r in rows
            ],
        )
    ]
    by = {(o.run, o.mode): o for o in outcomes}
    changed = sorted({run for r in rows for run in r.changed})
    if changed:
        lines += [
            "",
            markdown_table(
                ("run", *MODES), [(run, *(_action(by[run, m]) for m in MODES)) for run in changed]
            ),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = recordings_parser(__doc__, MATRIX, "recordings to replay (default: all)")
    ap.add_argument("--drop-scrapes", type=float, default=0.1, metavar="SHARE")
    ap.add_argument("--drop-events", type=float, default=0.02, metavar="SHARE")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    for share in (args.drop_scrapes, args.drop_events):
        if not 0.0 <= share < 1.0:
            ap.error(f"a share to drop is in [0, 1): {share}")
    outcomes = evaluate(args.root, args.runs, args.drop_scrapes, args.drop_events, args.seed)
    if args.json:
        doc = {
            "summary": [asdict(r) for r in summary(outcomes)],
            "runs": [asdict(o) for o in outcomes],
        }
        print(json.dumps(doc))
    else:
        print(markdown(outcomes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
