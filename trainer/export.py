"""The Hugging Face directory of a checkpoint (verl's ``checkpoint.save_contents: hf_model``).

Layout, as verl's: the weights of checkpoint ``step-K.pt`` also go to
``FOLDER/global_step_K/actor/huggingface`` (``FOLDER``: the checkpoint folder,
:func:`runconfig.paths.checkpoint_dir`): the model's ``save_pretrained`` (config.json and
safetensors), the tokenizer files and ``generation_config.json`` of ``model.path``, so that
``AutoModelForCausalLM.from_pretrained`` and vLLM load it as they load the model it started
from; beside them ``rlbus_digests.json`` names every file with its size and sha256
(trainer.integrity), which ``rlbus model`` verifies the copy it makes against.

Off the trainer's critical path: the weights are copied to CPU on the worker thread (the
only blocking part, a device-to-host copy), then written by a thread of this exporter's own
while training goes on. One export at a time: the next checkpoint's copy waits for the
previous write, so at most one extra CPU copy of the model exists. Atomic: the files go to a
hidden temporary folder beside ``huggingface``, renamed into place when complete.

Retention deletes ``global_step_K`` with its checkpoint (trainer.retention). An export that
finishes after its checkpoint was deleted removes what it wrote: it renames into place
first, then checks that ``step-K.pt`` still exists, while retention deletes the ``.pt``
first and then the folder; in either order nothing is left behind.

On a remote ``run.storage`` (trainer.mirror) the same thread then uploads the directory to
the storage's checkpoint folder, every file and then a completion marker, so a checkpoint's
Hugging Face directory survives the trainer's node like the checkpoint does. The upload
races retention the same way: after it, the exporter checks ``step-K.pt`` again and deletes
the remote copy when it is gone (retention deletes the remote copies after the local files).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runschema.messages import WarningRaised
from storage.files import fsync_path
from trainer.integrity import write_folder_digests

if TYPE_CHECKING:  # trainer.mirror imports this module's layout
    from trainer.mirror import CheckpointMirror

__all__ = ["HFExport", "NotUploaded", "capture_state", "hf_dir", "step_folder",
           "write_hf_dir"]

RunOff = Callable[..., Awaitable[Any]]
_TMP = ".tmp-huggingface."
_OLD = ".old-huggingface."


def step_folder(folder: Path, step: int) -> Path:
    """``FOLDER/global_step_K``: what retention deletes with ``step-K.pt``."""
    return folder / f"global_step_{step}"


def hf_dir(folder: Path, step: int) -> Path:
    """``FOLDER/global_step_K/actor/huggingface`` (verl's layout)."""
    return step_folder(folder, step) / "actor" / "huggingface"


def _hf_model(policy: torch.nn.Module) -> Any:
    """The ``transformers`` model inside an HF policy (policy.hf.HFPolicy)."""
    from transformers import PreTrainedModel

    model = getattr(policy, "model", None)
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"{type(policy).__name__} holds no Hugging Face model to export")
    return model


def capture_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the HF model's state dict, tensors that share storage (tied
    embeddings) still sharing it (blocking: run it on the worker thread, between steps)."""
    copies: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in _hf_model(policy).state_dict().items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                   tuple(tensor.shape), tuple(tensor.stride()))
            if key not in copies:
                copies[key] = tensor.detach().to("cpu", copy=True)
            out[name] = copies[key]
    return out


def _checkpoint(folder: Path, step: int) -> Path:
    return folder / f"step-{step:06d}.pt"


class NotUploaded(Exception):
    """The directory was written locally but not copied to the storage at ``where``."""

    def __init__(self, where: str, cause: BaseException) -> None:
        super().__init__(f"written, but not copied to {where}: {type(cause).__name__}: {cause}")


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fsync_path(path)
    fsync_path(root)


def _replace_dir(tmp: Path, target: Path) -> None:
    """Put the complete folder ``tmp`` at ``target`` (an older one there, e.g. from a step
    trained again after a crash, is renamed away first, then deleted)."""
    old = None
    if target.exists():
        old = target.with_name(f"{_OLD}{secrets.token_hex(4)}")
        target.rename(old)
    tmp.rename(target)
    fsync_path(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_hf_dir(policy: torch.nn.Module, state: dict[str, torch.Tensor], model_path: str,
                 target: Path, tokenizer: Any = None) -> Path:
    """Write ``state`` as the HF directory ``target`` (atomically): ``save_pretrained`` of
    the policy's model with these weights, the tokenizer (``tokenizer``, else loaded from
    ``model_path``) and ``model_path``'s generation_config.json. Blocking."""
    from transformers import AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    for pattern in (f"{_TMP}*", f"{_OLD}*"):  # what a crashed export left
        for stale in target.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = target.with_name(f"{_TMP}{secrets.token_hex(4)}")
    try:
        # save_pretrained reads only the model's config and structure (tied keys, dtype)
        # here: the weights are the copy, whatever the worker does to the live ones.
        _hf_model(policy).save_pretrained(str(tmp), state_dict=state)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        tokenizer.save_pretrained(str(tmp))
        generation = Path(model_path) / "generation_config.json"
        if generation.is_file():  # the model's own, as verl copies it (every EOS id)
            shutil.copyfile(generation, tmp / "generation_config.json")
        write_folder_digests(tmp)  # what `rlbus model` verifies a copy against
        _fsync_tree(tmp)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


class HFExport:
    """The trainer's exporter: one export at a time, on a thread of its own; with a
    ``mirror`` (a remote run.storage), each directory is uploaded there too."""

    def __init__(self, model_path: str, mirror: CheckpointMirror | None = None) -> None:
        self.model_path = model_path
        self.mirror = mirror
        self.pending: asyncio.Future[Path] | None = None
        self._step = 0
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer: Any = None

    async def start(self, off: RunOff, policy: torch.nn.Module, folder: Path, step: int,
                    capture: Callable[[], dict[str, torch.Tensor]] | None = None,
                    ) -> tuple[Path, WarningRaised | None]:
        """Export the policy's weights as of now for checkpoint ``step`` of ``folder``:
        wait for the previous export, copy the weights on the worker (``off``; ``capture``,
        by default :func:`capture_state`: trainer ranks gather them whole), write them on
        the exporter's thread. Returns the directory it will be and the warning of a
        previous export that failed (to publish)."""
        warning = await self.wait()
        state = await (off(capture) if capture is not None else off(capture_state, policy))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-export")
        target = hf_dir(folder, step)
        self._step = step
        self.pending = asyncio.get_running_loop().run_in_executor(
            self._pool, self._write, policy, state, folder, step)
        return target, warning

    def _write(self, policy: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path,
               step: int) -> Path:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path,
                                                            local_files_only=True)
        target = write_hf_dir(policy, state, self.model_path, hf_dir(folder, step),
                              self._tokenizer)
        if not _checkpoint(folder, step).exists():
            # Retention deleted this checkpoint while we wrote (see the module docstring).
            shutil.rmtree(step_folder(folder, step), ignore_errors=True)
        elif self.mirror is not None:
            self._upload(self.mirror, target, folder, step)
        return target

    @staticmethod
    def _upload(mirror: CheckpointMirror, target: Path, folder: Path, step: int) -> None:
        """Copy ``target`` to the storage; when retention dropped the checkpoint
        meanwhile (its local files may vanish under the upload), remove the remote copy
        instead of failing."""
        try:
            mirror.upload_hf(target, step)
        except Exception as exc:  # any backend's error: a dropped checkpoint is no failure
            if _checkpoint(folder, step).exists():
                raise NotUploaded(mirror.hf_where(step), exc) from exc
        if not _checkpoint(folder, step).exists():
            mirror.delete_hf([step])

    async def wait(self) -> WarningRaised | None:
        """Wait for the export in flight; a failed one becomes a warning (training goes on:
        the checkpoint itself is written)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            await pending
        except NotUploaded as exc:  # the storage refused it: the local copy is whole
            return WarningRaised(
                source="trainer", code="hf_export_failed",
                message=f"the Hugging Face directory of checkpoint step {self._step} was {exc}")
        except Exception as exc:  # disk full, a tokenizer that will not load: say so
            return WarningRaised(
                source="trainer", code="hf_export_failed",
                message=f"the Hugging Face directory of checkpoint step {self._step} was not "
                        f"written: {type(exc).__name__}: {exc}")
        return None

    def close(self) -> None:
        """Let the exporter's thread end once its write is done (never cut short)."""
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.shutdown(wait=False)
