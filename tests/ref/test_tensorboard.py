"""test_tensorboard.py — luazero's TensorBoard event files read by TensorBoard.

Runs scripts/train.lua (gpt2-nano, 2 ranks, stage 3, fp16 for a loss scale,
wall_clock_breakdown on, a validation every 2 steps) with "tensorboard" enabled
and --log, then reads the event file with tensorboard's EventAccumulator.
Checks: one event file in output_path/job_name, its first event's
file_version "brain.Event:2", every scalar tag of the run present
(DeepSpeed's Train/Samples/train_loss, lr, loss_scale and luazero's
grad_norm, tokens_per_s, step_ms, peak_rss, peak_ledger, val_loss,
elapsed_time_ms_<phase>), each tag's steps the log's step x train_batch_size and
its values the log's rounded to float32 (TensorBoard's simple_value), and no
events from rank 1 (one value per step); a resume into the same job starts with a
SessionLog START, so TensorBoard shows each step once.

Without `tensorboard` (pip install tensorboard; tools/setup installs it into
build/ref-venv) prints a skip line and "0 passed, 0 failed". LZ_REF_VENV
names a virtual environment to take it from (default build/ref-venv).

    /usr/bin/python3 tests/ref/test_tensorboard.py     # ends with "N passed, N failed"
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from refenv import LUAZERO, REPO, import_from_venv  # noqa: E402


def import_accumulator():
    module, why = import_from_venv("tensorboard.backend.event_processing.event_accumulator")
    return (module.EventAccumulator if module else None), why


# The log's field of each tag (None: a field of "mem" or "time").
TAGS = {
    "Train/Samples/train_loss": ("loss",),
    "Train/Samples/lr": ("lr",),
    "Train/Samples/loss_scale": ("loss_scale",),
    "Train/Samples/grad_norm": ("grad_norm",),
    "Train/Samples/tokens_per_s": ("tokens_per_s",),
    "Train/Samples/step_ms": ("step_ms",),
    "Train/Samples/peak_rss": ("mem", "peak_rss"),
    "Train/Samples/peak_ledger": ("mem", "peak_ledger"),
    "Train/Samples/val_loss": ("val_loss",),
}
for phase in ("forward", "backward", "reduce", "step", "gather"):
    TAGS["Train/Samples/elapsed_time_ms_" + phase] = ("time", phase)


def field(rec, path):
    for k in path:
        if not isinstance(rec, dict) or k not in rec:
            return None
        rec = rec[k]
    return rec


def main():
    import numpy as np
    check = Checks("tensorboard")

    EventAccumulator, why = import_accumulator()
    if not EventAccumulator:
        print(f"skip: {why}")
        print("0 passed, 0 failed")
        return 0
    tmp = tempfile.mkdtemp(prefix="lz_tb_")
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("Shall I compare thee to a summer's day? Thou art more lovely. " * 80)
    batch = 8  # 2 micro x 2 accum x 2 ranks
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "fp16": {"enabled": True, "initial_scale_power": 8}, "wall_clock_breakdown": True,
           "zero_optimization": {"stage": 3},
           "tensorboard": {"enabled": True, "output_path": os.path.join(tmp, "tb"),
                           "job_name": "job"}}
    cfg_path = os.path.join(tmp, "ds.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    log = os.path.join(tmp, "log.jsonl")
    cmd = [LUAZERO, "-n", "2", "scripts/train.lua", "--model", "gpt2-nano", "--n-layer", "1",
           "--n-embd", "32", "--n-head", "2", "--context", "32", "--sample", "0",
           "--eval-batches", "1", "--eval-every", "2", "--steps", "5", "--data", corpus,
           "--config", cfg_path, "--log", log]
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    check("train.lua runs with tensorboard enabled", proc.returncode == 0, proc.stdout[-2000:])
    if proc.returncode != 0:
        return check.summary()
    recs = [json.loads(line) for line in open(log)]
    recs = [r for r in recs if "step" in r]
    files = glob.glob(os.path.join(tmp, "tb", "job", "events.out.tfevents.*"))
    check("one event file in output_path/job_name", len(files) == 1, str(files))
    acc = EventAccumulator(os.path.join(tmp, "tb", "job"), size_guidance={"scalars": 0})
    acc.Reload()
    check("EventAccumulator reads file version 2", acc.file_version == 2.0, str(acc.file_version))
    # The framing, record by record: tensorboard's own masked CRC-32C and Event parser.
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    raw, pos, events, crc_ok = open(files[0], "rb").read(), 0, [], True
    while pos < len(raw):
        head = raw[pos:pos + 8]
        n = int.from_bytes(head, "little")
        crc_ok &= int.from_bytes(raw[pos + 8:pos + 12], "little") == masked_crc32c(head)
        data = raw[pos + 12:pos + 12 + n]
        crc_ok &= int.from_bytes(raw[pos + 12 + n:pos + 16 + n], "little") == masked_crc32c(data)
        events.append(event_pb2.Event.FromString(data))
        pos += 16 + n
    check("every record's masked CRC-32C checks", crc_ok and pos == len(raw))
    check('the first event is file_version "brain.Event:2"',
          events and events[0].file_version == "brain.Event:2", str(events[:1]))
    check("one event per step after it", len(events) == 1 + len(recs), str(len(events)))
    tags = set(acc.Tags()["scalars"])
    check("every tag is there", tags == set(TAGS), f"{sorted(tags ^ set(TAGS))}")
    for tag, path in sorted(TAGS.items()):
        if tag not in tags:
            continue
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        want = [(r["step"] * batch, float(np.float32(field(r, path)))) for r in recs
                if field(r, path) is not None]
        same_steps = [s for s, _ in got] == [s for s, _ in want]
        close = same_steps and all(abs(g - w) <= 1e-6 * max(1.0, abs(w))
                                   for (_, g), (_, w) in zip(got, want))
        check(f"{tag}: {len(want)} values equal the log's", close and len(want) > 0,
              f"got {got[:6]}, want {want[:6]}")
    # A resume from step 2 into the same job: its file starts with a
    # SessionLog START just past step 2's x (TensorBoard's own parser), and
    # TensorBoard shows each step once (the first run's steps 3 to 5 purged).
    cfg["tensorboard"]["job_name"] = "resumed"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    ck = os.path.join(tmp, "ck")
    base = cmd[:cmd.index("--log")]
    first = subprocess.run(base + ["--save", ck, "--save-every", "2"], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    again = subprocess.run(base + ["--resume", os.path.join(ck, "step-000002")], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    check("a run and its resume from step 2 run", first.returncode == 0 and
          again.returncode == 0, first.stdout[-1000:] + again.stdout[-1000:])
    jobdir = os.path.join(tmp, "tb", "resumed")
    starts = []
    for path in glob.glob(os.path.join(jobdir, "events.out.tfevents.*")):
        raw, pos = open(path, "rb").read(), 0
        while pos < len(raw):
            n = int.from_bytes(raw[pos:pos + 8], "little")
            e = event_pb2.Event.FromString(raw[pos + 12:pos + 12 + n])
            if e.HasField("session_log"):
                starts.append((e.step, e.session_log.status))
            pos += 16 + n
    check("the resume's file holds a SessionLog START just past step 2 x the batch",
          starts == [(2 * batch + 1, event_pb2.SessionLog.START)], str(starts))
    acc = EventAccumulator(jobdir, size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("Train/Samples/train_loss")]
    check("each step shown once after the resume", steps == [s * batch for s in range(1, 6)],
          str(steps))
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
