"""``rlbus model``: the Hugging Face directory of a run's checkpoint, copied to a folder.

The trainer exports each kept checkpoint's weights as a Hugging Face directory
(``hf_model`` in ``trainer.checkpoint_contents``; trainer.export), in verl's layout under
the run's checkpoint folder, ``global_step_K/actor/huggingface``. On a remote ``run.storage`` it is
also uploaded there, with a completion marker written last (trainer.mirror). This command
finds the newest exported step (or ``--step K``): in this node's checkpoint folder first,
where a directory is complete once it has its name (the exporter renames it into place),
else in the storage, where only a directory with its marker counts; and copies it to
``--out``, which ``AutoModelForCausalLM.from_pretrained`` and vLLM then load.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from runconfig import Config
from runconfig.paths import checkpoint_dir
from trainer.export import hf_dir
from trainer.integrity import verify_folder
from trainer.mirror import CheckpointMirror, checkpoint_mirror

__all__ = ["ModelNotFound", "exported_steps", "fetch_model"]

_STEP = re.compile(r"^global_step_(\d+)$")
_PT = re.compile(r"^step-(\d+)\.pt$")


class ModelNotFound(Exception):
    """No exported Hugging Face directory of the asked step (or of any step)."""


def local_steps(folder: Path) -> set[int]:
    """The steps whose Hugging Face directory is in the local checkpoint ``folder``."""
    if not folder.is_dir():
        return set()
    return {int(m[1]) for p in folder.iterdir() if (m := _STEP.match(p.name))
            and hf_dir(folder, int(m[1])).is_dir()}


def remote_steps(mirror: CheckpointMirror) -> set[int]:
    """The steps whose Hugging Face directory is whole in the storage (its marker there);
    asked for the checkpoints the storage holds (an export belongs to one)."""
    steps = {int(m[1]) for name in mirror.storage.list(mirror.prefix) if (m := _PT.match(name))}
    return {s for s in steps if mirror.has_hf(s)}


def exported_steps(cfg: Config, run_id: str) -> dict[int, str]:
    """Every exported step of run ``run_id`` and where it is (``local`` or ``storage``;
    local first)."""
    return _exported(checkpoint_dir(cfg, run_id), checkpoint_mirror(cfg, run_id))


def _exported(folder: Path, mirror: CheckpointMirror | None) -> dict[int, str]:
    where = {s: "local" for s in local_steps(folder)}
    if mirror is not None:
        for s in remote_steps(mirror):
            where.setdefault(s, "storage")
    return where


def fetch_model(cfg: Config, run_id: str, step: int | None, out: Path) -> tuple[int, str]:
    """Copy the Hugging Face directory of ``step`` (None: the newest exported) of run
    ``run_id`` to ``out`` (which must not exist, or be empty); returns the step and where
    it came from. Raises :class:`ModelNotFound` naming what there is."""
    folder, mirror = checkpoint_dir(cfg, run_id), checkpoint_mirror(cfg, run_id)
    places = str(folder) if mirror is None else f"{folder} or {mirror.where()}"
    found = _exported(folder, mirror)
    if not found:
        raise ModelNotFound(f"run {run_id} has no exported Hugging Face directory in "
                            f"{places} (the trainer exports one per kept checkpoint when "
                            "trainer.checkpoint_contents has hf_model)")
    if step is None:
        step = max(found)
    elif step not in found:
        raise ModelNotFound(f"run {run_id} has no exported Hugging Face directory of step "
                            f"{step} in {places}; exported steps: "
                            f"{', '.join(map(str, sorted(found)))}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    if found[step] == "local":
        shutil.copytree(hf_dir(folder, step), out, dirs_exist_ok=True)
        source = str(hf_dir(folder, step))
    else:
        assert mirror is not None  # a step found in the storage
        if not mirror.download_hf(step, out):
            raise ModelNotFound(f"the Hugging Face directory of step {step} left "
                                f"{mirror.hf_where(step)} while it was read (retention)")
        source = mirror.hf_where(step)
    _verified(out, step, source, found)
    return step, source


def _verified(out: Path, step: int, source: str, found: dict[int, str]) -> None:
    """The copy at ``out`` is every file as the trainer wrote it (its digests), or it is
    removed and :class:`ModelNotFound` names the file and the other exported steps."""
    why = verify_folder(out)
    if why is None:
        return
    shutil.rmtree(out, ignore_errors=True)
    others = sorted(s for s in found if s != step)
    rest = (f"; other exported steps: {', '.join(map(str, others))} (--step K)" if others
            else "")
    raise ModelNotFound(f"the Hugging Face directory of step {step} at {source} is not as the "
                        f"trainer wrote it: {why.replace(str(out), source)}{rest}")
