"""The lent-device path (tools/device_train.py) without a device or a model: a pack split over calls that
each carry part of it, staged and assembled byte for byte, and the drafter brought back in <= 16 MiB files.
The jobs themselves (data, train, snapshot) are the CLI's, tested elsewhere; `python -m
tools.device_train dry-run` runs the whole path with them on the CPU (docs/TRAINING.md)."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tools import device_train as DT

TINY = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny.yaml"


def test_split_and_join_round_trip_and_catch_a_bad_part(tmp_path):
    blob = np.random.default_rng(0).bytes(10_000)
    (tmp_path / "blob").write_bytes(blob)
    (tmp_path / "parts").mkdir()
    parts = DT.split_file(tmp_path / "blob", tmp_path / "parts", 4096)
    assert [p["bytes"] for p in parts] == [4096, 4096, 1808] and parts[2]["name"] == "blob.002"
    whole = DT.sha256(tmp_path / "blob")
    DT.join_parts(parts, tmp_path / "parts", tmp_path / "joined", whole)
    assert (tmp_path / "joined").read_bytes() == blob
    (tmp_path / "parts" / "blob.001").write_bytes(b"x" * 4096)
    with pytest.raises(DT.DeviceTrainError, match="blob.001 is corrupt"):
        DT.join_parts(parts, tmp_path / "parts", tmp_path / "joined2", whole)
    (tmp_path / "parts" / "blob.001").unlink()
    with pytest.raises(DT.DeviceTrainError, match="missing part blob.001"):
        DT.join_parts(parts, tmp_path / "parts", tmp_path / "joined2", whole)
    assert not (tmp_path / "joined2").exists()


def test_plan_calls_fills_calls_and_leaves_room_for_the_common_folder():
    assert DT.plan_calls(100, 10, 40) == [40, 40, 20]  # the last: 20 + 10 <= 40
    assert DT.plan_calls(100, 15, 40) == [40, 40, 20]
    assert DT.plan_calls(100, 25, 40) == [40, 40, 20, 0]  # 20 + 25 > 40: the common folder goes alone
    assert DT.plan_calls(5, 10, 40) == [5]
    with pytest.raises(DT.DeviceTrainError, match="less than the .* wheels and data files"):
        DT.plan_calls(100, 40, 40)


def test_pack_stage_over_calls_assemble_and_results_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "shared"
    (data / "evals").mkdir(parents=True)
    (data / "evals" / "test.jsonl").write_text('{"question": "what is 2 + 2?"}\n')
    config = tmp_path / "device.yaml"
    config.write_text(f"extends: {TINY}\ndata:\n  datasets:\n    - name: self\n      limit: 8\n"
                      "      decontaminate: ['${SPECDEC_DATA}/evals/test.jsonl']\n")
    model = tmp_path / "model.gguf"
    model.write_bytes(np.random.default_rng(1).bytes(300_000))  # incompressible: xz keeps its size
    with pytest.raises(DT.DeviceTrainError, match="under \\$SPECDEC_DATA: set SPECDEC_DATA"):
        monkeypatch.delenv("SPECDEC_DATA", raising=False)
        DT.pack(str(config), tmp_path / "pack", model_file=model, room=150_000, wheels=False)
    plan = DT.pack(str(config), tmp_path / "pack", model_file=model, room=150_000, wheels=False,
                   data_root=str(data))
    assert plan["data_files"] == ["evals/test.jsonl"] and len(plan["parts"]) == 3
    assert (tmp_path / "pack" / "common" / "data" / "evals" / "test.jsonl").is_file()
    calls = DT.calls(plan)
    assert [c["carry"] for c in calls] == [[".device/part0"], [".device/part1"], [".device/part2", ".device/common"]]
    assert len({c["command"] for c in calls}) == 1 and all(len(c["command"]) < 2000 for c in calls)

    stage = tmp_path / "stage"
    for i, call in enumerate(calls):  # each call sees only what it carries
        carried = tmp_path / f"call{i}" / ".device"
        for path in call["carry"]:
            shutil.copytree(tmp_path / "pack" / Path(path).name, carried / Path(path).name)
        got, missing = DT.stage_parts(carried, stage)
        assert got["xz_sha256"] == plan["xz_sha256"] and len(missing) == 2 - i
    gguf = DT.assemble_model(plan, stage, tmp_path / "device_cache")
    assert gguf == tmp_path / "device_cache" / "models" / "tiny" / "model.gguf"
    assert gguf.read_bytes() == model.read_bytes()

    with pytest.raises(DT.DeviceTrainError, match="carries no part of a pack"):
        DT.stage_parts(tmp_path / "nothing", stage)
    bad = tmp_path / "bad" / ".device" / "part1"
    shutil.copytree(tmp_path / "pack" / "part1", bad)
    (bad / "model.xz.001").write_bytes(b"not the part")
    with pytest.raises(DT.DeviceTrainError, match="corrupt"):
        DT.stage_parts(bad.parent, stage)

    # the results: each drafter's params split under the file limit, the rest in one bundle, unpacked into one
    # drafter directory per drafter
    monkeypatch.setattr(DT, "OUT_FILE_LIMIT", 50_000)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    np.savez(drafter / "params.npz", w=np.random.default_rng(2).standard_normal(30_000).astype(np.float32))
    (drafter / "drafter.json").write_text(json.dumps({"drafter": "dspark"}))
    (tmp_path / "log.txt").write_text("the device's log\n")
    out = tmp_path / "OUT"
    DT.write_results({"dspark_s0": drafter}, [tmp_path / "log.txt", tmp_path / "absent.json"], out,
                     {"reached": "drafters", "jobs": []})
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bundle.tar.gz", "device.json", "dspark_s0.params.npz.000", "dspark_s0.params.npz.001",
                     "dspark_s0.params.npz.002"]
    assert all(os.path.getsize(out / f) <= 50_000 for f in files if ".params." in f)
    manifest = DT.unpack(out, tmp_path / "back")
    assert manifest["reached"] == "drafters"
    back = tmp_path / "back" / "dspark_s0"
    assert (back / "params.npz").read_bytes() == (drafter / "params.npz").read_bytes()
    assert json.loads((back / "drafter.json").read_text()) == {"drafter": "dspark"}
    assert (tmp_path / "back" / "device" / "log.txt").read_text() == "the device's log\n"
    # a run that got no drafter and ran no job says how far it got
    DT.write_results({}, [tmp_path / "log.txt"], tmp_path / "OUT2", {"reached": "staged",
                                                                   "error": "the install failed"})
    with pytest.raises(DT.DeviceTrainError, match="no drafter .*reached: staged.*the install failed"):
        DT.unpack(tmp_path / "OUT2", tmp_path / "back2")
    with pytest.raises(DT.DeviceTrainError, match="holds no device.json"):
        DT.unpack(tmp_path, tmp_path / "back3")


def test_study_files_list_jobs_and_refuse_bad_ones(tmp_path):
    """A study file is jobs run in order and drafters to bring back; any other config is its data and train job;
    a malformed job is an error that names it."""
    study = DT.load_study(str(TINY.parents[0] / "studies" / "same_budget_tpu.yaml"))
    assert [j["run"] for j in study["jobs"]] == ["data"] * 3 + ["train"] * 6
    assert study["bring_back"][:3] == ["dspark_s0", "dflash_s0", "eagle3_s0"]
    single = DT.load_study(str(TINY))
    assert [j["run"] for j in single["jobs"]] == ["data", "train"] and single["bring_back"] is None
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"jobs: [{{run: train, config: {TINY}, set: [output.name=a]}}]\nbring_back: [b]\n")
    with pytest.raises(DT.DeviceTrainError, match="bring_back names b, which no train job writes \\(a\\)"):
        DT.pack(str(bad), tmp_path / "pack", wheels=False)  # before anything is packed
    for text, message in [("jobs: []", "non-empty list"), ("jobs: [{run: eval, config: x.yaml}]", "job 0 must be"),
                          ("jobs: [{run: train, config: x.yaml, steps: 3}]", "unknown key"),
                          ("jobs: [{run: train, config: x.yaml, set: a=b}]", "list of key=value")]:
        bad.write_text(text)
        with pytest.raises(DT.DeviceTrainError, match=message):
            DT.load_study(str(bad))
