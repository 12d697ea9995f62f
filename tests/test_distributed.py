"""Multi-process runs: where each process finds its place, and real 2-process training on 127.0.0.1.

The environment tests feed `distributed.detect` faked environments of SLURM, Open MPI and
Kubernetes. The process tests start real processes (2 x 4 fake CPU devices, gloo collectives over
loopback), so they cost ~15-20 s each on a 2-core machine.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import ml_collections
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.runtime import distributed
from maxtext_rocm.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dist(**overrides):
    group = config_lib.defaults().distributed
    group.update(overrides)
    return ml_collections.FrozenConfigDict(group)


# ----------------------------------------------------------------------------------------------
# Detection from faked environments


def test_one_process_needs_nothing():
    assert distributed.detect(dist(), {}) is None
    assert distributed.detect(dist(), {"JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}) is None
    # A SLURM job step of one task is one process too.
    assert distributed.detect(dist(), {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                                       "SLURM_STEP_NODELIST": "gpu001"}) is None


def test_jax_environment_and_config_take_precedence_field_by_field():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed.detect(dist(), env) == distributed.Cluster("environment", "10.0.0.1:1234", 4, 3)
    # The config wins over the environment, which wins over SLURM; each field on its own.
    slurm = {"SLURM_JOB_ID": "123", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "gpu[1-2]"}
    found = distributed.detect(dist(coordinator="head:99"), {**slurm, "JAX_PROCESS_ID": "0"})
    assert (found.coordinator, found.num_processes, found.process_id) == ("head:99", 2, 0)
    assert found.source == "config, environment, slurm"
    # JAX_COORDINATOR_PORT moves only the port of a detected coordinator.
    assert distributed.detect(dist(), {**slurm, "JAX_COORDINATOR_PORT": "4444"}).coordinator == "gpu1:4444"


@pytest.mark.parametrize("nodelist, host", [
    ("gpu001", "gpu001"),
    ("gpu001,gpu002", "gpu001"),
    ("gpu[003-006,009],login1", "gpu003"),
    ("gpu[007,010-012]", "gpu007"),
    ("rack[2-3]-node[01-04]", "rack2-node01"),
    ("mi300x-[12-13]-ib", "mi300x-12-ib"),
])
def test_slurm_node_list_first_host(nodelist, host):
    assert distributed.first_slurm_host(nodelist) == host


def test_slurm_one_task_per_node_sees_every_gpu():
    env = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
           "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "mi355-[017-024]", "SLURM_STEP_TASKS_PER_NODE": "1(x8)",
           "SLURM_JOB_NODELIST": "mi355-[017-024]"}
    found = distributed.detect(dist(), env)
    port = distributed.BASE_PORT + 4242
    assert found == distributed.Cluster("slurm", f"mi355-017:{port}", 8, 5, None)


def test_slurm_one_task_per_gpu_pins_its_gpu():
    env = {"SLURM_JOB_ID": "99", "SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "8(x2)"}
    found = distributed.detect(dist(), env)
    assert (found.num_processes, found.process_id, found.local_device_ids) == (16, 11, (3,))
    assert found.coordinator == f"n1:{distributed.BASE_PORT + 99}"
    # JAX_LOCAL_DEVICE_IDS, when given, decides.
    assert distributed.detect(dist(), {**env, "JAX_LOCAL_DEVICE_IDS": "6,7"}).local_device_ids == (6, 7)


def test_open_mpi_4_names_its_launcher():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
           "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}
    found = distributed.detect(dist(), env)
    port = distributed.BASE_PORT + 1531576320 % distributed.PORT_SPAN
    assert found == distributed.Cluster("openmpi", f"10.96.0.1:{port}", 4, 2, None)
    ipv6 = {**env, "OMPI_MCA_orte_hnp_uri": "1314521088.0;tcp6://[fe80::b9b:ac5d,2620:10d::2]:43370"}
    assert distributed.detect(dist(), ipv6).coordinator.startswith("[fe80::b9b:ac5d]:")


def test_open_mpi_5_needs_a_coordinator_address():
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_RANK": "1"}
    with pytest.raises(ConfigError, match=r"no coordinator address \(Open MPI 5 does not say where process 0 runs\); "
                                          "set distributed.coordinator or JAX_COORDINATOR_ADDRESS"):
        distributed.detect(dist(), env)
    found = distributed.detect(dist(), {**env, "JAX_COORDINATOR_ADDRESS": "node0:5000"})
    assert found == distributed.Cluster("environment, openmpi", "node0:5000", 2, 1, (1,))


def test_kubernetes_jobset():
    # Job 1 of 2 in replicated job "workers", pod 2 of 4 in that Job: process 1 * 4 + 2 of 8.
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "2", "JOB_COMPLETIONS": "4",
           "JOBSET_NAME": "llama", "REPLICATED_JOB_NAME": "workers", "JOB_INDEX": "1",
           "REPLICATED_JOB_REPLICAS": "2"}
    found = distributed.detect(dist(), env)
    assert found == distributed.Cluster("kubernetes", f"llama-workers-0-0.llama:{distributed.DEFAULT_PORT}", 8, 6)
    # The JobSet's coordinator annotation, when present, names the host.
    named = distributed.detect(dist(), {**env, "JOBSET_COORDINATOR": "llama-workers-0-0.svc"})
    assert named.coordinator == f"llama-workers-0-0.svc:{distributed.DEFAULT_PORT}"


def test_kubernetes_example_gives_each_pod_its_place():
    """scripts/k8s-jobset.yaml, with the downward API resolved as the JobSet controller would."""
    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load(open(os.path.join(REPO, "scripts", "k8s-jobset.yaml")))
    rjob = spec["spec"]["replicatedJobs"][0]
    job = rjob["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    annotations = {"jobset.sigs.k8s.io/jobset-name": spec["metadata"]["name"],
                   "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                   "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob["replicas"])}
    found = []
    for job_index in range(rjob["replicas"]):
        for pod in range(job["completions"]):
            env = {"JOB_COMPLETION_INDEX": str(pod)}
            pod_annotations = {**annotations, "jobset.sigs.k8s.io/job-index": str(job_index)}
            for var in container["env"]:
                if "value" in var:
                    env[var["name"]] = var["value"]
                else:
                    path = var["valueFrom"]["fieldRef"]["fieldPath"]
                    env[var["name"]] = pod_annotations[path.split("'")[1]]
            found.append(distributed.detect(dist(), env))
    count = rjob["replicas"] * job["completions"]
    assert sorted(c.process_id for c in found) == list(range(count))
    assert {c.num_processes for c in found} == {count}
    assert {c.coordinator for c in found} == {f"llama-workers-0-0.llama:{distributed.DEFAULT_PORT}"}
    assert container["ports"][0]["containerPort"] == distributed.DEFAULT_PORT
    assert f"--config.mesh.dcn.fsdp={count}" in container["args"]


def test_kubernetes_plain_indexed_job():
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3", "JOB_COMPLETIONS": "4"}
    with pytest.raises(ConfigError, match="a plain indexed Job has no standard service name"):
        distributed.detect(dist(), env)
    found = distributed.detect(dist(), {**env, "JAX_COORDINATOR_ADDRESS": "train-0.train:8476"})
    assert (found.coordinator, found.num_processes, found.process_id) == ("train-0.train:8476", 4, 3)
    # A single-pod indexed Job is one process.
    assert distributed.detect(dist(), {"JOB_COMPLETION_INDEX": "0"}) is None


@pytest.mark.parametrize("group, env, message", [
    ({}, {"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1"}, "2 processes (from environment) but not which one"),
    ({}, {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h:1"}, "process id 2 (from environment) is outside 0..1"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1"}, "a coordinator (h:1) is given but not how many processes"),
    ({"num_processes": 2, "process_id": 0, "coordinator": "h"}, {}, "coordinator 'h' (from config) is not HOST:PORT"),
    ({}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' is not an integer"),
    ({}, {"SLURM_JOB_ID": "1", "SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "a"}, "SLURM_PROCID='x'"),
])
def test_inconsistent_layouts_are_one_sentence(group, env, message):
    with pytest.raises(ConfigError) as info:
        distributed.detect(dist(**group), env)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("override, message", [
    ("--config.distributed.num_processes=-1", "distributed.num_processes must be >= 0"),
    ("--config.distributed.process_id=-2", "distributed.process_id must be >= 0, or -1"),
    ("--config.distributed.init_timeout_s=0", "distributed.init_timeout_s must be positive"),
    ("--config.distributed.heartbeat_timeout_s=-5", "distributed.heartbeat_timeout_s must be positive"),
])
def test_distributed_keys_are_validated(override, message):
    with pytest.raises(ConfigError, match=message):
        config_lib.load("tiny_llama", [override])


# ----------------------------------------------------------------------------------------------
# Real processes on 127.0.0.1

# small_config's model through the command line, fp32, with a warmup of one step so that steps 2
# and 3 apply real updates (a wrong gradient reduction across processes shows in their loss).
SMALL = ["--config.model.vocab_size=128", "--config.model.d_model=64", "--config.model.n_layers=2",
         "--config.model.n_heads=4", "--config.model.n_kv_heads=2", "--config.model.head_dim=16",
         "--config.model.mlp_dim=128", "--config.model.scan_layers=true", "--config.data.source=synthetic",
         "--config.train.steps=3", "--config.train.per_device_batch_size=1", "--config.train.seq_len=32",
         "--config.optimizer.warmup_steps=1", "--config.log.every=1", "--config.log.tensorboard=false"]
if "checkpoint" in config_lib.defaults():
    SMALL.append("--config.checkpoint.enabled=false")  # saving across process counts: a later test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(**extra) -> dict:
    """The test process's environment with JAX's multi-process variables and the device flag removed."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "SLURM_", "OMPI_", "PMIX_", "JOB_", "JOBSET_")) and k != "XLA_FLAGS"}
    # LLVM -O0 compiles ~20% faster on this CPU; the numbers agree with the -O2 reference to 1e-6.
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS="--xla_backend_optimization_level=0")
    env.update(extra)
    return env


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def reference_rows(overrides, tmp_path, preset="configs/tiny_llama.py:fp32"):
    """The same run in this process on 8 devices: one process, no DCN."""
    from maxtext_rocm.train import Trainer

    cfg = config_lib.load(preset, SMALL + overrides + [f"--config.output_dir={tmp_path}/one"])
    trainer = Trainer(cfg, log=lambda *_: None)
    trainer.run()
    trainer.writer.close()
    return read_rows(tmp_path / "one" / "metrics.jsonl")


MIXTRAL = "configs/tiny_mixtral.py:fp32"


@pytest.mark.parametrize("preset, two_process_mesh, one_process_mesh", [
    # Parameters sharded across the processes and tensor parallelism within each: the harder dense
    # case, run by default. Pure data parallelism across processes costs another ~30 s: marked slow.
    pytest.param(TINY := "configs/tiny_llama.py:fp32",
                 ["--config.mesh.dcn.fsdp=2", "--config.mesh.ici.fsdp=2", "--config.mesh.ici.tensor=2"],
                 ["--config.mesh.ici.fsdp=4", "--config.mesh.ici.tensor=2"], id="dcn_fsdp2_ici_fsdp2_tensor2"),
    pytest.param(TINY, ["--config.mesh.dcn.data=2", "--config.mesh.ici.fsdp=4"],
                 ["--config.mesh.ici.data=2", "--config.mesh.ici.fsdp=4"], id="dcn_data2_ici_fsdp4",
                 marks=pytest.mark.slow),
    # A pipeline stage per process (maxtext_rocm/parallel/pipeline/): activations cross processes.
    pytest.param(TINY, ["--config.mesh.dcn.stage=2", "--config.mesh.ici.fsdp=4"],
                 ["--config.mesh.ici.stage=2", "--config.mesh.ici.fsdp=4"], id="dcn_stage2_ici_fsdp4",
                 marks=pytest.mark.slow),
    # The same with the hand-written pipeline backward (parallel/pipeline/gpipe_recompute.py): its
    # cotangents cross the processes by its own permutes, not the loop's autodiff.
    pytest.param(TINY, ["--config.mesh.dcn.stage=2", "--config.mesh.ici.fsdp=4", "--config.pipeline.schedule=gpipe_recompute"],
                 ["--config.mesh.ici.stage=2", "--config.mesh.ici.fsdp=4", "--config.pipeline.schedule=gpipe_recompute"],
                 id="dcn_stage2_ici_fsdp4_gpipe_recompute", marks=pytest.mark.slow),
    # 1f1b (parallel/pipeline/one_f_one_b.py): the loss runs inside the pipeline, each microbatch's
    # backward as its cotangent crosses back between the processes.
    pytest.param(TINY, ["--config.mesh.dcn.stage=2", "--config.mesh.ici.fsdp=4", "--config.pipeline.schedule=1f1b"],
                 ["--config.mesh.ici.stage=2", "--config.mesh.ici.fsdp=4", "--config.pipeline.schedule=1f1b"],
                 id="dcn_stage2_ici_fsdp4_1f1b"),
    # Interleaved 1f1b (parallel/pipeline/one_f_one_b_order.py): activations and cotangents go round the
    # ring, so both directions cross the processes, forward and back, twice per microbatch.
    pytest.param(TINY, ["--config.mesh.dcn.stage=2", "--config.mesh.ici.fsdp=4", "--config.pipeline.schedule=1f1b",
                        "--config.pipeline.repeats=2", "--config.model.n_layers=4"],
                 ["--config.mesh.ici.stage=2", "--config.mesh.ici.fsdp=4", "--config.pipeline.schedule=1f1b",
                  "--config.pipeline.repeats=2", "--config.model.n_layers=4"],
                 id="dcn_stage2_ici_fsdp4_interleaved_1f1b", marks=pytest.mark.slow),
    # Dropless MoE with its expert exchange across the processes (all-to-alls over gloo) and FSDP
    # within each: the default moe_impl, 8 experts, 4 per process.
    pytest.param(MIXTRAL, ["--config.mesh.dcn.expert=2", "--config.mesh.ici.fsdp=4"],
                 ["--config.mesh.ici.expert=2", "--config.mesh.ici.fsdp=4"], id="moe_dcn_expert2_ici_fsdp4"),
])
def test_two_processes_train_like_one(preset, two_process_mesh, one_process_mesh, tmp_path, devices):
    out, logs = tmp_path / "two", tmp_path / "logs"
    started = time.perf_counter()
    result = subprocess.run(
        ["bash", "scripts/launch_local.sh", "2", preset, *SMALL, *two_process_mesh,
         f"--config.output_dir={out}"],
        cwd=REPO, env=process_env(LOG_DIR=str(logs), DEVICES="8", PYTHON=sys.executable),
        capture_output=True, text=True, timeout=240)
    took = time.perf_counter() - started
    log0, log1 = (logs / "process_0.log").read_text(), (logs / "process_1.log").read_text()
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n--- process 1:\n{log1[-3000:]}"
    assert "devices: 8 x cpu" in log0 and "step 3/3 100%" in log0
    assert "step 1/3" not in log1 and "devices:" not in log1  # only process 0 speaks

    record = json.loads((out / "config.json").read_text())["environment"]
    assert record["process_count"] == 2 and record["device_count"] == 8
    two = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in two] == [1, 2, 3]  # written once, by process 0

    one = reference_rows(one_process_mesh, tmp_path, preset)
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=1e-5), (a, b)
    assert two[2]["loss"] != pytest.approx(two[0]["loss"], abs=1e-3)  # the updates did something
    print(f"2-process run: {took:.1f} s")


def start_pair_past_step_2(tmp_path, heartbeat, procs, logs):
    """Two trainer processes of one long run (dcn.data=2), started into `procs` (their logs into
    `logs`, so the caller's cleanup owns them), returned once process 0 has logged step 2."""
    port = free_port()
    args = [sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py:fp32", *SMALL,
            "--config.train.steps=100000", "--config.mesh.dcn.data=2", "--config.mesh.ici.fsdp=4",
            f"--config.distributed.heartbeat_timeout_s={heartbeat}", f"--config.output_dir={tmp_path}/run"]
    for i in range(2):
        logs.append(open(tmp_path / f"process_{i}.log", "w+"))
        env = process_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                          JAX_PROCESS_ID=str(i))
        env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
        procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=logs[i], stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 180
    while "step      2/100000" not in (tmp_path / "process_0.log").read_text():
        assert time.monotonic() < deadline, "the 2-process run never reached step 2"
        assert procs[0].poll() is None and procs[1].poll() is None, (tmp_path / "process_0.log").read_text()
        time.sleep(0.2)


def stop_pair(procs, logs):
    """Kills what start_pair_past_step_2 started and is still running, and closes its logs."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for f in logs:
        f.close()


def test_a_dead_process_stops_the_other(tmp_path):
    """Process 1 dies mid-training (SIGKILL: no goodbye); process 0 must exit non-zero in bounded time."""
    heartbeat = 5
    procs, logs = [], []
    try:
        start_pair_past_step_2(tmp_path, heartbeat, procs, logs)

        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        rc = procs[0].wait(timeout=heartbeat + 30)
        took = time.monotonic() - killed
    finally:
        stop_pair(procs, logs)
    log0 = (tmp_path / "process_0.log").read_text()
    assert rc != 0, log0[-2000:]
    # Usually the coordination service reports the dead task; when the kill lands inside a
    # collective, Gloo's transport fails first (seen once under heavy load: a short read).
    # Since maxtext_rocm/runtime/peers.py, process 0 names the dead process first (tests/test_dead_peer.py).
    assert any(sign in log0 for sign in ("went silent", "another task died", "unhealthy", "gloo::")), log0[-2000:]
    print(f"process 0 stopped {took:.1f} s after process 1 was killed (exit status {rc})")


def test_bad_input_on_every_process_is_each_ones_own_sentence_and_exit_2(tmp_path):
    """Every process finds the same bad setting, milliseconds apart: the first to say goodbye with
    exit status 2 no longer makes process 0 report it as a lost peer (exit 5, "restart from the
    last checkpoint") before process 0 reaches its own sentence (runtime/peers.py)."""
    logs = tmp_path / "logs"
    result = subprocess.run(
        ["bash", "scripts/launch_local.sh", "2", "configs/tiny_llama.py:fp32", *SMALL, "--config.mesh.dcn.stage=2",
         "--config.mesh.ici.fsdp=4", "--config.pipeline.schedule=1f1b", "--config.pipeline.repeats=2",
         f"--config.output_dir={tmp_path / 'run'}"],
        cwd=REPO, env=process_env(LOG_DIR=str(logs), DEVICES="8", PYTHON=sys.executable),
        capture_output=True, text=True, timeout=240)
    texts = [(logs / f"process_{i}.log").read_text() for i in range(2)]
    sentence = ("error: model.n_layers=2 leaves some of mesh stage=2 x pipeline.repeats=2 = 4 virtual stages "
                "without a layer; choose stage x repeats <= 2")
    assert result.returncode == 2, f"{result.stderr[-2000:]}\n--- 0:\n{texts[0][-2000:]}\n--- 1:\n{texts[1][-2000:]}"
    for text in texts:
        assert sentence in text and "exit status 5" not in text and "Traceback" not in text, text[-2000:]


def test_unanswered_coordinator_is_one_sentence_and_exit_2():
    port = free_port()  # nobody listens there
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py", *SMALL,
         f"--config.distributed.coordinator=127.0.0.1:{port}", "--config.distributed.num_processes=2",
         "--config.distributed.process_id=1", "--config.distributed.init_timeout_s=2"],
        cwd=REPO, env=process_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert (f"error: the coordinator at 127.0.0.1:{port} did not answer process 1 of 2 within "
            "distributed.init_timeout_s=2 s") in result.stderr
    assert "Traceback" not in result.stderr and "Check failure" not in result.stderr
    assert time.perf_counter() - started < 30


@pytest.mark.slow  # CI budget (~45 s); the checkpoint tests cover restores onto another mesh in one process
def test_checkpoints_move_between_two_processes_and_one(tmp_path, devices):
    """One output_dir, three legs, each resuming the last one's checkpoint with resume=auto:
    2 processes train steps 1-2 and save; 1 process (here, on the 8 fake devices) restores them
    and trains steps 3-4, saving; 2 processes restore that and train steps 5-6. Every leg's
    losses, and the restored parameters, equal an uninterrupted 1-process run (fp32, ~1e-5)."""
    import jax
    import numpy as np
    from flax import linen as nn

    from maxtext_rocm.checkpoint import restore_params
    from maxtext_rocm.api import abstract_params
    from maxtext_rocm.train import Trainer

    # A constant schedule after one warmup step: the learning rate of a step does not depend on
    # train.steps, so each leg can stop at its own train.steps and still follow the reference.
    common = SMALL + ["--config.optimizer.schedule=constant"]
    two_mesh = ["--config.mesh.dcn.fsdp=2", "--config.mesh.ici.fsdp=2", "--config.mesh.ici.tensor=2"]
    one_mesh = ["--config.mesh.ici.fsdp=4", "--config.mesh.ici.tensor=2"]
    run = tmp_path / "run"
    saving = ["--config.checkpoint.enabled=true", "--config.checkpoint.every=2", "--config.checkpoint.keep=5",
              "--config.checkpoint.resume=auto", f"--config.output_dir={run}"]

    def host(tree):
        return jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x)), tree)

    def assert_close(got, want, what):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{what}{jax.tree_util.keystr(path)}")

    def on_disk(step):
        """The parameters of checkpoints/<step>, read onto one device (not through the mesh)."""
        device = jax.sharding.SingleDeviceSharding(devices[0])
        cfg = config_lib.load("configs/tiny_llama.py:fp32", common)
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                          nn.meta.unbox(abstract_params(cfg)))
        return host(restore_params(run / "checkpoints" / str(step), abstract))

    def two_processes(steps, logs):
        started = time.perf_counter()
        result = subprocess.run(
            ["bash", "scripts/launch_local.sh", "2", "configs/tiny_llama.py:fp32", *common, *two_mesh, *saving,
             f"--config.train.steps={steps}"],
            cwd=REPO, env=process_env(LOG_DIR=str(tmp_path / logs), DEVICES="8", PYTHON=sys.executable),
            capture_output=True, text=True, timeout=240)
        log0 = (tmp_path / logs / "process_0.log").read_text()
        log1 = (tmp_path / logs / "process_1.log").read_text()
        assert result.returncode == 0, f"{result.stderr[-3000:]}\n--- process 1:\n{log1[-3000:]}"
        return log0, time.perf_counter() - started

    # The uninterrupted reference: 6 steps in one process, parameters kept after steps 2 and 4.
    cfg = config_lib.load("configs/tiny_llama.py:fp32",
                          common + one_mesh + ["--config.train.steps=6", f"--config.output_dir={tmp_path}/one"])
    reference = Trainer(cfg, devices=devices, log=lambda *_: None)
    reference.run(2)
    want_params = {2: host(reference.state.params)}
    reference.run(2)
    want_params[4] = host(reference.state.params)
    reference.run()
    want_params[6] = host(reference.state.params)
    reference.writer.close()
    want = {r["step"]: r for r in read_rows(tmp_path / "one" / "metrics.jsonl")}
    assert [*want] == [1, 2, 3, 4, 5, 6]

    # Leg 1: 2 processes x 4 devices, steps 1-2; every process writes its shards of step 2.
    log0, took_first = two_processes(2, "logs_first")
    assert "resumed from" not in log0 and "step 2/2 100%" in log0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    assert_close(on_disk(2), want_params[2], "2-process checkpoint 2: ")

    # Leg 2: 1 process x 8 devices restores step 2 (resume=auto), trains steps 3-4 and saves step 4.
    cfg = config_lib.load("configs/tiny_llama.py:fp32", common + one_mesh + saving + ["--config.train.steps=4"])
    said = []
    one = Trainer(cfg, devices=devices, log=said.append)
    assert one.step_count == 2 and int(jax.device_get(one.state.step)) == 2
    assert f"resumed from {run / 'checkpoints'}/2" in said
    for a, b in zip(jax.tree_util.tree_leaves(host(one.state.params)), jax.tree_util.tree_leaves(on_disk(2))):
        assert np.array_equal(a, b)  # exactly what the 2 processes saved
    one.run()
    one.close()  # frees run/ (its lock) for the 2-process leg
    assert_close(on_disk(4), want_params[4], "1-process checkpoint 4: ")

    # Leg 3: 2 processes restore the 1-process step 4 (resume=auto) and train steps 5-6.
    log0, took_last = two_processes(6, "logs_last")
    assert f"resumed from {run / 'checkpoints'}/4" in log0 and "step 6/6 100%" in log0
    assert_close(on_disk(6), want_params[6], "2-process checkpoint 6: ")

    rows = read_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # each leg picked up where the last stopped
    for row in rows:
        for key in ("loss", "grad_norm", "lr"):
            assert row[key] == pytest.approx(want[row["step"]][key], rel=1e-5, abs=1e-5), (row, want[row["step"]])
    assert rows[5]["loss"] != pytest.approx(rows[2]["loss"], abs=1e-3)  # the updates did something
    print(f"2-process legs: {took_first:.1f} s and {took_last:.1f} s")
