"""Resuming the files source (issue 34, items 4, 7 and 9): every data-loading process's position is
saved and restored, the data files are fingerprinted, and a resume that cannot continue exactly
is one sentence. In one process: several processes are played by several sources side by side
(tests/test_multihost_data.py runs real ones)."""
import json

import numpy as np
import pytest

from maxtext_rocm.data import lineindex, resume
from maxtext_rocm.data.checks import DataError
from test_bad_inputs import assert_one_sentence, files_args, run_main
from test_data_files import make_docs, source, write_jsonl


def batches(src, steps):
    return [src.batch(i) for i in steps]


def assert_same(got, want):
    for a, b in zip(got, want):
        for k in b:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def saved_by(sources, step, monkeypatch):
    """The checkpoint's data item, as `sources` (one per process, each having handed out batches
    0..step-1) would save it together: resume.saved_state with the gather played in one process."""
    records = [s.position_record(step) for s in sources]
    monkeypatch.setattr(resume, "gather", lambda local: records)
    return json.loads(json.dumps(resume.saved_state(sources[0], step)))  # what the checkpoint keeps


@pytest.fixture
def corpus(tmp_path):
    # Documents of very different lengths: the processes' positions drift apart at once.
    rng = np.random.default_rng(5)
    return write_jsonl(tmp_path / "c.jsonl", [t * int(rng.integers(1, 6)) for t in make_docs(60, lo=1, hi=30)])


def test_every_process_position_is_saved_and_each_resumes_its_own(corpus, monkeypatch):
    whole = [source(corpus, process_index=p, process_count=2) for p in range(2)]
    want = [batches(s, range(9)) for s in whole]
    first = [source(corpus, process_index=p, process_count=2) for p in range(2)]
    for s in first:
        batches(s, range(4))
    saved = saved_by(first, 4, monkeypatch)
    assert saved["shards"] == 2 and len(saved["positions"]) == 2
    assert saved["positions"][0] != saved["positions"][1]  # the old checkpoint kept process 0's only
    assert [f["file"] for f in saved["files"]] == [str(corpus)]
    for p in range(2):
        resumed = source(corpus, process_index=p, process_count=2)
        resumed.restore(saved)
        assert_same(batches(resumed, range(4, 9)), want[p][4:])


def test_an_older_checkpoint_keeps_working(corpus):
    want = [batches(source(corpus, process_index=p, process_count=2), range(6)) for p in range(2)]
    one = source(corpus)
    batches(one, range(3))
    flat = one.state()  # what checkpoints held before: one process's position
    resumed = source(corpus)
    resumed.restore(flat)
    assert_same(batches(resumed, range(3, 6)), batches(source(corpus), range(6))[3:])
    # Of several processes it held process 0's only: each replays its own stream instead.
    for p in range(2):
        replayed = source(corpus, process_index=p, process_count=2)
        replayed.restore({**flat, "step": 3})
        assert_same(batches(replayed, range(3, 6)), want[p][3:])


def changed_files(tmp_path, corpus, how):
    extra = tmp_path / "d.jsonl"
    if how == "appended":
        corpus.write_text(corpus.read_text() + json.dumps({"text": "one more"}) + "\n")
    elif how == "replaced":  # same size, other bytes
        corpus.write_text(corpus.read_text().replace("alpha", "ALPHA", 1))
    elif how == "added":
        write_jsonl(extra, make_docs(5))
    return f"{corpus},{extra}" if how == "added" else str(corpus)


@pytest.mark.parametrize("how, message", [
    ("appended", "c.jsonl grew from"),
    ("replaced", "c.jsonl was changed (same size, other content)"),
    ("added", "the data paths now also name"),
    ("removed", None),
    ("renamed_and_changed", "the data files differ from"),
])
def test_changed_data_is_one_sentence_unless_allowed(tmp_path, corpus, monkeypatch, how, message):
    first = source(corpus)
    batches(first, range(3))
    saved = saved_by([first], 3, monkeypatch)
    if how == "removed":  # the checkpoint's data had two files; the run now names one
        saved["files"].append({"file": str(tmp_path / "gone.jsonl"), "size": 10, "hash": "0"})
        paths = str(corpus)
        message = "gone.jsonl is no longer among the data paths (1 files, the checkpoint's data had 2)"
    elif how == "renamed_and_changed":
        paths = str(write_jsonl(tmp_path / "b.jsonl", make_docs(70)))
    else:
        paths = changed_files(tmp_path, corpus, how)
    with pytest.raises(DataError, match="since checkpoint step 3 was saved") as error:
        source(paths).restore(saved)
    assert message in str(error.value) and "data.allow_changed=true" in str(error.value)
    allowed = source(paths, allow_changed=True)
    allowed.restore(saved)  # goes on at the saved position
    assert allowed.state()["step"] == 3 and allowed.batch(3)["inputs"].shape == (4, 32)


def test_the_same_data_elsewhere_resumes(tmp_path, corpus, monkeypatch):
    first = source(corpus)
    batches(first, range(3))
    saved = saved_by([first], 3, monkeypatch)
    moved = tmp_path / "elsewhere" / "c.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(corpus.read_bytes())
    resumed = source(moved)
    resumed.restore(saved)
    assert_same(batches(resumed, [3]), batches(source(corpus), range(4))[3:])


def test_another_process_count_mid_epoch_is_one_sentence(corpus, monkeypatch):
    two = [source(corpus, process_index=p, process_count=2) for p in range(2)]
    for s in two:
        batches(s, range(3))
    saved = saved_by(two, 3, monkeypatch)
    with pytest.raises(DataError) as error:
        source(corpus).restore(saved)
    said = str(error.value)
    assert "holds the data positions of 2 data-loading processes in the middle of epoch 0" in said
    assert "this run loads data with 1" in said and "data.allow_changed=true" in said
    # Allowed: this layout's stream, replayed up to the step.
    allowed = source(corpus, allow_changed=True)
    allowed.restore(saved)
    assert_same(batches(allowed, [3, 4]), batches(source(corpus), range(5))[3:])


def test_another_process_count_at_an_epoch_boundary_resumes(corpus):
    boundary = {"step": 7, "shards": 2, "positions": [{"epoch": 2, "cursor": 0, "offset": 0}] * 2}
    one = source(corpus)
    one.restore(boundary)
    assert one.state() == {"step": 7, "epoch": 2, "cursor": 0, "offset": 0}


def test_a_position_past_the_shrunken_data_is_one_sentence(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs(60, lo=1, hi=4))
    first = source(corpus)
    batches(first, range(6))
    flat = first.state()  # an older checkpoint's: no fingerprint to compare
    assert flat["cursor"] > 5 and flat["epoch"] == 0
    write_jsonl(corpus, make_docs(5))
    with pytest.raises(DataError, match=r"lies past the 5 documents this process reads now: the data files "
                                        r"shrank since it was saved; restore them, or set data.allow_changed=true"):
        source(corpus).restore(flat)
    allowed = source(corpus, allow_changed=True)
    allowed.restore(flat)
    assert allowed.state() == {"step": 6, "epoch": flat["epoch"] + 1, "cursor": 0, "offset": 0}
    allowed.batch(6)


def test_resuming_over_a_shrunken_file_from_the_command_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "s.jsonl", make_docs(60))
    run = ["--config.checkpoint.async_save=false", f"--config.output_dir={tmp_path / 'run'}"]
    status, _ = run_main(capsys, *files_args(data, *run))
    assert status == 0
    write_jsonl(data, make_docs(6))
    status, err = run_main(capsys, *files_args(data, *run, "--config.train.steps=3"))
    assert_one_sentence(status, err, f"{data} shrank from", "since checkpoint step 2 was saved",
                        "data.allow_changed=true")


def test_a_truncated_arrayrecord_is_one_sentence(tmp_path, capsys):
    from array_record.python.array_record_module import ArrayRecordWriter

    whole = tmp_path / "whole.arrayrecord"
    writer = ArrayRecordWriter(str(whole), "group_size:1")
    for i in range(200):
        writer.write(np.arange(i % 50 + 5, dtype="<i4").tobytes())
    writer.close()
    data = whole.read_bytes()
    for cut in (len(data) // 2, len(data) - 10, 100):
        path = tmp_path / f"cut{cut}.arrayrecord"
        path.write_bytes(data[:cut])
        status, err = run_main(capsys, *files_args(path, f"--config.output_dir={tmp_path / 'run'}"))
        assert_one_sentence(status, err, str(path), "cannot be read as ArrayRecord", "truncated or corrupt")


def edit_in_the_middle(path):
    """A same-size edit of one document half-way through `path` (its mtime moves, as an editor's would)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"alpha", len(data) // 2)
    data[at:at + 5] = b"ALPHA"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt", ["text", "prompt_completion"])
def test_a_same_size_edit_in_the_middle_is_seen_on_resume(tmp_path, capsys, fmt):
    """The fingerprint hashes every byte (beyond the first and last 64 KiB that it read before,
    which let this edit through and resumed over changed data): one sentence naming the file."""
    texts = make_docs(3000, lo=20, hi=40)  # ~600 KB: the middle lies far from both ends
    if fmt == "text":
        data = write_jsonl(tmp_path / "big.jsonl", texts)
        extra = []
    else:
        data = tmp_path / "big.jsonl"
        data.write_text("".join(json.dumps({"prompt": t[:20], "completion": t[20:]}) + "\n" for t in texts))
        extra = ["--config.data.format=prompt_completion"]  # plain-text prompts: the byte tokenizer
    assert data.stat().st_size > 8 * resume.ENDS_BYTES
    run = ["--config.checkpoint.async_save=false", f"--config.output_dir={tmp_path / 'run'}", *extra]
    status, _ = run_main(capsys, *files_args(data, *run))
    assert status == 0
    edit_in_the_middle(data)
    status, err = run_main(capsys, *files_args(data, *run, "--config.train.steps=3"))
    assert_one_sentence(status, err, f"{data} was changed (same size, other content)",
                        "since checkpoint step 2 was saved", "data.allow_changed=true")


def test_each_files_sha256_is_hashlibs_of_its_bytes_from_every_reading(tmp_path, monkeypatch):
    """The fingerprint's SHA-256 against hashlib over the whole file, where it comes from the index
    pass, from the index's sidecar in a process that never read the file, from the records of a
    chat file, from the text check, and streamed (Parquet)."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from maxtext_rocm.data import filehash
    from maxtext_rocm.data.checks import check_text
    from maxtext_rocm.data.documents import Documents
    from maxtext_rocm.data.records import Records

    jsonl = write_jsonl(tmp_path / "a.jsonl", make_docs(400))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "ho"}]}) + "\n")
    text = tmp_path / "t.txt"
    text.write_text("some plain text\n" * 100)
    table = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": make_docs(50)}), table)
    want = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (jsonl, chats, text, table)}
    fresh = {}
    monkeypatch.setattr(filehash, "_DIGESTS", fresh)
    Documents([jsonl]), Records([chats], "chat"), check_text(text)
    assert {k[0] for k in fresh} == {str(p.resolve()) for p in (jsonl, chats, text)}  # hashed as they were read
    assert [f["sha256"] for f in resume.fingerprint([jsonl, chats, text, table])] == list(want.values())
    monkeypatch.setattr(filehash, "_DIGESTS", {})
    monkeypatch.setattr(lineindex, "_LOADED", {})
    monkeypatch.setattr(lineindex, "_build", lambda *a: pytest.fail("the sidecar should have served"))
    Documents([jsonl])
    assert filehash._DIGESTS == {filehash.version(jsonl): want[jsonl]}


def test_a_streamed_files_digest_is_kept_for_later_launches(tmp_path, monkeypatch):
    """Parquet (read by row groups, never whole) is hashed once per version of the file: a later
    launch reads the digest sidecar, not the file; an edit (another size or mtime) hashes again, and
    a sidecar in the data directory is no data file."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from maxtext_rocm.data import filehash
    from maxtext_rocm.data.documents import expand_paths

    table = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": make_docs(50)}), table)
    monkeypatch.setattr(filehash, "_DIGESTS", {})
    assert filehash.file_sha256(table) == hashlib.sha256(table.read_bytes()).hexdigest()
    sidecar = tmp_path / ".p.parquet.sha256"
    assert sidecar.is_file()
    assert [p.name for p in expand_paths(str(tmp_path / "*"))] == ["p.parquet"]

    monkeypatch.setattr(filehash, "_DIGESTS", {})  # a new launch
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k))
    assert filehash.file_sha256(table) == hashlib.sha256(table.read_bytes()).hexdigest()
    assert str(table) not in opened  # the sidecar served

    pq.write_table(pa.table({"text": make_docs(60)}), table)  # edited: another version
    monkeypatch.setattr(filehash, "_DIGESTS", {})
    assert filehash.file_sha256(table) == hashlib.sha256(table.read_bytes()).hexdigest()
    assert str(table) in opened
