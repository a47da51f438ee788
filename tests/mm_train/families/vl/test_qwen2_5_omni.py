"""The built-in Qwen2.5-Omni recipe trains through `mm-train run qwen2_5_omni_tiny` on generated
pictures and sounds (the real audio path: WAV decoding, resampling, Whisper features), its loss
falls, the saved thinker loads in transformers; under Ulysses cp2 (right-padded micro-batches) and
pp2 the first steps' losses equal the single process's; `generate --audio` on the checkpoint
answers a sound of the set with a sound's caption (after 80 steps: packed, 60 answered a
picture's word; not always the right pitch),
the same under pp2."""

import json

import pytest
from helpers.train_runs import main_on_this_rank, train

from mm_train.families.vl.tiny_omni import SOUNDS

pytestmark = pytest.mark.distributed


def losses(out):
    return [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]


def test_qwen2_5_omni_tiny_trains_and_layouts_equal_one_process(tmp_path, run_distributed):
    import transformers

    short = ["--set", "data.samples=48", "--no-progress"]
    data = tmp_path / "data"
    train(run_distributed, "qwen2_5_omni_tiny", *short, "--set", "train.steps=80", "--set", "checkpoint.every=80",
          "--set", "optim.decay_steps=80", "--set", f"output_dir={tmp_path / 'one'}", data=data)
    single = losses(tmp_path / "one")
    assert single[-1] < 0.5 * single[0], single
    folder = tmp_path / "one" / "checkpoints" / "step_80" / "model"
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2_5_omni_thinker"
    transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(str(folder))
    zero3 = ["--set", "parallel.zero_stage=3", "--set", "parallel.zero3_min_numel=1024"]  # cut over the cp ranks
    for name, layout in {"cp2_zero3": ["--set", "parallel.cp=2", *zero3], "pp2": ["--set", "parallel.pp=2"]}.items():
        train(run_distributed, "qwen2_5_omni_tiny", *short, *layout, "--set", "train.steps=3",
              "--set", "optim.decay_steps=80", "--set", f"output_dir={tmp_path / name}", nproc=2, data=data)
        assert losses(tmp_path / name) == pytest.approx(single[:3], rel=1e-4), name

    sample = next(e for e in json.loads((data / "tiny_omni" / "data.json").read_text()) if e.get("audios") and
                  not e.get("images"))
    sound, caption = str(data / "tiny_omni" / sample["audios"][0]), sample["messages"][1]["content"]
    answers = {}
    for name, extra in {"one": [], "pp2": ["--nproc", "2", "--set", "parallel.pp=2"]}.items():
        out = tmp_path / f"answer_{name}.txt"
        argv = ["generate", str(tmp_path / "one" / "checkpoints" / "step_80"), "--prompt", "", "--audio", sound,
                "--max-new-tokens", "8", "--out", str(out)]
        home = {"MM_TRAIN_DATA": str(data)}  # where the run's tokenizer is
        if extra:
            run_distributed(main_on_this_rank, nproc=2, timeout=600, argv=argv + extra, variables=home)
        else:
            main_on_this_rank(argv, home)
        answers[name] = out.read_text().strip()
    sounds = {f"a {name}" if name != "noise" else name for name in SOUNDS}
    assert answers["one"] == answers["pp2"] and answers["one"] in sounds, (answers, caption)
