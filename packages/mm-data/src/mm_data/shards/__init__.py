"""Sharded data sets: Parquet, WebDataset tars and Arrow (Hugging Face's save_to_disk folders) read
a block at a time, only the blocks a rank's samples live in (`ShardSet`), their rows as the
entries the data sets parse (`ShardEntries`)."""

from mm_data.shards.entries import MEDIA_INFO, ShardEntries, media_info, medium, row_entry, tar_json
from mm_data.shards.formats import FORMATS, TAR_BLOCK
from mm_data.shards.index import MANIFEST, Shard, ShardSet, write_manifest

__all__ = ["FORMATS", "MANIFEST", "MEDIA_INFO", "Shard", "ShardEntries", "ShardSet", "TAR_BLOCK", "media_info",
           "medium", "row_entry", "tar_json", "write_manifest"]
