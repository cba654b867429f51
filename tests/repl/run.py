#!/usr/bin/python3
"""tests/repl/run.py — the REPL driven through a real pseudo-terminal, as a
person would: plain REPL (values, tensors, multi-line chunks, history,
Ctrl-D), `-i` after a failing script, and `-n 2 -i` where rank 0 leads and
rank 1 serves (shards of every rank, gather against norms, a wait at the
prompt longer than LZ_COMM_TIMEOUT, Ctrl-D ending every rank).
Ends with "N passed, N failed"."""
import math
import os
import pty
import re
import select
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXE = os.environ.get("LUAZERO", os.path.join(ROOT, "build", "bin", "luazero"))
ENGINE = os.path.join(ROOT, "tests", "repl", "engine.lua")
SCRATCH = tempfile.mkdtemp(prefix="luazero-repl-")


class Session:
    """A luazero process on a pty: send lines, expect output, wait for exit."""

    def __init__(self, args, env=None):
        e = dict(os.environ)
        e["LUAZERO_HISTORY"] = os.path.join(SCRATCH, "history")
        e.update(env or {})
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.chdir(ROOT)
            os.execve(EXE, [EXE] + args, e)
        self.out = b""
        self.mark = 0  # expect() searches after what it matched last

    def _read(self, timeout):
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the other side closed
            return None
        if not data:
            return None
        self.out += data
        return True

    def text(self):
        return self.out.decode("utf-8", "replace").replace("\r\n", "\n")

    def expect(self, pattern, timeout=30):
        deadline = time.time() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.text(), self.mark)
            if m:
                self.mark = m.end()
                return m
            left = deadline - time.time()
            if left <= 0 or self._read(left) is None:
                m = rx.search(self.text(), self.mark)
                if m:
                    self.mark = m.end()
                    return m
                raise AssertionError("no %r in the output:\n%s" % (pattern, self.text()[-3000:]))

    def send(self, line):
        os.write(self.fd, line.encode() + b"\r")

    def eof(self):
        """Ctrl-D at the prompt (typed ahead, while the terminal is in cooked
        mode between lines, the line discipline swallows it)."""
        self.expect(PROMPT)
        os.write(self.fd, b"\x04")

    def quit(self, timeout=30):
        """Ctrl-D at the prompt; the exit code."""
        self.eof()
        return self.wait(timeout)

    def wait(self, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while self._read(0.05):
                    pass
                return os.waitstatus_to_exitcode(status)
            self._read(0.1)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError("did not exit within %d s:\n%s" % (timeout, self.text()[-3000:]))

    def close(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


PROMPT = r"(?m)^> "


def test_plain_repl_values_multiline_history_ctrl_d():
    s = Session([])
    try:
        s.expect(r"luazero .* REPL")
        s.expect(PROMPT)
        s.send("x = lz.tensor({2, 3}):fill(1.5)")
        s.expect(PROMPT)
        s.send("x")
        m = s.expect(r"tensor f32\[2,3\]\s+6 elements, 24 B\s+norm ([0-9.]+)\s*\n\s*\[1\.5, 1\.5")
        assert abs(float(m.group(1)) - math.sqrt(6 * 1.5 ** 2)) < 1e-3, m.group(0)
        s.send("=6 * 7")
        s.expect(r"\n42\s*\n")
        s.send("for i = 1, 3 do")
        s.expect(r"(?m)^>> ")
        s.send("  io.write(i * 11, ';')")
        s.expect(r"(?m)^>> ")
        s.send("end")
        s.expect(r"11;22;33;")
        s.send("= 40 +")  # an expression cut short continues as well
        s.expect(r"(?m)^>> ")
        s.send("2")
        s.expect(r"\n42\s*\n")
        s.send("{ a = 1, b = { c = 'x' } }")
        s.expect(r'b = \{\s*\n\s*c = "x"')
        s.send("error('bad thing')")
        s.expect(r"stdin:1: bad thing")  # (its line kept: no tail call)
        s.send("lz.mem()")
        s.expect(r"workspace\s+24 B\s+24 B")
        code = s.quit()
        assert code == 0, "exit code %d" % code
        hist = open(os.path.join(SCRATCH, "history")).read().replace("\\040", " ")
        assert "x = lz.tensor({2, 3}):fill(1.5)" in hist, hist
    finally:
        s.close()


def test_dash_i_after_a_failing_script_keeps_its_globals():
    s = Session(["-i", ENGINE, "3", "fail"])
    try:
        s.expect(r"the script failed on purpose")
        s.expect(r"stack traceback")
        s.expect(PROMPT)
        s.send("steps_done")
        s.expect(r"\n2\s*\n")
        s.send("engine")
        s.expect(r"engine: ZeRO stage 3, world 1 \(this is rank 0\), fp32")
        s.send("engine:plan()")
        s.expect(r"ZeRO stage 3 on cpu: working f32, gradients f32")
        s.expect(r"params\s+shard\s+f32\s+device, gathered per module")
        s.expect(r"after step gather persistent")
        s.send("model")
        s.expect(r"GPT\s+117\.5K params")
        code = s.quit()
        assert code == 1, "a failed script should still exit 1 after the REPL, got %d" % code
    finally:
        s.close()


def test_dash_i_after_a_script_that_stops_on_bad_input():
    """A script that stops through its exits (scripts/train.lua's bad flag,
    exit 2) still reaches the REPL under -i, then exits 2."""
    s = Session(["-i", os.path.join(ROOT, "scripts", "train.lua"), "--steps", "-2", "--data",
                 os.path.join(ROOT, "README.md")])
    try:
        s.expect(r"train: --steps must be >= 1 \(got -2\)")
        s.expect(PROMPT)
        s.send("1 + 1")
        s.expect(r"\n2\s*\n")
        code = s.quit()
        assert code == 2, "bad input should still exit 2 after the REPL, got %d" % code
    finally:
        s.close()


def expected_ranges(W, rows, cols, bias):
    """Rank ranges of a Linear's weight and bias: one segment (weight, then
    bias) padded to a multiple of W * 16 and cut into W slices
    (lua/luazero/zero/layout.lua, recomputed here)."""
    n = rows * cols + bias
    padded = -(-n // (W * 16)) * (W * 16)
    sl = padded // W
    w, b = [], []
    for r in range(W):
        lo, hi = r * sl, (r + 1) * sl
        a, z = max(lo, 0), min(hi, rows * cols)
        if z > a:
            w.append("r%d [%d, %d)" % (r, a, z))
        a, z = max(lo, rows * cols), min(hi, n)
        if z > a:
            b.append("r%d [%d, %d)" % (r, a - rows * cols, z - rows * cols))
    return "  ".join(w), "  ".join(b)


def test_multi_rank_repl_rank0_leads_and_ctrl_d_ends_every_rank():
    W = 2
    s = Session(["-n", str(W), "-i", ENGINE, "3"], env={"LZ_COMM_TIMEOUT": "3"})
    try:
        s.expect(r"REPL on rank 0 of 2")
        s.expect(PROMPT)
        # Longer at the prompt than the collective timeout: rank 1 must
        # still be there.
        time.sleep(5)
        s.send("shards(engine)")
        s.expect(r"ZeRO stage 3, world 2")
        for r in range(W):
            s.expect(r"rank %d: 58,752 elements in its shard" % r)
        w, b = expected_ranges(W, 192, 64, 192)
        s.expect(re.escape("transformer.h.0.attn.c_attn.weight [192,64]") + r"\s+" + re.escape(w))
        s.expect(re.escape("transformer.h.0.attn.c_attn.bias") + r"\s+\[192\]\s+" + re.escape(b))
        s.send("mem()")
        s.expect(r"rank 0: now / peak\s+rank 1: now / peak")
        s.expect(r"optimizer\s+459\.0 KiB / 459\.0 KiB\s+459\.0 KiB / 459\.0 KiB")
        s.send("norms(engine, 'h.1.mlp.c_fc.weight')")
        m = s.expect(r"transformer\.h\.1\.mlp\.c_fc\.weight\s+([0-9.e+-]+)\s+\| r0 ([0-9.e+-]+)\s+r1 ([0-9.e+-]+)")
        total, r0, r1 = (float(x) for x in m.groups())
        assert r0 > 0 and r1 > 0, m.group(0)
        assert abs(math.hypot(r0, r1) - total) < 1e-3 * total, m.group(0)
        s.send("w = gather(engine, 'h.1.mlp.c_fc.weight')")
        s.expect(PROMPT)
        s.send("w")
        m = s.expect(r"tensor f32\[256,64\]\s+16,384 elements, 64\.0 KiB\s+norm ([0-9.e+-]+)")
        assert abs(float(m.group(1)) - total) < 1e-3 * total, (m.group(0), total)
        s.send("gather(engine, 'no.such.weight')")
        s.expect(r"gather: no parameter 'no\.such\.weight'")
        s.send("shards(engine, 'ln_f')")  # the ranks still answer after an error
        s.expect(r"transformer\.ln_f\.weight\s+\[64\]\s+r0 \[0, 64\)")
        # An engine under a global the other rank has as something else:
        # refused, naming the rank, before any rank enters the collectives.
        s.send("cfg, engine = engine, nil")
        s.expect(PROMPT)
        s.send("shards(cfg, 'ln_f')")
        s.expect(r"shards: rank 1: the global cfg is not an engine on this rank")
        s.send("engine = cfg")
        s.expect(PROMPT)
        s.send("shards(engine, 'ln_f')")
        s.expect(r"transformer\.ln_f\.weight\s+\[64\]\s+r0 \[0, 64\)")
        code = s.quit(timeout=20)
        assert code == 0, "exit code %d:\n%s" % (code, s.text()[-2000:])
        assert "timeout" not in s.text().lower() and "waited" not in s.text(), s.text()[-2000:]
    finally:
        s.close()


def test_ckpt_prints_a_checkpoint_shard_table():
    import subprocess
    corpus = os.path.join(SCRATCH, "ck-corpus.txt")
    with open(corpus, "w") as f:
        f.write("To be, or not to be, that is the question.\n" * 60)
    ck = os.path.join(SCRATCH, "ck")
    out = subprocess.run([EXE, "-n", "2", os.path.join(ROOT, "scripts", "train.lua"),
                          "--model", "gpt2-nano", "--n-layer", "2", "--n-embd", "64",
                          "--n-head", "4", "--context", "32", "--seq-len", "16", "--steps", "2",
                          "--stage", "3", "--sample", "0", "--eval-batches", "0",
                          "--data", corpus, "--save", ck],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    s = Session([])
    try:
        s.expect(PROMPT)
        s.send("c = ckpt(%r, 'norms')" % ck)
        s.expect(PROMPT)
        s.send("c")
        s.expect(r"checkpoint \S+step-000002: model gpt2-nano, world 2, stage 3, fp32")
        s.expect(r"step 2 \(global 2, skipped 0\)")
        s.expect(r"optimizer AdamW lr \S+ betas \(0\.9, 0\.95\) eps 1e-08 weight_decay 0\.1; "
                 r"states master, m, v")
        s.expect(r"shard-00000-of-00002\.zst\s+0\s+[\d,]+\s+\S+ \S+\s+\S+ \S+\s+\[0, \d+\)")
        s.expect(r"shard-00001-of-00002\.zst\s+1\s+[\d,]+")
        s.expect(r"transformer\.wte\.weight\s+\[256, 64\]\s+[0-9.]+")
        s.send("c.summary.shards + c.summary.world_size")
        s.expect(r"\b4\b")
        s.send("ckpt('/no/such/checkpoint')")
        s.expect(r"checkpoint: .*no/such/checkpoint")
        code = s.quit(timeout=20)
        assert code == 0, "exit code %d:\n%s" % (code, s.text()[-2000:])
    finally:
        s.close()


def test_only_rank_0_reads_the_terminal():
    code = ("if os.getenv('RANK') == '1' then print('rank 1 stdin:', io.read('*l')) end "
            "if os.getenv('RANK') == '0' then print('rank 0 has a terminal:', "
            "io.popen('test -t 0 && echo yes'):read('*l')) end")
    s = Session(["-n", "2", "-e", code])
    try:
        s.expect(r"rank 0 has a terminal:\s+yes", timeout=20)
        s.mark = 0
        s.expect(r"\[rank 1\] rank 1 stdin:\s+nil", timeout=20)
        code = s.wait(timeout=20)
        assert code == 0, "exit code %d" % code
    finally:
        s.close()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pyrun import run_tests
    run_tests(globals())
