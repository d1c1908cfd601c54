"""Checksums in the completion marker, and deletes that never leave a half checkpoint
(fitrl/checkpoint/layout.py): files only, no model."""

from __future__ import annotations

import json

import pytest

from fitrl.checkpoint import layout
from fitrl.core.errors import CheckpointError


def save(root, step, payload=b"0123456789" * 100):
    tmp = layout.begin(root, step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "__0_0.distcp").write_bytes(payload)
    (tmp / "trainer_state.json").write_text('{"step": %d}' % step)
    return layout.finalize(tmp, {"step": step})


def test_the_marker_records_a_checksum_of_every_file(tmp_path):
    path = save(tmp_path, 1)
    meta = json.loads((path / layout.MARKER).read_text())
    assert meta["hash"] == "xxh3_128" and set(meta["hashes"]) == set(meta["files"]) == {
        "actor/__0_0.distcp", "trainer_state.json"}
    assert meta["hashes"]["actor/__0_0.distcp"] == layout.file_hash(path / "actor" / "__0_0.distcp")
    assert layout.read(path).step == 1


def test_same_size_damage_is_found_and_names_the_file(tmp_path):
    path = save(tmp_path, 1)
    shard = path / "actor" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[500] ^= 1  # one bit, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: checksum differs from the one recorded"):
        layout.read(path)
    point = layout.read(path, verify=False)  # the marker alone still reads
    assert [rel for rel, _ in layout.damaged(layout.verify_files(path, point.meta))] == ["actor/__0_0.distcp"]


def test_verify_files_reports_every_file(tmp_path):
    path = save(tmp_path, 1)
    (path / "trainer_state.json").unlink()
    results = dict(layout.verify_files(path, json.loads((path / layout.MARKER).read_text())))
    assert results["actor/__0_0.distcp"] == "ok"
    assert results["trainer_state.json"].startswith("missing")


def test_a_marker_without_checksums_still_loads_by_sizes(tmp_path):
    path = save(tmp_path, 1)
    marker = path / layout.MARKER
    meta = json.loads(marker.read_text())
    del meta["hash"], meta["hashes"]
    marker.write_text(json.dumps(meta))
    assert layout.read(path).step == 1
    assert {status for _, status in layout.verify_files(path, meta)} == {"ok (size only: no checksum recorded)"}
    (path / "trainer_state.json").write_text("{}")  # a size change is still found
    with pytest.raises(CheckpointError, match="trainer_state.json is 2 bytes, 11 when it was saved"):
        layout.read(path)


def test_replacing_and_removing_never_leave_a_half_checkpoint(tmp_path):
    first = save(tmp_path, 2, payload=b"a" * 10)
    again = save(tmp_path, 2, payload=b"b" * 10)  # an abandoned later branch's step_2, replaced
    assert again == first and (again / "actor" / "__0_0.distcp").read_bytes() == b"b" * 10
    assert [d.name for d in tmp_path.iterdir()] == ["step_2"]  # the old one is gone, no leftovers
    layout.remove(again)
    assert list(tmp_path.iterdir()) == []
    layout.remove(again)  # gone already: nothing to do


def test_a_step_dir_without_marker_is_reported_never_deleted(tmp_path):
    path = save(tmp_path, 3)
    (path / layout.MARKER).unlink()  # e.g. a copy that stopped before the marker
    partial = layout.begin(tmp_path, 4)  # an interrupted save
    assert layout.clean_partial(tmp_path) == [partial.name]
    assert path.is_dir() and layout.incomplete(tmp_path) == [path]
    assert layout.list_complete(tmp_path) == []
