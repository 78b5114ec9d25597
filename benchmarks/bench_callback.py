#!/usr/bin/env python
"""The cost of TrakCallback: transformers' Trainer training with it against the same training without it.

A small GPT-2 (``--layers`` x ``--width``, ``--vocab`` tokens, tied embeddings) trains
for ``--epochs`` epochs on ``--rows`` sequences of ``--seq-len`` random token ids (the
time of a step does not depend on which tokens), batches of ``--batch-size``, AdamW,
in one process. Each repeat trains a freshly seeded model twice, once with
``TrakCallback(save="epoch")`` (a checkpoint and its AdamW state per epoch, the
manifest, each written atomically with fsync and hashed) and once without, in
alternating order so that load from elsewhere slows both alike. The table gives the
median wall time and process CPU time of ``trainer.train()`` over ``--repeats``
repeats and the overhead of each, and the wall time spent inside the callback's
events. The callback works synchronously in the training loop, so that last time is
what it adds to the training; on a machine shared with other work the end-to-end wall
times vary by more than the callback costs, and it is the steadier measure.

What one save costs is fixed by the model's size (the state dict, twice its size of
AdamW moments, the sha256 of the checkpoint); what an epoch costs grows with the
data. The overhead is their ratio, so the JSON also records the seconds per save and
per optimizer step, to extrapolate to other epoch sizes.

Prints a table and writes JSON (``--out``, default bench_results/callback.json) with
the date, command, commit, trakcli version and machine.

Usage::

    python -m benchmarks.bench_callback                 # 3 epochs of 64 steps, 5 repeats, 1 thread
    python -m benchmarks.bench_callback --quick         # to check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic: a killed run keeps the previous result)

DEFAULT_OUT = REPO / "bench_results" / "callback.json"


def run_info(argv: list[str], threads: int, device: str) -> dict[str, Any]:
    """The command and the run's threads and device (write_result adds date, commit, version and machine)."""
    import torch

    machine = {"threads": threads, "device": device}
    if device.startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name(0)
    return {"command": " ".join(["python", "-m", "benchmarks.bench_callback", *argv]), "machine": machine}


class Rows:
    """``rows`` sequences of ``seq_len`` random token ids (every token a target), as the default collator takes them."""

    def __init__(self, rows: int, seq_len: int, vocab: int, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def make_model(a: argparse.Namespace):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=a.vocab, n_embd=a.width, n_layer=a.layers, n_head=max(1, a.width // 64),
                     n_positions=a.seq_len, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg)


def timed_callback(out_dir: Path):
    """A TrakCallback whose events add their wall time to ``.seconds`` (behaviour unchanged)."""
    from trakcli.integrations import TrakCallback

    class Timed(TrakCallback):
        seconds = 0.0

        def _timed(self, event: str, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return getattr(super(), event)(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        def on_train_begin(self, *args, **kwargs):
            return self._timed("on_train_begin", *args, **kwargs)

        def on_step_end(self, *args, **kwargs):
            return self._timed("on_step_end", *args, **kwargs)

        def on_epoch_end(self, *args, **kwargs):
            return self._timed("on_epoch_end", *args, **kwargs)

        def on_train_end(self, *args, **kwargs):
            return self._timed("on_train_end", *args, **kwargs)

    return Timed(out_dir, save="epoch")


def train_once(a: argparse.Namespace, data: Rows, work: Path, with_callback: bool) -> dict[str, Any]:
    """One ``trainer.train()``: its wall seconds, and with the callback its own seconds and bytes written."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    model = make_model(a)
    out_dir = work / "trak"
    shutil.rmtree(out_dir, ignore_errors=True)
    callbacks = [timed_callback(out_dir)] if with_callback else []
    args = TrainingArguments(
        output_dir=str(work / "hf"), num_train_epochs=a.epochs, per_device_train_batch_size=a.batch_size,
        learning_rate=3e-4, optim="adamw_torch", use_cpu=a.device == "cpu", report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # its log lines on stdout, not part of either variant's work
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    out: dict[str, Any] = {"seconds": seconds, "cpu_seconds": cpu, "steps": trainer.state.global_step}
    if with_callback:
        manifest = json.loads((out_dir / "manifest.json").read_text())
        files = [p for p in out_dir.rglob("*") if p.is_file()]
        out.update(callback_seconds=callbacks[0].seconds, saves=1 + len(manifest["models"][0].get("epoch_checkpoints", [])),
                   bytes_written=sum(p.stat().st_size for p in files), complete=manifest["complete"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rows", type=int, default=512, help="training rows: an epoch is rows / batch-size steps")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a machine shared with other work, more threads spin on each other)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: a temporary folder)")
    ap.add_argument("--quick", action="store_true", help="2 epochs of 8 steps, 1 repeat")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    if a.quick:
        a.rows, a.epochs, a.repeats = 8 * a.batch_size, 2, 1
    import torch

    torch.set_num_threads(a.threads)
    data = Rows(a.rows, a.seq_len, a.vocab)
    n_params = sum(p.numel() for p in make_model(a).parameters())
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="bench_callback_"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "callback": []}
    try:
        train_once(a, data, work, False)  # warm-up: first-call costs (imports, allocator) in neither variant
        for r in range(a.repeats):
            order = ("plain", "callback") if r % 2 == 0 else ("callback", "plain")
            for name in order:
                runs[name].append(train_once(a, data, work, name == "callback"))
                print(f"repeat {r + 1}/{a.repeats} {name:8s} {runs[name][-1]['seconds']:7.2f} s", file=sys.stderr)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    plain = statistics.median(r["seconds"] for r in runs["plain"])
    with_cb = statistics.median(r["seconds"] for r in runs["callback"])
    cpu_plain = statistics.median(r["cpu_seconds"] for r in runs["plain"])
    cpu_cb = statistics.median(r["cpu_seconds"] for r in runs["callback"])
    inside = statistics.median(r["callback_seconds"] for r in runs["callback"])
    saves = runs["callback"][0]["saves"]
    steps = runs["plain"][0]["steps"]
    result = {
        "benchmark": "callback", **run_info(argv, a.threads, a.device),
        "setup": {"model": "GPT-2", "layers": a.layers, "width": a.width, "vocab": a.vocab, "n_params": n_params,
                  "seq_len": a.seq_len, "batch_size": a.batch_size, "rows": a.rows, "epochs": a.epochs,
                  "steps": steps, "steps_per_epoch": steps // a.epochs, "repeats": a.repeats, "save": "epoch"},
        "runs": runs,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "median_seconds": {"plain": plain, "callback": with_cb},
        "median_cpu_seconds": {"plain": cpu_plain, "callback": cpu_cb},
        "overhead": with_cb / plain - 1.0,
        # each repeat's two runs ran back to back, under the same load from elsewhere
        "overhead_paired_median": statistics.median(
            c["seconds"] / p["seconds"] - 1.0 for c, p in zip(runs["callback"], runs["plain"])),
        "overhead_cpu": cpu_cb / cpu_plain - 1.0,
        "overhead_inside": inside / plain,
        "callback_seconds_median": inside,
        "saves": saves,
        "seconds_per_save": inside / saves,
        "seconds_per_step": plain / steps,
        "bytes_per_save": runs["callback"][0]["bytes_written"] // saves,
    }
    print(f"\nGPT-2 {a.layers}x{a.width}, {n_params / 1e6:.2f}M parameters, {steps // a.epochs} steps per epoch "
          f"(batch {a.batch_size} x {a.seq_len} tokens), {a.epochs} epochs, median of {a.repeats}, {a.device}, "
          f"{a.threads} threads")
    print(f"{'run':34s} {'wall s':>9s} {'CPU s':>9s}")
    print(f"{'Trainer':34s} {plain:9.2f} {cpu_plain:9.2f}")
    print(f"{'Trainer + TrakCallback (per epoch)':34s} {with_cb:9.2f} {cpu_cb:9.2f}")
    print(f"{'overhead (of the medians)':34s} {result['overhead']:+9.1%} {result['overhead_cpu']:+9.1%}")
    print(f"{'overhead (median of the repeats)':34s} {result['overhead_paired_median']:+9.1%}")
    print(f"inside the callback {inside:.2f} s for {saves} saves, {result['overhead_inside']:.1%} of the training "
          f"({inside / saves:.3f} s per save, {result['bytes_per_save'] / 2**20:.1f} MiB each; "
          f"a step takes {plain / steps:.3f} s)")
    out = Path(a.out)
    write_result(out, result)
    print(f"-> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
