"""Checkpoints that survive faults, and output folders runs cannot clobber (in process, one rank).

A crash between two files of a save, a full disk at the writer, a truncated file in the newest
checkpoint: each leaves the earlier checkpoints usable, and the resumed run's losses equal the
uninterrupted run's bit for bit. A new run refuses another run's output_dir (changing nothing
there) unless --overwrite; a resume refuses another model, another data order or a data set
that changed under it, and names what changed."""

import errno
import json
import os
import shutil

import pytest

STEPS = 8


def train(out, steps=STEPS, *extra, **options):
    """The tiny default for ``steps`` steps into ``out`` (one data set for the whole session)."""
    from mm_train import loop
    from mm_train.recipe import load_recipe

    data = os.path.join(os.path.dirname(os.path.dirname(out)), "data")
    recipe = load_recipe(None, [f"train.steps={steps}", "data.samples=32", f"data.path={data}", "checkpoint.every=3",
                                f"output_dir={out}", *extra])
    return loop.train(recipe, progress=False, **options)


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run's losses."""
    base = tmp_path_factory.mktemp("faults") / "whole"
    train(base)
    return losses(base)


class Crash(BaseException):
    """What a killed process leaves: the save stops where it is, nothing cleans up."""


def test_a_crash_between_two_files_of_a_save_resumes_bit_exact(tmp_path, whole, monkeypatch, capfd):
    from mm_parallel import DistributedOptimizer

    real = DistributedOptimizer.save

    def crash_at_step_6(self, folder, names=None):
        if folder.endswith(".step_6.tmp"):  # the model files are written, the optimizer's not yet
            raise Crash()
        return real(self, folder, names)

    monkeypatch.setattr(DistributedOptimizer, "save", crash_at_step_6)
    out = tmp_path / "whole"
    with pytest.raises(Crash):
        train(out)
    monkeypatch.setattr(DistributedOptimizer, "save", real)
    assert (out / "checkpoints" / ".step_6.tmp" / "model").is_dir()
    assert not (out / "checkpoints" / "step_6").exists()
    capfd.readouterr()
    train(out, resume=True)
    err = capfd.readouterr().err
    assert "removed" in err and ".step_6.tmp" in err and "resuming from" in err and "step_3 (step 3)" in err
    assert not (out / "checkpoints" / ".step_6.tmp").exists()
    assert losses(out) == whole  # bit for bit


def test_a_full_disk_at_the_writer_is_a_clear_error_and_leaves_earlier_checkpoints(tmp_path, whole, monkeypatch):
    import safetensors.numpy

    from mm_train import checkpoint

    real = safetensors.numpy.save_file

    def full_at_step_6(tensors, filename, metadata=None):
        if ".step_6.tmp" in str(filename) and "optimizer" in str(filename):
            with open(filename, "wb") as f:  # part of the file got out before the disk filled
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.numpy, "save_file", full_at_step_6)
    out = tmp_path / "whole"
    with pytest.raises(RuntimeError, match=r"checkpoint step_6 could not be written \(\[Errno 28\] No space left"
                                           r".*partial folder was removed.*step_3.*free space"):
        train(out)
    monkeypatch.setattr(safetensors.numpy, "save_file", real)
    assert sorted(os.listdir(out / "checkpoints")) == ["step_3"]  # no partial folder holds the space
    assert checkpoint.verify(str(out / "checkpoints" / "step_3")) is None
    train(out, resume=True)
    assert losses(out) == whole


def test_a_truncated_file_in_the_newest_checkpoint_is_skipped_with_its_reason(tmp_path, whole, capfd):
    out = tmp_path / "whole"
    train(out, 6)
    shard = out / "checkpoints" / "step_6" / "model" / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    capfd.readouterr()
    train(out, resume=True)
    err = capfd.readouterr().err
    assert "skipping checkpoint" in err and "model/model.safetensors has" in err and "truncated" in err, err
    assert "step_3 (step 3)" in err
    assert losses(out) == whole
    # the resumed run wrote step_6 again and dropped nothing it can still use
    assert sorted(os.listdir(out / "checkpoints")) == ["step_6", "step_8"]


def test_resume_from_names_a_checkpoint_and_refuses_a_broken_one(tmp_path, whole):
    out = tmp_path / "whole"
    train(out, 6)
    train(out, resume_from=str(out / "checkpoints" / "step_3"))  # not the newest
    assert losses(out) == whole
    step_6 = out / "checkpoints" / "step_6"  # written again by the resumed run
    (step_6 / "trainer_state.json").write_text("{}")
    with pytest.raises(ValueError, match=r"--resume-from .*step_6 cannot be used: trainer_state.json has 2 bytes"):
        train(out, resume_from=str(step_6))


def test_a_new_run_refuses_another_runs_folder_and_changes_nothing(tmp_path, whole):
    out = tmp_path / "whole"
    train(out, 3)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"holds another run \(step_3, metrics.jsonl\); continue it with --resume, "
                                         r"train into another folder with --set output_dir=\.\.\., or replace it "
                                         r"with --overwrite"):
        train(out, 3)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    (out / "logs").mkdir()
    (out / "logs" / "keep.txt").write_text("the launcher's logs stay")
    train(out, overwrite=True)
    assert losses(out) == whole and (out / "logs" / "keep.txt").exists()


def test_keep_prunes_only_this_runs_checkpoints(tmp_path, whole):
    from mm_train import checkpoint

    out = tmp_path / "whole"
    train(out, 6)
    other = out / "checkpoints" / "step_99"  # another run's, e.g. copied in by hand
    shutil.copytree(out / "checkpoints" / "step_6", other)
    state = json.loads((other / "trainer_state.json").read_text())
    state["run_id"] = "another run"
    (other / "trainer_state.json").write_text(json.dumps(state))
    checkpoint.write_manifest(str(other))
    train(out, resume_from=str(out / "checkpoints" / "step_6"))
    assert sorted(os.listdir(out / "checkpoints")) == ["step_6", "step_8", "step_99"]
    saved = json.loads((out / "checkpoints" / "step_8" / "trainer_state.json").read_text())
    first = json.loads((out / "checkpoints" / "step_6" / "trainer_state.json").read_text())
    assert saved["run_id"] == first["run_id"] != "another run"
    assert set(saved["versions"]) >= {"mm-train", "mm-parallel", "mindspore"}
    assert json.loads((out / "checkpoints" / "step_8" / "recipe.json").read_text())["train"]["steps"] == STEPS


def test_a_resume_refuses_another_model_or_data_order_and_names_other_changes(tmp_path, whole, capfd):
    out = tmp_path / "whole"
    train(out, 3)
    with pytest.raises(ValueError, match=r"another model or data order: model.config.text_config.hidden_size: 64 "
                                         r"-> 128"):
        train(out, STEPS, "model.config.text_config.hidden_size=128", resume=True)
    with pytest.raises(ValueError, match=r"train.seed: 0 -> 5"):
        train(out, STEPS, "train.seed=5", resume=True)
    capfd.readouterr()
    train(out, STEPS, "optim.lr=0.001", "parallel.zero_stage=1", resume=True)
    err = capfd.readouterr().err
    assert "resuming with a changed setting: optim.lr: 0.003 -> 0.001" in err and "zero_stage" not in err


def test_a_data_set_changed_under_a_resumed_run_is_refused(tmp_path, whole):
    out, data = tmp_path / "whole", tmp_path / "own_data"
    shutil.copytree(tmp_path.parent / "data", data, ignore=shutil.ignore_patterns("features*"))
    own = [f"data.path={data}"]
    train(out, 3, *own)
    entries = json.loads((data / "data.json").read_text())
    image = data / entries[0]["images"][0]
    image.write_bytes(image.read_bytes() + b"\0")
    with pytest.raises(ValueError, match=r"the data set changed .* media files: .*changed size: "
                                         + entries[0]["images"][0]):
        train(out, STEPS, *own, resume=True)
    (data / "data.json").write_text(json.dumps(entries[1:]))
    with pytest.raises(ValueError, match=r"annotation file data.json was edited"):
        train(out, STEPS, *own, resume=True)
