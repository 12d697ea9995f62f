"""How the Trainer's programs are compiled: XLA options per program and backend, the step's
compilation overlapped with the state's initialisation, the persistent cache that spares a
restarted run its compilation, the host memory the compiler leaves, and which library kernels a
compiled program calls.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor

import jax

from maxtext_rocm.config import UserError


def in_thread(fn, *args, **kwargs) -> Future:
    """fn(*args, **kwargs) in a new thread (XLA compiles without holding the GIL)."""
    executor = ThreadPoolExecutor(1, thread_name_prefix=getattr(fn, "__name__", "task"))
    try:
        return executor.submit(fn, *args, **kwargs)
    finally:
        executor.shutdown(wait=False)  # the thread ends when fn does


def compile_overlaps_init() -> bool:
    """Whether the train step compiles while the state is still being initialised or restored.
    On an accelerator XLA compiles on host cores that the state's making leaves idle (restoring a
    large checkpoint takes as long as compiling its step). On the CPU both compete for the same
    cores and memory, so overlapping them starts later with a higher peak
    (docs/figures.md#compiling-the-step-while-the-state-is-made-on-the-cpu): there the step
    compiles once the state exists. (Either way the step is traced and lowered
    while the state is being made: that part is Python, and the init program's compilation and
    run release the GIL.)"""
    return jax.default_backend() != "cpu"


def cache_directory(setting: str, output_dir: str) -> str | None:
    """The persistent compilation cache directory that `train.compilation_cache` names: "auto" is
    $JAX_COMPILATION_CACHE_DIR when set (the user's own JAX setting wins), else the run's own
    output_dir/compilation_cache; "off" is None."""
    if setting == "off":
        return None
    if setting == "auto":
        setting = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(output_dir, "compilation_cache")
    return os.path.abspath(os.path.expanduser(setting))


_cache_hits = 0


def _count_cache_hit(event: str, **_) -> None:
    global _cache_hits
    if event == "/jax/compilation_cache/cache_hits":
        _cache_hits += 1


jax.monitoring.register_event_listener(_count_cache_hit)


def cache_hits() -> int:
    """How many programs this process has loaded from the persistent compilation cache so far."""
    return _cache_hits


def use_persistent_cache(setting: str, output_dir: str) -> str | None:
    """Points JAX's persistent compilation cache at `cache_directory(setting, output_dir)` (or
    turns it off) and returns that directory. Compiled programs are written there and read back
    by any later process that compiles the same program for the same devices with the same options:
    a run restarted after preemption, or resumed in its output_dir, skips compiling its step and
    init programs (docs/figures.md#the-persistent-compilation-cache). JAX writes only programs whose
    compilation took at least jax_persistent_cache_min_compile_time_secs and, on GPUs, also keeps
    XLA's autotuning results there. The setting is process-wide, as JAX's is: the newest Trainer's
    applies."""
    from jax.experimental.compilation_cache import compilation_cache

    path = cache_directory(setting, output_dir)
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as error:
            raise UserError(f"cannot create the compilation cache directory {path} ({error.strerror}); set "
                            "train.compilation_cache to a writable directory, or 'off'") from None
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()  # JAX opens its cache once; the next compile reopens it here
    return path


def release_freed_host_memory() -> None:
    """Returns the heap that XLA's compiler and the init program have freed to the OS. glibc keeps
    freed small blocks (LLVM's IR, scattered over per-thread arenas) mapped, so the first step's
    buffers would come on top of them and raise the run's peak RSS
    (docs/figures.md#returning-freed-heap-after-compiling). A no-op where the C library has no
    malloc_trim."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


# Parameter values below which the CPU compiles the init program unoptimised (init_compiler_options).
INIT_O0_MAX_VALUES = 8_000_000


def init_compiler_options(n_values: int) -> dict | None:
    """XLA options for the program that initialises the state. It runs once, so on the CPU its cost
    is one compile plus one pass of the RNG code over every parameter value: unoptimised (O0) that
    code runs slower but compiles faster, which wins for small states only; INIT_O0_MAX_VALUES
    sits at the measured crossover (docs/figures.md#compiling-the-states-init-program-on-the-cpu).
    The random bits are the same either way; a float can differ in its last bit."""
    if jax.default_backend() != "cpu":
        return None
    return {"xla_backend_optimization_level": 0 if n_values < INIT_O0_MAX_VALUES else 1}


@contextlib.contextmanager
def unrolled_threefry_on_cpu():
    """Within this context, programs lowered for the CPU hash jax.random's Threefry with its 20
    rounds unrolled, as on every other backend. JAX's CPU rule rolls them into a loop of 5
    iterations, which XLA's CPU backend compiles into many kernels per random array and runs as
    5 passes over it; unrolled, each array's hash fuses into one kernel. Same algorithm, same
    bits. The state's init program, whose cost on the CPU is its compile plus one pass of the
    RNG over every parameter, compiles and runs faster so
    (docs/figures.md#threefry-unrolled-on-the-cpu). Where JAX's internals are not as expected,
    nothing changes."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32

        primitive, unrolled = threefry2x32.threefry2x32_p, threefry2x32._threefry2x32_lowering_rule
        cpu_rules = mlir._platform_specific_lowerings["cpu"]
        previous = cpu_rules[primitive]
    except (ImportError, AttributeError, KeyError):
        yield
        return
    mlir.register_lowering(primitive, unrolled, platform="cpu")
    try:
        yield
    finally:
        cpu_rules[primitive] = previous


def lower_init(init_jit, key) -> jax.stages.Lowered:
    """An init program (the Trainer's state, `api.init_params`'s parameters) lowered the one way
    both use: Threefry unrolled on the CPU. Lowering is Python (it holds the GIL); `run_init`'s
    compilation and run are not."""
    with unrolled_threefry_on_cpu():
        return init_jit.lower(key)


def run_init(lowered: jax.stages.Lowered, key, n_param_values: int):
    """Compiles a `lower_init` program with the XLA options for its size and runs it."""
    return lowered.compile(compiler_options=init_compiler_options(n_param_values))(key)


def step_compiler_options(policy: str, platform: str) -> dict | None:
    """XLA options for the train step. fp8 on a GPU compiles without Triton GEMMs: with them XLA
    autotunes Triton's configurations for every fp8 GEMM and the step may not finish compiling;
    without them it compiles to cuBLASLt fp8 GEMMs. bf16 keeps them: without, it runs slower
    (docs/figures.md#one-nvidia-h200). XLA_FLAGS naming the option wins over this.
    `platform`: that of the devices the step runs on (a CPU mesh in a GPU process gets none)."""
    if policy != "fp8" or platform != "gpu":
        return None
    if "xla_gpu_enable_triton_gemm" in os.environ.get("XLA_FLAGS", ""):
        return None
    return {"xla_gpu_enable_triton_gemm": False}


def library_calls(compiled_text: str) -> dict[str, int]:
    """How often each library kernel appears in a compiled program's text: custom-call targets
    (cuBLAS/hipBLASLt GEMMs, fp8 GEMMs, cuDNN attention) and the kinds of custom fusions (Triton
    GEMMs). A scanned layer's body appears once, so these count call sites, not calls per step.
    An fp8 row's proof that its GEMMs run in fp8 (`__cublas$lt$matmul$f8` on CUDA)."""
    targets = re.findall(r'custom_call_target="([^"]+)"', compiled_text)
    kinds = re.findall(r'"kind":"(__[^"]+)"', compiled_text)
    return dict(sorted(collections.Counter(targets + kinds).items()))
