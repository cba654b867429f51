#!/usr/bin/python3
"""tests/sweep/run.py — scripts/sweep.lua end to end: a sweep of 4 tiny
training runs (one on 2 ranks, one made to fail with an invalid --dtype) at
2 jobs at once; results.csv, results.md and loss.png (decoded here: PNG
signature, IHDR size as the sweep file asked, IDAT inflated with zlib and
its pixels varying); a second run skips every finished run, and
--retry-failed reruns only the failed one; a sweep file's mistakes refused
before any run. Ends with "N passed, N failed"."""
import csv
import os
import struct
import subprocess
import sys
import tempfile
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXE = os.environ.get("LUAZERO", os.path.join(ROOT, "build", "bin", "luazero"))
WORK = tempfile.mkdtemp(prefix="luazero-sweep-")
OUT = os.path.join(WORK, "out")
WIDTH, HEIGHT = 640, 400

SWEEP = """
return {
  name = "tiny",
  base = { model = "gpt2-nano", data = "corpus.txt", steps = 8, ["n-layer"] = 1, ["n-embd"] = 32,
           ["n-head"] = 2, context = 32, ["seq-len"] = 16, ["micro-batch"] = 2, sample = 0,
           ["eval-batches"] = 1 },
  grid = { lr = { 3e-3, 1e-2 } },
  runs = { { lr = 1e-3, stage = 2, ranks = 2 }, { lr = 1e-3, dtype = "fp8" } },
  plot = { width = %d, height = %d },
}
""" % (WIDTH, HEIGHT)


def sweep(*flags):
    p = subprocess.run([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), "tiny.lua", "--jobs", "2",
                        "--out", OUT] + list(flags), cwd=WORK, capture_output=True, text=True,
                       timeout=120)
    return p.returncode, p.stdout + p.stderr


def write_corpus():
    text = ("To be, or not to be, that is the question:\n"
            "Whether 'tis nobler in the mind to suffer\n") * 80
    open(os.path.join(WORK, "corpus.txt"), "w").write(text)


def setup():
    write_corpus()
    open(os.path.join(WORK, "tiny.lua"), "w").write(SWEEP)
    return sweep()


FIRST = None


def first():
    global FIRST
    if FIRST is None:
        FIRST = setup()
    return FIRST


def rows():
    with open(os.path.join(OUT, "results.csv")) as f:
        return list(csv.DictReader(f))


def test_sweep_records_3_results_and_1_failure():
    code, out = first()
    assert code == 0, out
    assert out.count(" started: ") == 4, out
    assert "sweep tiny: 3 ok, 1 failed" in out, out
    rs = rows()
    assert len(rs) == 4, rs
    ok = [r for r in rs if r["status"] == "ok"]
    bad = [r for r in rs if r["status"] == "failed"]
    assert len(ok) == 3 and len(bad) == 1, rs
    assert bad[0]["dtype"] == "fp8" and "--dtype must be fp32, bf16 or fp16 (got fp8)" in bad[0]["error"], bad
    for r in ok:
        assert 0 < float(r["final_loss"]) < 6, r
        assert 0 < float(r["val_loss"]) < 6, r
        assert float(r["tokens_per_s"]) > 0 and float(r["peak_rss_mib"]) > 0, r
        assert float(r["peak_mem_mib"]) > 0, r
    two = [r for r in ok if r["ranks"] == "2"]
    assert len(two) == 1 and two[0]["stage"] == "2", ok
    # The loss in the CSV is the metrics log's last step.
    for r in ok:
        log = os.path.join(OUT, "runs", r["id"], "metrics.jsonl")
        last = [l for l in open(log) if '"step"' in l][-1]
        import json
        assert abs(json.loads(last)["loss"] - float(r["final_loss"])) < 1e-4, (last, r)
    md = open(os.path.join(OUT, "results.md")).read()
    assert md.count("\n| ") == 5, md  # header + 4 runs
    assert "| failed |" in md and "(got fp8)" in md, md


def png_chunks(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    pos, chunks = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunks.append((kind, data[pos + 8:pos + 8 + n]))
        pos += 12 + n
    return chunks


def test_loss_png_is_a_real_image_of_the_requested_size():
    code, out = first()
    assert code == 0, out
    data = open(os.path.join(OUT, "loss.png"), "rb").read()
    chunks = png_chunks(data)
    assert chunks[0][0] == b"IHDR", chunks[0][0]
    w, h, depth, color = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (w, h) == (WIDTH, HEIGHT), (w, h)
    raw = zlib.decompress(b"".join(c for k, c in chunks if k == b"IDAT"))
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color]
    stride = 1 + w * channels * depth // 8
    assert len(raw) == stride * h, (len(raw), stride, h)
    lines = {raw[i * stride + 1:(i + 1) * stride] for i in range(h)}
    assert len(lines) > h // 4, "only %d distinct rows of %d" % (len(lines), h)
    assert len(set(raw)) > 16, "only %d distinct byte values" % len(set(raw))
    gp = open(os.path.join(OUT, "loss.gp")).read()
    assert gp.count("with lines") == 3 and "dtype=fp8" not in gp, gp


def test_rerun_skips_finished_runs_and_retry_failed_reruns_only_those():
    first()
    stamps = {d: os.stat(os.path.join(OUT, "runs", d, "status.json")).st_mtime_ns
              for d in os.listdir(os.path.join(OUT, "runs"))}
    code, out = sweep()
    assert code == 0, out
    assert " started: " not in out, out
    assert out.count("skipped (ok before)") == 3 and out.count("skipped (failed before)") == 1, out
    after = {d: os.stat(os.path.join(OUT, "runs", d, "status.json")).st_mtime_ns for d in stamps}
    assert after == stamps, (stamps, after)
    code, out = sweep("--retry-failed")
    assert code == 0, out
    assert out.count(" started: ") == 1 and "dtype=fp8" in out.split(" started: ")[1].split("\n")[0], out
    assert out.count("skipped (ok before)") == 3, out


def test_bad_sweep_file_is_a_user_error():
    path = os.path.join(WORK, "bad.lua")
    open(path, "w").write("return { grid = { lr = 0.1 } }")
    p = subprocess.run([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), path], cwd=WORK,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "grid.lr must be a non-empty list of values" in p.stderr, p.stderr
    # a flag given twice is refused (the last one used to win), --name=value taken
    first()  # tiny.lua
    p = subprocess.run([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), "tiny.lua", "--jobs",
                        "2", "--jobs=3", "--list"], cwd=WORK, capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2 and "--jobs given twice; give it once" in p.stderr, p.stderr


def test_a_sweep_files_name_plot_base_and_script_are_checked_before_any_run():
    """A name that is not a plain folder name (it could write outside --out's
    parent), a plot that is not { width, height } of whole pixels, ranks in
    base (passed on as a flag, failing every run), a script that is not there:
    exit 2 with one line, before any run."""
    cases = [
        ('return { name = "../up", grid = { lr = {1} } }', "name must be a plain folder name"),
        ('return { grid = { lr = {1} }, plot = { width = -5 } }',
         "plot.width must be a whole number of pixels, 64 to 16384 (got -5)"),
        ('return { grid = { lr = {1} }, plot = { widht = 300 } }',
         "plot.widht is not a key of plot (width, height)"),
        ('return { grid = { lr = {1} }, plot = 5 }', "plot must be a table"),
        ('return { grid = { lr = {1} }, base = { ranks = 2 } }', "base.ranks: ranks is the sweep's"),
        ('return { grid = { lr = {1} }, script = "nope.lua" }', "script nope.lua is not there"),
        ('return { grid = { lr = {1} }, base = { data = "nope.txt" } }',
         "base.data: nope.txt is not there (looked in the current folder and in "),
        ('return { grid = { ["val-data"] = { "a.txt", "nope.txt" } } }',
         'grid.val-data[1]: a.txt is not there'),
    ]
    for i, (text, want) in enumerate(cases):
        path = os.path.join(WORK, "check%d.lua" % i)
        open(path, "w").write(text)
        out = os.path.join(WORK, "check%d-out" % i)
        p = subprocess.run([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), path, "--out", out],
                           cwd=WORK, capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and want in p.stderr, (text, p.returncode, p.stderr)
        assert not os.path.exists(out), out


def test_a_data_file_is_found_beside_the_sweep_file():
    """A data file named relative to the sweep file's folder (the script's
    rule): the run reads it from any folder; the current folder's comes
    first."""
    sub = os.path.join(WORK, "datasub")
    os.makedirs(sub, exist_ok=True)
    open(os.path.join(sub, "echo.lua"), "w").write('print("args", table.concat(arg, " "))')
    open(os.path.join(sub, "corpus.txt"), "w").write("some text\n")
    path = os.path.join(sub, "s.lua")
    open(path, "w").write('return { script = "echo.lua", base = { data = "corpus.txt" }, '
                          'grid = { lr = { 1 } } }')
    p = subprocess.run([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), path, "--out",
                        os.path.join(WORK, "data-out")], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "1 ok, 0 failed" in p.stdout, p.stdout + p.stderr
    logs = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(WORK, "data-out")) for f in fs
            if f.endswith(".log") or f == "output.txt"]
    text = "".join(open(f).read() for f in logs)
    assert "--data " + os.path.join(sub, "corpus.txt") in text, text


def test_a_script_is_found_beside_the_sweep_file_and_is_part_of_the_run_id():
    """A script named relative to the sweep file's folder is found from any
    folder; another script gives other run ids (its results are not taken
    for the first one's)."""
    sub = os.path.join(WORK, "sub")
    os.makedirs(sub, exist_ok=True)
    for name in ("a.lua", "b.lua"):
        open(os.path.join(sub, name), "w").write('print("%s", table.concat(arg, " "))' % name)
    ids = []
    for name in ("a.lua", "b.lua"):
        path = os.path.join(sub, "s.lua")
        open(path, "w").write('return { script = "%s", grid = { lr = { 1 } } }' % name)
        p = subprocess.run([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), path, "--out",
                            os.path.join(WORK, "scr-out")], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0 and "1 ok, 0 failed" in p.stdout, p.stdout + p.stderr
        assert "skipped" not in p.stdout, p.stdout
        ids.append([l for l in p.stdout.split() if l.startswith("lr1-")][0])
    assert ids[0] != ids[1], ids


def test_a_sweep_whose_every_run_fails_exits_1_naming_the_first_error():
    """An unknown flag in the grid fails every run: the sweep says so and
    exits 1, as a script calling it would want (some failed runs: exit 0)."""
    path = os.path.join(WORK, "allfail.lua")
    open(path, "w").write(
        'return { base = { model = "gpt2-nano", data = "corpus.txt", steps = 1 }, '
        'grid = { lrr = { 1e-3, 2e-3 } } }')
    p = subprocess.run([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), path, "--out",
                        os.path.join(WORK, "allfail")], cwd=WORK, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, (p.returncode, p.stdout + p.stderr)
    assert "sweep allfail: 0 ok, 2 failed" in p.stdout, p.stdout
    assert "every run failed (the first: " in p.stderr and "--lrr" in p.stderr, p.stderr


def test_a_flag_in_either_spelling_is_one_flag():
    """micro_batch in a run replaces base's ["micro-batch"] (one --micro-batch
    on the command line, one run id from one invocation to the next); one
    table giving both spellings is refused."""
    write_corpus()
    path = os.path.join(WORK, "spell.lua")
    open(path, "w").write(
        'return { base = { model = "gpt2-nano", data = "corpus.txt", steps = 1, ["n-layer"] = 1, '
        '["n-embd"] = 32, ["n-head"] = 2, context = 32, ["seq-len"] = 16, ["micro-batch"] = 2, '
        'sample = 0, ["eval-batches"] = 1 }, runs = { { micro_batch = 1 } } }')
    ids = []
    for flags in ([], ["--retry-failed"]):
        p = subprocess.run([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), path, "--out",
                            os.path.join(WORK, "spell")] + flags, cwd=WORK, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        ids.append(sorted(os.listdir(os.path.join(WORK, "spell", "runs"))))
    assert ids[0] == ids[1] and len(ids[0]) == 1 and ids[0][0].startswith("micro-batch1-"), ids
    open(path, "w").write('return { base = { micro_batch = 1, ["micro-batch"] = 2 }, '
                          'runs = { { lr = 1 } } }')
    p = subprocess.run([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), path], cwd=WORK,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "base gives --micro-batch twice (micro-batch and micro_batch)" \
        in p.stderr, (p.returncode, p.stderr)
    open(path, "w").write('return { base = { log = "x.jsonl" }, runs = { { lr = 1 } } }')
    p = subprocess.run([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), path], cwd=WORK,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--log is the sweep's own" in p.stderr, (p.returncode, p.stderr)


def test_a_killed_sweep_leaves_no_run_behind():
    """SIGTERM to the sweep (a scheduler's, timeout's) stops its running job
    too, one rank or a launcher of two; none outlives it (LZ_PARENT_PID)."""
    import signal
    import time
    first()  # the corpus
    for ranks in (1, 2):
        out = os.path.join(WORK, "killed%d" % ranks)
        path = os.path.join(WORK, "long%d.lua" % ranks)
        open(path, "w").write(
            'return { ranks = %d, base = { model = "gpt2-nano", data = "corpus.txt", '
            'steps = 100000, ["n-layer"] = 1, ["n-embd"] = 32, ["n-head"] = 2, context = 32, '
            '["seq-len"] = 16, ["micro-batch"] = 2, sample = 0 }, runs = { { lr = 1e-3 } } }'
            % ranks)
        p = subprocess.Popen([EXE, os.path.join(ROOT, "scripts", "sweep.lua"), path, "--out", out],
                             cwd=WORK, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def running():
            r = subprocess.run(["pgrep", "-f", out], capture_output=True, text=True)
            return [l for l in r.stdout.split() if int(l) != p.pid]
        deadline = time.time() + 60
        while not running() and time.time() < deadline:
            time.sleep(0.2)
        assert running(), "the run did not start"
        time.sleep(1.0)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        deadline = time.time() + 20
        while running() and time.time() < deadline:
            time.sleep(0.2)
        assert not running(), "left running: %s" % running()


def long_run_started(out):
    """Whether the sweep in `out` has started its 100000-step run."""
    runs = os.path.join(out, "runs")
    return os.path.isdir(runs) and any(
        d.startswith("steps100000") and os.path.exists(os.path.join(runs, d, "command.txt"))
        for d in os.listdir(runs))


def test_an_interrupted_sweep_writes_the_finished_runs_and_the_same_command_goes_on():
    """SIGINT to the sweep: the running run is stopped and keeps no record,
    the finished run's results are written, the sweep says what happened and
    exits 130; the same command skips the finished run and starts the other."""
    import signal
    import time
    first()  # the corpus
    out = os.path.join(WORK, "stopped")
    path = os.path.join(WORK, "stop.lua")
    open(path, "w").write(
        'return { base = { model = "gpt2-nano", data = "corpus.txt", ["n-layer"] = 1, '
        '["n-embd"] = 32, ["n-head"] = 2, context = 32, ["seq-len"] = 16, ["micro-batch"] = 2, '
        'sample = 0, ["eval-batches"] = 0 }, grid = { steps = { 2, 100000 } } }')
    cmd = [EXE, os.path.join(ROOT, "scripts", "sweep.lua"), path, "--out", out]
    for attempt in (1, 2):
        p = subprocess.Popen(cmd, cwd=WORK, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        deadline = time.time() + 60
        while time.time() < deadline and not long_run_started(out):
            time.sleep(0.2)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        text, _ = p.communicate(timeout=30)
        assert p.returncode == 130, (p.returncode, text)
        assert "stopped by SIGINT: 1 ok, 0 failed, 1 not run" in text, text
        if attempt == 2:
            assert "skipped (ok before)" in text, text
        with open(os.path.join(out, "results.csv")) as f:
            got = list(csv.DictReader(f))
        assert [r["steps"] for r in got] == ["2"], got
    left = subprocess.run(["pgrep", "-f", out], capture_output=True, text=True).stdout.split()
    assert not left, left


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pyrun import run_tests
    run_tests(globals())
