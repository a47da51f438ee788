"""Reading Hugging Face folders: an index's shards are read by name, and an index that points
outside its own folder is refused before anything is opened."""

import json

import numpy as np
import pytest

from mm_parallel.hf_checkpoint import SafetensorsFolder, write_index, write_weights


def sharded(folder):
    write_weights({"a": np.arange(4, dtype=np.float32)}, folder, "model-00001-of-00002.safetensors")
    write_weights({"b": np.ones((2, 2), np.float32)}, folder, "model-00002-of-00002.safetensors")
    write_index(folder, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    return folder


def test_an_index_reads_every_shard(tmp_path):
    found = SafetensorsFolder(sharded(tmp_path))
    assert sorted(found.names()) == ["a", "b"] and found.read("a").tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", ".."])
def test_an_index_entry_outside_the_folder_is_refused(tmp_path, entry):
    index = sharded(tmp_path) / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"]["b"] = entry
    index.write_text(json.dumps(content))
    with pytest.raises(ValueError, match="an index may only name files in its own folder"):
        SafetensorsFolder(tmp_path)
