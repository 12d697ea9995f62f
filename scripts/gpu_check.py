#!/usr/bin/env python
"""Correctness checks that need a GPU (CI has none): run them on a GPU node before trusting its
benchmark figures.

    python scripts/gpu_check.py [--json OUT] [--checks a,b] [--dry-run]

1. The device's matrix rate: a bf16 8192^3 product through XLA, the measured ceiling beside the
   datasheet peak that MFU uses.
2. cuDNN's fused attention (model.attention="cudnn", CUDA only) and the Pallas kernels
   ("pallas", Triton on CUDA and ROCm) against the "xla" attention computed from the same bf16
   inputs in fp32: output and the gradients of q, k and v, causal with GQA, with document masks
   (segment ids), and (pallas) with documents and a sliding window.
3. The trainer on the GPU against the same trainer on the CPU: tiny_llama in fp32, the losses of
   the first steps from the same initialisation and data.
4. The fp8 dot (maxtext_rocm/numerics/fp8.py) at an 8B MLP's shape: output and gradients against fp32 dots
   of the same quantized operands, which library kernels its compiled program calls, and its
   forward+backward time against the bf16 dot's.

5. attention_speed: pallas vs cudnn vs blockwise vs xla at 2 x 8,192 tokens, 32 query / 8 KV
   heads of 128, bf16: forward+backward time and the error of each against the fp32 "xla"
   attention of the same inputs (pallas also at a second tile shape).

Each check prints one line (PASS/FAIL and its figures); the exit status is 1 if any failed.
`--dry-run` runs only the attention checks at tiny shapes, on whatever device is there (the
CPU interprets the Pallas kernels; cuDNN's rows are then skipped): the script's own check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def relative_error(x, reference) -> float:
    x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(x - reference) / max(np.linalg.norm(reference), 1e-30))


def matmul_rate(n: int = 8192) -> dict:
    """TFLOP/s of an n^3 bf16 product on random data (`timed`'s median)."""
    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in jax.random.split(jax.random.key(0)))
    return {"n": n, "tflops": 2 * n ** 3 / timed(jax.jit(lambda x, y: x @ y), a, b) / 1e12}


def attention_inputs(batch, seq, heads, kv_heads, head_dim, documents):
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), jnp.bfloat16)
    cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
    # Three documents per row at uneven boundaries, so the mask is neither causal alone nor uniform.
    segments = (jnp.searchsorted(jnp.array([seq // 3, seq // 2 + 7]), jnp.arange(seq), side="right")
                .astype(jnp.int32)[None].repeat(batch, 0)) if documents else None
    return (q, k, v), cotangent, segments


def attention_grads(implementation, segments, cotangent, window=None, blocks=None):
    """jit of (q, k, v) -> [out, dq, dk, dv] through model.attention=`implementation`."""
    from maxtext_rocm.models.attention import dot_product_attention
    from maxtext_rocm.models.pallas_attention import pallas_attention

    def attend(q, k, v):
        if blocks is not None:
            return pallas_attention(q, k, v, segment_ids=segments, sliding_window=window, blocks=blocks)
        return dot_product_attention(q, k, v, segment_ids=segments, implementation=implementation,
                                     sliding_window=window)

    def run(q, k, v):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(cotangent.astype(out.dtype)))

    return jax.jit(run)


def attention_check(implementation="cudnn", batch=2, seq=2048, heads=32, kv_heads=8, head_dim=128,
                    documents=False, window=None) -> dict:
    qkv, cotangent, segments = attention_inputs(batch, seq, heads, kv_heads, head_dim, documents)

    def run(implementation, dtype):
        outs = attention_grads(implementation, segments, cotangent, window)(*(x.astype(dtype) for x in qkv))
        return [np.asarray(x, np.float32) for x in outs]

    fused, reference = run(implementation, jnp.bfloat16), run("xla", jnp.float32)
    errors = {name: relative_error(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), fused, reference)}
    # bf16 operands and bf16 probabilities: ~4e-3 relative per element, norms land near 1e-2.
    return {"errors": errors, "passed": all(e < 2e-2 for e in errors.values())}


def attention_speed(batch=2, seq=8192, heads=32, kv_heads=8, head_dim=128, repeats=10) -> dict:
    """Forward+backward milliseconds of each attention in bf16, and its error against the fp32
    "xla" attention of the same inputs: relative norm and max |difference| / max |reference|,
    on the first sequence of the batch (the fp32 reference of the whole batch would hold
    [2, 32, 8192, 8192] fp32 scores several times over). TFLOP/s by the FlashAttention-2
    convention for causal attention: 7 * batch * heads * seq^2 * head_dim (forward 2 and backward
    5 matmuls, halved by the causal mask), whatever each implementation really computes."""
    from maxtext_rocm.models.attention import is_cuda_gpu
    from maxtext_rocm.models.pallas_attention import BlockSizes

    qkv, cotangent, _ = attention_inputs(batch, seq, heads, kv_heads, head_dim, documents=False)
    first = [x[:1] for x in qkv]
    reference = [np.asarray(x, np.float32) for x in
                 attention_grads("xla", None, cotangent[:1])(*(x.astype(jnp.float32) for x in first))]
    tflop = 7 * batch * heads * seq ** 2 * head_dim / 1e12
    rows = {"xla": ("xla", None), "blockwise": ("blockwise", None), "pallas": ("pallas", None),
            "pallas_tiles_128_128_128_64": ("pallas", BlockSizes(128, 128, 128, 64))}
    if is_cuda_gpu(jax.devices()[0]):
        rows["cudnn"] = ("cudnn", None)
    results = {"shape": {"batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}}
    for name, (implementation, blocks) in rows.items():
        try:
            fn = attention_grads(implementation, None, cotangent, blocks=blocks)
            seconds = timed(fn, *qkv, repeats=repeats)
            got = [np.asarray(x, np.float32) for x in
                   attention_grads(implementation, None, cotangent[:1], blocks=blocks)(*first)]
            results[name] = {
                "ms": 1e3 * seconds, "tflops": tflop / seconds,
                "relative_error": {n: relative_error(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, reference)},
                "max_error": {n: float(np.abs(a - b).max() / np.abs(b).max())
                              for n, a, b in zip(("out", "dq", "dk", "dv"), got, reference)}}
        except Exception as error:  # one implementation failing must not hide the others' figures
            results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
    pallas = results["pallas"]
    results["passed"] = "relative_error" in pallas and all(e < 2e-2 for e in pallas["relative_error"].values())
    return results


def timed(fn, *args, repeats: int = 10) -> float:
    """Median seconds of fn(*args) after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def fp8_dot_check(tokens=8192, d_model=4096, mlp=14336) -> dict:
    from maxtext_rocm.numerics import fp8
    from maxtext_rocm.trainer.compilation import library_calls

    e4m3, e5m2 = fp8.FORMATS[fp8.resolve_format("auto", jax.devices()[0])]
    fmt = "fnuz" if e4m3 == jnp.float8_e4m3fnuz else "ocp"
    keys = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(keys[0], (tokens, d_model), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (d_model, mlp), jnp.float32) * 0.02).astype(jnp.bfloat16)
    g = (jax.random.normal(keys[2], (tokens, mlp), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    scales = [fp8.scale_from_amax(fp8.amax(t), q, jnp.float32(1)) for t, q in ((x, e4m3), (w, e4m3), (g, e5m2))]
    history = jnp.zeros((16,), jnp.float32).at[0].set(fp8.amax(g))  # gives the gradient scales[2]

    def fp8_grads(x, w, g):
        y, vjp = jax.vjp(lambda a, b: fp8.fp8_dot(a, b, scales[0], scales[1], jnp.float32(1), history, dims,
                                                  fmt, True), x, w)
        return (y, *vjp(g))

    def bf16_grads(x, w, g):
        y, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims), x, w)
        return (y, *vjp(g))

    def reference(x, w, g):  # the same quantized operands, fp32 dots
        xq, wq = (fp8.quantize_dequantize(t.astype(jnp.float32), e4m3, s) for t, s in ((x, scales[0]), (w, scales[1])))
        gq = fp8.quantize_dequantize(g.astype(jnp.float32), e5m2, scales[2])
        y, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims, precision="highest"), xq, wq)
        return (y, *vjp(gq))

    fp8_fn, bf16_fn = jax.jit(fp8_grads), jax.jit(bf16_grads)
    got, want = fp8_fn(x, w, g), jax.jit(reference)(x, w, g)
    errors = {name: relative_error(a, b) for name, a, b in zip(("y", "dx", "dw"), got, want)}
    calls = library_calls(fp8_fn.lower(x, w, g).compile().as_text())
    fp8_s, bf16_s = timed(fp8_fn, x, w, g), timed(bf16_fn, x, w, g)
    tflop = 3 * 2 * tokens * d_model * mlp / 1e12
    return {"format": fmt, "errors": errors, "library_calls": calls, "fp8_ms": 1e3 * fp8_s, "bf16_ms": 1e3 * bf16_s,
            "fp8_tflops": tflop / fp8_s, "bf16_tflops": tflop / bf16_s,
            "passed": all(e < 1e-2 for e in errors.values())}


def trainer_parity(steps: int = 5) -> dict:
    import maxtext_rocm as mr

    def losses(devices):
        cfg = mr.load_config("tiny_llama:fp32", ["--config.data.source=synthetic", "--config.log.tensorboard=false",
                                                  "--config.checkpoint.enabled=false",
                                                  f"--config.output_dir=/tmp/gpu_check_{devices[0].platform}",
                                                  "--config.train.per_device_batch_size=8"])
        trainer = mr.Trainer(cfg, devices=devices, log=lambda *_: None)
        return [float(trainer.step()["loss"]) for _ in range(steps)]

    gpu, cpu = losses(jax.devices()[:1]), losses(jax.devices("cpu")[:1])
    worst = max(abs(g - c) / abs(c) for g, c in zip(gpu, cpu))
    # The GPU may run fp32 matmuls as TF32 (XLA's default precision there): ~1e-3 relative.
    return {"gpu": gpu, "cpu": cpu, "max_relative_difference": worst, "passed": worst < 5e-3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--checks", help="only these checks, comma-separated (default: all)")
    parser.add_argument("--dry-run", action="store_true",
                        help="only the attention checks, at tiny shapes, on any device (the CPU included)")
    args = parser.parse_args()
    device = jax.devices()[0]
    results = {"device": device.device_kind, "platform_version": device.client.platform_version,
               "jax": jax.__version__}
    print(f"device: {device.device_kind} ({device.client.platform_version}), jax {jax.__version__}", flush=True)
    # JAX names both GPU backends "gpu"; ROCm's platform version says "rocm".
    on_cuda = device.platform == "gpu" and "rocm" not in device.client.platform_version.lower()
    checks = {"matmul_rate": matmul_rate, "trainer_parity": trainer_parity, "fp8_dot": fp8_dot_check}
    shape = {}
    if args.dry_run:
        checks, shape = {}, {"batch": 1, "seq": 128, "heads": 4, "kv_heads": 2, "head_dim": 64}
    if on_cuda:
        checks["attention_causal"] = lambda: attention_check(**shape)
        checks["attention_documents"] = lambda: attention_check(documents=True, **shape)
    checks["attention_pallas_causal"] = lambda: attention_check("pallas", **shape)
    checks["attention_pallas_documents_window"] = lambda: attention_check(
        "pallas", documents=True, window=(shape.get("seq", 2048) // 4) + 3, **shape)
    checks["attention_speed"] = lambda: attention_speed(**shape, **({"repeats": 2} if args.dry_run else {}))
    if args.checks:
        checks = {name: check for name, check in checks.items() if name in args.checks.split(",")}
    failed = False
    for name, check in checks.items():
        try:
            result = check()
        except Exception as error:  # one broken check must not hide the others' figures
            result = {"passed": False, "error": f"{type(error).__name__}: {error}"[:500]}
        results[name] = result
        failed |= result.get("passed") is False
        status = {True: "PASS", False: "FAIL", None: "INFO"}[result.get("passed")]
        print(f"{status} {name}: {json.dumps({k: v for k, v in result.items() if k != 'passed'})}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
