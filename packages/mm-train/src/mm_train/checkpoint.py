"""Training checkpoints: OUT/checkpoints/step_N/, layout-independent, verified before use.

    step_N/model/              the model in its Hugging Face form (save_pretrained; tp gathered)
    step_N/adapters/           PEFT adapters, when the run trains LoRA
    step_N/optimizer-stageK.safetensors   per trainable parameter of pipeline stage K (by its name
                               in the whole model): <name>.master, .exp_avg, .exp_avg_sq, full tensors,
                               and the step counters (DistributedOptimizer.save: its one format)
    step_N/trainer_state.json  step, the data position (epoch, batch) and the data set's fingerprint,
                               the layout that wrote it, the run's id, the package versions
    step_N/recipe.json         the recipe as run
    step_N/manifest.json       written last: every other file with its size and sha256

Everything is stored whole (tp shards and ZeRO slices gathered, stages by global names), so a run
resumes under any layout (TP2 -> TP1, PP2 -> PP1, DP2 -> DP1 ...): each rank cuts its shard again
while loading.

Durability: a checkpoint is written into ``.step_N.tmp``; when every rank's files are in, rank 0
writes the manifest, fsyncs every file and folder and renames the folder to step_N, then fsyncs
``checkpoints/``. Overwriting step_N first renames the old one to ``.step_N.old``, so at every
moment one of the two exists (`recover` puts it back after a crash between the renames). A
checkpoint is used only if its manifest verifies (`verify`: every file present with its size and
sha256); `latest` names each newer one it had to skip and why. A save that fails (a full disk)
removes its partial folder and says so; one killed mid-write leaves a ``.tmp`` folder that the
next run removes at start. ``keep`` prunes this run's oldest checkpoints, never another run's
(the run id in trainer_state.json; a resumed run keeps the id of the run it continues).

Node-local disks (``checkpoint.shared_fs: false``, `mm_train.node_disks`): each node's first rank
does on its own disk what rank 0 does above; the manifest, the same on every node, lists every
rank's files with the ``nodes`` that hold them. A checkpoint is used when every node's files
verify and together they hold every listed file (`find_latest_on_nodes`); a rank reads only its
own disk, so such a run resumes with the layout and the node order that wrote it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

from mm_train import node_disks

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).

MANIFEST, TRAINER_STATE, RECIPE = "manifest.json", "trainer_state.json", "recipe.json"
_STEP = re.compile(r"^step_(\d+)$")
_HIDDEN = re.compile(r"^\.step_(\d+)\.(tmp|old)$")


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: str) -> None:
    """Every file's data and every folder's entries on disk (a rename is durable only then)."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def file_sha256(path: str) -> str:
    """A file's sha256, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: str) -> List[str]:
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, names in os.walk(folder) for name in names)


def file_entries(folder: str) -> Dict[str, dict]:
    """{relative path: {size, sha256}} of every file in ``folder`` but the manifest."""
    paths = {rel: os.path.join(folder, rel) for rel in _files(folder) if rel != MANIFEST}
    return {rel: {"size": os.path.getsize(p), "sha256": file_sha256(p)} for rel, p in paths.items()}


def write_manifest(folder: str, files: Optional[Dict[str, dict]] = None) -> Dict[str, dict]:
    """``folder/manifest.json``: ``files`` (default: `file_entries` of the folder)."""
    files = file_entries(folder) if files is None else files
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"files": files}, f, indent=1)
    return files


def _listed(folder: str) -> Tuple[Optional[Dict[str, dict]], Optional[str]]:
    """(the manifest's files, None) or (None, why there are none)."""
    manifest = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest):
        return None, f"no {MANIFEST} (the save did not finish)"
    try:
        with open(manifest) as f:
            return json.load(f)["files"], None
    except (ValueError, KeyError) as error:
        return None, f"{MANIFEST} is unreadable ({error})"


def verify(folder: str, hashes: bool = True, here_only: bool = False) -> Optional[str]:
    """None when every file the manifest lists is there with its size and sha256 (only the size
    without ``hashes``); else why not. ``here_only`` (node-local disks): a file this disk does not
    hold is not a fault — another node's holds it (`verify_on_nodes` checks that)."""
    files, reason = _listed(folder)
    if files is None:
        return reason
    for rel, entry in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            if here_only:
                continue
            return f"{rel} is missing"
        size = os.path.getsize(path)
        if size != entry["size"]:
            return f"{rel} has {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
        if hashes and file_sha256(path) != entry["sha256"]:
            return f"{rel} does not match its sha256 in the manifest (corrupted)"
    return None


def _steps(root: str) -> List[Tuple[int, str]]:
    """(step, folder) of every step_N under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    return sorted(((int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
                   if (m := _STEP.match(name))), reverse=True)


def find_latest(out: str) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """(the newest checkpoint under OUT/checkpoints whose manifest verifies, or None;
    [(folder, reason)] of each newer one that did not)."""
    skipped = []
    for _, folder in _steps(os.path.join(out, "checkpoints")):
        reason = verify(folder)
        if reason is None:
            return folder, skipped
        skipped.append((folder, reason))
    return None, skipped


def _node_verdict(folder: str) -> dict:
    """What this node's disk holds of a checkpoint: why its part is unusable (or None), the
    manifest's files, and which of them are here."""
    if not os.path.isdir(folder):
        return {"reason": "its folder is not on this disk", "listed": [], "present": []}
    files, reason = _listed(folder)
    if files is None:
        return {"reason": reason, "listed": [], "present": []}
    present = [rel for rel in sorted(files) if os.path.isfile(os.path.join(folder, rel))]
    return {"reason": verify(folder, here_only=True), "listed": sorted(files), "present": present}


def verify_on_nodes(folder: str, disks, topo) -> Optional[str]:
    """`verify` across node-local disks (a collective): None when every node's files verify and
    together they hold every file the manifest lists; else why not, naming the node."""
    verdicts = [(node, json.loads(data)) for node, data in disks.gather(json.dumps(_node_verdict(folder)).encode(),
                                                                        topo)]
    for node, verdict in verdicts:
        if verdict["reason"]:
            return f"on node {node}: {verdict['reason']}"
    listed = verdicts[0][1]["listed"]
    if any(verdict["listed"] != listed for _, verdict in verdicts):
        return "the nodes' manifests list different files"
    held = {rel for _, verdict in verdicts for rel in verdict["present"]}
    missing = [rel for rel in listed if rel not in held]
    if not missing:
        return None
    return f"{missing[0]} is on no node's disk" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")


def find_latest_on_nodes(out: str, disks, topo) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """`find_latest` across node-local disks (collectives; every rank gets the same answer)."""
    root = os.path.join(out, "checkpoints")
    mine = json.dumps([step for step, _ in _steps(root)]).encode()
    steps = sorted({step for _, data in disks.gather(mine, topo) for step in json.loads(data)}, reverse=True)
    skipped = []
    for step in steps:
        folder = os.path.join(root, f"step_{step}")
        reason = verify_on_nodes(folder, disks, topo)
        if reason is None:
            return folder, skipped
        skipped.append((folder, reason))
    return None, skipped


def missing_here(folder: str) -> List[str]:
    """The manifest's files this disk does not hold, each with the nodes that wrote it."""
    files, _ = _listed(folder)
    return [f"{rel} (on node {', '.join(entry.get('nodes', ['?']))})" for rel, entry in sorted((files or {}).items())
            if not os.path.isfile(os.path.join(folder, rel))]


def latest(out: str) -> Optional[str]:
    """The newest verified checkpoint folder under OUT/checkpoints, or None."""
    return find_latest(out)[0]


def recover(out: str) -> List[str]:
    """Tidy OUT/checkpoints after a crash (rank 0, before training): remove the ``.tmp`` folders
    of interrupted saves; put back a ``.step_N.old`` whose replacement never arrived (else drop
    it). Returns what it did, one line each."""
    root, done = os.path.join(out, "checkpoints"), []
    if not os.path.isdir(root):
        return done
    for name in sorted(os.listdir(root)):
        m = _HIDDEN.match(name)
        if not m:
            continue
        folder, final = os.path.join(root, name), os.path.join(root, f"step_{m.group(1)}")
        if m.group(2) == "old" and not os.path.exists(final):
            os.replace(folder, final)
            done.append(f"restored {final} (a save that replaced it was interrupted)")
        else:
            shutil.rmtree(folder, ignore_errors=True)
            done.append(f"removed {folder} (left by an interrupted save)")
    if done:
        _fsync_dir(root)
    return done


def _names(chunks, optimizer):
    """Each optimizer parameter's name in the whole model (pipeline stages numbered as one)."""
    from mm_parallel.census import owned_parameters

    names = {id(p): chunk.adapter_name(chunk, name) for chunk in chunks for name, p, _, _ in owned_parameters(chunk)}
    return [names[id(p)] for p in optimizer.params]


def save(out: str, step: int, chunks, optimizer, topo, lora=None, keep: int = 2,
         data_state: Optional[dict] = None, model_dtype: Optional[str] = None,
         run: Optional[dict] = None, disks=None) -> str:
    """Write step_N (every rank calls: the gathers are collectives); returns its path.
    ``chunks``: the model chunks (virtual pipeline stages) this rank holds, usually one;
    ``model_dtype``: the model weights' dtype on disk (default the parameters'; the optimizer
    state is fp32 whatever it is); ``run``: what trainer_state.json records of the run (its
    ``run_id``, ``recipe``, ``versions``, ``data_fingerprint``); ``disks``: who shares a disk
    (`mm_train.node_disks`; default one shared file system)."""
    from mm_parallel import comm

    run, disks = dict(run or {}), disks or node_disks.shared(topo)
    root = os.path.join(out, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f".step_{step}.tmp")
    writes = disks.folder_writer
    try:
        if writes:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        if topo.world_size > 1:
            comm.barrier(topo.world)
        chunks[0].save_pretrained(os.path.join(tmp, "model"), chunks, dtype=model_dtype, folder_writer=writes)
        if lora is not None:
            chunks[0].save_adapter(os.path.join(tmp, "adapters"), lora, chunks, folder_writer=writes)
        optimizer.save(tmp, _names(chunks, optimizer))  # one file per pipeline stage; waits for every stage
        if writes:
            _write_state(tmp, step, data_state, topo, run)
        files = None if disks.shared else _nodes_manifest(tmp, disks, topo)
        if writes:
            write_manifest(tmp, files)  # last: a folder without it is not a checkpoint
            _fsync_tree(tmp)
            _put_in_place(tmp, final)
            _prune(root, keep, run.get("run_id"), here_only=not disks.shared)
    except OSError as error:  # a full disk, a quota, a read-only mount: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        kept = [os.path.basename(f) for _, f in _steps(root)]
        raise RuntimeError(f"checkpoint step_{step} could not be written ({error}); its partial folder was removed "
                           f"and the earlier checkpoints are untouched ({', '.join(kept) or 'none'}): free space "
                           f"under {root}, lower checkpoint.keep or raise checkpoint.every") from error
    if topo.world_size > 1:
        comm.barrier(topo.world)
    return final


def _nodes_manifest(folder: str, disks, topo) -> Dict[str, dict]:
    """The manifest of a checkpoint spread over node-local disks (a collective): every node's
    files with the ``nodes`` holding them; a file two nodes hold (config, index, trainer_state)
    must be the same on both."""
    files: Dict[str, dict] = {}
    mine = json.dumps(file_entries(folder) if disks.folder_writer else {}).encode()
    for node, data in disks.gather(mine, topo):
        for rel, entry in json.loads(data).items():
            known = files.setdefault(rel, {**entry, "nodes": []})
            if (known["size"], known["sha256"]) != (entry["size"], entry["sha256"]):
                raise RuntimeError(f"{rel} of {folder} differs between nodes {known['nodes'][0]} and {node}")
            known["nodes"].append(node)
    return files


def _write_state(folder: str, step: int, data_state, topo, run: dict) -> None:
    recipe = run.pop("recipe", None)
    state = {"step": step, "data": data_state,
             "layout": {"world_size": topo.world_size, "tp": topo.tp.size, "pp": topo.pp.size, "dp": topo.dp.size},
             **run}
    with open(os.path.join(folder, TRAINER_STATE), "w") as f:
        json.dump(state, f, indent=2)
    if recipe is not None:
        with open(os.path.join(folder, RECIPE), "w") as f:
            json.dump(recipe, f, indent=2, default=str)


def _put_in_place(tmp: str, final: str) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` steps aside first (never neither)."""
    root = os.path.dirname(final)
    old = os.path.join(root, f".{os.path.basename(final)}.old")
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def trainer_state(folder: str) -> dict:
    with open(os.path.join(folder, TRAINER_STATE)) as f:
        return json.load(f)


def saved_recipe(folder: str) -> Optional[dict]:
    path = os.path.join(folder, RECIPE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _prune(root: str, keep: int, run_id: Optional[str], here_only: bool = False) -> None:
    """Keep this run's newest ``keep`` checkpoints (all when keep <= 0) and drop its broken ones (a
    file missing or of the wrong size: a resume skipped them); other runs' are not touched.
    ``here_only``: node-local disks, where other nodes hold the rest of each checkpoint."""
    if keep <= 0:
        return
    mine = [folder for _, folder in _steps(root) if _run_id(folder) == run_id]
    whole = [folder for folder in mine if verify(folder, hashes=False, here_only=here_only) is None]
    for folder in [f for f in mine if f not in whole] + whole[keep:]:
        shutil.rmtree(folder, ignore_errors=True)


def _run_id(folder: str) -> Optional[str]:
    try:
        return trainer_state(folder).get("run_id")
    except (OSError, ValueError):
        return None


def load_optimizer(folder: str, chunks, optimizer) -> int:
    """Set the optimizer (and through its master weights the parameters) from step_N; returns
    the step to continue from."""
    optimizer.load(folder, _names(chunks, optimizer))
    return int(trainer_state(folder)["step"])
