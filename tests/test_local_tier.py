"""Issue 47: the node-local tier's own contract, in one process on 8 fake devices: what it saves
comes back bit for bit into the same layout, through orbax; a step whose arrays were changed on
disk fails its (global) checksums; a step saved on another mesh is refused before it is read; an
unfinished write is never a step; local_keep steps are kept."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ml_collections import ConfigDict

from maxtext_rocm.checkpoint import checksums
from maxtext_rocm.checkpoint.local_tier import UNFINISHED, LocalDamaged, LocalTier, verify_loaded


def tier(tmp_path, keep=2) -> LocalTier:
    cfg = ConfigDict({"local_dir": str(tmp_path / "local"), "local_every": 1, "local_keep": keep})
    return LocalTier(cfg, str(tmp_path / "run"))


def state_on(mesh, spec, scale=1.0):
    weights = jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8) * scale, NamedSharding(mesh, spec))
    return {"weights": weights, "step": jax.device_put(jnp.int32(7), NamedSharding(mesh, P())),
            "moments": jax.device_put(jnp.full((8,), 0.5, jnp.bfloat16), NamedSharding(mesh, P()))}


def abstract(state):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


@pytest.fixture
def fsdp(devices):
    return Mesh(np.array(devices).reshape(8), ("fsdp",))


def test_a_local_step_comes_back_bit_for_bit_and_verifies(tmp_path, fsdp):
    local, state = tier(tmp_path), state_on(fsdp, P("fsdp"))
    local.save(3, state, {"step": 3, "epoch": 0})
    local.wait()
    restored, data, meta = local.load(3, abstract(state))
    assert data == {"step": 3, "epoch": 0} and meta["step"] == 3
    for name in state:
        assert restored[name].sharding == state[name].sharding
        assert np.array_equal(np.asarray(restored[name]), np.asarray(state[name])), name
    assert verify_loaded(restored, data, meta) is None
    local.close()


def test_arrays_changed_on_disk_fail_the_checksums(tmp_path, fsdp):
    local = tier(tmp_path)
    state = state_on(fsdp, P("fsdp"))
    local.save(2, state_on(fsdp, P("fsdp"), scale=2.0), {"step": 2})
    local.save(4, state, {"step": 4})
    local.wait()
    # Step 2's arrays under step 4's meta: every file reads cleanly, the numbers are another step's.
    shutil.rmtree(local.directory / "4" / "state")
    shutil.copytree(local.directory / "2" / "state", local.directory / "4" / "state")
    restored, data, meta = local.load(4, abstract(state))
    assert verify_loaded(restored, data, meta) == "failed verification (weights does not match its checksum)"
    assert verify_loaded(restored, {"step": 5}, {**meta, "checksums": checksums.summarise(restored)[0]}) == (
        "failed verification (its data position does not match its checksum)")
    local.close()


def test_a_step_saved_on_another_mesh_is_refused_before_it_is_read(tmp_path, fsdp, devices):
    local = tier(tmp_path)
    local.save(1, state_on(fsdp, P("fsdp")), {"step": 1})
    local.wait()
    other = Mesh(np.array(devices).reshape(4, 2), ("fsdp", "tensor"))
    with pytest.raises(LocalDamaged, match="was saved on another mesh or process layout"):
        local.load(1, abstract(state_on(other, P("fsdp", "tensor"))))
    local.close()


def test_unfinished_writes_are_not_steps_and_local_keep_holds(tmp_path, fsdp):
    local = tier(tmp_path, keep=2)
    for step in (1, 2, 3):
        local.save(step, state_on(fsdp, P("fsdp")), {"step": step})
    local.wait()
    assert local.steps() == [3, 2]
    (local.directory / f"5{UNFINISHED}").mkdir()  # what a process killed mid-write leaves
    shutil.copytree(local.directory / "3", local.directory / "4")
    (local.directory / "4" / "checksums.json").unlink()  # ... or killed after orbax's commit, before its last act
    assert local.steps() == [3, 2]
    local.remove_unfinished()
    assert sorted(p.name for p in local.directory.iterdir()) == ["2", "3"]
    local.close()


def test_a_non_finite_state_is_not_saved(tmp_path, fsdp):
    local, state = tier(tmp_path), state_on(fsdp, P("fsdp"))
    local.save(1, {**state, "weights": state["weights"].at[0, 0].set(jnp.nan)}, {"step": 1})
    local.wait()
    assert local.steps() == [] and local.last_saved is None
    local.close()


def test_a_failed_local_write_is_one_warning_and_the_run_goes_on(tmp_path, fsdp, capsys):
    local = tier(tmp_path)
    local.directory.parent.mkdir(parents=True)
    local.directory.write_text("not a folder")  # where the process's steps would go
    for step in (1, 2):
        local.save(step, state_on(fsdp, P("fsdp")), {"step": step})
    local.wait()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "a local checkpoint write in" in warnings[0], warnings
    assert warnings[0].endswith("the run goes on and the persistent tier still protects it")
    assert local.steps() == [] and local.last_saved is None
    local.close()
