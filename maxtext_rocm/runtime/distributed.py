"""Starting `jax.distributed`: how many processes there are, which one this is, and who coordinates.

`initialize(cfg.distributed)` runs before anything touches a device. It finds the three numbers of
a multi-process run from the first of these that gives them, field by field:

1. the config: `distributed.coordinator`, `distributed.num_processes`, `distributed.process_id`;
2. the environment: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`
   (what `scripts/launch_local.sh` sets; `JAX_COORDINATOR_PORT` changes only the port);
3. SLURM (`srun`): `SLURM_PROCID` of `SLURM_STEP_NUM_TASKS`, the first host of the step's node list;
4. Open MPI (`mpirun`): `OMPI_COMM_WORLD_RANK` of `OMPI_COMM_WORLD_SIZE`, the launcher's address
   (Open MPI 4; Open MPI 5 does not name it, so give `JAX_COORDINATOR_ADDRESS`);
5. Kubernetes, an indexed Job or a JobSet (see `_kubernetes` for the variables it reads).

One process (nothing found, or a count of 1) needs no start-up at all. `detect` is a pure function
of a config group and an environment mapping, so the tests feed it faked environments.

Failure is bounded both ways: if the coordinator does not answer within `init_timeout_s`, the
process prints one sentence naming it and exits with status 2; once running, a process that stops
sending heartbeats for `heartbeat_timeout_s` is declared dead and the coordination service stops
the others (JAX terminates them with a message that another task died). Before that, a process
that dies is named by the survivors at once, exit status 5 (maxtext_rocm/runtime/peers.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
import time
from typing import Mapping

from maxtext_rocm.config import ConfigError, UserError

# Coordinator ports derived from a job id fall in [BASE_PORT, BASE_PORT + PORT_SPAN): below
# Linux's ephemeral range (32768-60999), so an outgoing connection never holds one.
BASE_PORT = 10000
PORT_SPAN = 20000
DEFAULT_PORT = 23456  # where nothing derives one (Kubernetes): any port free on process 0's host
INIT_EXIT_STATUS = 2


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process sits in a multi-process run."""

    source: str  # which of config / environment / slurm / openmpi / kubernetes decided
    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None  # None: every local accelerator

    def describe(self) -> str:
        return (f"process {self.process_id} of {self.num_processes}, coordinator {self.coordinator} "
                f"(from {self.source})")


# ----------------------------------------------------------------------------------------------
# Detection: pure functions of an environment mapping


def _int(env: Mapping[str, str], name: str, source: str) -> int | None:
    text = env.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} is not an integer, "
                          f"so the {source} process layout cannot be read") from None


def _job_port(job_id: str) -> int:
    """A port every process of one job derives alike, different between most jobs on a node."""
    digits = re.sub(r"\D", "", job_id)
    return BASE_PORT + (int(digits) if digits else 0) % PORT_SPAN


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-006,9]-ib,login1' -> 'gpu003-ib'."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level comma ends the first group
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    group = nodelist[:end].strip()
    # Each bracket keeps its first member; '003-006' keeps '003' (zero padding included).
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], group)


def _tasks_per_node(text: str | None) -> int | None:
    """SLURM's '8(x2),4' -> 8: the tasks on the first node."""
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match else None


def _slurm(env: Mapping[str, str]) -> dict | None:
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
        return None
    count = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM") or _int(env, "SLURM_NTASKS", "SLURM")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if count is None or not nodelist:
        return None
    per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"))
    return dict(source="slurm", num_processes=count, process_id=_int(env, "SLURM_PROCID", "SLURM"),
                host=first_slurm_host(nodelist), port=_job_port(env["SLURM_JOB_ID"]),
                local_rank=_int(env, "SLURM_LOCALID", "SLURM"), local_size=per_node)


def _openmpi(env: Mapping[str, str]) -> dict | None:
    if "OMPI_COMM_WORLD_SIZE" not in env or "OMPI_COMM_WORLD_RANK" not in env:
        return None
    host = port = None
    # Open MPI 4 names its launcher (mpirun's host, usually where rank 0 runs):
    # '1531576320.0;tcp://10.96.0.1,10.148.0.1:34911' or '...;tcp6://[fe80::1,2620::2]:43370'.
    uri = env.get("OMPI_MCA_orte_hnp_uri", "")
    match = re.search(r"tcp://([^,:;]+)|tcp6://\[([^,\]]+)", uri)
    if match:
        host = match.group(1) or f"[{match.group(2)}]"
        port = _job_port(uri.split(".", 1)[0])
    return dict(source="openmpi", num_processes=_int(env, "OMPI_COMM_WORLD_SIZE", "Open MPI"),
                process_id=_int(env, "OMPI_COMM_WORLD_RANK", "Open MPI"), host=host, port=port,
                local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
                local_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"))


def _kubernetes(env: Mapping[str, str]) -> dict | None:
    """An indexed Job, alone or as one of the Jobs of a JobSet.

    Kubernetes sets `JOB_COMPLETION_INDEX` (the pod's index within its Job) in every pod of an
    indexed Job. Nothing tells a pod how many pods there are, so the pod template says so:
    `JOB_COMPLETIONS` (the Job's `completions`, default 1) and, in a JobSet, `JOBSET_NAME`,
    `REPLICATED_JOB_NAME`, `JOB_INDEX` and `REPLICATED_JOB_REPLICAS` through the downward API
    (the `jobset.sigs.k8s.io/...` annotations; `scripts/k8s-jobset.yaml` shows how). Process
    `JOB_INDEX * JOB_COMPLETIONS + JOB_COMPLETION_INDEX` of `REPLICATED_JOB_REPLICAS * JOB_COMPLETIONS`;
    the coordinator is pod 0 of Job 0 through the JobSet's headless service
    (`JOBSET_COORDINATOR`, the `jobset.sigs.k8s.io/coordinator` annotation, when the JobSet names one).
    A plain indexed Job has no standard service name: give `JAX_COORDINATOR_ADDRESS`.
    """
    index = _int(env, "JOB_COMPLETION_INDEX", "Kubernetes")
    if index is None:
        return None
    pods_per_job = _int(env, "JOB_COMPLETIONS", "Kubernetes") or 1
    jobset = env.get("JOBSET_NAME")
    if not jobset:
        return dict(source="kubernetes", num_processes=pods_per_job, process_id=index,
                    host=None, port=DEFAULT_PORT)
    job_index = _int(env, "JOB_INDEX", "Kubernetes") or 0
    replicas = _int(env, "REPLICATED_JOB_REPLICAS", "Kubernetes") or 1
    host = env.get("JOBSET_COORDINATOR")
    if not host and env.get("REPLICATED_JOB_NAME"):
        # JobSet names Job j of a replicated job '<jobset>-<rjob>-<j>', its pod i '<job>-<i>', and
        # the headless service (the pods' subdomain) after the JobSet unless spec.network says otherwise.
        host = f"{jobset}-{env['REPLICATED_JOB_NAME']}-0-0.{env.get('JOBSET_SUBDOMAIN') or jobset}"
    return dict(source="kubernetes", num_processes=replicas * pods_per_job,
                process_id=job_index * pods_per_job + index, host=host, port=DEFAULT_PORT)


CLUSTERS = (_slurm, _openmpi, _kubernetes)


def detect(dist_cfg, env: Mapping[str, str]) -> Cluster | None:
    """The multi-process layout that `dist_cfg` and `env` describe; None for a single process.

    Each of coordinator, process count and process id comes from the first source that gives it:
    the config, then JAX_* variables, then the first cluster manager whose variables are present.
    """
    cluster = next((found for probe in CLUSTERS if (found := probe(env)) is not None), None) or {}
    given_by = {}

    def pick(field, config_value, unset, env_name, cast):
        if config_value != unset:
            given_by[field] = "config"
            return config_value
        if env.get(env_name, "") != "":
            given_by[field] = "environment"
            return cast(env, env_name, "JAX") if cast else env[env_name]
        if cluster.get(field) is not None:
            given_by[field] = cluster["source"]
            return cluster[field]
        return None

    num = pick("num_processes", dist_cfg.num_processes, 0, "JAX_NUM_PROCESSES", _int)
    pid = pick("process_id", dist_cfg.process_id, -1, "JAX_PROCESS_ID", _int)
    coordinator = pick("coordinator", dist_cfg.coordinator, "", "JAX_COORDINATOR_ADDRESS", None)
    if coordinator is None and cluster.get("host"):
        port = _int(env, "JAX_COORDINATOR_PORT", "JAX") or cluster["port"]
        coordinator, given_by["coordinator"] = f"{cluster['host']}:{port}", cluster["source"]

    if num is None or num == 1:
        if pid not in (None, 0):
            raise ConfigError(f"process id {pid} (from {given_by['process_id']}) needs a process count above it; "
                              "set distributed.num_processes or JAX_NUM_PROCESSES")
        if coordinator is not None and num is None and given_by["coordinator"] in ("config", "environment"):
            raise ConfigError(f"a coordinator ({coordinator}) is given but not how many processes there are; "
                              "set distributed.num_processes or JAX_NUM_PROCESSES")
        return None
    if pid is None:
        raise ConfigError(f"{num} processes (from {given_by['num_processes']}) but not which one this is; "
                          "set distributed.process_id or JAX_PROCESS_ID")
    if not 0 <= pid < num:
        raise ConfigError(f"process id {pid} (from {given_by['process_id']}) is outside 0..{num - 1} "
                          f"for {num} processes (from {given_by['num_processes']})")
    if coordinator is None:
        where = {"openmpi": "Open MPI 5 does not say where process 0 runs",
                 "kubernetes": "a plain indexed Job has no standard service name"}.get(cluster.get("source"), "")
        raise ConfigError(f"{num} processes but no coordinator address{f' ({where})' if where else ''}; "
                          "set distributed.coordinator or JAX_COORDINATOR_ADDRESS to HOST:PORT of process 0")
    if not re.fullmatch(r".+:\d+", coordinator):
        raise ConfigError(f"coordinator {coordinator!r} (from {given_by['coordinator']}) is not HOST:PORT")

    local_ids = None
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        local_ids = tuple(int(i) for i in env["JAX_LOCAL_DEVICE_IDS"].split(","))
    elif (cluster.get("local_size") or 1) > 1 and cluster.get("local_rank") is not None:
        # Several processes on one node: each drives the accelerator of its local rank.
        local_ids = (cluster["local_rank"],)
    sources = sorted(set(given_by.values()), key=["config", "environment", "slurm", "openmpi", "kubernetes"].index)
    return Cluster(source=", ".join(sources), coordinator=coordinator, num_processes=num, process_id=pid,
                   local_device_ids=local_ids)


# ----------------------------------------------------------------------------------------------
# Start-up


def _exit_unless_connected(cluster: Cluster, timeout_s: int, connected: threading.Event) -> None:
    """After `timeout_s`, one sentence naming the coordinator and exit 2, unless start-up finished.

    JAX's own start-up timeout aborts the process from C++ with a stack trace; this watchdog speaks
    first (jax is given a few seconds more), and it runs on a thread because the connect call holds
    the main thread but not the GIL.
    """
    if connected.wait(timeout_s):
        return
    if cluster.process_id == 0:
        problem = (f"process 0 started the coordinator at {cluster.coordinator} but not all "
                   f"{cluster.num_processes} processes joined it")
    else:
        problem = (f"the coordinator at {cluster.coordinator} did not answer process {cluster.process_id} "
                   f"of {cluster.num_processes}")
    print(f"error: {problem} within distributed.init_timeout_s={timeout_s} s; check that every process "
          "was started with the same coordinator and that its port is reachable", file=sys.stderr, flush=True)
    os._exit(INIT_EXIT_STATUS)


def initialize(dist_cfg, env: Mapping[str, str] | None = None) -> Cluster | None:
    """Starts jax.distributed for a multi-process run; does nothing for a single process.

    Must run before anything initialises a JAX backend (jax.devices(), any computation).
    """
    import jax

    cluster = detect(dist_cfg, os.environ if env is None else env)
    if cluster is None:
        return None
    if jax.distributed.is_initialized():
        return cluster  # a notebook or a test started it already
    # CPU collectives across processes: gloo over TCP (the default in recent JAX; say so anyway).
    if not jax.config.jax_cpu_collectives_implementation:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service installs a C++ SIGTERM handler here, which would take SIGTERM from
    # the start-up handler (startup_signals: exit at once with one line) until the training loop
    # reinstalls its own. The stop is agreed by maxtext_rocm/runtime/preemption.py instead, for SIGINT too.
    jax.config.update("jax_enable_preemption_service", False)

    connected = threading.Event()
    watchdog = threading.Thread(target=_exit_unless_connected, daemon=True, name="distributed-init-watchdog",
                                args=(cluster, dist_cfg.init_timeout_s, connected))
    watchdog.start()
    began = time.time()
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            local_device_ids=list(cluster.local_device_ids) if cluster.local_device_ids else None,
            # Everything is decided above; JAX's own detection would pin one GPU per SLURM task.
            cluster_detection_method="deactivate",
            initialization_timeout=dist_cfg.init_timeout_s + 5,
            heartbeat_timeout_seconds=dist_cfg.heartbeat_timeout_s,
            # Waiting at exit for the others is bounded by the same time as a missing heartbeat.
            shutdown_timeout_seconds=dist_cfg.heartbeat_timeout_s,
        )
    except RuntimeError as error:
        raise UserError(f"jax.distributed could not start ({error}); start it before any JAX computation") from None
    finally:
        connected.set()
    global init_span
    init_span = (began, time.time())
    _watch_peers(cluster, dist_cfg)
    return cluster


init_span: tuple[float, float] | None = None  # (start, end) of this process's initialize, for goodput


_peer_watch = None


def _watch_peers(cluster: Cluster, dist_cfg) -> None:
    """Starts naming dead peers (maxtext_rocm/runtime/peers.py); a run goes on without it if it cannot."""
    global _peer_watch
    from jax._src import distributed as jax_distributed  # the coordination service's key-value store

    from maxtext_rocm.runtime.peers import PeerWatch

    try:
        _peer_watch = PeerWatch(jax_distributed.global_state.client, cluster.process_id, cluster.num_processes,
                                cluster.coordinator.rsplit(":", 1)[0], timeout_s=dist_cfg.init_timeout_s,
                                heartbeat_s=dist_cfg.heartbeat_timeout_s)
    except Exception as error:  # noqa: BLE001 - a firewall or an old jax: the run itself is unaffected
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        print(f"warning: process {cluster.process_id} cannot watch its peers ({first}); a dead process will "
              "be reported by JAX's heartbeat instead (exit status 134)", file=sys.stderr, flush=True)


def agree_on_config(cfg) -> None:
    """Every process's resolved config is process 0's, or every process raises one UserError
    naming the first key that differs (maxtext_rocm/config/agreement.py); nothing for one process."""
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    if state.client is None or (state.num_processes or 1) < 2:
        return
    from maxtext_rocm.config import agreement as config_agreement

    config_agreement.check(cfg, state.client, state.process_id, state.num_processes, cfg.distributed.init_timeout_s,
                           on_disagreement=_peer_watch.end_together if _peer_watch is not None else None)


def wait_if_peer_lost(grace_s: float = 3.0) -> None:
    """See PeerWatch.wait_if_peer_lost; nothing for a single process."""
    if _peer_watch is not None:
        _peer_watch.wait_if_peer_lost(grace_s)


def expect_peer_exit(status: int) -> None:
    """Every process is to end with `status` (an agreed stop): a peer's goodbye with it is no
    failure (PeerWatch.expect_exit); nothing for a single process."""
    if _peer_watch is not None:
        _peer_watch.expect_exit(status)


def say_goodbye(status: int) -> None:
    """Tells the other processes that this one ends with `status` (0: a normal end; else they stop
    with a sentence naming it); nothing for a single process."""
    if _peer_watch is not None:
        _peer_watch.say_goodbye(status)
