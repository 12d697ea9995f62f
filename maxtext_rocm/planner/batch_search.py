"""The batch search of `python -m maxtext_rocm.compile --search` (and of any config that does not
fit): the largest per-device batch under each remat policy by the estimate (analyse without a
compile), the choices that implies, confirmed by at most `max_compiles` real compiles."""

from __future__ import annotations

import copy

from maxtext_rocm.planner.analysis import analyse
from maxtext_rocm.planner.fit_report import BatchSearch, Confirmed
from maxtext_rocm.planner.gpu_nodes import flash_attention_for

# Least recomputation first: the first policy that fits is the fastest one that fits.
REMAT_ORDER = ("none", "save_dots", "minimal", "full")


def search(cfg, kind: str, n_devices: int, usable: float, max_compiles: int, log=print, nodes: int = 1,
           microbatches: int | None = None) -> BatchSearch:
    """Largest per-device batch that fits for each remat policy (by the estimate), confirmed by
    compiling at most `max_compiles` candidates. `microbatches`: the pipeline.microbatches the user
    asked for, where `cfg` has been through analyse (which resolves 0, auto, for its own batch):
    each trial batch resolves it afresh."""
    def with_(remat, batch, attention=None):
        trial = copy.deepcopy(cfg)
        trial.model.remat, trial.train.per_device_batch_size, trial.train.grad_accum = remat, batch, 1
        trial.model.attention = attention or cfg.model.attention
        if microbatches is not None:
            trial.pipeline.microbatches = microbatches
        return trial

    def largest_by_remat(attention=None):
        largest = {}
        for remat in REMAT_ORDER:
            best, batch = None, 1
            while batch <= 256:
                if not analyse(with_(remat, batch, attention), kind, n_devices, usable, compile_it=False,
                               nodes=nodes).fits:
                    break
                best, batch = batch, batch * 2
            largest[remat] = best
        return largest

    largest = largest_by_remat()
    wanted = cfg.train.per_device_batch_size
    fitting = [r for r in REMAT_ORDER if largest[r] and largest[r] >= wanted]
    largest_batch = max((b for b in largest.values() if b), default=None)
    result = BatchSearch(largest_batch_by_remat=largest, remat_for_configured_batch=fitting[0] if fitting else None,
                         largest_batch=largest_batch,
                         largest_batch_remat=next((r for r in REMAT_ORDER if largest[r] == largest_batch), None),
                         confirmed=[])
    candidates = []
    if result.remat_for_configured_batch:
        candidates.append((result.remat_for_configured_batch, wanted))
    if result.largest_batch and (result.largest_batch_remat, result.largest_batch) not in candidates:
        candidates.append((result.largest_batch_remat, result.largest_batch))
    for remat, batch in candidates[:max_compiles]:
        log(f"  confirming remat={remat} per_device_batch_size={batch} by compiling ...")
        r = analyse(with_(remat, batch), kind, n_devices, usable, nodes=nodes)
        xla = r.compiled.memory if r.compiled else None
        result.confirmed.append(Confirmed(remat=remat, per_device_batch_size=batch,
                                          compile_s=r.compiled.compile_s if r.compiled else None,
                                          analytic_total_bytes=r.memory.analytic_total_bytes,
                                          xla_total_bytes=xla.total_bytes if xla else None, fits=r.fits))
    if result.largest_batch is None and cfg.model.attention == "xla":
        result.flash_attention = flash_attention_for(kind, cfg.model.attention_sinks)
        result.largest_batch_by_remat_flash = largest_by_remat(result.flash_attention)
    return result
