"""Run reports (PNG and table), ``pt-ray report``, the progress reporter and TensorBoard export,
on a literal summary: no processes."""

import argparse
import io
import json
import struct
from pathlib import Path

import pytest

from pt_ray.reporting.progress import EpochProgress, RunProgress
from pt_ray.reporting.report import (
    Transition,
    cache_epochs,
    format_comparison,
    format_table,
    render_report,
    transitions,
)
from pt_ray.cli.report import add_report_parser, run_report
from pt_ray.reporting.summary import EpochRecord, read_summary

pytestmark = pytest.mark.unit

# (num_frozen, K, R, M, throughput, epoch_time, transition_time, cache_hit_rate, loss, metric)
ROWS = [
    (0, 4, 1, 8, 100.0, 10.0, 0.0, 0.0, 2.0, 0.40),
    (0, 4, 1, 8, 110.0, 9.0, 0.0, 0.0, 1.5, 0.55),
    (3, 2, 2, 4, 180.0, 5.5, 0.25, 0.0, 1.0, 0.70),
    (6, 1, 4, 1, 400.0, 2.5, 0.5, 0.5, 0.6, 0.80),
    (6, 1, 4, 1, 650.0, 1.5, 0.0, 1.0, 0.5, 0.82),
]
L = 8


def make_summary(rows=ROWS, metric="accuracy", engine="ray") -> dict:
    timeline = [EpochRecord(e, n, L, k, r, m, tp, et, tt, hit, loss, met)
                for e, (n, k, r, m, tp, et, tt, hit, loss, met) in enumerate(rows)]
    return {
        "wall_time_s": 61.5,
        "epochs": len(timeline),
        "metric_name": metric,
        "final_eval_metric": timeline[-1].eval_metric,
        "timeline": [t.__dict__ for t in timeline],
        "config": {"name": "tiny", "engine": engine, "model": {"family": "timm", "depth": L},
                   "data": {"name": "digits", "batch_size": 32},
                   "pipeline": {"num_workers": 4}, "freeze": {"policy": "paper", "alpha": 0.5}},
        "engine": engine,
    }


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps(make_summary()))
    return d


def test_transitions_and_cache_epochs_from_the_timeline():
    tl = make_summary()["timeline"]
    assert transitions(tl) == [
        Transition(2, (("frozen", 0, 3), ("K", 4, 2), ("R", 1, 2))),
        Transition(3, (("frozen", 3, 6), ("K", 2, 1), ("R", 2, 4))),
    ]
    assert transitions(tl)[0].label() == "frozen 0->3, K 4->2, R 1->2"
    assert cache_epochs(tl) == [3, 4]


def test_table_has_one_row_per_epoch_with_its_numbers(run_dir):
    text = format_table(run_dir)
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("epoch"))
    assert lines[header].split()[:11] == ["epoch", "frozen/L", "K", "R", "M", "samples/s",
                                          "epoch", "s", "trans", "s", "cache"]
    assert "accuracy" in lines[header]
    body = lines[header + 2: header + 2 + len(ROWS)]
    assert len(body) == len(ROWS)
    assert body[0].split() == ["1", "0/8", "4", "1", "8", "100", "10.00", "0.00", "-",
                               "2.0000", "0.4000"]
    assert body[2].split() == ["3", "3/8", "2", "2", "4", "180", "5.50", "0.25", "-",
                               "1.0000", "0.7000", "frozen", "0->3,", "K", "4->2,", "R", "1->2"]
    assert body[3].split()[:11] == ["4", "6/8", "1", "4", "1", "400", "2.50", "0.50", "50%",
                                    "0.6000", "0.8000"]
    assert body[4].split() == ["5", "6/8", "1", "4", "1", "650", "1.50", "0.00", "100%",
                               "0.5000", "0.8200"]
    assert lines[header + 2 + len(ROWS)].startswith("---")
    foot = "\n".join(lines[header + 3 + len(ROWS):])
    assert "train time 28.50 s" in foot and "wall time 61.5 s" in foot
    # 5 epochs of 8 blocks (a block: forward 1, backward 2) against 0, 0, 3, 6, 6 frozen, a
    # frozen block running its forward only: (5*24) / (24+24+18+12+12) = 1.33; with the cache a
    # frozen block costs nothing from the epoch after it froze (its rows are read then):
    # 120 / (24+24+(15+3)+(6+3)+6) = 1.48, not 120 / (24+24+15+6+6) = 1.60.
    assert "ideal speedup bound from the freeze timeline: 1.33x" in foot
    assert ("1.48x with the cache, serving each frozen block from the epoch after it froze"
            in foot)


def test_table_tells_a_filling_cache_from_an_off_one():
    summary = make_summary()
    summary["timeline"][2]["cache_objects"] = 4  # on, filling: holds rows, served none
    rows = [ln.split() for ln in format_table(summary).splitlines()]
    cache = {r[0]: r[8] for r in rows if r and r[0].isdigit()}
    assert cache == {"1": "-", "2": "-", "3": "0%", "4": "50%", "5": "100%"}


def test_table_with_a_baseline_gives_the_measured_speedup(run_dir, tmp_path):
    base = make_summary([(0, 4, 1, 8, 100.0, 10.0, 0.0, 0.0, 2.0, 0.4)] * 5)
    text = format_table(run_dir, baseline=base)
    # 50 s of baseline training against 28.5 s: 1.75x, against the bound with the cache (this
    # run's cache served): 1.7544 / 1.4815 = 118%.
    assert "measured speedup 1.75x over the baseline's train time 50.00 s" in text
    assert "(118% of the ideal 1.48x)" in text


def test_comparison_has_one_row_per_run(run_dir):
    base = make_summary([(0, 4, 1, 8, 100.0, 10.0, 0.0, 0.0, 2.0, 0.4)] * 5)
    lines = format_comparison({"alpha=0.5": run_dir, "no freezing": base}).splitlines()
    assert lines[0].split() == ["run", "epochs", "frozen/L", "K", "R", "train", "s", "wall",
                                "s", "samples/s", "ideal", "accuracy"]
    assert lines[2].split() == ["alpha=0.5", "5", "6/8", "1", "4", "28.50", "61.5", "288",
                                "1.33x", "0.8200"]
    assert lines[3].split() == ["no", "freezing", "5", "0/8", "4", "1", "50.00", "61.5", "100",
                                "1.00x", "0.4000"]


def test_png_is_written_and_not_blank(run_dir, tmp_path):
    from matplotlib.image import imread

    out = render_report(run_dir, tmp_path / "sub" / "report.png")
    assert out == tmp_path / "sub" / "report.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000
    img = imread(out)
    assert img.shape[0] > 1000 and img.shape[1] > 1000
    # Many colours: four panels of lines, fills and text, not an empty canvas.
    assert len({tuple(px) for px in img[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}) > 50


def test_png_from_a_dict_without_cache_or_transitions(tmp_path):
    rows = [(0, 1, 1, 1, 300.0, 3.0, 0.0, 0.0, 1.6, 0.7),
            (0, 1, 1, 1, 700.0, 2.0, 0.0, 0.0, 0.9, 0.8)]
    out = render_report(make_summary(rows, engine="reference"), tmp_path / "r.png")
    assert out.stat().st_size > 20_000


def test_missing_summary_names_the_path(tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(FileNotFoundError, match=f"{missing} does not exist"):
        read_summary(missing)
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "unfinished" / "summary.json")):
        read_summary(tmp_path / "unfinished")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "summary.json").write_text(json.dumps({"timeline": []}))
    assert read_summary(tmp_path / "empty")["timeline"] == []  # a summary, with no epochs
    with pytest.raises(ValueError, match="no epochs"):
        read_summary(tmp_path / "empty", need_epochs=True)
    (tmp_path / "bad.json").write_text(json.dumps({"timeline": [{"epoch": "first"}]}))
    with pytest.raises(ValueError, match=r"bad.json: timeline.0.epoch: .*integer.*; is it a "
                                         "summary.json this version of pt-ray wrote"):
        read_summary(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="no 'timeline'"):
        read_summary(tmp_path / "other.json")


def _parse(argv):
    parser = argparse.ArgumentParser(prog="pt-ray")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_writes_png_and_prints_table(run_dir, capsys):
    args = _parse(["report", str(run_dir)])
    assert args.func is run_report
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert (run_dir / "report.png").stat().st_size > 30_000
    assert f"report: {run_dir / 'report.png'}" in out
    assert "frozen/L" in out and "0->3" in out


def test_cli_no_table_and_out_path(run_dir, tmp_path, capsys):
    png = tmp_path / "elsewhere.png"
    args = _parse(["report", str(run_dir / "summary.json"), "--out", str(png), "--no-table"])
    assert run_report(args) == 0
    out = capsys.readouterr().out
    assert png.is_file() and "frozen/L" not in out


def test_cli_missing_summary_is_an_error_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "nothing-here"
    missing.mkdir()
    assert run_report(_parse(["report", str(missing)])) == 2
    err = capsys.readouterr().err
    assert err.startswith("pt-ray: error:") and str(missing / "summary.json") in err
    assert not (missing / "report.png").exists()


# --- TensorBoard ---------------------------------------------------------------------------


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every event file in ``logdir``: TFRecord framing (u64 length, u32 crc, data,
    u32 crc) around ``Event`` protos."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_tensorboard_event_file_has_the_timeline_scalars(run_dir, tmp_path):
    from pt_ray.reporting.tensorboard import scalar_tags, write_tensorboard

    logdir = write_tensorboard(run_dir, tmp_path / "tb")
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    scalars = read_scalars(logdir)
    expected = {"train/loss", "eval/accuracy", "throughput/samples_per_s", "layout/num_frozen",
                "layout/pipeline_length", "layout/num_replicas", "layout/num_microbatches",
                "cache/hit_rate", "time/epoch_s", "time/transition_s"}
    assert expected <= set(scalars) == set(scalar_tags("accuracy"))
    assert scalars["layout/num_frozen"] == [(1, 0.0), (2, 0.0), (3, 3.0), (4, 6.0), (5, 6.0)]
    assert scalars["layout/pipeline_length"] == [(1, 4.0), (2, 4.0), (3, 2.0), (4, 1.0), (5, 1.0)]
    assert [v for _, v in scalars["cache/hit_rate"]] == [0, 0, 0, 0.5, 1.0]
    assert [v for _, v in scalars["eval/accuracy"]] == pytest.approx([r[9] for r in ROWS])
    assert [v for _, v in scalars["throughput/samples_per_s"]] == [r[4] for r in ROWS]


# --- progress ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_lines_mode_writes_a_few_plain_lines():
    buf, clock = io.StringIO(), FakeClock()
    p = EpochProgress(40, 2, 10, stream=buf, mode="lines", clock=clock, min_line_interval_s=4)
    for step in range(41):
        p.update(step)
        clock.t += 0.5
    p.close("epoch  3/10  loss 0.5")
    lines = buf.getvalue().splitlines()
    assert lines == [
        "epoch  3/10: 25% (10/40 steps, 2.0 steps/s, ETA 00:15)",
        "epoch  3/10: 50% (20/40 steps, 2.0 steps/s, ETA 00:10)",
        "epoch  3/10: 75% (30/40 steps, 2.0 steps/s, ETA 00:05)",
        "epoch  3/10  loss 0.5",
    ]
    assert "\r" not in buf.getvalue()


def test_progress_lines_mode_is_silent_on_short_epochs():
    buf, clock = io.StringIO(), FakeClock()
    p = EpochProgress(40, 0, 1, stream=buf, mode="lines", clock=clock, min_line_interval_s=10)
    for step in range(41):  # a 6 s epoch: no mark is 10 s after the start
        p.update(step)
        clock.t += 0.15
    assert buf.getvalue() == ""
    p = EpochProgress(40, 0, 1, stream=buf, mode="lines", clock=clock, min_line_interval_s=10)
    for step in range(41):  # 20 s: 25% (5 s) too early, 50% (10 s) written, 75% (15 s) too soon
        p.update(step)
        clock.t += 0.5
    assert [ln.split(" (")[0] for ln in buf.getvalue().splitlines()] == ["epoch 1/1: 50%"]


def test_progress_bar_mode_redraws_in_place_and_clears():
    buf = io.StringIO()
    p = EpochProgress(10, 0, 2, stream=buf, mode="bar", min_interval_s=0)
    for step in range(11):
        p.update(step)
    text = buf.getvalue()
    # tqdm's bar, redrawn in place on one line: no newline until the epoch ends.
    assert "\n" not in text and text.count("\r") >= 10
    assert "epoch 1/2:" in text and "10/10" in text and "100%" in text
    p.close("done")
    assert buf.getvalue().endswith("\rdone\n")


def test_progress_auto_mode_follows_isatty():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert EpochProgress(5, 0, 1, stream=Tty()).bar
    assert not EpochProgress(5, 0, 1, stream=io.StringIO()).bar


def test_progress_disabled_writes_nothing():
    buf = io.StringIO()
    p = EpochProgress(10, 0, 1, enabled=False, stream=buf, mode="bar")
    for step in range(10):
        p.update(step)
    p.close("line")
    hook = RunProgress(2, 10, enabled=False, stream=buf)
    hook(0, 3)
    hook.end_epoch("x")
    assert buf.getvalue() == ""


def test_run_progress_is_an_on_step_hook_with_one_bar_per_epoch():
    buf = io.StringIO()
    hook = RunProgress(2, lambda epoch: 4 * (epoch + 1), stream=buf, mode="lines", every=0.5,
                       min_line_interval_s=0)
    for epoch in range(2):
        for step in range(4 * (epoch + 1)):
            hook(epoch, step)
        hook.end_epoch(f"epoch {epoch + 1} done")
    lines = [ln.split(" (")[0] for ln in buf.getvalue().splitlines()]
    assert lines == ["epoch 1/2: 50%", "epoch 1 done", "epoch 2/2: 50%", "epoch 2 done"]


def test_table_and_png_show_a_rollback(tmp_path):
    s = make_summary()
    undone = {**s["timeline"][3], "num_frozen": 7, "epoch_time_s": 2.25}
    s["rollbacks"] = [{"epoch": 3, "rollback_to": 3, "num_frozen": 6, "undone": 7,
                       "before": 0.70, "after": 0.61, "discarded": [undone]}]
    table = format_table(s)
    assert ("rollback: epoch 4's 0.6100 fell from 0.7000 after freezing 6 -> 7 blocks; returned "
            "to the start of epoch 4 with 6 frozen (1 epoch undone, 2.25 s of training not in "
            "the train time above)") in table
    assert "rollback" not in format_table(make_summary())
    assert render_report(s, tmp_path / "r.png").stat().st_size > 30_000


def test_cache_nodes_table_shows_each_node_and_is_empty_without_them():
    from pt_ray.reporting.report import cache_nodes_table

    node = {"bytes": 3 * 2**20, "objects": 8, "local_reads": 16, "remote_reads": 0,
            "refused_rows": 2, "spilled_bytes": 0}
    table = cache_nodes_table({**make_summary(), "cache": {"nodes": {
        "a" * 40: node, "b" * 40: {**node, "remote_reads": 5}}}})
    lines = table.splitlines()
    assert lines[0].startswith("activation cache per node") and len(lines) == 4
    assert lines[2].split() == ["a" * 12, "3.0", "8", "16", "0", "2", "0.0"]
    assert lines[3].split()[4] == "5"
    # With the run's totals: the distinct size, then what both nodes' stores hold together.
    lines = cache_nodes_table({**make_summary(), "cache": {
        "bytes": 3 * 2**20, "objects": 8, "stored_bytes": 6 * 2**20, "stored_objects": 16,
        "nodes": {"a" * 40: node, "b" * 40: node}}}).splitlines()
    assert len(lines) == 5 and lines[1] == ("cache 3.0 MiB in 8 blocks, stored as 6.0 MiB in "
                                            "16 blocks on 2 nodes")
    assert cache_nodes_table({**make_summary(), "cache": {}}) == ""
    assert cache_nodes_table(make_summary()) == ""
