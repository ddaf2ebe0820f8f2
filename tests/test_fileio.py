"""Atomic writes: all or nothing, ordinary permissions, and the failing file named; file digests
trusted only while a file is provably unchanged."""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path

import pytest

from mtcli import builddir, fileio
from mtcli.builddir import CONTENTS_NAME, atomic_dir
from mtcli.fileio import (
    DEAD_WRITE_S,
    FileHasher,
    atomic_write,
    check_directory,
    default_file_mode,
    file_record,
    sha256_file,
    unchanged_since,
)


def test_atomic_write_replaces_with_ordinary_mode(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old\n")
    with atomic_write(target) as handle:
        handle.write("new\n")
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == default_file_mode()
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_write_failure_keeps_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_write(target) as handle:
        handle.write("half")
        raise RuntimeError("boom")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_write_writes_into_a_pipe_and_through_a_link(tmp_path: Path) -> None:
    """A FIFO (or a device, /dev/null) named as the output is written to, not renamed over (its
    reader got nothing, and -o /dev/null as root made /dev/null a file); a link stays a link
    and its target gets the text."""
    import os
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    with atomic_write(fifo) as handle:
        handle.write("through the pipe\n")
    reader.join(timeout=30)
    assert got == ["through the pipe\n"] and not fifo.is_file()
    with atomic_write(os.devnull) as handle:  # a character device: written, not replaced
        handle.write("gone\n")
    assert not Path(os.devnull).is_file()
    target, link = tmp_path / "target.txt", tmp_path / "link.txt"
    target.write_text("old\n")
    link.symlink_to(target)
    with atomic_write(link, follow=True) as handle:  # the user's own output (-o)
        handle.write("new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    # a file mtcli names itself: the link is replaced, its target untouched (a run directory from
    # elsewhere made evaluate overwrite any file it pointed at)
    with atomic_write(link) as handle:
        handle.write("ours\n")
    assert not link.is_symlink() and link.read_text() == "ours\n" and target.read_text() == "new\n"


def test_atomic_write_appends_to_an_open_file_named_through_proc_and_says_what_fails(tmp_path: Path) -> None:
    """-o /dev/stdout with stdout redirected to a file (>>): the file was resolved and renamed
    over, its earlier lines gone; a link naming /proc/self/fd/N is the open file, appended to.
    A loop of links, or /dev/full, is one OSError naming the output."""
    import errno
    import os

    kept = tmp_path / "kept.txt"
    kept.write_text("earlier line\n")
    with open(kept, "a") as handle:
        link = tmp_path / "out"
        link.symlink_to(f"/proc/self/fd/{handle.fileno()}")
        inode = kept.stat().st_ino
        with atomic_write(link, follow=True) as out:
            out.write("new line\n")
    assert kept.read_text() == "earlier line\nnew line\n" and kept.stat().st_ino == inode
    from mtcli.fileio import is_stream

    assert is_stream("/dev/null") and not is_stream(kept) and not is_stream(tmp_path)
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):  # an ordinary file under /dev: renamed as any
        shm = Path("/dev/shm") / f"mtcli-test-{os.getpid()}.txt"
        shm.write_text("x")
        try:
            assert not is_stream(shm)
        finally:
            shm.unlink()
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(OSError) as caught, atomic_write(loop, follow=True):
        pass
    assert caught.value.errno == errno.ELOOP and caught.value.filename == str(loop)
    if os.path.exists("/dev/full"):
        with pytest.raises(OSError) as full, atomic_write("/dev/full") as out:
            out.write("x" * 100_000)
        assert full.value.errno == errno.ENOSPC and full.value.filename == "/dev/full"


def test_atomic_dir_swaps_in_complete_directory(tmp_path: Path) -> None:
    target = tmp_path / "cache"
    target.mkdir()
    old = '{"mtcli_version": "0.0"}'  # an older mtcli's, from before the contents record
    (target / "a").write_text(old)
    with pytest.raises(RuntimeError), atomic_dir(target, mark="a") as tmp:
        (tmp / "a").write_text("half")
        raise RuntimeError("interrupted")
    assert (target / "a").read_text() == old
    with atomic_dir(target, mark="a") as tmp:
        (tmp / "b").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == [CONTENTS_NAME, "b"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~_umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_a_directory_another_build_put_in_place_meanwhile_is_named_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two exports to one directory at once: the one whose swap lost said "the previous one is
    unchanged" (it held the other's output) and left the previous one under a hidden name."""
    target = tmp_path / "out"
    with atomic_dir(target, mark="a") as tmp:
        (tmp / "a").write_text("previous")
    replace = os.replace

    def another_build_first(src: str | Path, dst: str | Path) -> None:
        if Path(dst) == target and Path(src).name.endswith(".tmp"):  # the other build's swap, just before ours
            target.mkdir()
            (target / "a").write_text("theirs")
        replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", another_build_first)
    with pytest.raises(OSError, match="another process put its own there meanwhile"), \
            atomic_dir(target, mark="a") as tmp:
        (tmp / "a").write_text("ours")
    assert (target / "a").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the previous one is not left hidden


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_sha256_file(tmp_path: Path) -> None:
    path = tmp_path / "x"
    path.write_bytes(b"abc")
    assert sha256_file(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_unchanged_since_trusts_only_a_settled_file_with_the_same_size_time_and_inode(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_text("hello\n")
    fresh = file_record(path, sha256_file(path), time.time_ns())
    assert not unchanged_since(path, fresh)  # changed in the tick it was hashed: read it again
    hour_ago = time.time_ns() - 3600 * 10**9
    os.utime(path, ns=(hour_ago, hour_ago))
    settled = file_record(path, sha256_file(path), time.time_ns())
    assert unchanged_since(path, settled)
    path.write_text("HELLO\n")  # same size, new bytes: the modification time moves
    assert not unchanged_since(path, settled)
    assert not unchanged_since(tmp_path / "gone", settled) and not unchanged_since(path, None)


def test_unchanged_since_notices_a_new_size_or_another_file_under_the_old_time(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_text("hello\n")
    hour_ago = time.time_ns() - 3600 * 10**9
    os.utime(path, ns=(hour_ago, hour_ago))
    settled = file_record(path, sha256_file(path), time.time_ns())
    path.write_text("hello, world\n")
    os.utime(path, ns=(hour_ago, hour_ago))  # appended to, its old time put back: the size moved
    assert not unchanged_since(path, settled)
    path.write_text("hello\n")
    os.utime(path, ns=(hour_ago, hour_ago))
    assert unchanged_since(path, settled)
    other = tmp_path / "g.txt"
    other.write_text("HELLO\n")
    os.utime(other, ns=(hour_ago, hour_ago))
    os.replace(other, path)  # another file of that size and time renamed over it: a new inode
    assert not unchanged_since(path, settled)


def test_file_hasher_reuses_a_settled_digest_and_rereads_a_changed_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "f.txt"
    path.write_text("hello\n")
    hour_ago = time.time_ns() - 3600 * 10**9
    os.utime(path, ns=(hour_ago, hour_ago))
    first = FileHasher()
    digest = first(path, "f")
    reads = []
    monkeypatch.setattr(fileio, "sha256_file", lambda p: reads.append(p) or "recomputed")
    again = FileHasher(first.records)
    assert again(path, "f") == digest and reads == [] and again.records["f"] == first.records["f"]
    by_path = FileHasher(first.records, by_path=True)  # a cache's records from before they were kept by path
    assert by_path(path, "f") == digest and reads == [] and list(by_path.records) == [str(path.absolute())]
    path.write_text("hellO\n")
    assert FileHasher(first.records)(path, "f") == "recomputed" and reads == [path]


def test_file_hasher_many_gives_each_files_digest_in_order(tmp_path: Path, monkeypatch) -> None:
    files = []
    for i in range(7):
        path = tmp_path / f"f{i}"
        path.write_bytes(os.urandom(1000 * (7 - i)))  # the first files take longest
        files.append((path, f"name{i}"))
    for cores in ({0}, {0, 1, 2}):  # one thread, and several
        monkeypatch.setattr(fileio.os, "sched_getaffinity", lambda pid, cores=cores: cores, raising=False)
        hasher = FileHasher()
        digests = hasher.many(files)
        assert digests == {name: fileio.sha256_file(path) for path, name in files}
        assert list(hasher.records) == [name for _, name in files]
        assert all(hasher.records[name]["sha256"] == digests[name] for _, name in files)


def test_atomic_dir_never_replaces_what_mtcli_did_not_write(tmp_path: Path) -> None:
    """An output directory pointed at a user's own files (``mtcli export run docs``) or at a file
    is refused before anything is built, and both are left as they were; an empty directory, or
    one holding the mark of what mtcli writes there, is replaced."""
    mine = tmp_path / "docs"
    mine.mkdir()
    (mine / "thesis.tex").write_text("mine")
    with pytest.raises(FileExistsError, match="has no manifest.json"), atomic_dir(mine, mark="manifest.json"):
        pytest.fail("the body must not run")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with pytest.raises(NotADirectoryError), atomic_dir(a_file, mark=None):
        pytest.fail("the body must not run")
    assert (mine / "thesis.tex").read_text() == "mine" and a_file.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    for _ in range(2):  # an empty directory, then the one written into it
        with atomic_dir(empty, mark="manifest.json") as tmp:
            (tmp / "manifest.json").write_text("{}")
    assert sorted(p.name for p in empty.iterdir()) == [CONTENTS_NAME, "manifest.json"]
    (empty / "notes.txt").write_text("mine")  # added since: the directory is no longer only mtcli's
    with pytest.raises(FileExistsError, match=r"holds files besides those mtcli wrote there \(notes.txt\)"), \
            atomic_dir(empty, mark="manifest.json"):
        pytest.fail("the body must not run")
    # a folder holding only a file of the mark's name that is not mtcli's (a web app's manifest.json,
    # or no JSON at all) was replaced, the file lost
    for text in ('{"name": "my web app", "icons": []}', "not json"):
        app = tmp_path / "app"
        app.mkdir(exist_ok=True)
        (app / "manifest.json").write_text(text)
        with pytest.raises(FileExistsError, match=r"holds files besides those mtcli wrote there \(manifest.json\)"), \
                atomic_dir(app, mark="manifest.json"):
            pytest.fail("the body must not run")
        assert (app / "manifest.json").read_text() == text


def test_atomic_dir_through_a_symbolic_link_replaces_the_directory_it_points_to(tmp_path: Path) -> None:
    """A cache or export reached through a link was built beside the link (on the link's disk,
    perhaps a full one), the link renamed aside and never removed, and a plain directory left in
    its place: the directory on the other disk was never updated again."""
    real, link, dangling = tmp_path / "disk" / "cache", tmp_path / "cache", tmp_path / "new"
    real.mkdir(parents=True)
    link.symlink_to(real)
    dangling.symlink_to(tmp_path / "disk" / "new")
    for _ in range(2):  # into the empty directory, then over the build
        with atomic_dir(link, mark="manifest.json") as tmp:
            assert tmp.parent == real.parent
            (tmp / "manifest.json").write_text("{}")
    with atomic_dir(dangling, mark="manifest.json") as tmp:
        (tmp / "manifest.json").write_text("{}")
    assert link.is_symlink() and dangling.is_symlink() and (dangling / "manifest.json").is_file()
    assert sorted(p.name for p in real.iterdir()) == [CONTENTS_NAME, "manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "disk", "new"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["cache", "new"]


def test_atomic_dir_refuses_a_mount_point_before_the_work_and_names_the_place_it_builds_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mount point cannot be renamed: prepare (or export) into one did all its work, then
    failed with "Device or resource busy". A parent it cannot write in was named as the output."""
    volume = tmp_path / "volume"
    volume.mkdir()
    monkeypatch.setattr(builddir.os.path, "ismount", lambda path: Path(path) == volume)
    with pytest.raises(OSError, match="a mount point: .* give a directory inside it: '.*volume'"), \
            atomic_dir(volume, mark="manifest.json"):
        pytest.fail("the body must not run")
    with atomic_dir(volume / "cache", mark="manifest.json") as tmp:
        (tmp / "manifest.json").write_text("{}")

    def read_only(**kwargs: object) -> str:
        raise PermissionError(errno.EACCES, "Permission denied", str(kwargs["dir"]))

    monkeypatch.setattr(builddir.tempfile, "mkdtemp", read_only)
    with pytest.raises(PermissionError, match=rf"Permission denied \(it is built beside it, in {volume}, then swapped "
                                              r"in\): '.*volume/cache'"), \
            atomic_dir(volume / "cache", mark="manifest.json"):
        pytest.fail("the body must not run")


@pytest.mark.parametrize("kind", ["run", "project", "corpus"])
def test_a_directory_that_only_holds_a_file_of_the_marks_name_is_not_replaced(tmp_path: Path, kind: str) -> None:
    """``prepared_dir`` pointed at a run (which keeps a copy of its cache's manifest.json), at a
    web project's manifest.json or at a corpus with one: each was deleted and made a cache."""
    target = tmp_path / kind
    target.mkdir()
    own = {"files": {"train.en.bin": {}}, "format": 1} if kind == "run" else {"name": "app"}
    (target / "manifest.json").write_text(json.dumps(own))
    kept = {"run": "checkpoints", "project": "app.js", "corpus": "train.en"}[kind]
    (target / kept).mkdir() if kind == "run" else (target / kept).write_text("mine")
    with pytest.raises(FileExistsError, match=f"holds files besides those mtcli wrote there \\((manifest.json, )?{kept}"), \
            atomic_dir(target, mark="manifest.json"):
        pytest.fail("the body must not run")
    assert (target / kept).exists()


def test_a_failed_build_names_the_output_not_its_hidden_build(tmp_path: Path) -> None:
    """A full disk said '.cache.w0rvuqo6.tmp/spm.model: No space left on device', a file gone by then."""
    import errno

    target = tmp_path / "cache"
    for kept in ("nothing was written", "the previous one is unchanged"):
        with pytest.raises(OSError) as caught, atomic_dir(target, mark="manifest.json") as tmp:
            (tmp / "manifest.json").write_text("{}")
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "spm.model"))
        assert caught.value.filename == str(target) and caught.value.strerror == f"No space left on device; {kept}"
        with atomic_dir(target, mark="manifest.json") as tmp:
            (tmp / "manifest.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_a_build_removes_what_a_killed_one_left(tmp_path: Path) -> None:
    """A SIGKILLed export left its ``.out.*.tmp`` for good (prepare alone cleaned up its own)."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that has ended
    for name, pid in ((".out.k1.tmp", gone.pid), (".out.k2.tmp", os.getpid()), (f".out.old-{gone.pid}", None)):
        (tmp_path / name).mkdir()
        if pid is not None:
            (tmp_path / name / builddir.BUILDER_NAME).write_text(str(pid))
    (tmp_path / ".out.mine.tmp").mkdir()  # no builder's pid: not one of ours
    with atomic_dir(tmp_path / "out", mark="mtcli_export.json") as tmp:
        (tmp / "mtcli_export.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.k2.tmp", ".out.mine.tmp", "out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [CONTENTS_NAME, "mtcli_export.json"]


def test_a_directory_of_an_older_mtcli_is_still_replaced(tmp_path: Path) -> None:
    """Before the contents record: a cache whose manifest lists its files, an export's record."""
    cache, export = tmp_path / "cache", tmp_path / "export"
    cache.mkdir()
    export.mkdir()
    (cache / "train.en.bin").write_text("ids")
    (cache / "manifest.json").write_text(json.dumps({"files": {"train.en.bin": {"size": 3}}}))
    (export / "model.bin").write_text("weights")
    (export / "mtcli_export.json").write_text(json.dumps({"run_dir": "r", "checkpoint": "c"}))
    for target, mark in ((cache, "manifest.json"), (export, "mtcli_export.json")):
        with atomic_dir(target, mark=mark) as tmp:
            (tmp / mark).write_text("{}")
        assert sorted(p.name for p in target.iterdir()) == [CONTENTS_NAME, mark]


def test_atomic_write_names_a_directory_or_a_file_in_the_way(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match="is a directory"), atomic_write(tmp_path):
        pytest.fail("the body must not run")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(NotADirectoryError, match=r"so .*notes.txt/out.txt cannot be written") as err, \
            atomic_write(tmp_path / "notes.txt" / "out.txt"):
        pytest.fail("the body must not run")
    assert err.value.filename == str(tmp_path / "notes.txt")


def test_check_directory_names_the_file_in_the_way(tmp_path: Path) -> None:
    check_directory(tmp_path / "new" / "deeper")  # to be made: fine, and nothing is made
    assert list(tmp_path.iterdir()) == []
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory") as err:
        check_directory(notes)
    assert err.value.filename == str(notes)
    with pytest.raises(NotADirectoryError, match=r"so .*notes.txt/a/b cannot be made") as err:
        check_directory(notes / "a" / "b")
    assert err.value.filename == str(notes)


def test_atomic_write_removes_what_a_killed_write_of_the_same_file_left(tmp_path: Path) -> None:
    """A writer killed mid-write (SIGKILL during translate -o of stdin) left its hidden temporary
    file, as large as the output, and nothing ever removed it."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    left = tmp_path / f".out.txt.p{gone}-abcd1234.tmp"
    live = tmp_path / f".out.txt.p{os.getpid()}-efgh5678.tmp"  # a write still under way
    other = tmp_path / f".other.txt.p{gone}-abcd1234.tmp"  # another file's
    recent = tmp_path / f".out.txt.p{gone}-ijkl9012.tmp"  # another machine's pid, maybe, still writing
    for path in (left, live, other, recent):
        path.write_text("half\n")
    for path in (left, live, other):
        os.utime(path, (time.time() - 2 * DEAD_WRITE_S,) * 2)
    with atomic_write(tmp_path / "out.txt") as handle:
        handle.write("whole\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, recent.name, "out.txt"])


def test_a_long_output_name_still_gets_its_temporary_file_or_a_line_naming_it(tmp_path: Path) -> None:
    """The pid in the temporary name broke names of 235-241 bytes, which fit before (the error
    named the hidden temporary file); a stray temporary of an impossible pid was an OverflowError."""
    import errno

    (tmp_path / ".out.p99999999999999999999-abc.tmp").write_text("")
    with atomic_write(tmp_path / "out") as handle:  # the stray one is left alone
        handle.write("x")
    for length, fits in ((236, True), (250, False)):
        target = tmp_path / ("b" * length)
        if fits:
            with atomic_write(target) as handle:
                handle.write("x")
            assert target.read_text() == "x"
        else:
            with pytest.raises(OSError) as caught, atomic_write(target) as handle:
                handle.write("x")
            assert caught.value.errno == errno.ENAMETOOLONG and caught.value.filename == str(target)


def test_a_temporary_file_that_cannot_be_made_is_named_after_the_output(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory that refuses new files: the error named the hidden temporary file."""
    import errno
    import tempfile

    def refused(**kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", f"{kwargs['dir']}/.out.txt.p1-abc.tmp")

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(PermissionError) as caught, atomic_write(tmp_path / "out.txt") as handle:
        handle.write("x")
    assert caught.value.filename == str(tmp_path / "out.txt")


def test_a_build_killed_inside_its_swap_leaves_no_finished_directory_for_good(tmp_path: Path) -> None:
    """Killed between moving the old directory aside and moving the new one in, a build left its
    finished directory for good: its builder file was removed before the swap. It stays till after."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that has ended
    with atomic_dir(tmp_path / "out", mark="mtcli_export.json") as tmp:
        (tmp / "mtcli_export.json").write_text("{}")
        built = tmp
    assert not built.exists() and sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        CONTENTS_NAME, "mtcli_export.json"]  # the builder file: gone after the swap, not listed
    killed = tmp_path / ".out.k1.tmp"  # what the kill left: the build, its builder file still in it
    killed.mkdir()
    (killed / builddir.BUILDER_NAME).write_text(str(gone.pid))
    (killed / "mtcli_export.json").write_text("{}")
    with atomic_dir(tmp_path / "out", mark="mtcli_export.json") as tmp:
        (tmp / "mtcli_export.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_links_temporary_name_says_its_writer_is_alive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume removes temporary files whose writer is gone; atomic_link's had no pid in its
    name, so a live process's link under way counted as a dead one's."""
    source = tmp_path / "checkpoint_4.pt"
    source.write_bytes(b"weights")
    seen = []
    replace = os.replace

    def watching(src: str | Path, dst: str | Path) -> None:
        seen.append(Path(src).name)
        replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", watching)
    fileio.atomic_link(source, tmp_path / "checkpoint_best.pt")
    assert len(seen) == 1 and fileio._writer_pid(seen[0]) == os.getpid()
    assert (tmp_path / "checkpoint_best.pt").read_bytes() == b"weights"


_KILLED_IN_SWAP = """
import os, sys
from pathlib import Path
from mtcli import builddir, fileio
real = os.replace
def replace(src, dst):
    if str(src).endswith(".tmp"):  # the new build's move in: killed just before it
        os._exit(9)
    real(src, dst)
fileio.os.replace = replace
with builddir.atomic_dir(Path(sys.argv[1]), mark="mtcli_export.json") as tmp:
    (tmp / "mtcli_export.json").write_text("new")
"""


def test_a_build_killed_between_its_renames_is_put_in_place(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "out"
    with atomic_dir(out, mark="mtcli_export.json") as tmp:
        (tmp / "mtcli_export.json").write_text("old")
    killed = subprocess.run([sys.executable, "-c", _KILLED_IN_SWAP, str(out)], check=False)
    assert killed.returncode == 9 and not out.exists()
    assert builddir.restore_swap(out)
    assert (out / "mtcli_export.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old one moved aside: removed
    assert builddir.BUILDER_NAME not in {p.name for p in out.iterdir()}
    assert not builddir.restore_swap(out)


def test_a_copy_that_finds_no_room_names_the_output_not_its_source(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """export and import-hf on a full disk said "run/spm.model: No space left on device", about
    the run's file on another disk: Linux's sendfile names the source of a copy."""
    import errno
    import shutil

    from mtcli.builddir import atomic_dir
    from mtcli.fileio import copy_file

    source = tmp_path / "run" / "spm.model"
    source.parent.mkdir()
    source.write_bytes(b"model")

    def full(src, dst):  # noqa: ANN001, ANN202
        raise OSError(errno.ENOSPC, "No space left on device", str(src))

    monkeypatch.setattr(shutil, "copyfile", full)
    out = tmp_path / "export"
    with pytest.raises(OSError) as caught, atomic_dir(out, mark="mtcli_export.json") as tmp:
        copy_file(source, tmp / "spm.model")
    assert caught.value.errno == errno.ENOSPC and str(source) not in str(caught.value.filename)
    assert str(caught.value.filename).startswith(str(out))
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_an_existing_file_on_a_read_only_file_system_is_said_to_be_on_one(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """It was called "write-protected", which chmod cannot mend."""
    import errno

    from mtcli.fileio import replaced_mode

    out = tmp_path / "out.txt"
    out.write_text("old\n")
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False)
    real = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: type("V", (), {"f_flag": real.f_flag | os.ST_RDONLY})())
    with pytest.raises(OSError) as raised:
        replaced_mode(out)
    assert raised.value.errno == errno.EROFS and raised.value.filename == str(out)
    assert "write-protected" not in str(raised.value)


def test_atomic_write_syncs_the_file_before_renaming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash after the rename must not leave a name pointing at unwritten blocks: the data is
    synced before the temporary file is renamed over the output."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    with atomic_write(tmp_path / "out.txt") as handle:
        handle.write("x\n")
    assert "replace" in events and "fsync" in events[:events.index("replace")], events


def test_atomic_link_leaves_no_temporary_file_when_its_rename_fails(tmp_path: Path) -> None:
    source = tmp_path / "source.pt"
    source.write_bytes(b"weights")
    (tmp_path / "in_the_way").mkdir()
    (tmp_path / "in_the_way" / "keep").write_text("x")
    with pytest.raises(OSError):
        fileio.atomic_link(source, tmp_path / "in_the_way")  # a rename over a non-empty directory fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in_the_way", "source.pt"]


def test_atomic_link_copies_where_hard_links_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without hard links (EPERM, as on some FUSE and SMB mounts): a whole copy."""
    source = tmp_path / "source.pt"
    source.write_bytes(b"weights")

    def no_link(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(fileio.os, "link", no_link)
    fileio.atomic_link(source, tmp_path / "best.pt")
    assert (tmp_path / "best.pt").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "source.pt"]


def test_a_failed_atomic_copy_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, out = tmp_path / "source", tmp_path / "out"
    source.write_bytes(b"new bytes")
    out.write_bytes(b"old bytes")

    def half_copy(inp, dst):
        dst.write(b"new")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.shutil, "copyfileobj", half_copy)
    with pytest.raises(OSError):
        fileio.atomic_copy(source, out)
    assert out.read_bytes() == b"old bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "source"]


def test_a_swap_whose_builder_is_alive_is_not_taken_over(tmp_path: Path) -> None:
    """restore_swap puts a killed build's swap in place; while its builder still runs (between
    its two renames) the build is that builder's to finish."""
    import subprocess
    import sys

    out = tmp_path / "out"
    with atomic_dir(out, mark="mtcli_export.json") as tmp:
        (tmp / "mtcli_export.json").write_text("old")
    killed = subprocess.run([sys.executable, "-c", _KILLED_IN_SWAP, str(out)], check=False)
    assert killed.returncode == 9 and not out.exists()
    [builder] = [p / builddir.BUILDER_NAME for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    words = builder.read_text().split()
    builder.write_text(" ".join([str(os.getppid()), *words[1:]]))  # a live process other than this one
    assert not builddir.restore_swap(out)
    assert not out.exists()
