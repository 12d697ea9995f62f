"""The Checkpointer: periodic asynchronous saves through orbax, verified resume, keep-N.

A checkpoint is `output_dir/checkpoints/<step>/` with three items:
- `state`: the TrainState (step, params, optimizer state, non-finite counters), sharded arrays;
- `data`:  the data iterator's position, so the batch after a resume is the one that would have come;
- `meta`:  the step, the model config, checksums of every array and of the data position, and
           what the run was built from (`Checkpointer.built_from`: a LoRA run's base)
           (maxtext_rocm/checkpoint/checksums.py), for people and for checks.

Orbax writes each step into a temporary directory and renames it when complete, so a process
killed mid-save leaves no directory that `latest_step` would pick. A resume verifies what it
restored against the checksums; a damaged checkpoint is skipped with one warning and moved to
`output_dir/checkpoints_set_aside/`, and the newest intact older one is used (never deleted:
moving it back restores it). A save that fails (disk full, I/O error) stops the run at that
save with one sentence; a state holding inf/NaN is never written.

Reading parameters alone (exports, conversions, notebooks), verified the same way: params.py;
the command line (export, verify): cli.py.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as policies

from maxtext_rocm.checkpoint import checksums
from maxtext_rocm.checkpoint.errors import cause, quiet_closed_loop_callbacks, quiet_orbax_error_logs, release_orbax_waiters
from maxtext_rocm.checkpoint.local_tier import LocalTier
from maxtext_rocm.checkpoint.reading import _on_every_process, _shape_mismatch
from maxtext_rocm.checkpoint.tiers import LocalRestore, common_steps, fallback_line, restore_newest_common
from maxtext_rocm.errors import CheckpointError

STATE, DATA, META = "state", "data", "meta"


def _handlers():
    # Named up front so that a manager that has not saved yet can read metadata and restore.
    return {STATE: ocp.StandardCheckpointHandler(), DATA: ocp.JsonCheckpointHandler(),
            META: ocp.JsonCheckpointHandler()}


class SaveFailed(CheckpointError):
    """Writing a checkpoint failed (disk full, permissions, I/O): the run stops at that save."""


class NonFiniteState(RuntimeError):
    """The state to be saved holds inf/NaN: it is not written (train.py reports the divergence)."""


class _Damaged(Exception):
    """A checkpoint that cannot be used as it is on disk; the message says why, as a phrase."""


@dataclasses.dataclass
class Resume:
    """Where a resume reads from: checkpoints `steps` of `manager`, newest first, tried in turn
    unless `explicit` (a step the user named); `own`: this run's directory. `local`: the state
    already read from the local tier (checkpoint.local_dir), which then wins over `steps`."""
    manager: ocp.CheckpointManager
    steps: list[int]
    explicit: bool
    own: bool
    local: LocalRestore | None = None

    @property
    def newest(self) -> int:
        """The step this resume reads, or the newest it may read."""
        return self.local.step if self.local is not None else self.steps[0]

    def where(self, step: int) -> str:
        return f"the local tier's step {step}" if self.local is not None else f"{self.manager.directory}/{step}"

    def step_dir(self, step: int) -> Path:
        """The directory of `step`, whose `meta` records what the run was built from (either tier)."""
        return self.local.folder if self.local is not None else Path(self.manager.directory) / str(step)


class Checkpointer:
    """Saves and restores one run's checkpoints. Every process calls every method (orbax
    coordinates multi-host writes itself); process 0 alone moves directories and warns."""

    def __init__(self, ckpt_cfg, output_dir: str, warn=None):
        self.cfg = ckpt_cfg
        self.run_dir = Path(output_dir).absolute()
        self.directory = self.run_dir / "checkpoints"
        self.set_aside_dir = self.run_dir / "checkpoints_set_aside"
        self.is_primary = jax.process_index() == 0
        self._warn = warn or self._print_warning
        keep = [policies.LatestN(ckpt_cfg.keep)]
        if ckpt_cfg.keep_period:
            keep.append(policies.EveryNSteps(ckpt_cfg.keep_period))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=ckpt_cfg.async_save,
            preservation_policy=policies.AnyPreservationPolicy(keep),
            create=False)  # made on the first save: a failed start leaves the run directory alone
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
        self._last_saved = None
        self._pending = None  # the step whose background write has not been seen to succeed yet
        self._skipped = (None, [])  # (the Resume, [(step, why)]) of the damaged checkpoints it passed over
        self._launched = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())  # names what this launch set aside
        # What the run was built from beyond its config, saved in every step's meta so that a
        # resume or an export reads it back: a LoRA run's settings and base (finetune/lora_base.py).
        self.built_from: dict = {}
        # The node-local tier (local_tier.py), or None: checkpoint.local_dir unset changes nothing.
        self.local = LocalTier(ckpt_cfg, output_dir) if ckpt_cfg.get("local_dir") else None
        self.tier_line = ""  # which tier a resume read and why, for the Trainer to say once
        self.restore_s, self.restored_tier = 0.0, ""  # how long reading the resumed state took, and from where
        quiet_orbax_error_logs()

    def _print_warning(self, message: str) -> None:
        if self.is_primary:  # process 0 speaks for every process
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def should_save(self, step: int, last_step: int) -> bool:
        """Whether `step` is a save step: every checkpoint.every steps and the run's `last_step`.
        The step alone decides, so every process of a run saves at the same steps."""
        return step == last_step or (self.cfg.every > 0 and step % self.cfg.every == 0)

    def save_if_due(self, step: int, last_step: int, save: Callable[[], None],
                    save_local: Callable[[], None] | None = None) -> None:
        """The training loop's one call per step: raises SaveFailed if a background write has
        failed (poll), then calls `save()`, the caller's save of its state at `step`, if `step` is a
        save step (should_save), or else `save_local()` if it is a local save step."""
        self.poll()
        if self.should_save(step, last_step):
            save()
        elif save_local is not None and self.local is not None and self.local.due(step):
            save_local()

    def save_local(self, step: int, state, data_state: dict) -> None:
        """Starts the local tier's save of `step` (this process's shards; every process calls it)."""
        self.local.save(step, state, data_state, self.built_from)

    def has_saved(self, step: int) -> bool:
        """Whether this Checkpointer has already started the save of `step` (save() would do nothing)."""
        return step == self._last_saved

    # ------------------------------------------------------------------------------------------
    # Saving

    def save(self, step: int, state, data_state: dict, model_cfg) -> None:
        """Starts writing `step`; returns once the arrays are copied off the devices. Raises
        NonFiniteState (nothing written) if the state holds inf/NaN, SaveFailed if this or the
        previous save failed."""
        if step == self._last_saved:
            return
        self._finish_pending()  # a failure of the previous save is reported as that save's
        sums, nonfinite = checksums.summarise(state)  # a sync point already: the save copies the state
        if nonfinite:
            raise NonFiniteState(f"the state at step {step} holds inf/NaN values (first in {nonfinite[0]}); "
                                 "it was not saved")
        self._last_saved = step
        meta = {"step": step, "model": model_cfg.to_dict(), "checksum_algorithm": checksums.ALGORITHM,
                "checksums": sums, "data_checksum": checksums.json_digest(data_state), **self.built_from}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.manager.save(step, force=True, args=ocp.args.Composite(**{
                STATE: ocp.args.StandardSave(state), DATA: ocp.args.JsonSave(data_state),
                META: ocp.args.JsonSave(meta)}))
        except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many types
            raise self._save_failed(step, error) from None
        self._pending = step

    def poll(self) -> None:
        """Raises SaveFailed as soon as a background write has failed; never blocks (orbax's
        progress flag is a plain read), so the loop calls it after every step."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self._finish_pending()

    def wait(self) -> None:
        """Blocks until every started save is committed to disk (SaveFailed if one was not)."""
        if self.local is not None:
            self.local.wait()
        self._finish_pending()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001
            raise self._save_failed(step, error) from None

    def _save_failed(self, step: int, error: BaseException) -> SaveFailed:
        """Removes what the failed save left (orbax's temporary directory; it never deletes older
        steps before the new one is committed) and its threads still waiting on it (the exit would
        wait for them), and says so in one sentence."""
        release_orbax_waiters()
        if self.is_primary:
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        intact = committed_steps(self.directory)
        after = (f"checkpoints {', '.join(map(str, intact))} are untouched and a restart resumes from step "
                 f"{intact[-1]}" if intact else "there is no earlier checkpoint, so a restart begins at step 0")
        return SaveFailed(f"saving checkpoint {step} in {self.directory} failed ({cause(error)}); its partial "
                          f"directory was removed, {after}")

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        self.manager.close()

    # ------------------------------------------------------------------------------------------
    # Resuming

    def find_resume(self, abstract_state=None) -> Resume | None:
        """What `checkpoint.resume` asks for, or None for a fresh start: "auto" = the newest intact
        checkpoint here, "never", a step here, or a checkpoint path. Under "auto" with a local
        tier, every process reads the newest local step they all hold intact into
        `abstract_state` now (tiers.py), when it is not older than the newest persistent one."""
        choice = str(self.cfg.resume)
        steps = sorted(self.manager.all_steps(), reverse=True) if self.directory.exists() else []
        if choice == "never":
            if steps:  # a fresh run would collide with (and then delete) them
                raise CheckpointError(
                    f"checkpoint.resume=never but {self.directory} already holds checkpoints "
                    f"(steps {', '.join(map(str, sorted(steps)))}); "
                    "use a new output_dir for a fresh start, or checkpoint.resume=auto to continue from them")
            return None
        if choice == "auto" and self.local is not None:
            return self._auto_resume_with_local(steps, abstract_state)
        if choice == "auto":
            return Resume(self.manager, steps, explicit=False, own=True) if steps else None
        if choice.isdigit():
            if int(choice) not in steps:
                raise CheckpointError(
                    f"checkpoint.resume={choice} is not a saved step in {self.directory}; use 'auto', 'never' "
                    f"or one of: {', '.join(map(str, sorted(steps))) or 'none (no checkpoints yet)'}")
            return Resume(self.manager, [int(choice)], explicit=True, own=True)
        path = Path(choice).absolute()  # another run's checkpoints/<step>, checkpoints/ or run directory
        if path.name.isdigit() and (path / STATE).is_dir():
            return Resume(_reader(path.parent), [int(path.name)], explicit=True, own=False)
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        reader = _reader(folder)
        if not reader.all_steps():
            raise CheckpointError(f"checkpoint.resume={choice} holds no complete checkpoint")
        return Resume(reader, sorted(reader.all_steps(), reverse=True), explicit=False, own=False)

    def _auto_resume_with_local(self, steps: list[int], abstract_state) -> Resume | None:
        """checkpoint.resume=auto with a local tier: one decision of every process (tiers.py)."""
        self.local.remove_unfinished()  # writes their process did not live to finish
        candidates, held = common_steps(self.local)
        newest = steps[0] if steps else None
        began = time.perf_counter()
        local, notes = restore_newest_common(self.local, candidates, newest, abstract_state)
        self.restore_s += time.perf_counter() - began
        if local is not None:
            self.tier_line, self.restored_tier = notes, "local"
            return Resume(self.manager, steps, explicit=False, own=True, local=local)
        if steps or any(held):
            self.tier_line = fallback_line(candidates, held, newest, notes)
        if not steps:  # a fresh start: local steps of the run before it would outrank its own saves
            self.local.discard_after(0)
        return Resume(self.manager, steps, explicit=False, own=True) if steps else None

    def restore(self, resume: Resume, abstract_state):
        """(state, data_state, step) of the newest intact checkpoint of `resume`, each array placed
        straight into `abstract_state`'s sharding and checked against the checksums saved with it
        (or the local tier's state that `find_resume` read already)."""
        if resume.local is not None:
            return resume.local.state, resume.local.data_state, resume.local.step
        began = time.perf_counter()
        try:
            return self._restore_persistent(resume, abstract_state)
        finally:
            self.restore_s += time.perf_counter() - began
            self.restored_tier = "persistent"

    def _restore_persistent(self, resume: Resume, abstract_state):
        quiet_closed_loop_callbacks()
        skipped = []
        for step in resume.steps:
            path = Path(resume.manager.directory) / str(step)
            try:
                state, data_state = self._restore_verified(resume.manager, step, abstract_state)
            except _Damaged as damage:
                if resume.explicit:
                    raise CheckpointError(f"checkpoint {path} {damage}; choose another with checkpoint.resume "
                                          "(or 'auto' for the newest intact one)") from None
                skipped.append((step, str(damage)))
                continue
            self._skipped = (resume, skipped)  # reported by set_aside, once they are out of the way
            return state, data_state, step
        raise CheckpointError(
            f"no checkpoint in {resume.manager.directory} is intact ("
            + "; ".join(f"{step}: {why}" for step, why in skipped)
            + "); set checkpoint.resume=never with a new output_dir to start afresh")

    def _restore_verified(self, manager, step: int, abstract_state):
        path = Path(manager.directory) / str(step)
        try:
            metadata = manager.item_metadata(step)
            on_disk = metadata[STATE]
        except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many types
            raise _Damaged(f"cannot be read ({cause(error)})") from None
        _damaged_unless(on_disk is not None, f"has no readable {STATE}/_METADATA")
        mismatch = _shape_mismatch(abstract_state, on_disk.tree)
        if mismatch:  # not damage: another model's checkpoint, which no older step would fix
            raise CheckpointError(f"checkpoint {path} does not fit this model: {mismatch}; "
                                  "use a new output_dir or set checkpoint.resume=never")
        # A checkpoint written before the state gained an (empty here) field, such as the DPO
        # reference: restored without it, the field keeps its empty value.
        absent = _empty_fields_absent_on_disk(abstract_state, on_disk.tree)
        target = ({k: v for k, v in vars(abstract_state).items() if k not in absent} if absent else abstract_state)
        try:
            restored = manager.restore(step, args=ocp.args.Composite(**{
                STATE: ocp.args.StandardRestore(target), DATA: ocp.args.JsonRestore(),
                META: ocp.args.JsonRestore()}))
            if absent:
                restored = {**restored, STATE: abstract_state.replace(**restored[STATE])}
            ok = True
        except Exception as error:  # noqa: BLE001
            ok, why = False, f"cannot be read ({cause(error)})"
        # Each process read its own shards: all must have succeeded, or all move on together.
        _damaged_unless(_on_every_process(ok), why if not ok else "cannot be read by another process of this run")
        meta = restored[META] or {}
        if "checksums" not in meta:
            self._warn(f"checkpoint {path} was written without checksums; it is restored unverified")
            return restored[STATE], restored[DATA]
        _damaged_unless(meta.get("checksum_algorithm") == checksums.ALGORITHM,
                        f"has checksums of an unknown kind ({meta.get('checksum_algorithm')!r})")
        computed, _ = checksums.summarise(restored[STATE])  # global sums: every process gets the same
        difference = checksums.first_difference(meta["checksums"], computed)
        _damaged_unless(difference is None, f"failed verification ({difference})")
        _damaged_unless(checksums.json_digest(restored[DATA]) == meta.get("data_checksum"),
                        "failed verification (its data position does not match its checksum)")
        return restored[STATE], restored[DATA]

    def _set_aside_name(self, step: int, reason: str) -> Path:
        return self.set_aside_dir / f"{step}.{reason}.{self._launched}"

    def set_aside(self, resumed_step: int) -> list[Path]:
        """Moves this run's checkpoints that the resume skipped (damaged: one warning each) or passed
        over (newer than `resumed_step`, under checkpoint.resume=STEP) into
        output_dir/checkpoints_set_aside/: the run will write those steps again, and orbax's
        retention policy would otherwise count (and delete) them. Nothing is deleted; moving one
        back restores it. Called once the Trainer has its state. Returns where the newer ones went."""
        if self.local is not None:  # local steps after the resumed one are written again
            self.local.discard_after(resumed_step)
        resume, skipped = self._skipped
        self._skipped = (None, [])
        damaged = dict(skipped) if resume is not None and resume.own else {}
        newer = [s for s in self.manager.all_steps() if s > resumed_step and s not in damaged]
        moves = [(s, self._set_aside_name(s, "failed-verification")) for s in damaged]
        moves += [(s, self._set_aside_name(s, f"newer-than-resume-{resumed_step}")) for s in sorted(newer)]
        if self.is_primary and moves:
            self.set_aside_dir.mkdir(parents=True, exist_ok=True)
            for step, destination in moves:
                (self.directory / str(step)).rename(destination)
        if moves:
            _sync_processes("maxtext_rocm:set_aside")
            self.manager.reload()
        for step, why in skipped:
            where = f"it was moved to {dict(moves)[step]}" if step in damaged else "it was left where it is"
            self._warn(f"checkpoint {Path(resume.manager.directory) / str(step)} {why}; {where} and the run "
                       f"resumes from step {resumed_step}")
        return [destination for step, destination in moves if step not in damaged]


def _damaged_unless(ok: bool, why: str) -> None:
    if not ok:
        raise _Damaged(why)


def _sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def committed_steps(directory: Path) -> list[int]:
    """Steps with a committed checkpoint directory (orbax renames a step's directory into place
    only once it is complete)."""
    return sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit() and p.is_dir()) \
        if directory.is_dir() else []


def _reader(directory) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    return ocp.CheckpointManager(directory, options=options, item_handlers=_handlers())


def _empty_fields_absent_on_disk(abstract_state, on_disk_tree) -> set:
    """The fields of a dataclass state that hold an empty dict here and are missing from a
    checkpoint's tree (one saved before they existed)."""
    if not hasattr(on_disk_tree, "keys") or not hasattr(abstract_state, "replace"):
        return set()
    return {k for k, v in vars(abstract_state).items() if v == {} and k not in on_disk_tree.keys()}
