"""Corpora larger than memory and tokenization on several cores (issue 35): the JSON Lines offset
index and its sidecar, Parquet by row groups, peak RSS against corpus size, data.workers, and
pretokenize.py on every core."""
import json
import os
import re
import runpy
import subprocess
import sys
import time

import numpy as np
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.data import lineindex
from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.documents import Documents, expand_paths
from maxtext_rocm.data.files import FilesSource

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"])


def texts(n, seed=0, lo=1, hi=60):
    rng = np.random.default_rng(seed)
    return [f"d{i} " + " ".join(WORDS[rng.integers(0, len(WORDS), rng.integers(lo, hi))]) for i in range(n)]


def source(path, workers=0, global_batch=4, seq_len=48, **kw):
    cfg = config_lib.defaults().data
    cfg.update(source="files", paths=str(path), workers=workers, **kw)
    return FilesSource(cfg, vocab_size=512, global_batch=global_batch, seq_len=seq_len)


def fresh_index():
    lineindex._LOADED.clear()  # as a new process would: only the sidecar remains


# -- JSON Lines through the offset index --------------------------------------------------------------

def test_offset_index_reads_what_splitting_the_file_reads(tmp_path, monkeypatch):
    """Blank lines (counted in line numbers), CRLF, no final newline, lines longer than a read chunk."""
    monkeypatch.setattr(lineindex, "CHUNK", 64)  # lines cross chunk ends, some span several
    docs = texts(40, lo=0, hi=30)
    lines = [json.dumps({"text": t, "n": i}) for i, t in enumerate(docs)]
    raw = "\n".join(lines[:10]) + "\n\n   \n" + "\r\n".join(lines[10:20]) + "\r\n" + "\n".join(lines[20:])
    path = tmp_path / "a.jsonl"
    path.write_bytes(raw.encode())
    reference = [json.loads(line)["text"] for line in path.read_bytes().splitlines() if line.strip()]
    got = Documents([path])
    assert list(got) == reference == docs
    assert got.record(25) == {"text": docs[25], "n": 25}
    assert got.where(0) == f"{path} line 1" and got.where(10) == f"{path} line 13"  # two blank lines before
    got.close()
    # A bad line past the first chunks is named by its line number, blank lines counted.
    fresh_index()
    bad = raw.replace(lines[30], lines[30][:-3])
    (tmp_path / "b.jsonl").write_bytes(bad.encode())
    with pytest.raises(DataError, match=r"b.jsonl line 33 is not valid JSON"):
        Documents([tmp_path / "b.jsonl"])


def test_records_of_other_shapes_are_checked_by_the_callers_check(tmp_path):
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": "oops"}) + "\n")

    def messages(record, where):
        if not isinstance(record.get("messages"), list):
            raise DataError(f"{where} has no list of messages")

    with pytest.raises(DataError, match=r"chat.jsonl line 2 has no list of messages"):
        Documents([path], record_check=messages)
    path.write_text(json.dumps(good) + "\n")
    docs = Documents([path], record_check=messages)
    assert docs.record(0) == good and len(docs) == 1


def test_sidecar_is_reused_rebuilt_when_the_file_changes_and_falls_back_to_tmp(tmp_path, monkeypatch):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(30)))
    Documents([path])
    beside = lineindex.sidecar_paths(path)[0]
    assert beside.is_file() and beside.name == ".c.jsonl.idx.npy"
    assert expand_paths(f"{tmp_path}/*,{tmp_path}/*.jsonl") == [path]
    with pytest.raises(DataError, match="matches no file"):  # never taken for data, even when named
        expand_paths(str(beside))
    fresh_index()
    built = []
    real_build = lineindex._build
    monkeypatch.setattr(lineindex, "_build", lambda *a: built.append(1) or real_build(*a))
    assert len(Documents([path])) == 30 and not built  # loaded, not read again
    fresh_index()
    with pytest.raises(DataError, match="has no field 'body'"):  # checked for another field: read again
        Documents([path], text_field="body")
    assert built == [1]
    built.clear()
    fresh_index()
    with open(path, "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    assert Documents([path])[30] == "one more" and built == [1]  # a changed file is indexed again
    # A read-only data directory: the index goes to the temp directory instead.
    fresh_index()
    beside.unlink()
    real_save = lineindex._save
    monkeypatch.setattr(lineindex, "_save", lambda sidecar, flat: sidecar != beside and real_save(sidecar, flat))
    assert len(Documents([path])) == 31
    elsewhere = lineindex.sidecar_paths(path)[1]
    assert not beside.exists() and elsewhere.is_file()
    fresh_index()
    assert len(Documents([path])) == 31 and built == [1, 1]
    elsewhere.unlink()


def test_processes_opening_a_file_together_read_it_once(tmp_path, monkeypatch):
    """The processes of a node start together: one builds the index, the others wait for its sidecar
    (threads with their own lock descriptors stand in for processes)."""
    import threading

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(30)))
    built, real_build = [], lineindex._build

    def slow_build(*args):
        built.append(1)
        time.sleep(0.3)
        return real_build(*args)

    monkeypatch.setattr(lineindex, "_build", slow_build)
    monkeypatch.setattr(lineindex, "_LOADED", {})
    counts = []
    threads = [threading.Thread(target=lambda: counts.append(lineindex.line_index(path, None, "x").count))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == [30, 30, 30] and built == [1]


def test_parquet_is_read_a_row_group_at_a_time(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from maxtext_rocm.data import parquet

    docs = texts(95)
    pq.write_table(pa.table({"text": docs, "n": list(range(95))}), tmp_path / "p.parquet", row_group_size=10)
    got = Documents([tmp_path / "p.parquet"])
    order = np.random.default_rng(0).permutation(95)
    assert [got[int(i)] for i in order] == [docs[i] for i in order]
    rows = got._parts[0][2]
    assert len(rows._groups) <= parquet.CACHED  # never more decoded row groups than that
    assert got.record(42) == {"text": docs[42], "n": 42} and got.where(42) == f"{tmp_path / 'p.parquet'} row 43"


def test_with_parquet_an_epoch_is_shuffled_by_row_groups(tmp_path):
    """Each document once per epoch; each window of two row groups read whole before the next (so a
    row group is decoded once per epoch); documents of other files mixed in one by one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from maxtext_rocm.data.packing import DocumentStream

    pq.write_table(pa.table({"text": texts(95)}), tmp_path / "p.parquet", row_group_size=10)
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(7, seed=1)))
    docs = Documents([tmp_path / "p.parquet", tmp_path / "q.jsonl"])
    blocks = docs.blocks()
    assert blocks.tolist() == [10, 20, 30, 40, 50, 60, 70, 80, 90, 95, 96, 97, 98, 99, 100, 101, 102]
    assert Documents([tmp_path / "q.jsonl"]).blocks() is None  # JSONL alone: shuffled one by one, as before
    orders = []
    for epoch in range(2):
        order = DocumentStream(docs, seed=5, process_index=0, process_count=1, blocks=blocks).order(epoch)
        assert sorted(order.tolist()) == list(range(102))
        block = np.searchsorted(blocks, order, side="right")
        for group in range(10):  # between a row group's first and last document: one other block at most
            where = np.flatnonzero(block == group)
            assert len(set(block[where[0]:where[-1] + 1].tolist())) <= 2
        orders.append(order.tolist())
    assert orders[0] != orders[1]


RSS_CHILD = """
import json, resource, sys
from maxtext_rocm import config
from maxtext_rocm.data.files import FilesSource
for path in sys.argv[1:]:
    cfg = config.defaults().data
    cfg.update(source="files", paths=path, workers=0)
    src = FilesSource(cfg, vocab_size=512, global_batch=8, seq_len=2048)
    for step in range(4):
        src.batch(step)
    src.close()
    print(json.dumps({"maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
"""


def write_corpus(path, megabytes, seed=0):
    """Documents of 100 to 20,000 characters (slices of a text of random words), as JSON Lines or
    Parquet (row groups of 2,000 documents)."""
    rng = np.random.default_rng(seed)
    base = " ".join(WORDS[rng.integers(0, len(WORDS), 200_000)])
    lengths = rng.integers(100, 20_000, int(megabytes * 1e6 / 10_000) + 1)
    starts = rng.integers(0, len(base) - 20_000, len(lengths))
    docs = [base[s:s + n] for s, n in zip(starts, lengths)]
    if path.suffix == ".jsonl":
        with open(path, "w") as f:
            f.writelines(f'{{"text": "{d}"}}\n' for d in docs)  # words only: nothing to escape
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), path, row_group_size=2000)
    return path


def peak_rss(groups):
    """Peak RSS (MiB) after reading each corpus of a group in turn, a process per group (side by
    side): the peak after the larger corpus against the one after the smaller (jax's own import
    and the first corpus's share are the same in both)."""
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", RSS_CHILD, *map(str, paths)], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for paths in groups]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr
        out.append([json.loads(line)["maxrss_mib"] for line in stdout.strip().splitlines()[-2:]])
    return out


def test_ten_times_the_corpus_adds_little_peak_rss(tmp_path):
    """3 MB then 30 MB of JSON Lines, and of Parquet. Held whole (as before this index), 27 MB more
    of JSON Lines cost ~80 MiB; the index is 16 bytes a document, a Parquet row group ~1-2 MB."""
    groups = [[write_corpus(tmp_path / f"s{suffix}", 3), write_corpus(tmp_path / f"l{suffix}", 30, seed=1)]
              for suffix in (".jsonl", ".parquet")]
    for (small, large), paths in zip(peak_rss(groups), groups):
        assert large - small < 25, (paths, small, large)


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_ten_times_a_200_mb_corpus_adds_under_100_mib(tmp_path, suffix):
    """20 MB and 200 MB, each in a process of its own."""
    small, large = write_corpus(tmp_path / f"s{suffix}", 20), write_corpus(tmp_path / f"l{suffix}", 200, seed=1)
    (rss_small,), (rss_large,) = [r[-1:] for r in peak_rss([[small], [large]])]
    assert rss_large - rss_small < 100, (rss_small, rss_large)


# -- data.workers ------------------------------------------------------------------------------------

def test_workers_give_the_same_batches_and_resume_alike(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(16, hi=30)))
    one = source(path, workers=1)
    expected = [one.batch(s) for s in range(24)]  # several epochs: reads ahead across their ends
    assert one.state()["epoch"] >= 2
    one.close()
    two = source(path, workers=2)
    for s in range(24):
        got = two.batch(s)
        for k in got:
            np.testing.assert_array_equal(got[k], expected[s][k])
    two.close()
    first = source(path, workers=2)
    for s in range(10):
        first.batch(s)
    state = json.loads(json.dumps(first.state()))
    first.close()
    resumed = source(path, workers=2)
    resumed.restore(state)
    for s in range(10, 24):
        got = resumed.batch(s)
        for k in got:
            np.testing.assert_array_equal(got[k], expected[s][k])
    np.testing.assert_array_equal(resumed.batch(3)["inputs"], expected[3]["inputs"])  # a jump back: replays
    resumed.close()


def test_a_workers_error_is_its_sentence_and_close_reaps_the_workers(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(50)))
    src = source(path, workers=2)
    with open(path, "r+b") as f:  # changed under the run: the workers refuse it
        f.seek(5)
        f.write(b"#")
    with pytest.raises(DataError) as raised:
        src.batch(0)
    message = str(raised.value)
    assert message.startswith(f"{path} changed since the run opened it") and "\n" not in message
    procs = list(src._pool._procs)
    src.close()
    assert all(p.poll() is not None for p in procs)


EXIT_CHILD = """
import json, sys, types
package = types.ModuleType("maxtext_rocm")  # the data modules alone, as a worker imports them
package.__path__ = [sys.argv[2] + "/maxtext_rocm"]
sys.modules["maxtext_rocm"] = package
from pathlib import Path
import numpy as np
from maxtext_rocm.data.documents import Documents
from maxtext_rocm.data.workers import WorkerPool
docs = Documents([Path(sys.argv[1])])
pool = WorkerPool(docs.files, docs.versions, text_field="text", tokenizer="byte", bos=True, eos=True, workers=2)
pool.tokenize(np.arange(4))
pool.tokenize(np.arange(4, 8))
assert len(pool.result()) == 4
print(json.dumps([p.pid for p in pool._procs]), flush=True)
# no close(), a chunk still in flight: leaving must not wait for the workers, nor leave them behind
"""


def test_workers_never_outlive_their_process(tmp_path):
    path = tmp_path / "y.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(50)))
    started = time.time()
    result = subprocess.run([sys.executable, "-c", EXIT_CHILD, str(path), REPO], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    pids = json.loads(result.stdout.strip().splitlines()[-1])
    deadline = time.time() + 20
    while time.time() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), time.time() - started


def test_workers_is_validated():
    cfg = config_lib.defaults()
    cfg.data.workers = -1
    with pytest.raises(config_lib.ConfigError, match=r"data.workers=-1 is not valid"):
        config_lib.validate(cfg)


# -- pretokenize.py on every core --------------------------------------------------------------------

def test_pretokenize_writes_the_same_bytes_with_two_processes(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(300)))
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"t{workers}.arrayrecord"
        monkeypatch.setattr(sys, "argv", ["pretokenize.py", str(path), "--out", str(out), "--workers", str(workers)])
        with pytest.raises(SystemExit) as done:
            runpy.run_path(os.path.join(REPO, "scripts", "pretokenize.py"), run_name="__main__")
        assert done.value.code == 0
        outputs.append((out.read_bytes(), json.loads((tmp_path / f"t{workers}.arrayrecord.meta.json").read_text())))
    assert outputs[0] == outputs[1] and outputs[0][1]["documents"] == 300


@pytest.mark.slow
def test_sigterm_to_the_whole_job_stops_a_run_with_workers_cleanly(tmp_path):
    """A scheduler's SIGTERM reaches the trainer and its workers alike: the trainer stops at a step
    with a checkpoint and exit 0 (the workers ignore the signal and leave with it), and nothing of
    the session is left running."""
    import signal

    path = tmp_path / "z.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(200, hi=80)))
    run = tmp_path / "run"
    small = ["--config.model.vocab_size=512", "--config.model.d_model=64", "--config.model.n_layers=2",
             "--config.model.n_heads=4", "--config.model.n_kv_heads=2", "--config.model.head_dim=16",
             "--config.model.mlp_dim=128", "--config.train.seq_len=32", "--config.train.per_device_batch_size=2",
             "--config.log.every=1", "--config.log.tensorboard=false", "--config.train.compilation_cache=off"]
    process = subprocess.Popen(
        [sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py", *small, "--config.data.source=files",
         f"--config.data.paths={path}", "--config.data.workers=2", "--config.train.steps=100000",
         f"--config.output_dir={run}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1",
                                     "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    try:
        deadline = time.monotonic() + 300
        while not re.match(r"step +3/", process.stdout.readline()):
            assert time.monotonic() < deadline and process.poll() is None, "no step 3 line"
        os.killpg(process.pid, signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, err
    assert "checkpoint committed" in err.strip().splitlines()[-1], err
    deadline = time.monotonic() + 20
    alive = lambda: [p for p in os.listdir("/proc") if p.isdigit() and _session(p) == process.pid]  # noqa: E731
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive()


def _session(pid: str) -> int | None:
    try:
        return os.getsid(int(pid))
    except OSError:
        return None
