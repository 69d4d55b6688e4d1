"""The run folder's files are written whole or not at all, and a folder belongs to one live run:
a second run given it stops in one line naming the first, before it writes anything."""

from __future__ import annotations

import json
import os

import pytest

from pt_ray.api import fit
from pt_ray.cli import main
from pt_ray.reporting.files import (LOCK_FILE, RunFolderBusy, hold_run_folder,
                                    replaced_atomically, write_text_atomically)
from pt_ray.reporting.summary import read_summary

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

TINY = {"name": "tiny", "engine": "reference", "epochs": 1,
        "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 16,
                  "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
        "data": {"name": "digits", "batch_size": 64}, "logging": {"report": False}}


def test_a_held_folder_refuses_a_second_holder_by_name_until_released(tmp_path):
    run = tmp_path / "run"
    with hold_run_folder(run):
        holder = json.loads((run / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(RunFolderBusy) as err:
            with hold_run_folder(run):
                pass
        message = str(err.value)
        assert message.startswith(f"run folder {str(run)!r} is in use by another run (pid "
                                  f"{os.getpid()} on ")
        assert "choose another --output" in message and "\n" not in message
    with hold_run_folder(run):  # released at the end of the block (and when a process dies)
        pass


def test_a_second_run_in_a_held_folder_stops_before_writing(tmp_path, capsys):
    run = tmp_path / "run"
    with hold_run_folder(run):
        with pytest.raises(RunFolderBusy):
            fit(TINY, output_dir=run)
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
        assert main(["train", "--set", "engine=reference", "--set", "epochs=1",
                     "--output", str(run)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pt-ray: error: run folder ") and err.count("\n") == 1
    result = fit(TINY, output_dir=run)  # free again: the run goes through
    assert read_summary(run)["epochs"] == 1 and result.run_dir == run
    assert (run / "config.yaml").is_file()
    assert not [p for p in run.iterdir() if ".tmp" in p.name]


def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path):
    target = tmp_path / "summary.json"
    write_text_atomically(target, '{"epochs": 1}')
    with pytest.raises(KeyboardInterrupt):
        with replaced_atomically(target) as tmp:
            tmp.write_text('{"epo')  # half written when the run is stopped
            raise KeyboardInterrupt
    assert target.read_text() == '{"epochs": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_replace_is_trusted_only_after_the_bytes_and_the_folder_entry_are_on_disk(tmp_path,
                                                                                   monkeypatch):
    """The order a power loss needs: the new file's bytes are fsynced before the rename (else
    the rename can land before the data: an empty summary), and the folder after it (else the
    rename itself can be lost)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "summary.json"
    write_text_atomically(target, '{"epochs": 2}')
    assert target.read_text() == '{"epochs": 2}'
    assert len(events) == 3
    (kind0, first), (kind1, moved), (kind2, folder) = events
    assert kind0 == "fsync" and first.startswith(str(tmp_path / ".summary.")) and ".tmp" in first
    assert (kind1, moved) == ("replace", str(target))
    assert (kind2, folder) == ("fsync", str(tmp_path))
